"""The shard checkpoint: ordered parts, resume from what is there, order enforced."""

from __future__ import annotations

import io

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_batch.core.layout import join_uri
from llm_batch.core.records import ResultRecord, dumps_line
from llm_batch.infra import storage
from llm_batch.infra.results import ResultsError, ResultsWriter, count_results, list_parts, part_uri, read_results
from llm_batch.infra.storage import iter_lines
from tests.fuzzing import examples
from tests.unit.data_plane_fixtures import new_layout


def result(index: int) -> ResultRecord:
    return ResultRecord(index=index, custom_id=f"c{index}", status_code=200, body={"i": index})


@pytest.fixture
def results_uri() -> str:
    return new_layout().shard(0).results


def test_empty_checkpoint_has_nothing_done(results_uri):
    writer = ResultsWriter.open(results_uri)
    assert writer.done == 0
    writer.close()
    assert list_parts(results_uri) == []
    assert list(read_results(results_uri)) == []
    assert count_results(results_uri) == 0


def test_parts_are_published_on_the_record_bound_and_read_back_in_order(results_uri):
    with ResultsWriter.open(results_uri, flush_every_records=2, flush_every_s=3600) as writer:
        for i in (3, 5, 8, 13, 21):
            writer.write(result(i))
        assert [p.start for p in list_parts(results_uri)] == [0, 2]  # 5th still buffered
    assert [p.start for p in list_parts(results_uri)] == [0, 2, 4]
    assert [r.index for r in read_results(results_uri)] == [3, 5, 8, 13, 21]
    assert count_results(results_uri) == 5


def test_time_bound_publishes_each_write(results_uri):
    writer = ResultsWriter.open(results_uri, flush_every_s=0)
    writer.write(result(0))
    writer.write(result(1))
    assert [p.start for p in list_parts(results_uri)] == [0, 1]


def test_resume_continues_after_the_published_prefix(results_uri):
    with ResultsWriter.open(results_uri, flush_every_records=3) as writer:
        for i in range(7):
            writer.write(result(i))
    resumed = ResultsWriter.open(results_uri)
    assert resumed.done == 7
    with pytest.raises(ResultsError, match="request order"):
        resumed.write(result(6))
    resumed.write(result(7))
    assert resumed.done == 8
    resumed.close()
    assert [r.index for r in read_results(results_uri)] == list(range(8))


def test_unflushed_records_are_lost_not_torn(results_uri):
    """A killed worker loses only its buffer; resume redoes exactly those requests."""
    writer = ResultsWriter.open(results_uri, flush_every_records=4, flush_every_s=3600)
    for i in range(6):
        writer.write(result(i))
    del writer  # killed: never closed
    assert ResultsWriter.open(results_uri).done == 4
    assert [r.index for r in read_results(results_uri)] == [0, 1, 2, 3]


def test_out_of_order_write_is_refused(results_uri):
    writer = ResultsWriter.open(results_uri)
    writer.write(result(4))
    with pytest.raises(ResultsError, match="result for request 2 written after request 4"):
        writer.write(result(2))


def test_leaving_with_block_on_error_still_publishes_finished_results(results_uri):
    with pytest.raises(RuntimeError):
        with ResultsWriter.open(results_uri, flush_every_s=3600) as writer:
            writer.write(result(0))
            raise RuntimeError("engine died")
    assert count_results(results_uri) == 1


def test_parts_sort_by_number_past_six_digits_and_strangers_are_ignored(results_uri):
    storage.write_bytes(part_uri(results_uri, 1_000_000), dumps_line(result(1_000_000)))
    storage.write_bytes(part_uri(results_uri, 999_999), dumps_line(result(999_999)))
    storage.write_bytes(join_uri(results_uri, "notes.txt"), b"x")
    assert [p.start for p in list_parts(results_uri)] == [999_999, 1_000_000]
    assert count_results(results_uri) == 1_000_001


def test_overlapping_parts_are_read_once(results_uri):
    """Two writers resumed from one checkpoint: positions already read are skipped."""
    storage.write_bytes(part_uri(results_uri, 0), b"".join(dumps_line(result(i)) for i in range(3)))
    storage.write_bytes(part_uri(results_uri, 2), b"".join(dumps_line(result(i)) for i in (2, 3, 4)))
    assert [r.index for r in read_results(results_uri)] == [0, 1, 2, 3, 4]


