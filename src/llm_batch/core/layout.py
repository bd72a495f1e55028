"""Where a job's intermediate files live, under one work prefix (a local root or s3:// prefix):
``{work}/{job_id}/...`` and ``{work}/{job_id}/shards/{k:05d}/...``."""

from __future__ import annotations

from dataclasses import dataclass


def join_uri(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])


def _file(name: str) -> property:
    return property(lambda self: join_uri(self.root, name))


@dataclass(frozen=True)
class JobLayout:
    work_uri: str
    job_id: str

    @property
    def root(self) -> str:
        return join_uri(self.work_uri, self.job_id)

    validated = _file("validated.jsonl")  # BatchRequest lines, in input order
    validation_errors = _file("validation_errors.jsonl")  # ErrorRecord lines of bad input lines
    uncached = _file("uncached.jsonl")  # the validated requests the result cache did not answer: what shards run
    cached_results = _file("cached.jsonl")  # the results the result cache answered, in input order
    validation_report = _file("validation.json")  # counts of the validation step
    cancel_marker = _file("cancel")  # its presence asks workers to stop
    # A fault drill's hold point (llm_batch.runtime.worker.HoldPoint): written by operators and tests only.
    hold_marker = _file("hold")
    shard_manifest = _file("shards.json")  # the shard plan (sharding.ShardManifest)
    output_jsonl = _file("output.jsonl")
    errors_jsonl = _file("errors.jsonl")
    output_json = _file("output.json")
    merge_report = _file("merge.json")  # counts of the merge step (read by finalize)

    def shard(self, k: int) -> ShardLayout:
        return ShardLayout(join_uri(self.root, "shards", f"{k:05d}"))


@dataclass(frozen=True)
class ShardLayout:
    root: str

    requests = _file("requests.jsonl")  # BatchRequest lines of the shard, in order
    results = _file("results")  # ResultRecord parts, in request order
    progress = _file("progress.json")  # the worker's live counters
