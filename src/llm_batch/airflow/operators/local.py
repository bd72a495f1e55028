"""LocalShardOperator: one shard as a local ``llm-batch worker`` subprocess, supervised by the task
(docs/orchestration.md, "Shard runners"); with ``Settings.warm_engines``, on a warm engine of
its model instead (``llm_batch.runtime.warm_engines``), which a kill leaves warm.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import orjson
from airflow.configuration import conf
from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException

from llm_batch.airflow.operators.shard import ShardTaskMixin, error_tail
from llm_batch.core.placement import multi_node_refusal
from llm_batch.pipeline import steps
from llm_batch.pipeline.shard_task import try_report_shard
from llm_batch.runtime.warm_engines import WarmEngineError, WarmShard, prewarm, start_shard

if TYPE_CHECKING:
    from llm_batch.core.config import Settings
    from llm_batch.infra.jobstore import JobStore

# Seconds between supervision rounds (cancel flag, deadline, progress).
POLL_SECONDS = 2.0
# After SIGTERM, seconds before SIGKILL.
TERM_SECONDS = 10.0
_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)
log = logging.getLogger(__name__)


def _die_with_parent() -> None:
    """Runs in the child before exec: if the task process dies without cleaning up (kill -9),
    the kernel kills the worker too, so a retry never races an orphan on the same shard."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def warm_early(store: JobStore, settings: Settings, job_id: str) -> threading.Thread | None:
    """Start the warm engine the job's shards will take while its shards are planned, so a cold
    engine's start overlaps the planning and the scheduling of its shard tasks; join the thread
    before the task ends. None: its shards run elsewhere (another runner, or another machine's
    executor slots), or the cache may answer its lines."""
    if settings.shard_runner != "local" or not settings.warm_engines or not _tasks_run_here():
        return None
    if (to_warm := steps.engine_to_warm(store, settings, job_id)) is None:
        return None

    def start() -> None:
        try:
            prewarm(settings, *to_warm)
        except (WarmEngineError, OSError) as exc:  # an early start only: the shard starts it as usual
            log.warning("could not start the warm engine early: %s", exc)

    thread = threading.Thread(target=start, name="warm-early", daemon=True)
    thread.start()
    return thread


def _tasks_run_here() -> bool:
    """Whether every task of the run runs on this machine (Airflow's LocalExecutor, as the
    embedded stack's), so the shards find the engine its prepare step started."""
    executors = conf.get("core", "executor").split(",")  # names, module paths or "alias:path"
    return [e.strip().rpartition(":")[2].rpartition(".")[2] for e in executors] == ["LocalExecutor"]


