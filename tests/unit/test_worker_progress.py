"""Progress counters and publishing, and the stop monitor (deadline, cancel marker rate)."""

from __future__ import annotations

import uuid

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
    marker = llm_batch_home / f"cancel-test-{uuid.uuid4().hex[:8]}" / "cancel"  # a job of its own
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


# -- the fault drills' hold point ---------------------------------------------------------

def _held_shard(root, *, after: int, resumed: int = 0):
    """A StopMonitor over a real results writer and progress object under ``root``, with the
    job's hold marker saying ``after`` (and ``resumed`` results there from an earlier try)."""
    import orjson

    from llm_batch.core.layout import JobLayout
    from llm_batch.core.records import ResultRecord
    from llm_batch.infra import storage
    from llm_batch.infra.results import ResultsWriter

    job = JobLayout(str(root), "job-held")
    shard = job.shard(0)
    if resumed:
        with ResultsWriter.open(shard.results) as earlier:
            for i in range(resumed):
                earlier.write(ResultRecord(index=i, custom_id=f"r{i}", status_code=200, body={}))
    storage.write_bytes(job.hold_marker, orjson.dumps({"after_results": after}))
    writer = ResultsWriter.open(shard.results, flush_every_s=3600)
    config = WorkerConfig(job_id=job.job_id, shard=0, requests="r", results=shard.results,
                          endpoint=Endpoint.COMPLETIONS, model_config={}, cancel_marker=job.cancel_marker,
                          hold_marker=job.hold_marker, cancel_check_s=0.0)
    reporter = ProgressReporter(shard.progress, ShardProgress(job_id=job.job_id, shard=0, total=10, done=writer.done))
    monitor = StopMonitor(config, reporter, writer)
    monitor.hold.poll_s = 0.01

    def result(i: int) -> None:
        writer.write(ResultRecord(index=i, custom_id=f"r{i}", status_code=200, body={}))
        reporter.record(True)

    return monitor, job, shard, result


def _done_published(uri: str) -> int | None:
    from llm_batch.infra.storage import ObjectNotFound

    try:
        return read_progress(uri).done
    except ObjectNotFound:  # not written yet
        return None


def _in_thread(call):
    import threading

    answer: list = []
    thread = threading.Thread(target=lambda: answer.append(call()), daemon=True)
    thread.start()
    return thread, answer


def test_a_first_attempt_holds_at_its_results_checkpointed_until_released(llm_batch_home):
    import time

    from llm_batch.infra import storage
    from llm_batch.infra.results import count_results

    monitor, job, shard, result = _held_shard(llm_batch_home / "held", after=2)
    result(0)
    assert monitor() is None  # one result: runs on
    result(1)
    thread, answer = _in_thread(monitor)
    deadline = time.monotonic() + 10
    while _done_published(shard.progress) != 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    # Held, with both results durable and counted where a test (or an operator) looks.
    assert thread.is_alive() and count_results(shard.results) == 2
    assert read_progress(shard.progress).done == 2
    storage.delete(job.hold_marker)
    thread.join(10)
    assert answer == [None]  # released: the shard goes on
    result(2)
    assert monitor() is None  # and never holds again


def test_a_held_shard_still_stops_for_cancel(llm_batch_home):
    from llm_batch.infra import storage

    monitor, job, _, result = _held_shard(llm_batch_home / "held-cancel", after=1)
    result(0)
    thread, answer = _in_thread(monitor)
    storage.write_bytes(job.cancel_marker, b"{}")
    thread.join(10)
    assert answer == [StopReason.CANCELLED]


def test_a_resumed_attempt_never_holds(llm_batch_home):
    monitor, _, _, result = _held_shard(llm_batch_home / "held-resumed", after=1, resumed=2)
    result(2)
    assert monitor() is None


def test_a_higher_n_in_the_marker_moves_the_hold_point_on(llm_batch_home):
    import time

    import orjson

    from llm_batch.infra import storage

    monitor, job, shard, result = _held_shard(llm_batch_home / "held-next", after=1)
    result(0)
    thread, answer = _in_thread(monitor)
    deadline = time.monotonic() + 10
    while _done_published(shard.progress) != 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    storage.write_bytes(job.hold_marker, orjson.dumps({"after_results": 3}))
    thread.join(10)
    assert answer == [None]
    result(1)
    assert monitor() is None  # before the next hold point
    result(2)
    thread, answer = _in_thread(monitor)
    thread.join(0.5)
    assert thread.is_alive()  # held again, at 3
    storage.delete(job.hold_marker)
    thread.join(10)
    assert answer == [None]
