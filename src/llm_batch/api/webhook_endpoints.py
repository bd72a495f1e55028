"""The webhook endpoint resource with its checks and limits, written once for both its paths:
``/v1/webhooks`` (native/webhooks.py, ours) and ``/v1/webhook_endpoints`` (openai/webhooks.py,
OpenAI's ``client.webhooks``), which reach the same endpoints in one table and one outbox."""

from __future__ import annotations

from datetime import timedelta

from starlette.concurrency import run_in_threadpool

from llm_batch.api.auth import Caller
from llm_batch.api.errors import ApiError, not_found
from llm_batch.api.state import ApiState
from llm_batch.core.config import Settings
from llm_batch.infra.jobstore import JobStore, WebhookRepository
from llm_batch.infra.jobstore.webhooks import WebhookAttempt, WebhookEndpoint, WebhookEndpointNotFound
from llm_batch.infra.webhook_destinations import DestinationRefused, check_destination
from llm_batch.infra.webhooks import Deliverer, new_client

MAX_ENDPOINTS_PER_OWNER = 20
KIND = "webhook endpoint"


def throttled_response(error_body: str) -> dict:
    """The OpenAPI answer of a throttled test, its body the app's schema `error_body`."""
    return {
        "description": "Too many test events: the owner's per-minute or at-once bound, or the server's, is reached "
        "(code rate_limit_exceeded)",
        "headers": {"Retry-After": {"description": "Seconds to wait before trying again", "schema": {"type": "integer"}}},
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{error_body}"}}},
    }


def owned(store: WebhookRepository, caller: Caller, endpoint_id: str) -> WebhookEndpoint:
    if (found := store.get_webhook_endpoint(endpoint_id, owner=caller.owner_filter)) is None:
        raise not_found(KIND, endpoint_id)
    return found


def _check_url(url: str, settings: Settings) -> None:
    try:
        # A name that does not resolve now passes: every delivery checks again.
        check_destination(url, settings, unresolved_ok=True)
    except DestinationRefused as exc:
        raise ApiError(400, str(exc), param="url", code="webhook_url_refused") from None


def create(store: WebhookRepository, settings: Settings, caller: Caller, url: str, events: list[str] | None,
           description: str) -> tuple[WebhookEndpoint, str]:
    """A new endpoint of the caller and its secret (shown once)."""
    caller.require_submit()
    _check_url(url, settings)
    if len(store.list_webhook_endpoints(owner=caller.name)) >= MAX_ENDPOINTS_PER_OWNER:
        raise ApiError(429, f"{caller.name!r} has {MAX_ENDPOINTS_PER_OWNER} webhook endpoints already, the limit: "
                       "delete one first", code="limit_exceeded")
    return store.create_webhook_endpoint(caller.name, url, events, description)


def update(store: JobStore, settings: Settings, caller: Caller, endpoint_id: str, *, url: str | None,
           events: list[str] | None, description: str | None) -> WebhookEndpoint:
    caller.require_submit()
    owned(store, caller, endpoint_id)  # someone else's is 404 before its URL is judged
    if url is not None:
        _check_url(url, settings)
    try:
        return store.update_webhook_endpoint(endpoint_id, caller.owner_filter, url=url, events=events,
                                             description=description)
    except WebhookEndpointNotFound:
        raise not_found(KIND, endpoint_id) from None


def rotate_secret(store: WebhookRepository, caller: Caller, endpoint_id: str,
                  keep_previous_for: timedelta | None) -> tuple[WebhookEndpoint, str]:
    caller.require_submit()
    try:
        return store.rotate_webhook_secret(endpoint_id, caller.owner_filter, keep_previous_for)
    except WebhookEndpointNotFound:
        raise not_found(KIND, endpoint_id) from None


def delete(store: WebhookRepository, caller: Caller, endpoint_id: str) -> None:
    caller.require_submit()
    try:
        store.delete_webhook_endpoint(endpoint_id, owner=caller.owner_filter)
    except WebhookEndpointNotFound:
        raise not_found(KIND, endpoint_id) from None


async def send_test(
    state: ApiState, caller: Caller, endpoint_id: str, event_type: str
) -> tuple[str, WebhookAttempt | None]:
    """Send one signed test event now; its ``webhook-id`` and the attempt (None: another deliverer
    held it). Sent on the event loop: a slow receiver holds no thread the rest of the API needs."""
    caller.require_submit()
    settings, store = state.settings, state.store
    with state.webhook_tests.admit(
        caller.name, per_minute=settings.webhook_test_per_minute, at_once=settings.webhook_test_concurrency,
        in_all=settings.webhook_test_concurrency_total, busy_for_s=settings.webhook_timeout_s, what="webhook tests",
    ):
        try:
            delivery = await run_in_threadpool(store.enqueue_webhook_test, endpoint_id, owner=caller.owner_filter,
                                               event_type=event_type)
        except WebhookEndpointNotFound:
            raise not_found(KIND, endpoint_id) from None
        async with new_client(settings) as client:
            await Deliverer(store, settings, name="api-test").deliver_now(client, delivery.id)
        attempts = await run_in_threadpool(store.list_webhook_attempts, endpoint_id, delivery_id=delivery.id, limit=1)
    return delivery.id, attempts[0] if attempts else None