class LocalShardOperator(ShardTaskMixin, BaseOperator):
    """Run one shard (``shard_task``: a ``steps.shard_ref`` or a whole ShardTask, as a dict).

    Returns the shard's outcome dict (``ShardOutcome``). A worker failure raises (the task
    retries and the worker resumes); a usage error fails without retry.
    """

    template_fields = ("shard_task",)
    ui_color = "#e8f4ea"
    # The worker program; the shard's `worker ...` arguments follow it.
    worker_command: tuple[str, ...] = (sys.executable, "-m", "llm_batch.cli.main")
    term_seconds: float = TERM_SECONDS

    def __init__(self, *, shard_task: dict[str, Any], settings: Settings | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.use_settings(settings)
        self.shard_task = shard_task
        self._process: subprocess.Popen[bytes] | WarmShard | None = None
        self._tail: deque[str] = deque(maxlen=20)  # the worker's last output lines, for error_tail

    def execute(self, context: Any) -> dict[str, Any]:
        if (ended := self.ended_before_start(context)) is not None:
            return ended
        if (refusal := multi_node_refusal(self.shard.nodes_per_worker, "local")) is not None:
            return self.refuse(refusal, context)  # register and the API refuse such jobs already
        if self.on_warm_engine():
            try:
                self._process = self._start_warm()
            except WarmEngineError as exc:
                raise AirflowException(str(exc)) from None
            forced = self._supervise(self._process)
            self._process.wait(timeout=5)
        else:
            self._process = self._start()
            reader = threading.Thread(target=self._stream_output, args=(self._process,), daemon=True)
            reader.start()
            forced = self._supervise(self._process)
            reader.join(timeout=5)
        outcome = self.outcome(self._process.returncode, forced)
        if outcome.state in ("failed", "usage") and (tail := error_tail(list(self._tail))):
            outcome = outcome.model_copy(update={"message": f"{outcome.message}: {tail}"})
        return self.finish(outcome, context)

    def on_kill(self) -> None:
        if isinstance(self._process, WarmShard):
            self.log.info("task killed: stopping the shard on warm engine pid %s", self._process.pid)
            self._process.detach()
        elif self._process is not None and self._process.poll() is None:
            self.log.info("task killed: terminating worker pid %s", self._process.pid)
            _terminate(self._process, self.term_seconds)

    def on_warm_engine(self) -> bool:
        """Whether the shard runs on a warm engine (``_start_warm``) or a worker of its own."""
        return self.llm_settings.warm_engines

    def _start(self) -> subprocess.Popen[bytes]:
        task = self.shard
        command = [*self.worker_command, *task.worker_args()]
        env = {**os.environ, "LLM_BATCH_JOB_ID": task.job_id, "LLM_BATCH_SHARD": str(task.shard)}
        self.log.info("starting worker: %s", " ".join(command))
        # Its own process group, so a kill reaches the engine processes vLLM spawns too.
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=_die_with_parent)

    def _start_warm(self) -> WarmShard:
        task = self.shard
        self.log.info("handing shard %s to a warm engine", task.shard)
        return start_shard(self.llm_settings, orjson.loads(task.model_config_json), task.worker_args(), self._log_line,
                           lora=task.lora)

    def _stream_output(self, process: subprocess.Popen[bytes]) -> None:
        assert process.stdout is not None
        for raw in iter(process.stdout.readline, b""):
            self._log_line(raw.decode("utf-8", errors="backslashreplace").rstrip())

    def _log_line(self, line: str) -> None:
        self.log.info("[worker] %s", line)
        if line.strip() and not line.lstrip().startswith(("Traceback", "File ", "^")):
            self._tail.append(line.strip()[:300])

    def _supervise(self, process: subprocess.Popen[bytes]) -> str | None:
        """Wait for the worker; returns "cancelled"/"deadline" if it had to be killed."""
        grace = self.llm_settings.cancel_grace_seconds
        stop_seen: tuple[str, float] | None = None
        while not _ended(process, POLL_SECONDS):
            try_report_shard(self.job_store, self.shard)  # live counts for the API; never fails the shard
            if stop_seen is None:
                cause = self.stop_cause()
                if cause is not None:
                    self.log.info("shard %s: %s; waiting up to %ss for the worker", self.shard.shard, cause, grace)
                    stop_seen = (cause, time.monotonic())
            elif time.monotonic() - stop_seen[1] > grace and process.poll() is None:
                self.log.warning("worker did not stop %ss after %s: killing it", grace, stop_seen[0])
                _terminate(process, self.term_seconds)
                return stop_seen[0]
        return None


def _ended(process: subprocess.Popen[bytes] | WarmShard, timeout: float) -> bool:
    """Whether the worker ends within ``timeout`` (a wait, so a short shard ends at once)."""
    try:
        process.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        return False


def _terminate(process: subprocess.Popen[bytes] | WarmShard, term_seconds: float) -> None:
    """SIGTERM the worker's process group, then SIGKILL it if it lingers. A shard on a warm engine
    is only left (the host stops it at its next step): the host runs other jobs' shards too."""
    if isinstance(process, WarmShard):
        process.detach()
        return
    for sig, wait in ((signal.SIGTERM, term_seconds), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=wait)
            return
