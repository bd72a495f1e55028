"""OpenAI's webhook endpoints API as the openai SDK's ``client.webhooks`` calls it:
``/v1/webhook_endpoints`` and ``/v1/webhook_event_types`` (the rules: webhook_endpoints.py). The
SDK's types (``openai.types.webhooks``) are the contract; an endpoint's ``name`` is our ``description``."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Literal

from fastapi import APIRouter, Body, Query
from pydantic import BaseModel, Field

from llm_batch.api import webhook_endpoints
from llm_batch.api.auth import CallerDep
from llm_batch.api.errors import ApiError
from llm_batch.api.native.webhooks import SECRET_DESCRIPTION, URL_DESCRIPTION, WebhookEndpointDeleted, WebhookEventType
from llm_batch.api.state import MAX_OPENAI_PAGE_SIZE, SettingsDep, StateDep, StoreDep
from llm_batch.infra.jobstore.webhooks import EVENT_TYPES, WebhookEndpoint

_EVENT_TYPES = ("The event types that trigger deliveries to it; only job-end events are sent: batch.completed, "
                "batch.failed, batch.expired, batch.cancelled (other types of OpenAI's list are refused, 422)")


class WebhookEndpointCreateParams(BaseModel):
    """A new webhook endpoint (``client.webhooks.create``)."""

    url: str = Field(min_length=1, max_length=2048, description=URL_DESCRIPTION)
    name: str = Field(max_length=512, description="A human-readable name for the endpoint")
    event_types: list[WebhookEventType] = Field(min_length=1, max_length=4, description=_EVENT_TYPES)


class WebhookEndpointUpdateParams(BaseModel):
    """What to change of an endpoint (``client.webhooks.update``); what is omitted stays."""

    url: str | None = Field(None, min_length=1, max_length=2048, description=URL_DESCRIPTION)
    name: str | None = Field(None, max_length=512, description="A new human-readable name")
    event_types: list[WebhookEventType] | None = Field(None, min_length=1, max_length=4, description="The complete "
                                                       "set of event types to deliver (replaces the old one)")


class WebhookRotateSecretParams(BaseModel):
    """How to rotate an endpoint's signing secret (``client.webhooks.rotate_secret``)."""

    keep_old_secret_active_for_24_hours: bool = Field(
        False, description="True: for 24 hours every delivery is signed with the old secret too (two signatures in "
        "`webhook-signature`), so receivers switch without missing an event; false: the old secret stops at once")


class WebhookTestParams(BaseModel):
    """Which sample event to send (``client.webhooks.test``); its data.id is `batch_test`, no real job."""

    event_type: WebhookEventType = Field(description="The event type to send as a sample delivery")


class OpenAIWebhookEndpoint(BaseModel):
    """A webhook endpoint (``WebhookEndpoint``): never its secret, only a hint of it."""

    id: str = Field(description="The endpoint's id (we_...)")
    object: Literal["webhook_endpoint"] = Field("webhook_endpoint", description="Always `webhook_endpoint`")
    url: str = Field(description="Where the events are POSTed")
    name: str = Field(description="The endpoint's human-readable name")
    event_types: list[str] = Field(description="The event types delivered to it")
    created_at: int = Field(description="When it was created (Unix seconds)")
    updated_at: int = Field(description="When its URL, name, event types or secret last changed (Unix seconds)")
    signing_secret_hint: str = Field(description="The signing secret's last characters (`whsec_...abcd`)")

    @classmethod
    def of(cls, endpoint: WebhookEndpoint, **extra: str) -> OpenAIWebhookEndpoint:
        return cls(id=endpoint.id, url=endpoint.url, name=endpoint.description, event_types=endpoint.events,
                   created_at=int(endpoint.created_at.timestamp()), updated_at=int(endpoint.updated_at.timestamp()),
                   signing_secret_hint=endpoint.secret_hint, **extra)


class OpenAIWebhookEndpointWithSecret(OpenAIWebhookEndpoint):
    """An endpoint with its signing secret (``WebhookEndpointWithSecret``): answered by create and
    rotate_secret only; store it safely."""

    signing_secret: str = Field(description=SECRET_DESCRIPTION)


class OpenAIWebhookEndpointList(BaseModel):
    """A page of webhook endpoints, newest first (``SyncCursorPage[WebhookEndpoint]``)."""

    object: Literal["list"] = Field("list", description="Always `list`")
    data: list[OpenAIWebhookEndpoint] = Field(description="The endpoints of this page, newest first")
    first_id: str | None = Field(None, description="Id of the first endpoint of the page; null when it is empty")
    last_id: str | None = Field(None, description="Id of the last endpoint of the page (pass it as `after` for the "
                                "next page); null when empty")
    has_more: bool = Field(description="Whether endpoints follow this page")


class WebhookEndpointTestResult(BaseModel):
    """The receiver's answer to a sample event (``WebhookEndpointTestResult``). A receiver that
    gave no HTTP answer (refused, unreachable, past the deadline) is a 502 error instead."""

    object: Literal["webhook_endpoint.test"] = Field("webhook_endpoint.test", description="Always `webhook_endpoint.test`")
    webhook_endpoint_id: str = Field(description="The endpoint tested")
    event_type: WebhookEventType = Field(description="The type of the event sent")
    status_code: int = Field(description="The receiver's HTTP status")
    success: Literal[True] = Field(True, description="Always true: the request completed (see status_code)")


