"""Where a job's intermediate files live, under one work prefix (a local root or s3:// prefix).

    {work}/{job_id}/validated.jsonl            BatchRequest lines, in input order
    {work}/{job_id}/validation_errors.jsonl    ErrorRecord lines for bad input lines, in order
    {work}/{job_id}/validation.json            counts of the validation step
    {work}/{job_id}/shards.json                the shard plan (sharding.ShardManifest)
    {work}/{job_id}/shards/{k:05d}/requests.jsonl   BatchRequest lines of shard k, in order
    {work}/{job_id}/shards/{k:05d}/results/         ResultRecord parts, in request order
    {work}/{job_id}/shards/{k:05d}/progress.json    the worker's live counters
    {work}/{job_id}/cancel                     marker: its presence asks workers to stop
    {work}/{job_id}/output.jsonl, errors.jsonl, output.json   merged outputs
    {work}/{job_id}/merge.json                 counts of the merge step (read by finalize)
"""

from __future__ import annotations

from dataclasses import dataclass


def join_uri(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])


@dataclass(frozen=True)
class JobLayout:
    work_uri: str
    job_id: str

    @property
    def root(self) -> str:
        return join_uri(self.work_uri, self.job_id)

    @property
    def validated(self) -> str:
        return join_uri(self.root, "validated.jsonl")

    @property
    def validation_errors(self) -> str:
        return join_uri(self.root, "validation_errors.jsonl")

    @property
    def uncached(self) -> str:
        """The validated requests the result cache did not answer: what the shards run."""
        return join_uri(self.root, "uncached.jsonl")

    @property
    def cached_results(self) -> str:
        """The results the result cache answered, in input order."""
        return join_uri(self.root, "cached.jsonl")

    @property
    def validation_report(self) -> str:
        return join_uri(self.root, "validation.json")

    @property
    def cancel_marker(self) -> str:
        return join_uri(self.root, "cancel")

    @property
    def hold_marker(self) -> str:
        """A fault drill's hold point (``llm_batch.runtime.worker.HoldPoint``): written by the
        system's operators and tests only, never by a user."""
        return join_uri(self.root, "hold")

    @property
    def shard_manifest(self) -> str:
        return join_uri(self.root, "shards.json")

    def shard(self, k: int) -> ShardLayout:
        return ShardLayout(join_uri(self.root, "shards", f"{k:05d}"))

    @property
    def output_jsonl(self) -> str:
        return join_uri(self.root, "output.jsonl")

    @property
    def errors_jsonl(self) -> str:
        return join_uri(self.root, "errors.jsonl")

    @property
    def output_json(self) -> str:
        return join_uri(self.root, "output.json")

    @property
    def merge_report(self) -> str:
        return join_uri(self.root, "merge.json")


@dataclass(frozen=True)
class ShardLayout:
    root: str

    @property
    def requests(self) -> str:
        return join_uri(self.root, "requests.jsonl")

    @property
    def results(self) -> str:
        return join_uri(self.root, "results")

    @property
    def progress(self) -> str:
        return join_uri(self.root, "progress.json")
