"""``/v1/webhooks``: an owner's webhook endpoints, which get the owner's job-end events as OpenAI's
batch events signed with Standard Webhooks (the rules: webhook_endpoints.py); times in Unix seconds."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Body, Query
from pydantic import BaseModel, Field

from llm_batch.api import webhook_endpoints
from llm_batch.api.auth import CallerDep
from llm_batch.api.state import SettingsDep, StateDep, StoreDep
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
    events: list[WebhookEventType] | None = Field(None, min_length=1, max_length=4, description="The events to send: "
                                                  "batch.completed, batch.failed, batch.expired, batch.cancelled; "
                                                  "omitted: all four")
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
    object: Literal["webhook_endpoint.deleted"] = Field("webhook_endpoint.deleted",
                                                        description="Always `webhook_endpoint.deleted`")
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
    delivery_status: Literal["pending", "delivered", "failed"] = Field(description="The event's state now: pending "
                                                                       "(more attempts to come), delivered, or failed "
                                                                       "(retries exhausted)")

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


router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"])


@router.post("", response_model=WebhookEndpointCreated, summary="Create a webhook endpoint (its secret is shown once)")
def create_webhook(body: WebhookEndpointCreate, caller: CallerDep, store: StoreDep,
                   settings: SettingsDep) -> WebhookEndpointCreated:
    endpoint, secret = webhook_endpoints.create(store, settings, caller, body.url, body.events, body.description)
    return WebhookEndpointCreated(**WebhookEndpointOut.of(endpoint).model_dump(), secret=secret)


@router.get("", response_model=WebhookEndpointList, summary="List webhook endpoints")
def list_webhooks(caller: CallerDep, store: StoreDep) -> WebhookEndpointList:
    return WebhookEndpointList(data=[WebhookEndpointOut.of(e) for e in store.list_webhook_endpoints(caller.owner_filter)])


@router.get("/{endpoint_id}", response_model=WebhookEndpointOut, summary="Get a webhook endpoint")
def get_webhook(endpoint_id: str, caller: CallerDep, store: StoreDep) -> WebhookEndpointOut:
    return WebhookEndpointOut.of(webhook_endpoints.owned(store, caller, endpoint_id))


@router.delete("/{endpoint_id}", response_model=WebhookEndpointDeleted, summary="Delete a webhook endpoint")
def delete_webhook(endpoint_id: str, caller: CallerDep, store: StoreDep) -> WebhookEndpointDeleted:
    webhook_endpoints.delete(store, caller, endpoint_id)
    return WebhookEndpointDeleted(id=endpoint_id)


@router.post("/{endpoint_id}/test", response_model=WebhookTestResult,
             summary="Send a signed test event to the endpoint now (once) and say what it answered",
             responses={429: webhook_endpoints.throttled_response("ErrorBody")})
async def test_webhook(
    endpoint_id: str, caller: CallerDep, state: StateDep,
    body: Annotated[WebhookTestRequest | None, Body()] = None,
) -> WebhookTestResult:
    event_type = (body or WebhookTestRequest()).event_type
    webhook_id, attempt = await webhook_endpoints.send_test(state, caller, endpoint_id, event_type)
    status = attempt.status_code if attempt else None
    return WebhookTestResult(webhook_endpoint_id=endpoint_id, event_type=event_type, webhook_id=webhook_id,
                             delivered=status is not None and 200 <= status < 300, status_code=status,
                             latency_ms=attempt.latency_ms if attempt else 0.0,
                             error=attempt.error if attempt else "not attempted: another deliverer holds the event")


@router.get("/{endpoint_id}/attempts", response_model=WebhookAttemptList,
            summary="List the endpoint's delivery attempts, newest first")
def list_webhook_attempts(
    endpoint_id: str, caller: CallerDep, store: StoreDep,
    limit: Annotated[int, Query(ge=1, le=1000, description="At most this many attempts")] = 100,
    job_id: Annotated[str | None, Query(max_length=128, description="Only the attempts of this job's event")] = None,
) -> WebhookAttemptList:
    webhook_endpoints.owned(store, caller, endpoint_id)
    attempts = store.list_webhook_attempts(endpoint_id, owner=caller.owner_filter, limit=limit, job_id=job_id)
    return WebhookAttemptList(data=[WebhookAttemptOut.of(a) for a in attempts])
