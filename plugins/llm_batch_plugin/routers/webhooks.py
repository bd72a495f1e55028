"""Webhooks: ``/v1/webhooks`` (create, list, get, delete, test, attempts) per owner.

An endpoint gets its owner's job-end events (every dialect's jobs) as OpenAI's batch events,
signed with Standard Webhooks; the secret is shown once, in the create answer. URLs are
checked against the admin's allow-list (llm_batch.webhooks.check_destination) here and again
at each delivery. Admins see and manage every owner's endpoints."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Query

from llm_batch.jobstore.webhooks import WebhookEndpointNotFound
from llm_batch.webhooks import Deliverer, DestinationRefused, check_destination
from llm_batch_plugin.auth import Caller, CallerDep
from llm_batch_plugin.errors import ApiError, not_found
from llm_batch_plugin.models_webhooks import (
    WebhookAttemptList,
    WebhookAttemptOut,
    WebhookEndpointCreate,
    WebhookEndpointCreated,
    WebhookEndpointDeleted,
    WebhookEndpointList,
    WebhookEndpointOut,
    WebhookTestRequest,
    WebhookTestResult,
)
from llm_batch_plugin.state import SettingsDep, StoreDep

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"])

MAX_ENDPOINTS_PER_OWNER = 20
_KIND = "webhook endpoint"


def _owned(store, caller: Caller, endpoint_id: str):
    found = store.get_webhook_endpoint(endpoint_id, owner=caller.owner_filter)
    if found is None:
        raise not_found(_KIND, endpoint_id)
    return found


@router.post("", response_model=WebhookEndpointCreated, summary="Create a webhook endpoint (its secret is shown once)")
def create_webhook(body: WebhookEndpointCreate, caller: CallerDep, store: StoreDep,
                   settings: SettingsDep) -> WebhookEndpointCreated:
    caller.require_submit()
    try:
        # A name that does not resolve now passes: every delivery checks again.
        check_destination(body.url, settings, unresolved_ok=True)
    except DestinationRefused as exc:
        raise ApiError(400, str(exc), param="url", code="webhook_url_refused") from None
    if len(store.list_webhook_endpoints(owner=caller.name)) >= MAX_ENDPOINTS_PER_OWNER:
        raise ApiError(429, f"{caller.name!r} has {MAX_ENDPOINTS_PER_OWNER} webhook endpoints already, the limit: "
                       "delete one first", code="limit_exceeded")
    endpoint, secret = store.create_webhook_endpoint(caller.name, body.url, body.events, body.description)
    return WebhookEndpointCreated(**WebhookEndpointOut.of(endpoint).model_dump(), secret=secret)


@router.get("", response_model=WebhookEndpointList, summary="List webhook endpoints")
def list_webhooks(caller: CallerDep, store: StoreDep) -> WebhookEndpointList:
    return WebhookEndpointList(data=[WebhookEndpointOut.of(e) for e in store.list_webhook_endpoints(caller.owner_filter)])


@router.get("/{endpoint_id}", response_model=WebhookEndpointOut, summary="Get a webhook endpoint")
def get_webhook(endpoint_id: str, caller: CallerDep, store: StoreDep) -> WebhookEndpointOut:
    return WebhookEndpointOut.of(_owned(store, caller, endpoint_id))


@router.delete("/{endpoint_id}", response_model=WebhookEndpointDeleted, summary="Delete a webhook endpoint")
def delete_webhook(endpoint_id: str, caller: CallerDep, store: StoreDep) -> WebhookEndpointDeleted:
    caller.require_submit()
    try:
        store.delete_webhook_endpoint(endpoint_id, owner=caller.owner_filter)
    except WebhookEndpointNotFound:
        raise not_found(_KIND, endpoint_id) from None
    return WebhookEndpointDeleted(id=endpoint_id)


@router.post("/{endpoint_id}/test", response_model=WebhookTestResult,
             summary="Send a signed test event to the endpoint now (once) and say what it answered")
def test_webhook(
    endpoint_id: str, caller: CallerDep, store: StoreDep, settings: SettingsDep,
    body: Annotated[WebhookTestRequest | None, Body()] = None,
) -> WebhookTestResult:
    caller.require_submit()
    event_type = (body or WebhookTestRequest()).event_type
    try:
        delivery = store.enqueue_webhook_test(endpoint_id, owner=caller.owner_filter, event_type=event_type)
    except WebhookEndpointNotFound:
        raise not_found(_KIND, endpoint_id) from None
    deliverer = Deliverer(store, settings, name="api-test")
    try:
        deliverer.deliver_now(delivery.id)
    finally:
        deliverer.close()
    attempts = store.list_webhook_attempts(endpoint_id, delivery_id=delivery.id, limit=1)
    attempt = attempts[0] if attempts else None
    return WebhookTestResult(
        webhook_endpoint_id=endpoint_id, event_type=event_type, webhook_id=delivery.id,
        delivered=bool(attempt and attempt.status_code is not None and 200 <= attempt.status_code < 300),
        status_code=attempt.status_code if attempt else None, latency_ms=attempt.latency_ms if attempt else 0.0,
        error=(attempt.error if attempt else "not attempted: another deliverer holds the event"),
    )


@router.get("/{endpoint_id}/attempts", response_model=WebhookAttemptList,
            summary="List the endpoint's delivery attempts, newest first")
def list_webhook_attempts(
    endpoint_id: str, caller: CallerDep, store: StoreDep,
    limit: Annotated[int, Query(ge=1, le=1000, description="At most this many attempts")] = 100,
    job_id: Annotated[str | None, Query(max_length=128, description="Only the attempts of this job's event")] = None,
) -> WebhookAttemptList:
    _owned(store, caller, endpoint_id)
    attempts = store.list_webhook_attempts(endpoint_id, owner=caller.owner_filter, limit=limit, job_id=job_id)
    return WebhookAttemptList(data=[WebhookAttemptOut.of(a) for a in attempts])
