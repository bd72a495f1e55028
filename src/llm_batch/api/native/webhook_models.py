"""The webhook routes' bodies (``/v1/webhooks``): endpoints, test results and attempts.

Events are OpenAI's batch events for every dialect's jobs, signed with Standard Webhooks
(docs/api.md "Webhooks"); times are Unix seconds, as in OpenAI's objects."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from llm_batch.infra.jobstore.webhooks import WebhookAttempt, WebhookEndpoint

WebhookEventType = Literal["batch.completed", "batch.failed", "batch.expired", "batch.cancelled"]
URL_DESCRIPTION = (
    "The receiver: an http(s) URL whose host is, or resolves only to, globally routable unicast addresses; any "
    "other is refused (400 webhook_url_refused) unless an admin allowed the host in LLM_BATCH_WEBHOOK_ALLOWED_HOSTS"
)
SECRET_DESCRIPTION = ("The Standard Webhooks secret (whsec_...): verify each event with it, e.g. "
                      "`openai.OpenAI().webhooks.unwrap(body, headers, secret=...)`")


class WebhookEndpointCreate(BaseModel):
    """A new webhook endpoint: where the caller's job-end events go."""

    url: str = Field(min_length=1, max_length=2048, description=URL_DESCRIPTION)
    events: list[WebhookEventType] | None = Field(
        None, min_length=1, max_length=4,
        description="The events to send: batch.completed, batch.failed, batch.expired, batch.cancelled; "
        "omitted: all four",
    )
    description: str = Field("", max_length=512, description="A label to recognise the endpoint by")


class WebhookEndpointOut(BaseModel):
    """A webhook endpoint (never its secret, which only the create answer shows)."""

    id: str = Field(description="The endpoint's id (we_...)")
    object: Literal["webhook_endpoint"] = Field("webhook_endpoint", description="Always `webhook_endpoint`")
    url: str = Field(description="Where the events are POSTed")
    events: list[WebhookEventType] = Field(description="The events sent to it")
    description: str = Field(description="The endpoint's label")
    owner: str = Field(description="Whose jobs' events it gets")
    created_at: int = Field(description="When it was created (Unix seconds)")

    @classmethod
    def of(cls, endpoint: WebhookEndpoint) -> WebhookEndpointOut:
        return cls(id=endpoint.id, url=endpoint.url, events=endpoint.events, description=endpoint.description,
                   owner=endpoint.owner, created_at=int(endpoint.created_at.timestamp()))


class WebhookEndpointCreated(WebhookEndpointOut):
    """A new endpoint with its signing secret: shown in this answer only, store it safely."""

    secret: str = Field(description=SECRET_DESCRIPTION)


class WebhookEndpointList(BaseModel):
    """The caller's webhook endpoints (an admin's: everyone's), oldest first."""

    object: Literal["list"] = Field("list", description="Always `list`")
    data: list[WebhookEndpointOut] = Field(description="The endpoints")


class WebhookEndpointDeleted(BaseModel):
    """The answer to deleting an endpoint (its pending events are dropped)."""

    id: str = Field(description="The deleted endpoint's id")
    object: Literal["webhook_endpoint.deleted"] = Field(
        "webhook_endpoint.deleted", description="Always `webhook_endpoint.deleted`"
    )
    deleted: bool = Field(True, description="Always true")


class WebhookTestRequest(BaseModel):
    """Which event a test sends (its data.id is `batch_test`, no real job)."""

    event_type: WebhookEventType = Field("batch.completed", description="The type of the test event")


class WebhookTestResult(BaseModel):
    """What the receiver answered to one signed test event (sent once, not retried)."""

    object: Literal["webhook_endpoint.test"] = Field("webhook_endpoint.test", description="Always `webhook_endpoint.test`")
    webhook_endpoint_id: str = Field(description="The endpoint tested")
    event_type: WebhookEventType = Field(description="The type of the event sent")
    webhook_id: str = Field(description="The event's `webhook-id` header")
    delivered: bool = Field(description="True when the receiver answered 2xx")
    status_code: int | None = Field(description="The receiver's HTTP status; null: no answer (refused, timeout, ...)")
    latency_ms: float = Field(description="How long the attempt took, in milliseconds")
    error: str | None = Field(description="Why it was not delivered, if it was not")


class WebhookAttemptOut(BaseModel):
    """One HTTP attempt to deliver an event."""

    id: str = Field(description="The attempt's id (wa_...)")
    object: Literal["webhook_attempt"] = Field("webhook_attempt", description="Always `webhook_attempt`")
    webhook_id: str = Field(description="The event's `webhook-id` header: the same on every attempt of one event")
    event_id: str = Field(description="The event's id (evt_..., the body's `id`)")
    event_type: str = Field(description="The event's type, e.g. batch.completed")
    job_id: str | None = Field(description="The job whose end the event announces; null for a test event")
    attempt: int = Field(description="1 for the first attempt of the event, 2 for its first retry, ...")
    started_at: int = Field(description="When the attempt started (Unix seconds)")
    status_code: int | None = Field(description="The receiver's HTTP status; null: no answer (refused, timeout, ...)")
    latency_ms: float = Field(description="How long the attempt took, in milliseconds")
    error: str | None = Field(description="Why the attempt failed; null when delivered")
    delivery_status: Literal["pending", "delivered", "failed"] = Field(
        description="The event's state now: pending (more attempts to come), delivered, or failed (retries exhausted)"
    )

    @classmethod
    def of(cls, attempt: WebhookAttempt) -> WebhookAttemptOut:
        return cls(id=attempt.id, webhook_id=attempt.delivery_id, event_id=attempt.event_id,
                   event_type=attempt.event_type, job_id=attempt.job_id, attempt=attempt.attempt,
                   started_at=int(attempt.started_at.timestamp()), status_code=attempt.status_code,
                   latency_ms=attempt.latency_ms, error=attempt.error,
                   delivery_status=attempt.delivery_status)  # type: ignore[arg-type]


class WebhookAttemptList(BaseModel):
    """An endpoint's delivery attempts, newest first."""

    object: Literal["list"] = Field("list", description="Always `list`")
    data: list[WebhookAttemptOut] = Field(description="The attempts")
