"""Webhooks: ``/v1/webhooks`` (create, list, get, delete, test, attempts) per owner.

An endpoint gets its owner's job-end events (every dialect's jobs) as OpenAI's batch events,
signed with Standard Webhooks; the secret is shown once, in the create answer. The same
endpoints are OpenAI's ``/v1/webhook_endpoints`` (openai/webhooks.py); the rules of
both are in webhook_endpoints.py. Admins see and manage every owner's endpoints."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Query

from llm_batch.api import webhook_endpoints
from llm_batch.api.auth import CallerDep
from llm_batch.api.native.webhook_models import (
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
from llm_batch.api.state import SettingsDep, StateDep, StoreDep

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
    return WebhookTestResult(
        webhook_endpoint_id=endpoint_id, event_type=event_type, webhook_id=webhook_id,
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
    webhook_endpoints.owned(store, caller, endpoint_id)
    attempts = store.list_webhook_attempts(endpoint_id, owner=caller.owner_filter, limit=limit, job_id=job_id)
    return WebhookAttemptList(data=[WebhookAttemptOut.of(a) for a in attempts])
