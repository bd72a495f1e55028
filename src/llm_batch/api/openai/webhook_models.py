"""OpenAI's webhook endpoints API (``client.webhooks``): request and response models, the
openai SDK's types being the contract (``openai.types.webhooks``: ``WebhookEndpoint``,
``WebhookEndpointWithSecret``, ``WebhookEndpointList``, ``DeletedWebhookEndpoint``,
``WebhookEndpointTestResult``, ``WebhookEventTypeList``). An endpoint's ``name`` is the
``description`` of our own route's shape (native/webhook_models.py): one resource, two spellings."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from llm_batch.api.native.webhook_models import SECRET_DESCRIPTION, URL_DESCRIPTION, WebhookEventType
from llm_batch.infra.jobstore.webhooks import WebhookEndpoint

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
    event_types: list[WebhookEventType] | None = Field(
        None, min_length=1, max_length=4, description="The complete set of event types to deliver (replaces the old one)"
    )


class WebhookRotateSecretParams(BaseModel):
    """How to rotate an endpoint's signing secret (``client.webhooks.rotate_secret``)."""

    keep_old_secret_active_for_24_hours: bool = Field(
        False, description="True: for 24 hours every delivery is signed with the old secret too (two signatures in "
        "`webhook-signature`), so receivers switch without missing an event; false: the old secret stops at once"
    )


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
    last_id: str | None = Field(
        None, description="Id of the last endpoint of the page (pass it as `after` for the next page); null when empty"
    )
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
