"""The endpoints a batch can name, and the ones we refuse with a clear message."""

from __future__ import annotations

from enum import StrEnum


class Endpoint(StrEnum):
    CHAT_COMPLETIONS = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    EMBEDDINGS = "/v1/embeddings"


SUPPORTED_ENDPOINTS: tuple[str, ...] = tuple(e.value for e in Endpoint)

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
