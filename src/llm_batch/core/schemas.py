"""Request-body schemas per endpoint: the OpenAI-compatible bodies a batch line may carry.

Types are strict (``"5"`` is not a number, ``1`` not a boolean, ``100.0`` not an integer;
floats accept integers). Unknown fields are kept: the engine ignores what it does not know
(docs/validation.md). ``model`` is accepted and ignored: the job's model wins.
"""

from __future__ import annotations

import binascii
import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator
from pydantic.functional_validators import PlainValidator
from pydantic_core import PydanticCustomError

from llm_batch.core.endpoints import Endpoint
from llm_batch.core.output_check import schema_refused

# Documented maxima (vLLM's defaults: max_logprobs = 20).
MAX_N = 32
MAX_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # seed's range in vLLM's own server

ROLES = ("system", "user", "assistant", "tool", "developer", "function")
# Content part types and the field each one's payload is in: the OpenAI SDK's types plus the
# ones vLLM's chat parser reads (vllm/renderers/chat_utils.py MM_PARSER_MAP).
CONTENT_PART_PAYLOADS = {
    "text": "text", "input_text": "text", "output_text": "text", "thinking": "thinking",
    "refusal": "refusal", "image_url": "image_url", "input_image": "image_url",
    "input_audio": "input_audio", "audio_url": "audio_url", "video_url": "video_url",
    "file": "file", "image_embeds": "image_embeds", "audio_embeds": "audio_embeds",
    "video_embeds": "video_embeds", "prompt_embeds": "data", "tool_reference": "name",
}
# Parts whose payload is an object with a "url" (OpenAI and vLLM both read part[type]["url"]).
_URL_PARTS = ("image_url", "audio_url", "video_url")
# What an assistant message may carry instead of content (the SDK allows each alone).
_ASSISTANT_PAYLOADS = ("content", "tool_calls", "function_call", "refusal", "audio")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class _Body(_Strict):
    model: str | None = None  # accepted; the job's model wins


def _fail(kind: str, message: str) -> PydanticCustomError:
    return PydanticCustomError(kind, message)


def _nested_error(subpath: str, detail: str) -> PydanticCustomError:
    """An error at ``subpath`` below the checked field (its path continues the field's)."""
    return PydanticCustomError("nested_error", "{detail}", {"subpath": subpath, "detail": detail})


# -- union-typed fields, checked by hand so the error says what is allowed -----------------


def _is_str_list(value: Any) -> bool:
    return type(value) is list and all(type(v) is str for v in value)


def _is_token_ids(value: Any) -> bool:
    return type(value) is list and all(type(v) is int and v >= 0 for v in value)


def _is_texts(value: Any, field: str) -> bool:
    """Whether ``value`` is a string or a non-empty list of strings; an empty one is an error."""
    if type(value) is str:
        if not value:
            raise _fail("empty_input", f"{field} must not be an empty string")
        return True
    if type(value) is list and value and _is_str_list(value):
        if "" in value:
            raise _nested_error(f"[{value.index('')}]", "must not be an empty string")
        return True
    return False


def _union(accepts: Callable[[Any], bool], kind: str, message: str) -> Any:
    """A field whose values ``accepts`` takes; any other is refused with ``message``."""

    def check(value: Any) -> Any:
        if accepts(value):
            return value
        raise _fail(kind, message)

    return Annotated[Any, PlainValidator(check)]


def _prompt_like(field: str) -> Any:
    """str | list[str] | list[int] | list[list[int]], with no empty string or list (vLLM refuses them)."""

    def accepts(value: Any) -> bool:
        return _is_texts(value, field) or (type(value) is list and value != [] and (
            _is_token_ids(value) or all(_is_token_ids(ids) and ids for ids in value)))

    return _union(accepts, "invalid_input",
                  f"{field} must be a non-empty string, list of strings, list of token ids or list of token-id lists")


