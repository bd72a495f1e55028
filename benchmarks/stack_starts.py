"""How often does `llm-batch up` fail on the embedded stack (Airflow on SQLite)?

Starts the stack N times (default 20), each a clean start (``up --restart``: stop, migrate,
start the five components, wait until healthy, provision pools, the admin user and the CLI
key), in one LLM_BATCH_HOME, and prints per start: seconds, whether it failed, and how many
answers Airflow gave under lock (HTTP 5xx or a dropped connection) that the provisioning's
retries (``llm_batch.infra.api_client.send_with_retries``) absorbed. A start that saw such an answer
is one that would have failed without the retries.

    .venv/bin/python benchmarks/stack_starts.py --starts 20

Leaves the stack stopped. Its figures are in docs/benchmarks.md ("Starting the embedded stack").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=20)
    parser.add_argument("--home", type=Path, help="LLM_BATCH_HOME (default: a new temp folder)")
    parser.add_argument("--port", type=int, default=18089)
    args = parser.parse_args()
    home = args.home or Path(tempfile.mkdtemp(prefix="llm-batch-starts-"))
    os.environ["LLM_BATCH_HOME"] = str(home)

    import httpx

    from llm_batch.core.config import get_settings
    from llm_batch.devstack.stack import Stack
    from llm_batch.infra import api_client as client

    absorbed = {"n": 0}
    transient = client._transient

    def counting(outcome):  # count each answer the retry loop treats as transient
        is_transient = transient(outcome)
        absorbed["n"] += is_transient
        return is_transient

    client._transient = counting
    send = client.send_with_retries

    def counting_send(request):
        def once():
            try:
                return request()
            except httpx.TransportError:
                absorbed["n"] += 1
                raise
        return send(once)

    client.send_with_retries = counting_send

    stack = Stack.create(get_settings(), args.port)
    rows = []
    try:
        for number in range(1, args.starts + 1):
            absorbed["n"] = 0
            started = time.monotonic()
            error = None
            try:
                stack.up(restart=True)
            except Exception as exc:  # noqa: BLE001 - a failed start is what we count
                error = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
            seconds = time.monotonic() - started
            rows.append((seconds, error, absorbed["n"]))
            print(f"start {number:2d}: {seconds:6.1f} s  {'FAILED ' + error if error else 'ok'}"
                  f"  (answers under lock retried: {absorbed['n']})", flush=True)
    finally:
        stack.down()
    failed = sum(1 for _, error, _ in rows if error)
    saved = sum(1 for _, error, n in rows if n and not error)
    print(f"\n{len(rows)} starts: {failed} failed; {saved} saw Airflow answer under lock and succeeded "
          f"on a retry; median {statistics.median(r[0] for r in rows):.1f} s, "
          f"max {max(r[0] for r in rows):.1f} s (home {home})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
