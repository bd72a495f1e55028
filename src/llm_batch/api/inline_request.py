"""One inline request of a job created with its requests in the body (the native route's
``requests`` and Mistral's, which share its fields)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class InlineRequest(BaseModel):
    """One inline request of a batch job. No other field is allowed (422)."""

    model_config = ConfigDict(extra="forbid")

    custom_id: str | None = Field(
        default=None,
        max_length=512,
        description="Your id for the request, carried by its result or error line; default: its 0-based "
        "position in `requests`, as a string",
    )
    body: dict[str, Any] = Field(
        description="The request body for the job's endpoint (e.g. `messages`, `max_tokens`); checked per "
        "request by the job's validation (a bad one is an error line, not a refused job). A `model` in it is "
        "not used: the job's model runs"
    )