Prompt, EmbeddingInput = _prompt_like("prompt"), _prompt_like("input")
Stop = _union(lambda v: v is None or type(v) is str or _is_str_list(v), "invalid_stop",
              "stop must be a string or a list of strings")
ToolChoice = _union(lambda v: v is None or type(v) is str or type(v) is dict, "invalid_tool_choice",
                    "tool_choice must be a string (\"auto\", \"none\", \"required\") or an object naming a tool")
Stream = _union(lambda v: v is None or v is False, "stream_not_supported",
                "stream must be false or absent in a batch request")


def _check_content(value: Any) -> Any:
    if value is None or type(value) is str:
        return value
    if type(value) is list:
        return _check_nested(_CONTENT_PARTS, value)
    raise _fail("invalid_content", "content must be a string or a list of content parts")


def _check_nested(adapter: TypeAdapter, value: Any, prefix: str = "", drop: str = "") -> Any:
    """``value`` validated with ``adapter``; its first error raised as a nested error whose
    path continues the outer one: ``prefix``, then its own path without a leading ``drop``."""
    try:
        return adapter.validate_python(value)
    except ValidationError as exc:
        subpath, detail = _located(exc.errors(include_url=False)[0], "")
        raise _nested_error(prefix + subpath.removeprefix(drop), detail) from None


# -- chat messages ----------------------------------------------------------------------------


class ContentPart(_Strict):
    type: Literal[tuple(CONTENT_PART_PAYLOADS)]  # type: ignore[valid-type]
    text: str | None = None

    @model_validator(mode="after")
    def _payload_present(self) -> ContentPart:
        field = CONTENT_PART_PAYLOADS[self.type]
        payload = getattr(self, field, None) if field == "text" else (self.model_extra or {}).get(field)
        if payload is None:
            raise ValueError(f"a content part of type {self.type!r} needs a {field!r} field")
        if self.type in _URL_PARTS and not (type(payload) is dict and type(payload.get("url")) is str):
            raise ValueError(f"{field} must be an object with a 'url' string, like {{\"url\": \"https://...\"}}")
        return self


_CONTENT_PARTS = TypeAdapter(list[ContentPart])


class ToolCall(_Strict):
    id: str | None = None  # OpenAI sends one; Mistral's SDK may leave it out (vLLM does not need it)
    type: str = "function"
    function: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _function_call(self) -> ToolCall:
        if self.type != "function":  # the SDK also has "custom"; vLLM's chat parser refuses it
            raise ValueError(f"a tool call of type {self.type!r} is not supported: vLLM runs "
                             "only 'function' tool calls")
        if self.function is None:
            raise ValueError("a function tool call needs a 'function' object")
        return self


class Message(_Strict):
    """A chat message; per-role rules follow OpenAI (tool messages name their call)."""

    role: Literal[ROLES]  # type: ignore[valid-type]
    content: Annotated[Any, PlainValidator(_check_content)] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _role_rules(self) -> Message:
        fields = {**self.__dict__, **(self.model_extra or {})}
        if self.role == "assistant":
            if all(fields.get(name) is None for name in _ASSISTANT_PAYLOADS):
                raise ValueError("an assistant message needs content, tool_calls, function_call, refusal or audio")
        elif self.role == "function":  # deprecated by OpenAI, still in its SDK and vLLM
            if not self.name:
                raise ValueError("a function message needs name")
        elif self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        # A tool message's tool_call_id is optional in Mistral's SDK and vLLM's chat parser.
        return self


# -- response_format -------------------------------------------------------------------------


def _self_contained(schema: dict[str, Any] | None) -> dict[str, Any] | None:
    """A line's output schema names nothing outside itself: nothing it names is fetched."""
    if schema is not None and (problem := schema_refused(schema)):
        raise ValueError(problem)
    return schema


