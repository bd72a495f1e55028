"""OpenAI's webhook endpoints API, as the openai SDK's ``client.webhooks`` calls it:
``/v1/webhook_endpoints`` (create, retrieve, update, list, delete, rotate_secret, test) and
``/v1/webhook_event_types``, in the SDK's shapes (openai/webhook_models.py) and OpenAI's
error shape. The endpoints are the same as ``/v1/webhooks``' (webhook_endpoints.py says why
one resource serves both paths)."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter, Body, Query

from llm_batch.api import webhook_endpoints
from llm_batch.api.auth import CallerDep
from llm_batch.api.errors import ApiError
from llm_batch.api.native.webhook_models import WebhookEndpointDeleted
from llm_batch.api.openai.webhook_models import (
    OpenAIWebhookEndpoint,
    OpenAIWebhookEndpointList,
    OpenAIWebhookEndpointWithSecret,
    WebhookEndpointCreateParams,
    WebhookEndpointTestResult,
    WebhookEndpointUpdateParams,
    WebhookEventTypeList,
    WebhookRotateSecretParams,
    WebhookTestParams,
)
from llm_batch.api.state import MAX_OPENAI_PAGE_SIZE, SettingsDep, StateDep, StoreDep
from llm_batch.infra.jobstore.webhooks import EVENT_TYPES

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