class WebhookEventTypeList(BaseModel):
    """The event types this API delivers (``WebhookEventTypeList``)."""

    object: Literal["list"] = Field("list", description="Always `list`")
    data: list[WebhookEventType] = Field(description="batch.completed, batch.failed, batch.expired, batch.cancelled")


router = APIRouter(tags=["webhooks"])

PREFIX = "/v1/webhook_endpoints"
ONE = PREFIX + "/{webhook_endpoint_id}"
OLD_SECRET_GRACE = timedelta(hours=24)
_NO_ANSWER = {
    "description": "The receiver gave no HTTP answer (refused, unreachable, or past the delivery deadline); the "
    "message says which. Not retried by the SDK",
    "headers": {"x-should-retry": {"description": "`false`: retrying would only send another event",
                                   "schema": {"type": "string"}}},
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/OpenAIErrorBody"}}},
}


@router.post(PREFIX, response_model=OpenAIWebhookEndpointWithSecret,
             summary="Create a webhook endpoint (its signing secret is shown once)")
def create_webhook_endpoint(body: WebhookEndpointCreateParams, caller: CallerDep, store: StoreDep,
                            settings: SettingsDep) -> OpenAIWebhookEndpointWithSecret:
    endpoint, secret = webhook_endpoints.create(store, settings, caller, body.url, body.event_types, body.name)
    return OpenAIWebhookEndpointWithSecret.of(endpoint, signing_secret=secret)


@router.get(PREFIX, response_model=OpenAIWebhookEndpointList, summary="List webhook endpoints, newest first")
def list_webhook_endpoints(
    caller: CallerDep, store: StoreDep,
    after: Annotated[str | None, Query(max_length=128, description="The last endpoint id of the previous page")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_OPENAI_PAGE_SIZE, description="At most this many endpoints")] = 20,
) -> OpenAIWebhookEndpointList:
    endpoints, has_more = store.page_webhook_endpoints(caller.owner_filter, limit=limit, after=after)
    data = [OpenAIWebhookEndpoint.of(e) for e in endpoints]
    return OpenAIWebhookEndpointList(data=data, has_more=has_more, first_id=data[0].id if data else None,
                                     last_id=data[-1].id if data else None)


@router.get(ONE, response_model=OpenAIWebhookEndpoint, summary="Retrieve a webhook endpoint")
def retrieve_webhook_endpoint(webhook_endpoint_id: str, caller: CallerDep, store: StoreDep) -> OpenAIWebhookEndpoint:
    return OpenAIWebhookEndpoint.of(webhook_endpoints.owned(store, caller, webhook_endpoint_id))


@router.post(ONE, response_model=OpenAIWebhookEndpoint, summary="Update a webhook endpoint's URL, name or event types")
def update_webhook_endpoint(webhook_endpoint_id: str, body: WebhookEndpointUpdateParams, caller: CallerDep,
                            store: StoreDep, settings: SettingsDep) -> OpenAIWebhookEndpoint:
    endpoint = webhook_endpoints.update(store, settings, caller, webhook_endpoint_id, url=body.url,
                                        events=body.event_types, description=body.name)
    return OpenAIWebhookEndpoint.of(endpoint)


@router.delete(ONE, response_model=WebhookEndpointDeleted, summary="Delete a webhook endpoint")
def delete_webhook_endpoint(webhook_endpoint_id: str, caller: CallerDep, store: StoreDep) -> WebhookEndpointDeleted:
    webhook_endpoints.delete(store, caller, webhook_endpoint_id)
    return WebhookEndpointDeleted(id=webhook_endpoint_id)


@router.post(ONE + "/rotate_secret", response_model=OpenAIWebhookEndpointWithSecret,
             summary="Rotate the signing secret (the new one is shown once)")
def rotate_webhook_secret(
    webhook_endpoint_id: str, caller: CallerDep, store: StoreDep,
    body: Annotated[WebhookRotateSecretParams | None, Body()] = None,
) -> OpenAIWebhookEndpointWithSecret:
    keep = (body or WebhookRotateSecretParams()).keep_old_secret_active_for_24_hours
    endpoint, secret = webhook_endpoints.rotate_secret(store, caller, webhook_endpoint_id,
                                                       OLD_SECRET_GRACE if keep else None)
    return OpenAIWebhookEndpointWithSecret.of(endpoint, signing_secret=secret)


@router.post(ONE + "/test", response_model=WebhookEndpointTestResult,
             summary="Send a signed sample event now (once) and answer the receiver's HTTP status",
             responses={429: webhook_endpoints.throttled_response("OpenAIErrorBody"), 502: _NO_ANSWER})
async def test_webhook_endpoint(webhook_endpoint_id: str, body: WebhookTestParams, caller: CallerDep,
                                state: StateDep) -> WebhookEndpointTestResult:
    _, attempt = await webhook_endpoints.send_test(state, caller, webhook_endpoint_id, body.event_type)
    if attempt is None or attempt.status_code is None:
        why = attempt.error if attempt else "another deliverer holds the event"
        raise ApiError(502, f"the webhook endpoint gave no HTTP answer: {why}", code="webhook_no_answer",
                       headers={"x-should-retry": "false"})
    return WebhookEndpointTestResult(webhook_endpoint_id=webhook_endpoint_id, event_type=body.event_type,
                                     status_code=attempt.status_code)


@router.get("/v1/webhook_event_types", response_model=WebhookEventTypeList,
            summary="The webhook event types this API sends")
def list_webhook_event_types(caller: CallerDep) -> WebhookEventTypeList:
    return WebhookEventTypeList(data=list(EVENT_TYPES))