class JsonSchemaSpec(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    _schema_self_contained = field_validator("schema_")(_self_contained)


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_present(self) -> ResponseFormat:
        if self.type == "json_schema":
            # The SDK makes "schema" optional, but vLLM has nothing to constrain output with.
            if self.json_schema is None:
                raise ValueError("response_format of type 'json_schema' needs a json_schema object")
            if self.json_schema.schema_ is None:
                raise ValueError("response_format.json_schema needs a 'schema' (the JSON schema "
                                 "the output must follow)")
        return self


# -- bodies -----------------------------------------------------------------------------------


class _GenerationBody(_Body):
    """Sampling fields shared by chat and completions (OpenAI plus vLLM's extras)."""

    stream: Stream = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    stop: Stop = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)  # vLLM's server: torch.long
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0)
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None

    def _max_tokens_limit(self) -> int | None:
        return self.max_tokens

    @model_validator(mode="after")
    def _min_not_above_max(self) -> _GenerationBody:
        limit = self._max_tokens_limit()
        if self.min_tokens is not None and limit is not None and self.min_tokens > limit:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({limit})")
        return self


class ChatCompletionBody(_GenerationBody):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice = None

    def _max_tokens_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionBody:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self


class CompletionBody(_GenerationBody):
    prompt: Prompt
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = None
    suffix: str | None = None


class FimCompletionBody(_GenerationBody):
    """Body of a /v1/fim/completions request (Mistral's FIMCompletionRequest): the answer goes
    between ``prompt`` and ``suffix``; ``random_seed`` is Mistral's ``seed``."""

    prompt: str
    suffix: str | None = None
    random_seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    metadata: dict[str, Any] | None = None
    prompt_cache_key: str | None = None


Texts = _union(lambda v: _is_texts(v, "input"), "invalid_input",
               "input must be a non-empty string or a non-empty list of strings")


class ClassificationBody(_Body):
    """Body of a /v1/classifications request (Mistral's ClassificationRequest): a result per text."""

    input: Texts
    metadata: dict[str, Any] | None = None


class InstructRequest(_Strict):
    """One conversation to classify (Mistral's InstructRequest)."""

    messages: list[Message] = Field(min_length=1)


_CONVERSATIONS = TypeAdapter(list[InstructRequest])


def _check_conversations(value: Any) -> Any:
    """One conversation or a non-empty list of them; errors continue the path."""
    one = type(value) is dict
    if not one and not (type(value) is list and value):
        raise _fail("invalid_input", "input must be a conversation ({\"messages\": [...]}) or a non-empty list of them")
    _check_nested(_CONVERSATIONS, [value] if one else value, drop="[0]" if one else "")  # one: no [0]
    return value


class ChatClassificationBody(_Body):
    """Body of a /v1/chat/classifications request (Mistral's ChatClassificationRequest)."""

    input: Annotated[Any, PlainValidator(_check_conversations)]


_MESSAGES = TypeAdapter(Annotated[list[Message], Field(min_length=1)])


def _check_moderated_chats(value: Any) -> Any:
    """One conversation (a list of messages) or a list of them."""
    if type(value) is not list or not value:
        raise _fail("invalid_input", "input must be a non-empty list of messages (one conversation) "
                    "or a non-empty list of such lists (several)")
    several = all(type(item) is list for item in value)
    for i, conversation in enumerate(value if several else [value]):
        _check_nested(_MESSAGES, conversation, prefix=f"[{i}]" if several else "")
    return value


class ChatModerationBody(_Body):
    """Body of a /v1/chat/moderations request (Mistral's ChatModerationRequest)."""

    input: Annotated[Any, PlainValidator(_check_moderated_chats)]


class EmbeddingBody(_Body):
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = Field(default=None, ge=1)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    user: str | None = None


# -- /v1/responses ---------------------------------------------------------------------------
# Run on the chat path. An option a batch cannot honour is refused per line unless it holds
# its harmless value (the one that asks for nothing: an empty tool list, background false).

RESPONSES_ROLES = ("user", "system", "developer", "assistant")
# Text only (output_text: an assistant message of the history).
RESPONSES_TEXT_PARTS = ("input_text", "output_text")


