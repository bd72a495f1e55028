"""The elements of a Scale job's output file: a JSON array, one element per input request in
input order, in the shapes llmengine's clients read. A success is a ``CompletionOutput`` for
``scale-v1`` input, else the response body as it is; a failure is ``failed_element``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from llm_batch.core.input_formats import InputFormat

ArrayElement = Callable[[dict[str, Any]], Any]


class TokenOutput(BaseModel):
    """One generated token and its log probability (llmengine's ``TokenOutput``)."""

    token: str
    log_prob: float


class CompletionOutput(BaseModel):
    """The result of one v1 prompt (llmengine's ``CompletionOutput``)."""

    text: str
    num_prompt_tokens: int | None
    num_completion_tokens: int
    tokens: list[TokenOutput]

    @classmethod
    def of_text_completion(cls, body: dict[str, Any]) -> CompletionOutput:
        """From the prompt's ``text_completion`` body (one choice); its ``logprobs`` give the tokens."""
        choice = body["choices"][0]
        usage = body.get("usage") or {}
        logprobs = choice.get("logprobs") or {}
        return cls(
            text=choice["text"],
            num_prompt_tokens=usage.get("prompt_tokens"),
            num_completion_tokens=usage.get("completion_tokens") or 0,
            tokens=[TokenOutput(token=token, log_prob=log_prob) for token, log_prob in
                    zip(logprobs.get("tokens") or (), logprobs.get("token_logprobs") or ())],
        )


def success_element(input_format: str | None) -> ArrayElement:
    """How a successful request's response body becomes its element, for a job whose input
    came in ``input_format``."""
    if input_format == InputFormat.SCALE_V1:
        return lambda body: CompletionOutput.of_text_completion(body).model_dump()
    return lambda body: body


def failed_element(code: str, message: str, custom_id: str | None, line: int) -> dict[str, Any]:
    """The element of a request with no result body: an engine error, a bad item, or one never run."""
    return {"error": {"code": code, "message": message}, "custom_id": custom_id, "line": line}
