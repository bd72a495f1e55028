"""``llm-batch up | down | status``: the embedded stack (see llm_batch.devstack.stack)."""

from __future__ import annotations

import argparse
import sys

from llm_batch.cli import fail


def register(subparsers: argparse._SubParsersAction) -> None:
    up = subparsers.add_parser("up", help="start the embedded Airflow stack's missing components (running ones are "
                               "left alone), wait until healthy, make the CLI's API key")
    up.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for health")
    up.add_argument("--restart", action="store_true",
                    help="stop every component first, then start them all (applies a configuration change)")
    up.add_argument("--executor", choices=("local", "celery"), default="local",
                    help="local: LocalExecutor, one home (default); celery: the production shape on one machine "
                    "(CeleryExecutor, Redis broker, PostgreSQL, SeaweedFS S3, workers with homes of their own: "
                    "docs/production-shape.md)")
    up.add_argument("--database", choices=("postgres", "sqlite"), default=None,
                    help="local: Airflow's metadata DB and the job store on a private PostgreSQL (the default for a "
                    "new home) or on SQLite files (for trying things out); kept per home, each keeps its own jobs "
                    "(docs/embedded.md)")
    up.add_argument("--workers", type=int, default=None, help="celery: how many Celery workers (default 2, then kept)")
    up.add_argument("--prepare-model", action="append", default=[], metavar="NAME",
                    help="celery: prepare this registered model in every worker's own model cache (repeatable)")
    up.set_defaults(func=_up)
    subparsers.add_parser("down", help="stop the embedded stack").set_defaults(func=_down)
    subparsers.add_parser("status", help="show which stack components run, their restarts by the supervisor, and "
                          "the job store's health (exit 3 if any is not ok)").set_defaults(func=_status)


_DATABASES = {"postgres": "PostgreSQL (Airflow's metadata and the job store)",
              "sqlite": "SQLite (files under LLM_BATCH_HOME; for trying things out)"}


def _up(args: argparse.Namespace) -> int:
    import httpx  # heavy

    from llm_batch.devstack.celery_stack import CeleryStack  # heavy
    from llm_batch.devstack.stack import ADMIN_USER, Stack, StackError  # heavy

    if args.executor == "celery":
        if args.database == "sqlite":
            return fail("the Celery shape runs on PostgreSQL only")
        if args.workers is not None and args.workers < 1:
            return fail("--workers must be at least 1")
        stack = CeleryStack.create(workers=args.workers)
    else:
        if args.workers is not None or args.prepare_model:
            return fail("--workers and --prepare-model need --executor celery")
        stack = Stack.create(database=args.database)
        if CeleryStack.exists(stack.settings) and any(CeleryStack.create().services_status().values()):
            return fail("the Celery shape runs in this LLM_BATCH_HOME: `llm-batch up --executor celery`, or "
                        "`llm-batch down` first", 1)
    print(f"starting the embedded stack (logs in {stack.log_dir}) ...", file=sys.stderr)
    try:
        result = stack.up(timeout=args.timeout, restart=args.restart)
        if isinstance(stack, CeleryStack):
            for name in args.prepare_model:
                stack.prepare_model(name)
    except (StackError, httpx.HTTPError) as exc:
        return fail(f"{exc}\nthe components that did start keep running; stop them with: llm-batch down", 1)
    print(f"Components:         {result.summary()}")
    if result.config_changed:
        print(
            f"warning: the running components started with another configuration ({', '.join(result.config_changed)}); "
            "llm-batch up --restart applies it",
            file=sys.stderr,
        )
    print(f"Airflow UI and API: {stack.base_url}  (user {ADMIN_USER}, password {stack.admin_password()})")
    print(f"Database:           {_DATABASES[stack.database]}")
    print(f"Batch API:          {stack.base_url}/batch  (docs: {stack.base_url}/batch/docs)")
    print(f"CLI API key:        {stack.api_key_file} (admin; llm-batch submit/jobs/... use it)")
    print("API key for SDKs:   llm-batch api-key create <user>   (add --admin to see every job)")
    print("Stop:               llm-batch down")
    return 0


def _down(args: argparse.Namespace) -> int:
    from llm_batch.devstack.home import home_stack  # heavy

    home_stack().down()  # (workers,) control plane, services
    return 0


def _status(args: argparse.Namespace) -> int:
    from llm_batch.devstack.home import home_stack  # heavy
    from llm_batch.devstack.stack import SUPERVISOR  # heavy
    from llm_batch.devstack.supervisor import describe_restarts, read_restarts  # heavy
    from llm_batch.infra.jobstore import JobStore  # heavy
    from llm_batch.infra.jobstore.errors import JobStoreUnhealthy  # heavy

    stack = home_stack()
    state = stack.running()
    state.update(stack.services_status())
    state[SUPERVISOR] = stack.supervisor_pid()
    restarts = read_restarts(stack)
    for component, pid in state.items():
        shown = "running" if pid is True else "running (pid %d)" % pid if pid else "stopped"
        if restarted := describe_restarts(restarts.get(component)):
            shown = f"{shown:20} {restarted}"
        print(f"{component:14} {shown}")
    # The store itself, through a new connection (what every worker and API process opens),
    # also when the api-server is down; open_store=False: never creates or migrates a store.
    try:
        JobStore(stack.settings.database_url).check_health(open_store=False)
    except JobStoreUnhealthy as exc:
        store = f"FAILED: {exc}"
    else:
        store = "ok"
    print(f"{'job store':14} {store}")
    if all(state.values()):
        print(f"URL: {stack.base_url}")
    return 0 if all(state.values()) and store == "ok" else 3