def _absent(value: Any) -> bool:
    return value is None


def _off(value: Any) -> bool:
    return value is None or value is False


# option -> (is the value harmless?, why it is refused)
Rules = dict[str, tuple[Callable[[Any], bool], str]]
RESPONSES_UNSUPPORTED: Rules = {
    "tools": (lambda v: v is None or v == [], "tools (function calling, built-in tools) are not run"),
    "tool_choice": (lambda v: v is None or v in ("auto", "none"), "tools are not run"),
    "previous_response_id": (_absent, "responses are not stored, so there is no earlier "
                             "response to continue; send the whole conversation in input"),
    "conversation": (_absent, "conversations are not stored; send the whole conversation in input"),
    "background": (_off, "a batch line already runs in the background"),
    "store": (_off, "responses are not stored for retrieval by id (the batch's output file holds them); "
              "set store to false or leave it out"),
    "include": (lambda v: v is None or v == [], "no extra output items can be included"),
    "reasoning": (_absent, "reasoning options are not honoured"),
    "prompt": (_absent, "stored prompt templates are not available; send the text in input"),
    "max_tool_calls": (_absent, "tools are not run"),
    "top_logprobs": (_absent, "logprobs are not returned for /v1/responses (use /v1/chat/completions)"),
    "truncation": (lambda v: v is None or v == "disabled", "input is never truncated: a too-long "
                   "input is a per-line error"),
    "stream_options": (_absent, "a batch request does not stream"),
    "context_management": (_absent, "context management is not available"),
}


def refused_option(rules: Rules, body: dict[str, Any]) -> tuple[str, str] | None:
    """The first option of ``rules`` that ``body`` sets to a value that is not harmless, and why.
    A value of another type is left to the field's own type check: a rule never raises."""
    for option, (harmless, why) in rules.items():
        if option in body:
            try:
                refused = not harmless(body[option])
            except (TypeError, ValueError, AttributeError):
                refused = False
            if refused:
                return option, why
    return None


def _refusing(rules: Rules, endpoint: str) -> Any:
    """A body's model validator refusing the options of ``rules`` set to a harmful value."""

    def refuse(cls: type, value: Any) -> Any:
        if type(value) is dict and (found := refused_option(rules, value)):
            option, why = found
            raise _nested_error(f".{option}", f"{option} is not supported in a {endpoint} "
                                f"batch request: {why} (got {shown(value[option])})")
        return value

    return model_validator(mode="before")(classmethod(refuse))


class ResponsesContentPart(_Strict):
    type: str
    text: Any = None

    @model_validator(mode="after")
    def _text_only(self) -> ResponsesContentPart:
        if self.type not in RESPONSES_TEXT_PARTS:
            raise ValueError(f"content parts of type {self.type!r} are not supported in a "
                             f"/v1/responses batch request: only {' and '.join(RESPONSES_TEXT_PARTS)}")
        if type(self.text) is not str:
            raise ValueError(f"a content part of type {self.type!r} needs a 'text' string")
        return self


_RESPONSES_PARTS = TypeAdapter(list[ResponsesContentPart])


def _check_responses_content(value: Any) -> Any:
    if type(value) is str:
        return value
    if type(value) is list:
        return _check_nested(_RESPONSES_PARTS, value)
    raise _fail("invalid_content", "content must be a string or a list of input_text parts")


class ResponsesInputMessage(_Strict):
    """One input item: a message (``type`` "message" or left out)."""

    type: str | None = None
    role: Literal[RESPONSES_ROLES]  # type: ignore[valid-type]
    content: Annotated[Any, PlainValidator(_check_responses_content)]

    @model_validator(mode="before")
    @classmethod
    def _message_items_only(cls, value: Any) -> Any:
        if type(value) is dict and value.get("type") not in (None, "message"):
            raise ValueError(f"input items of type {shown(value.get('type'))} are not supported in a "
                             "/v1/responses batch request: only messages (role and content)")
        return value


