"""The endpoints a batch can name, and the ones we refuse with a clear message."""

from __future__ import annotations

from enum import StrEnum


class Endpoint(StrEnum):
    CHAT_COMPLETIONS = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    EMBEDDINGS = "/v1/embeddings"
    # The Responses API, run on the chat path (docs/api.md "Responses in batches").
    RESPONSES = "/v1/responses"


SUPPORTED_ENDPOINTS: tuple[str, ...] = tuple(e.value for e in Endpoint)

# The registry task a model must have to serve each endpoint (models.yaml `task`): the
# worker refuses a mismatch at its start, the API at create.
TASK_OF_ENDPOINT: dict[Endpoint, str] = {
    Endpoint.CHAT_COMPLETIONS: "generate",
    Endpoint.COMPLETIONS: "generate",
    Endpoint.EMBEDDINGS: "embed",
    Endpoint.RESPONSES: "generate",
}

# Listed by the Mistral contract but not served by this system.
UNSUPPORTED_ENDPOINTS: tuple[str, ...] = (
    "/v1/fim/completions",
    "/v1/moderations",
    "/v1/chat/moderations",
    "/v1/ocr",
    "/v1/classifications",
    "/v1/chat/classifications",
    "/v1/conversations",
    "/v1/audio/transcriptions",
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
