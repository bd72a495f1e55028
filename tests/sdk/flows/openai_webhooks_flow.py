"""OpenAI's webhook endpoints API as openai-python calls it, unchanged: `client.webhooks`
create -> retrieve -> update -> list (pages of one, followed by the client) -> test ->
rotate_secret (keeping the old secret, then not) -> test -> event_types.list -> delete.
Every answer is checked against the client's own type (`model_validate` of what came over
the wire: every field present and typed) and its keys reported, so a shape the client
cannot read fails the step. See _flow.py."""

from __future__ import annotations

from _flow import refusal, run
from openai import OpenAI
from openai.types.webhooks import (
    DeletedWebhookEndpoint,
    WebhookEndpoint,
    WebhookEndpointTestResult,
    WebhookEndpointWithSecret,
    WebhookEventTypeList,
)


def strict(model, answer) -> dict:
    """`answer` as the wire gave it, validated by `model`; its keys too."""
    wire = answer.to_dict(mode="json")
    return {"keys": sorted(wire), **model.model_validate(wire).model_dump(mode="json")}


def lifecycle(base, key, url, other_url):
    client = OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
    created = client.webhooks.create(url=url, name="ci", event_types=["batch.completed", "batch.failed"])
    other = client.webhooks.create(url=other_url, name="other", event_types=["batch.expired"])
    retrieved = client.webhooks.retrieve(created.id)
    updated = client.webhooks.update(created.id, name="ci-renamed",
                                     event_types=["batch.completed", "batch.failed", "batch.cancelled"])
    first_page = client.webhooks.list(limit=1)
    listed = [endpoint.id for endpoint in client.webhooks.list(limit=1)]  # the client follows `after`
    tests = [strict(WebhookEndpointTestResult, client.webhooks.test(created.id, event_type="batch.completed"))]
    kept = client.webhooks.rotate_secret(created.id, keep_old_secret_active_for_24_hours=True)
    tests.append(strict(WebhookEndpointTestResult, client.webhooks.test(created.id, event_type="batch.failed")))
    rotated = client.webhooks.rotate_secret(created.id)
    tests.append(strict(WebhookEndpointTestResult, client.webhooks.test(created.id, event_type="batch.cancelled")))
    after_rotation = client.webhooks.retrieve(created.id)
    event_types = client.webhooks.event_types.list()
    deleted = client.webhooks.delete(created.id)
    client.webhooks.delete(other.id)
    return {
        "created": strict(WebhookEndpointWithSecret, created),
        "other": other.id,
        "retrieved": strict(WebhookEndpoint, retrieved),
        "updated": strict(WebhookEndpoint, updated),
        "first_page": {"ids": [e.id for e in first_page.data], "has_more": first_page.has_more},
        "listed": listed,
        "tests": tests,
        "kept": strict(WebhookEndpointWithSecret, kept),
        "rotated": strict(WebhookEndpointWithSecret, rotated),
        "after_rotation": strict(WebhookEndpoint, after_rotation),
        "event_types": strict(WebhookEventTypeList, event_types),
        "deleted": strict(DeletedWebhookEndpoint, deleted),
        "refused": {
            "deleted": refusal(lambda: client.webhooks.retrieve(created.id)),
            "private_url": refusal(lambda: client.webhooks.create(url="http://10.0.0.1/hook", name="x",
                                                                  event_types=["batch.completed"])),
            "unsent_event_type": refusal(lambda: client.webhooks.create(url=url, name="x",
                                                                        event_types=["response.completed"])),
        },
    }


if __name__ == "__main__":
    run("openai", {"lifecycle": lifecycle})