def _check_responses_input(value: Any) -> Any:
    if type(value) is str:
        if not value:
            raise _fail("empty_input", "input must not be an empty string")
        return value
    if type(value) is list and value:
        return _check_nested(_RESPONSES_ITEMS, value)
    if type(value) is list:
        raise _fail("empty_input", "input must not be empty")
    raise _fail("invalid_input", "input must be a string or a list of input messages")


_RESPONSES_ITEMS = TypeAdapter(list[ResponsesInputMessage])


class ResponsesTextFormat(_Strict):
    """``text.format``: text, json_object, or json_schema (name and schema at this level)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    _schema_self_contained = field_validator("schema_")(_self_contained)

    @model_validator(mode="after")
    def _schema_present(self) -> ResponsesTextFormat:
        if self.type == "json_schema":
            if self.name is None:
                raise ValueError("text.format of type 'json_schema' needs a 'name'")
            if self.schema_ is None:
                raise ValueError("text.format of type 'json_schema' needs a 'schema' (the JSON "
                                 "schema the output must follow)")
        return self


class ResponsesText(_Strict):
    format: ResponsesTextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's limits


def _check_metadata(value: Any) -> Any:
    if value is None:
        return value
    if type(value) is not dict or not all(type(v) is str for v in value.values()):
        raise _fail("invalid_metadata", "metadata must be an object of string values")
    if len(value) > MAX_METADATA_KEYS:
        raise _fail("invalid_metadata", f"metadata holds at most {MAX_METADATA_KEYS} keys (got {len(value)})")
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY or len(item) > MAX_METADATA_VALUE:
            raise _fail("invalid_metadata", f"metadata keys are at most {MAX_METADATA_KEY} "
                        f"characters and values at most {MAX_METADATA_VALUE} (key {shown(key)})")
    return value


class ResponsesBody(_Body):
    """Body of a /v1/responses request (run as a chat: instructions, then the input)."""

    stream: Stream = None
    input: Annotated[Any, PlainValidator(_check_responses_input)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    text: ResponsesText | None = None
    metadata: Annotated[Any, PlainValidator(_check_metadata)] = None
    parallel_tool_calls: bool | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None

    _refuse_unsupported = _refusing(RESPONSES_UNSUPPORTED, "/v1/responses")


# -- media endpoints: audio transcriptions and OCR ------------------------------------------
# Only the shape of the file a line names is checked here (llm_batch.infra.media resolves it).


def _check_base64(value: Any, field: str) -> Any:
    """A non-empty standard base64 string (checked strictly: no stray characters)."""
    if type(value) is not str or not value:
        raise _fail("invalid_base64", f"{field} must be a non-empty base64 string")
    try:
        binascii.a2b_base64(value, strict_mode=True)
    except (binascii.Error, ValueError) as exc:
        raise _fail("invalid_base64", f"{field} is not valid base64 ({exc})") from None
    return value


class InlineFile(_Strict):
    """Mistral's ``file`` (a multipart upload in its SDK): here the bytes as base64."""

    file_name: str = Field(min_length=1)
    content: Annotated[Any, PlainValidator(lambda v: _check_base64(v, "content"))]
    content_type: str | None = None


TRANSCRIPTION_UNSUPPORTED: Rules = {
    "diarize": (_off, "speakers are not told apart (no diarization model runs)"),
    "speaker_references": (lambda v: not v, "speakers are not told apart (no diarization model runs)"),
    "timestamp_granularities": (lambda v: v is None or "word" not in v,
                                "only segment timestamps are given (Whisper has no word timestamps)"),
}