def test_a_corrupt_line_names_its_part_and_line(results_uri):
    storage.write_bytes(part_uri(results_uri, 0), dumps_line(result(0)) + b'{"index": 1\n')
    with pytest.raises(ResultsError, match=r"part-000000\.jsonl: line 2 is not a result record"):
        list(read_results(results_uri))


# -- storage.iter_lines: what every reader of results, shards and errors goes through ------------


@settings(max_examples=examples(300), deadline=None)
@given(data=st.binary(max_size=300).map(lambda b: b.replace(b"\r", b"\n")),
       chunk=st.integers(1, 40))
def test_iter_lines_gives_every_line_whatever_the_chunk_size(data: bytes, chunk: int) -> None:
    expected = data.split(b"\n")
    if expected[-1] == b"":
        expected.pop()  # a final newline ends the last line, it does not start one
    assert list(iter_lines(io.BytesIO(data), chunk_bytes=chunk)) == expected


def test_iter_lines_joins_a_line_far_longer_than_a_chunk() -> None:
    long_line = b"x" * 100_000
    data = b"a\n" + long_line + b"\nb"
    assert list(iter_lines(io.BytesIO(data), chunk_bytes=7)) == [b"a", long_line, b"b"]


class Outage:
    """storage.open_write failing (as boto3 does against a stopped S3 server) while `down`."""

    def __init__(self, monkeypatch):
        self.down = True
        self.attempts = 0
        real = storage.open_write

        def open_write(uri, **kwargs):
            self.attempts += 1
            if self.down:
                raise storage.StorageError(uri, "Could not connect to the endpoint URL")
            return real(uri, **kwargs)

        monkeypatch.setattr(storage, "open_write", open_write)


def test_records_stay_buffered_through_a_storage_outage_and_publish_after_it(results_uri, monkeypatch):
    monkeypatch.setattr("llm_batch.infra.results._RETRY_PUBLISH_AFTER_S", 0.0)
    outage = Outage(monkeypatch)
    writer = ResultsWriter.open(results_uri, flush_every_s=0, outage_s=60)
    for i in range(3):
        writer.write(result(i))  # each checkpoint fails: nothing raised, nothing lost
    assert outage.attempts == 3 and writer.done == 3
    outage.down = False
    writer.write(result(3))
    assert [p.start for p in list_parts(results_uri)] == [0]  # one part with all four
    assert [r.index for r in read_results(results_uri)] == [0, 1, 2, 3]


def test_a_failed_checkpoint_is_not_retried_on_every_write(results_uri, monkeypatch):
    outage = Outage(monkeypatch)
    writer = ResultsWriter.open(results_uri, flush_every_s=0, outage_s=60)
    for i in range(10):
        writer.write(result(i))
    assert outage.attempts == 1  # the next attempt waits _RETRY_PUBLISH_AFTER_S


def test_close_waits_out_a_short_outage(results_uri, monkeypatch):
    monkeypatch.setattr("llm_batch.infra.results._RETRY_PUBLISH_AFTER_S", 0.01)
    outage = Outage(monkeypatch)
    writer = ResultsWriter.open(results_uri, flush_every_s=3600, outage_s=60)
    writer.write(result(0))
    real_sleep = __import__("time").sleep

    def sleep(s):
        if outage.attempts >= 3:
            outage.down = False  # the server is back after the third attempt
        real_sleep(s)

    monkeypatch.setattr("llm_batch.infra.results.time.sleep", sleep)
    writer.close()
    assert [r.index for r in read_results(results_uri)] == [0]


def test_an_outage_longer_than_outage_s_fails_the_shard_keeping_what_was_published(results_uri, monkeypatch):
    monkeypatch.setattr("llm_batch.infra.results._RETRY_PUBLISH_AFTER_S", 0.0)
    writer = ResultsWriter.open(results_uri, flush_every_s=0, outage_s=0.05)
    writer.write(result(0))  # published before the outage
    outage = Outage(monkeypatch)
    writer.write(result(1))
    __import__("time").sleep(0.06)
    with pytest.raises(storage.StorageError, match="Could not connect"):
        writer.write(result(2))
    assert outage.attempts == 2
    assert [r.index for r in read_results(results_uri)] == [0]  # the retry resumes after it
