"""The elements of a Scale job's output file (``output_data_path``): a JSON array, one element
per input request, in input order, each in the shape Scale's clients read (llmengine's data
types). Which shape a success takes follows the job's input, whichever route made the job:

- v1 prompts content (``scale-v1``): a ``CompletionOutput`` (``text``, ``num_prompt_tokens``,
  ``num_completion_tokens``, ``tokens``: one ``TokenOutput`` per generated token when the
  content asked ``return_token_log_probs``, else empty), made from the request's
  ``text_completion`` body;
- v2 completion (``prompt``) or chat (``messages``) items (``scale-v2``): the response body
  as it is, a ``text_completion`` or a ``chat.completion`` (llmengine's
  ``CompletionV2Response`` / ``ChatCompletionV2Response``).

A request that failed or never ran is a ``FailedElement`` whatever the input.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from llm_batch.core.input_formats import InputFormat
from llm_batch.core.records import RequestError

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
        """From the ``text_completion`` body of the prompt's /v1/completions request (one
        choice: v1 content has no ``n``); its legacy ``logprobs`` lists give the tokens."""
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


class FailedElement(BaseModel):
    """A request with no result body: an engine error, a bad input item, or one never run;
    ``line`` is its 1-based element (or prompt) number in the input."""

    error: RequestError
    custom_id: str | None
    line: int


def _v1_element(body: dict[str, Any]) -> dict[str, Any]:
    return CompletionOutput.of_text_completion(body).model_dump()


def _as_is(body: dict[str, Any]) -> dict[str, Any]:
    return body


def success_element(input_format: str | None) -> ArrayElement:
    """How a successful request's response body becomes its element, for a job whose input
    came in ``input_format``."""
    return _v1_element if input_format == InputFormat.SCALE_V1 else _as_is


def failed_element(code: str, message: str, custom_id: str | None, line: int) -> dict[str, Any]:
    return FailedElement(error=RequestError(code=code, message=message), custom_id=custom_id,
                         line=line).model_dump()