class TranscriptionBody(_Body):
    """Body of a /v1/audio/transcriptions request (Mistral's AudioTranscriptionRequest): exactly
    one of ``file_id``, ``file_url`` (a path, never fetched from the web) and ``file``."""

    file: InlineFile | None = None
    file_url: str | None = Field(default=None, min_length=1)
    file_id: str | None = Field(default=None, min_length=1)
    language: str | None = Field(default=None, pattern=r"^[a-z]{2,3}$")
    temperature: float | None = Field(default=None, ge=0, le=2)
    stream: Stream = None
    diarize: bool | None = None
    context_bias: list[Annotated[str, Field(min_length=1)]] | None = None
    speaker_references: dict[str, str] | None = None
    timestamp_granularities: list[Literal["segment", "word"]] | None = None

    _refuse_unsupported = _refusing(TRANSCRIPTION_UNSUPPORTED, "/v1/audio/transcriptions")

    @model_validator(mode="after")
    def _one_file(self) -> TranscriptionBody:
        named = [f for f in ("file_id", "file_url", "file") if getattr(self, f) is not None]
        if len(named) != 1:
            raise ValueError("exactly one of file_id, file_url and file must name the audio"
                             + (f" (got {', '.join(named)})" if named else ""))
        return self


class FileChunk(_Strict):
    type: Literal["file"]
    file_id: str = Field(min_length=1)


class ImageURL(_Strict):
    url: str = Field(min_length=1)
    detail: str | None = None


class ImageURLChunk(_Strict):
    type: Literal["image_url"]
    image_url: str | ImageURL


class DocumentURLChunk(_Strict):
    type: Literal["document_url"]
    document_url: str = Field(min_length=1)
    document_name: str | None = None


_DOCUMENT_TYPES = {"file": TypeAdapter(FileChunk), "image_url": TypeAdapter(ImageURLChunk),
                   "document_url": TypeAdapter(DocumentURLChunk)}


def _check_document(value: Any) -> Any:
    """One of Mistral's document chunks, chosen by its ``type`` (no union noise in errors)."""
    kind = value.get("type") if type(value) is dict else None
    adapter = _DOCUMENT_TYPES.get(kind)  # type: ignore[arg-type]
    if adapter is None:
        raise _fail("invalid_document", "document must be an object of type \"file\" (file_id), "
                    "\"image_url\" (image_url) or \"document_url\" (document_url)"
                    + (f", got type {shown(kind)}" if type(value) is dict else f", got {shown(value)}"))
    return _check_nested(adapter, value)


OCR_UNSUPPORTED: Rules = {
    "bbox_annotation_format": (_absent, "no annotation model runs"),
    "document_annotation_format": (_absent, "no annotation model runs"),
    "document_annotation_prompt": (_absent, "no annotation model runs"),
    "extract_header": (_off, "headers are not told apart from the page"),
    "extract_footer": (_off, "footers are not told apart from the page"),
    "include_blocks": (_off, "no layout model gives block bounding boxes"),
    "confidence_scores_granularity": (_absent, "no confidence scores are computed"),
    "table_format": (_absent, "tables stay in the page's markdown"),
}


# Mistral's pages: a list of page numbers or a string such as "0,2-4".
Pages = _union(lambda v: v is None or (type(v) is list and all(type(p) is int and p >= 0 for p in v))
               or (type(v) is str and re.fullmatch(r"\s*\d+(\s*-\s*\d+)?(\s*,\s*\d+(\s*-\s*\d+)?)*\s*", v) is not None),
               "invalid_pages", "pages must be a list of page numbers (from 0) or a string such as \"0,2-4\"")


class OcrBody(_Body):
    """Body of a /v1/ocr request (Mistral's OCRRequest): ``document`` one image or PDF."""

    document: Annotated[Any, PlainValidator(_check_document)]
    pages: Pages = None
    include_image_base64: bool | None = None  # no images are extracted: nothing to include
    image_limit: int | None = Field(default=None, ge=0)
    image_min_size: int | None = Field(default=None, ge=0)

    _refuse_unsupported = _refusing(OCR_UNSUPPORTED, "/v1/ocr")


