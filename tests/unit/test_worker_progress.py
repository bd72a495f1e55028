"""Progress counters and publishing, and the stop monitor (deadline, cancel marker rate)."""

from __future__ import annotations

from llm_batch.core.endpoints import Endpoint
from llm_batch.infra.progress import ProgressReporter, ShardProgress, ShardState, read_progress
from llm_batch.runtime.engine import StopReason
from llm_batch.runtime.worker import StopMonitor, WorkerConfig


class Clock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_progress_counts_publishes_on_interval_and_measures_tokens_per_s(llm_batch_home):
    uri = str(llm_batch_home / "p" / "progress.json")
    clock = Clock(100.0)
    reporter = ProgressReporter(uri, ShardProgress(job_id="j", shard=1, total=10, done=4, resumed=4),
                                interval=2.0, clock=clock)
    reporter.start_running()
    assert read_progress(uri).state == ShardState.RUNNING
    reporter.record(True, prompt_tokens=5, completion_tokens=30)
    reporter.record(False)
    clock.now += 1.0
    assert not reporter.due  # within the interval: nothing new written
    assert read_progress(uri).done == 4
    clock.now += 1.0
    assert reporter.due
    reporter.publish()
    p = read_progress(uri)
    assert (p.done, p.succeeded, p.failed, p.resumed) == (6, 1, 1, 4)
    assert (p.prompt_tokens, p.completion_tokens, p.tokens_per_s) == (5, 30, 15.0)
    # tokens/s stop counting time when the engine loop ends, not when the engine has stopped
    reporter.stop_running()
    clock.now += 5.0
    reporter.publish(ShardState.DONE)
    p = read_progress(uri)
    assert p.state == ShardState.DONE and p.updated_at
    assert p.tokens_per_s == 15.0


def test_unwritable_progress_is_logged_not_raised(tmp_path):
    # Outside the allowed roots: storage refuses, the shard must go on.
    reporter = ProgressReporter(str(tmp_path / "nope.json"), ShardProgress(job_id="j", shard=0, total=1))
    reporter.publish(ShardState.RUNNING)


def _monitor(llm_batch_home, deadline=None):
    marker = llm_batch_home / "cancel-test" / "cancel"
    config = WorkerConfig(job_id="j", shard=0, requests="r", results="o", endpoint=Endpoint.COMPLETIONS,
                          model_config={}, cancel_marker=str(marker), deadline=deadline, cancel_check_s=1.0)
    reporter = ProgressReporter(None, ShardProgress(job_id="j", shard=0, total=1))
    clock, wall = Clock(), Clock(1000.0)
    return StopMonitor(config, reporter, clock=clock, wall_clock=wall), marker, clock, wall


def test_deadline_is_checked_on_every_call(llm_batch_home):
    monitor, _, _, wall = _monitor(llm_batch_home, deadline=1010.0)
    assert monitor() is None
    wall.now = 1010.0
    assert monitor() is StopReason.DEADLINE


def test_cancel_marker_is_checked_at_most_every_cancel_check_s(llm_batch_home):
    monitor, marker, clock, _ = _monitor(llm_batch_home)
    assert monitor() is None
    marker.parent.mkdir(parents=True)
    marker.touch()
    clock.now = 0.5
    assert monitor() is None  # not looked at again yet
    clock.now = 1.0
    assert monitor() is StopReason.CANCELLED
    assert monitor.check_now() is StopReason.CANCELLED
