"""``llm-batch webhook``: the caller's webhook endpoints through the REST API (``/v1/webhooks``),
and ``deliver``, a foreground deliverer of the job store's outbox (docs/api.md, "Webhooks").
``add`` prints the signing secret alone on a line of stdout (shown only then). Exit codes: 0;
1 when a test was not delivered; 2 for a usage or HTTP error."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from llm_batch.cli import print_table
from llm_batch.cli.jobs import _client_command
from llm_batch.core.config import get_settings

# llm_batch.infra.jobstore.webhooks.EVENT_TYPES (not imported: the CLI's parser loads no SQLAlchemy).
EVENT_TYPES = ("batch.completed", "batch.failed", "batch.expired", "batch.cancelled")

if TYPE_CHECKING:
    from llm_batch.infra.api_client import BatchClient


def _events(text: str) -> list[str]:
    events = [e.strip() for e in text.replace(" ", ",").split(",") if e.strip()]
    unknown = [e for e in events if e not in EVENT_TYPES]
    if unknown or not events:
        raise argparse.ArgumentTypeError(f"unknown events {unknown}: choose from {', '.join(EVENT_TYPES)}")
    return events


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("webhook", help="signed webhooks of your jobs' ends (add, list, remove, test)")
    actions = parser.add_subparsers(dest="webhook_command", required=True)

    add = actions.add_parser("add", help="add an endpoint and print its secret (shown only once)")
    add.add_argument("url", help="the receiver (http:// or https://)")
    add.add_argument("--events", type=_events, help=f"comma separated, of {', '.join(EVENT_TYPES)} (default: all)")
    add.add_argument("--description", default="", help="a label to recognise the endpoint by")
    add.set_defaults(func=_add)

    listing = actions.add_parser("list", help="list your endpoints")
    listing.set_defaults(func=_list)

    remove = actions.add_parser("remove", help="remove an endpoint by its id (we_...)")
    remove.add_argument("endpoint_id")
    remove.set_defaults(func=_remove)

    test = actions.add_parser("test", help="send a signed test event now and show the answer")
    test.add_argument("endpoint_id")
    test.add_argument("--event", choices=EVENT_TYPES, default="batch.completed", help="the test event's type")
    test.set_defaults(func=_test)

    attempts = actions.add_parser("attempts", help="an endpoint's delivery attempts, newest first")
    attempts.add_argument("endpoint_id")
    attempts.add_argument("--limit", type=int, default=20)
    attempts.set_defaults(func=_attempts)

    deliver = actions.add_parser("deliver", help="run a deliverer of the job store's outbox (foreground)")
    deliver.add_argument("--database-url", help="the job store (default: LLM_BATCH_DATABASE_URL, else the embedded stack's)")
    deliver.set_defaults(func=_deliver)


def _when(seconds: int | None) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds") if seconds else "-"


@_client_command
def _add(client: BatchClient, args: argparse.Namespace) -> int:
    endpoint = client.create_webhook(args.url, args.events, args.description)
    print(f"id: {endpoint['id']}\nurl: {endpoint['url']}\nevents: {', '.join(endpoint['events'])}", file=sys.stderr)
    print("the signing secret (shown only now; store it safely):", file=sys.stderr)
    print(endpoint["secret"])
    return 0


@_client_command
def _list(client: BatchClient, args: argparse.Namespace) -> int:
    rows = [("ID", "URL", "EVENTS", "CREATED", "DESCRIPTION")]
    for e in client.webhooks():
        rows.append((e["id"], e["url"], ",".join(e["events"]), _when(e["created_at"]), e.get("description") or ""))
    print_table(rows)
    return 0


@_client_command
def _remove(client: BatchClient, args: argparse.Namespace) -> int:
    client.delete_webhook(args.endpoint_id)
    print(f"removed {args.endpoint_id}")
    return 0


@_client_command
def _test(client: BatchClient, args: argparse.Namespace) -> int:
    result = client.test_webhook(args.endpoint_id, args.event)
    status = result.get("status_code")
    print(f"{result['event_type']} webhook-id {result['webhook_id']}: "
          f"{'delivered' if result['delivered'] else 'NOT delivered'}, HTTP {status if status else '-'}, "
          f"{result['latency_ms']:.0f} ms" + (f" ({result['error']})" if result.get("error") else ""))
    return 0 if result["delivered"] else 1


@_client_command
def _attempts(client: BatchClient, args: argparse.Namespace) -> int:
    print_attempts(client.webhook_attempts(args.endpoint_id, limit=args.limit))
    return 0


def print_attempts(attempts: list[dict[str, Any]]) -> None:
    rows = [("STARTED", "EVENT", "JOB", "WEBHOOK-ID", "#", "HTTP", "MS", "STATE", "ERROR")]
    for a in attempts:
        rows.append((_when(a["started_at"]), a["event_type"], a.get("job_id") or "-", a["webhook_id"], str(a["attempt"]),
                     str(a["status_code"] or "-"), f"{a['latency_ms']:.0f}", a["delivery_status"],
                     (a.get("error") or "")[:80]))
    print_table(rows)


def _deliver(args: argparse.Namespace) -> int:
    from llm_batch.devstack.home import job_store_url  # heavy
    from llm_batch.infra.jobstore import get_job_store  # heavy
    from llm_batch.infra.webhooks import Deliverer  # heavy

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = args.settings or get_settings()
    deliverer = Deliverer(get_job_store(job_store_url(args.database_url, settings=settings)), settings)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    print(f"delivering webhooks as {deliverer.name} (Ctrl-C stops)", file=sys.stderr)
    deliverer.run(stop)
    return 0