_BODY_MODELS: dict[Endpoint, type[BaseModel]] = {
    Endpoint.CHAT_COMPLETIONS: ChatCompletionBody,
    Endpoint.COMPLETIONS: CompletionBody,
    Endpoint.EMBEDDINGS: EmbeddingBody,
    Endpoint.RESPONSES: ResponsesBody,
    Endpoint.FIM_COMPLETIONS: FimCompletionBody,
    Endpoint.CLASSIFICATIONS: ClassificationBody,
    Endpoint.CHAT_CLASSIFICATIONS: ChatClassificationBody,
    # Mistral's moderations take a ClassificationRequest, the same body.
    Endpoint.MODERATIONS: ClassificationBody,
    Endpoint.CHAT_MODERATIONS: ChatModerationBody,
    Endpoint.TRANSCRIPTIONS: TranscriptionBody,
    Endpoint.OCR: OcrBody,
}


def body_model_for(endpoint: Endpoint | str) -> type[BaseModel]:
    return _BODY_MODELS[Endpoint(endpoint)]


# -- fast path ---------------------------------------------------------------------------------
# Most lines are plain (string messages, a few numeric fields): checked by hand, faster than
# the model. A fast check only ever accepts; anything else goes to the model, which words errors.


def _num_in(low: float, high: float) -> Callable[[Any], bool]:
    return lambda v: (type(v) is float or type(v) is int) and low <= v <= high


def _int_in(low: int, high: float = float("inf")) -> Callable[[Any], bool]:
    return lambda v: type(v) is int and low <= v <= high


_SIMPLE_FIELDS: dict[str, Callable[[Any], bool]] = {
    "model": lambda v: type(v) is str,
    "max_tokens": _int_in(1),
    "temperature": _num_in(0, 2),
    "top_p": lambda v: (type(v) is float or type(v) is int) and 0 < v <= 1,
    "top_k": _int_in(-1),
    "n": _int_in(1, MAX_N),
    "seed": _int_in(INT64_MIN, INT64_MAX),
    "stop": lambda v: type(v) is str or _is_str_list(v),
    "presence_penalty": _num_in(-2, 2),
    "frequency_penalty": _num_in(-2, 2),
    "user": lambda v: type(v) is str,
}
_CHAT_FIELDS = {**_SIMPLE_FIELDS, "max_completion_tokens": _int_in(1)}
# Roles whose string-content message is valid both in a chat and in /v1/responses input.
_PLAIN_ROLES = frozenset(("system", "user", "assistant", "developer"))


def _plain_chars(messages: Any) -> int | None:
    """The content characters of a non-empty list of ``{"role", "content"}`` messages with
    plain roles and string content; None for any other value."""
    if type(messages) is not list or not messages:
        return None
    chars = 0
    for message in messages:
        if type(message) is not dict or len(message) != 2:
            return None
        content = message.get("content")
        if type(content) is not str or message.get("role") not in _PLAIN_ROLES:
            return None
        chars += len(content)
    return chars


def _fast(field: str, fields: dict[str, Callable[[Any], bool]], *, text: bool = True,
          messages: bool = False) -> Callable[[dict[str, Any]], int | None]:
    """The fast check of bodies whose ``field`` is a non-empty string (``text``) or plain
    ``messages``, and whose other fields are all of ``fields``."""

    def check(body: dict[str, Any]) -> int | None:
        value = body.get(field)
        chars = len(value) if text and type(value) is str and value else _plain_chars(value) if messages else None
        if chars is None:
            return None
        for key, other in body.items():
            if key != field:
                check_field = fields.get(key)
                if check_field is None or not check_field(other):
                    return None
        return chars + len(body.get("instructions") or "")  # a Responses body's (no other fields allow it)

    return check


_MODEL_ONLY = {"model": _SIMPLE_FIELDS["model"]}
_RESPONSES_FIELDS = {**{name: _SIMPLE_FIELDS[name] for name in ("model", "temperature", "top_p", "user")},
                     "instructions": lambda v: type(v) is str, "max_output_tokens": _int_in(1)}


