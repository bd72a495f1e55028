"""The endpoints a batch can name, what a model must be to serve each, and the ones refused."""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum


class Endpoint(StrEnum):  # docs/api.md says what each answers
    CHAT_COMPLETIONS = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    EMBEDDINGS = "/v1/embeddings"
    RESPONSES = "/v1/responses"  # run on the chat path
    FIM_COMPLETIONS = "/v1/fim/completions"  # Mistral's fill-in-the-middle
    CLASSIFICATIONS = "/v1/classifications"
    CHAT_CLASSIFICATIONS = "/v1/chat/classifications"
    MODERATIONS = "/v1/moderations"  # a multi-label classifier's scores as moderation categories
    CHAT_MODERATIONS = "/v1/chat/moderations"
    TRANSCRIPTIONS = "/v1/audio/transcriptions"  # a speech model's transcript of one audio file
    OCR = "/v1/ocr"  # a vision-language model's markdown of one image or PDF


SUPPORTED_ENDPOINTS: tuple[str, ...] = tuple(e.value for e in Endpoint)
# The served endpoints as the API's field descriptions list them: "`a`, `b` or `c`".
SUPPORTED_LISTED = ", ".join(f"`{e}`" for e in SUPPORTED_ENDPOINTS[:-1]) + f" or `{SUPPORTED_ENDPOINTS[-1]}`"

# The registry task a model must have to serve each endpoint (models.yaml `task`).
TASK_OF_ENDPOINT: dict[Endpoint, str] = {
    Endpoint.CHAT_COMPLETIONS: "generate",
    Endpoint.COMPLETIONS: "generate",
    Endpoint.EMBEDDINGS: "embed",
    Endpoint.RESPONSES: "generate",
    Endpoint.FIM_COMPLETIONS: "generate",
    Endpoint.CLASSIFICATIONS: "classify",
    Endpoint.CHAT_CLASSIFICATIONS: "classify",
    Endpoint.MODERATIONS: "classify",
    Endpoint.CHAT_MODERATIONS: "classify",
    Endpoint.TRANSCRIPTIONS: "transcribe",
    Endpoint.OCR: "ocr",
}

# Endpoints whose lines name a file that validation resolves for the line's owner (llm_batch.infra.media).
MEDIA_ENDPOINTS: tuple[Endpoint, ...] = (Endpoint.TRANSCRIPTIONS, Endpoint.OCR)

# Endpoints that need a part of the model's registry entry beside its task.
FEATURE_OF_ENDPOINT: dict[Endpoint, str] = {
    Endpoint.FIM_COMPLETIONS: "fim",
    Endpoint.MODERATIONS: "moderation",
    Endpoint.CHAT_MODERATIONS: "moderation",
}

# Listed by the Mistral contract or the openai client's batch endpoints, but not served (docs/api.md says why).
UNSUPPORTED_ENDPOINTS: tuple[str, ...] = (
    "/v1/conversations",
    "/v1/images/generations",
    "/v1/images/edits",
    "/v1/videos",
)


class UnsupportedEndpointError(ValueError):
    pass


def parse_endpoint(value: str) -> Endpoint:
    """The Endpoint for `value`, or an error naming the supported ones."""
    try:
        return Endpoint(value)
    except ValueError:
        known = "is not supported by this system" if value in UNSUPPORTED_ENDPOINTS else "is unknown"
        raise UnsupportedEndpointError(
            f"endpoint {value!r} {known}; supported endpoints: {', '.join(SUPPORTED_ENDPOINTS)}"
        ) from None


def endpoints_served(task: str, features: Iterable[str] = ()) -> list[Endpoint]:
    """The endpoints a model of ``task`` with the registry ``features`` serves."""
    have = set(features)
    return [e for e, needed in TASK_OF_ENDPOINT.items()
            if needed == task and FEATURE_OF_ENDPOINT.get(e, task) in have | {task}]


def serving_problem(endpoint: Endpoint | str, model: str, task: str, features: Iterable[str] = ()) -> str | None:
    """Why ``model`` (its registry task and features) cannot serve ``endpoint``, or None."""
    endpoint = Endpoint(endpoint)
    if endpoint in endpoints_served(task, features):
        return None
    if TASK_OF_ENDPOINT[endpoint] != task:
        serves = ", ".join(endpoints_served(task, features)) or "no endpoint"
        return f"model {model!r} ({task} task) serves {serves}, not {endpoint.value}"
    feature = FEATURE_OF_ENDPOINT[endpoint]
    return (f"model {model!r} has no {feature!r} entry in the model registry, which "
            f"{endpoint.value} needs (docs/models.md)")
