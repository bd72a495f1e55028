"""OpenAI request bodies -> vLLM parameters, with a precise error for anything we cannot run.

Each endpoint's model holds the fields we honour (others are ignored: SDKs send extras);
value ranges are left to vLLM's ``SamplingParams``, so the limits stay vLLM's. Every failure
becomes ``InvalidRequest``, that request's 400 result.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from vllm.exceptions import VLLMClientError
from vllm.pooling_params import PoolingParams
from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

from llm_batch.core.endpoints import Endpoint
from llm_batch.core.schemas import RESPONSES_TEXT_PARTS, RESPONSES_UNSUPPORTED, refused_option

# OpenAI's default for /v1/completions; chat has none (up to the context length).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class InvalidRequest(ValueError):
    """A request the engine cannot run as given; ``code`` is the result's error code."""

    def __init__(self, message: str, code: str = "invalid_request"):
        super().__init__(message)
        self.code = code
        self.message = message


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class _SamplingBody(_Body):
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    response_format: ResponseFormat | None = None


class ChatBody(_SamplingBody):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatBody:
        for i, message in enumerate(self.messages):
            if "role" not in message:
                raise ValueError(f"messages[{i}] has no 'role'")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def sample_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class ResponsesBody(ChatBody):
    """A /v1/responses body, run as a chat (instructions, input, max_output_tokens and
    text.format translated); the original fields are kept for the Response object."""

    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    text_format: dict[str, Any] = Field(default_factory=lambda: {"type": "text"})
    parallel_tool_calls: bool = True
    tool_choice: str = "auto"

    @model_validator(mode="before")
    @classmethod
    def _as_chat(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        if found := refused_option(RESPONSES_UNSUPPORTED, value):
            raise ValueError(f"{found[0]} is not supported in a /v1/responses batch request: {found[1]}")
        messages = []
        instructions = value.get("instructions")
        if instructions is not None:
            messages.append({"role": "system", "content": instructions})
        messages.extend(_input_messages(value.get("input")))
        text_format = dict((value.get("text") or {}).get("format") or {"type": "text"})
        response_format: dict[str, Any] = {"type": text_format.get("type")}
        if text_format.get("type") == "json_schema":
            response_format["json_schema"] = {k: text_format[k] for k in ("name", "schema", "strict")
                                              if k in text_format}
        fields = {
            "messages": messages,
            "max_completion_tokens": value.get("max_output_tokens"),
            "response_format": response_format,
            "text_format": text_format,
        }
        # Only the Responses fields: a chat field (n, stop, seed, ...) in the body is ignored.
        kept = {k: value[k] for k in _RESPONSES_KEPT if value.get(k) is not None}
        return {**kept, **fields}


_RESPONSES_KEPT = ("instructions", "temperature", "top_p", "max_output_tokens", "metadata",
                   "parallel_tool_calls", "tool_choice")


def _input_messages(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise ValueError("input: a string or a non-empty list of messages is required")
    messages = []
    for i, item in enumerate(value):
        if not isinstance(item, dict) or item.get("type", "message") not in ("message", None):
            raise ValueError(f"input[{i}]: only message items are supported")
        content = item.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") not in RESPONSES_TEXT_PARTS:
                    raise ValueError(f"input[{i}].content[{j}]: only input_text and output_text parts "
                                     "are supported")
                parts.append({"type": "text", "text": part.get("text")})
            content = parts
        messages.append({"role": item.get("role"), "content": content})
    return messages


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionBody(_SamplingBody):
    prompt: Prompt
    max_tokens: int | None = COMPLETIONS_DEFAULT_MAX_TOKENS
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _check(self) -> CompletionBody:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (use n)")
        return self

    @property
    def sample_logprobs(self) -> int | None:
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request (a batch line carries one prompt)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        if not prompt:
            raise InvalidRequest("prompt: must not be empty")
        if all(isinstance(t, int) for t in prompt):
            return prompt  # one tokenized prompt
        if len(prompt) != 1:
            raise InvalidRequest(
                f"prompt: a list of {len(prompt)} prompts is not supported; "
                "send one request line per prompt"
            )
        return prompt[0]


class FimBody(_SamplingBody):
    """A /v1/fim/completions body (``random_seed`` is Mistral's ``seed``)."""

    prompt: str
    suffix: str | None = None
    random_seed: int | None = None

    @model_validator(mode="after")
    def _seed(self) -> FimBody:
        if self.seed is None:
            self.seed = self.random_seed
        return self

    @property
    def sample_logprobs(self) -> int | None:
        return None


class _InputsBody(_Body):
    input: Prompt

    def inputs(self) -> list[str | list[int]]:
        """The texts (or token lists) of ``input``, one embedding or classification each, in order."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if not value:
            raise InvalidRequest("input: must not be empty")
        if all(isinstance(t, int) for t in value):
            return [value]
        return list(value)


class EmbeddingBody(_InputsBody):
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None


class ClassifyBody(_InputsBody):
    """A /v1/classifications body: one classification per text of ``input``, in order."""

    input: str | list[str]  # type: ignore[assignment]


class ChatClassifyBody(_Body):
    """A /v1/chat/classifications body: one classification per conversation of ``input``."""

    input: dict[str, Any] | list[dict[str, Any]]

    def conversations(self) -> list[list[dict[str, Any]]]:
        items = [self.input] if isinstance(self.input, dict) else self.input
        if not items:
            raise InvalidRequest("input: must not be empty")
        conversations = []
        for i, item in enumerate(items):
            messages = item.get("messages")
            if not isinstance(messages, list) or not messages:
                raise InvalidRequest(f"input[{i}].messages: a non-empty list of messages is required")
            conversations.append(messages)
        return conversations


class ChatModerateBody(ChatClassifyBody):
    """A /v1/chat/moderations body: one conversation or a list of them, one result each."""

    input: list[dict[str, Any]] | list[list[dict[str, Any]]]  # type: ignore[assignment]

    def conversations(self) -> list[list[dict[str, Any]]]:
        if not self.input:
            raise InvalidRequest("input: must not be empty")
        several = all(isinstance(item, list) for item in self.input)
        conversations = list(self.input) if several else [self.input]
        if empty := [i for i, messages in enumerate(conversations) if not messages]:
            raise InvalidRequest(f"input[{empty[0]}]: a conversation needs at least one message")
        return conversations  # type: ignore[return-value]


class TranscribeBody(_Body):
    """A /v1/audio/transcriptions body (its file is the request's media record)."""

    language: str | None = None
    temperature: float | None = None
    context_bias: list[str] | None = None
    timestamp_granularities: list[str] | None = None

    @property
    def segments(self) -> bool:
        return "segment" in (self.timestamp_granularities or ())


class OcrBody(_Body):
    """A /v1/ocr body (its document is the request's media record)."""

    pages: str | list[int] | None = None


BODY_MODELS: dict[Endpoint, type[_Body]] = {
    Endpoint.CHAT_COMPLETIONS: ChatBody,
    Endpoint.RESPONSES: ResponsesBody,
    Endpoint.COMPLETIONS: CompletionBody,
    Endpoint.EMBEDDINGS: EmbeddingBody,
    Endpoint.FIM_COMPLETIONS: FimBody,
    Endpoint.CLASSIFICATIONS: ClassifyBody,
    Endpoint.CHAT_CLASSIFICATIONS: ChatClassifyBody,
    Endpoint.MODERATIONS: ClassifyBody,
    Endpoint.CHAT_MODERATIONS: ChatModerateBody,
    Endpoint.TRANSCRIPTIONS: TranscribeBody,
    Endpoint.OCR: OcrBody,
}

Body = ChatBody | CompletionBody | FimBody | EmbeddingBody | ClassifyBody | ChatClassifyBody | TranscribeBody | OcrBody


def parse_body(endpoint: Endpoint, body: dict[str, Any]) -> Body:
    """The typed body, or InvalidRequest naming the first bad field."""
    try:
        return BODY_MODELS[endpoint].model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"]) or "body"
        message = error["msg"].removeprefix("Value error, ")
        raise InvalidRequest(f"{where}: {message}") from None


def structured_outputs(response_format: ResponseFormat | None) -> StructuredOutputsParams | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = response_format.json_schema or {}
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise InvalidRequest("response_format.json_schema.schema: a JSON schema object is required")
    return StructuredOutputsParams(json=schema)


# The body fields that are SamplingParams fields of the same name.
_SAMPLED = ("n", "temperature", "top_p", "top_k", "min_p", "min_tokens", "ignore_eos", "stop", "seed",
            "presence_penalty", "frequency_penalty", "repetition_penalty")


def sampling_params(body: ChatBody | CompletionBody | FimBody) -> SamplingParams:
    """vLLM SamplingParams for a chat, completion or FIM body (unset fields keep vLLM defaults)."""
    max_tokens = body.max_tokens
    if isinstance(body, ChatBody) and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    fields = {name: getattr(body, name) for name in _SAMPLED} | {"logprobs": body.sample_logprobs}
    try:
        return SamplingParams(
            **{k: v for k, v in fields.items() if v is not None},
            # None (chat's default) means "up to the context length"; vLLM's own default is 16.
            max_tokens=max_tokens,
            structured_outputs=structured_outputs(body.response_format),
            # Batch needs only the finished request, never the deltas.
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
    except (VLLMClientError, ValueError) as exc:
        raise InvalidRequest(str(exc)) from None


def media_sampling_params(temperature: float | None = None, *, keep_special_tokens: bool = False) -> SamplingParams:
    """SamplingParams of a transcription or OCR request: greedy unless a temperature is given
    (a transcript keeps its special tokens: its language and timestamps are read from them)."""
    return SamplingParams(temperature=temperature or 0.0, max_tokens=None, skip_special_tokens=not keep_special_tokens,
                          output_kind=RequestOutputKind.FINAL_ONLY)


def pooling_params(body: EmbeddingBody | ClassifyBody | ChatClassifyBody) -> PoolingParams:
    if isinstance(body, EmbeddingBody):
        return PoolingParams(task="embed", dimensions=body.dimensions)
    return PoolingParams(task="classify")