_FAST_CHECKS: dict[Endpoint, Callable[[dict[str, Any]], int | None]] = {
    Endpoint.CHAT_COMPLETIONS: _fast("messages", _CHAT_FIELDS, text=False, messages=True),
    Endpoint.COMPLETIONS: _fast("prompt", _SIMPLE_FIELDS),
    Endpoint.EMBEDDINGS: _fast("input", _MODEL_ONLY),
    Endpoint.RESPONSES: _fast("input", _RESPONSES_FIELDS, messages=True),
    Endpoint.FIM_COMPLETIONS: _fast("prompt", _SIMPLE_FIELDS),
    Endpoint.CLASSIFICATIONS: _fast("input", _MODEL_ONLY),
    Endpoint.MODERATIONS: _fast("input", _MODEL_ONLY),
}


def fast_check_for(endpoint: Endpoint | str) -> Callable[[dict[str, Any]], int | None]:
    """A check that returns the prompt's character count when a body is certainly valid
    for ``endpoint`` in its plain common shape, and None when the full model must decide."""
    return _FAST_CHECKS.get(Endpoint(endpoint), lambda body: None)  # others: always the full model


def _text_chars(value: Any) -> int:
    if type(value) is str:
        return len(value)
    if type(value) is int:
        return 4  # a token id is one token
    if type(value) is list:
        return sum(_text_chars(v) for v in value)
    if type(value) is dict:  # a content part, a message, or a conversation to classify
        return _text_chars(value.get("text") or value.get("content") or value.get("messages"))
    return 0


def prompt_chars(body: dict[str, Any]) -> int:
    """Characters of prompt text in a valid body, a token id counting four (about one token)."""
    for field in ("messages", "prompt", "input"):
        if field in body:
            extra = sum(len(v) for v in (body.get("instructions"), body.get("suffix")) if type(v) is str)
            return _text_chars(body[field]) + extra
    return 0


# -- error messages ---------------------------------------------------------------------------


def _path(root: str, loc: tuple[int | str, ...]) -> str:
    # "schema_": the field a body spells "schema" (a BaseModel attribute name).
    return root + "".join(f"[{part}]" if isinstance(part, int) else f".{'schema' if part == 'schema_' else part}"
                          for part in loc)


def shown(value: Any, limit: int = 60) -> str:
    """The value as the user wrote it: JSON (``true``, ``null``), repr for what is not."""
    try:
        text = orjson.dumps(value).decode()
    except TypeError:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _message(err: Any) -> str:
    """What is wrong, with the offending value when it helps."""
    kind = err["type"]
    if kind == "missing":
        return "field required"
    if kind == "too_short" and err.get("input") == []:
        return "must not be empty"
    value = err.get("input")
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        return f"must be a JSON object (got {shown(value)})"
    if kind == "int_type" and type(value) is float and abs(value) >= 2.0**64:
        # orjson reads an integer literal past 64 bits as a float: say what went wrong.
        return f"Input should be an integer that fits in 64 bits (got {shown(value)})"
    message = err["msg"].removeprefix("Value error, ")
    if kind in ("value_error", "nested_error") or kind.startswith(("invalid_", "empty_", "stream_")):
        return message
    return f"{message} (got {shown(err.get('input'))})"


def _located(err: Any, root: str) -> tuple[str, str]:
    """Where an error is (a nested check's error continues its field's path) and what it is."""
    where = _path(root, err["loc"])
    if err["type"] == "nested_error":
        return where + err["ctx"]["subpath"], err["ctx"]["detail"]
    return where, _message(err)


def describe_validation_error(exc: ValidationError, root: str = "body", max_errors: int = 3) -> str:
    """One line naming where each problem is and what it is, e.g.
    ``body.temperature: Input should be less than or equal to 2 (got 3.5)``."""
    errors = exc.errors(include_url=False)
    parts = [": ".join(_located(err, root)) for err in errors[:max_errors]]
    if len(errors) > max_errors:
        parts.append(f"and {len(errors) - max_errors} more")
    return "; ".join(parts)
