"""Plan a job's shards: contiguous ranges of the validated file, one requests file each.

``plan_shards(layout, n)`` streams ``layout.validated`` twice (count, then route) and writes
``ShardLayout(k).requests`` for each shard and a manifest, ``{job}/shards.json``, that merge
and the DAG read. Memory does not grow with the number of requests.

Balance: by request count (shard sizes differ by at most one) or by estimated prompt tokens
(about four characters a token; see ``estimate_prompt_tokens``). Either way each request goes
to the shard its cumulative weight falls in, nudged so that no shard is empty: a plan has
exactly ``min(n, number of requests)`` shards, numbered 0.. without gaps. Asking for more
shards than requests gives one request per shard; no empty shard is ever planned.

Planning is deterministic. Re-planning a job with the same input and arguments rewrites the
same files and keeps the shards' results (their checkpoints); a different plan discards the
old shards' results, which would no longer match their requests.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson
from pydantic import BaseModel

from llm_batch import storage
from llm_batch.layout import JobLayout
from llm_batch.schemas import prompt_chars
from llm_batch.streams import ChunkedWriter, stored_lines

MAX_SHARDS = 64
ShardBy = Literal["count", "tokens"]


class ShardPlan(BaseModel):
    """One shard: ``count`` requests from position ``start`` of the validated file."""

    index: int  # k, as in JobLayout.shard(k)
    start: int  # position of its first request in the validated file (0-based)
    count: int
    first_index: int  # input index of its first and last request
    last_index: int
    weight: int  # what was balanced: requests, or estimated prompt tokens
    requests_uri: str
    results_uri: str
    progress_uri: str


class ShardManifest(BaseModel):
    job_id: str
    by: ShardBy
    num_shards: int  # as asked; len(shards) may be smaller
    total_requests: int
    total_weight: int
    shards: list[ShardPlan]


class ShardingError(ValueError):
    pass


def read_manifest(layout: JobLayout) -> ShardManifest:
    return ShardManifest.model_validate_json(storage.read_bytes(layout.shard_manifest))


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """A tokenizer-free estimate (~4 characters a token), at least 1 per request."""
    return max(1, prompt_chars(body) // 4)


def _weight(line: bytes, by: ShardBy) -> int:
    return estimate_prompt_tokens(orjson.loads(line)["body"]) if by == "tokens" else 1


class _Assigner:
    """Gives each request, in order, its shard: where its weight's midpoint falls among
    ``n`` equal slices of the total, clamped so shards advance one at a time and enough
    requests remain for the rest (so none is empty)."""

    def __init__(self, num_shards: int, total_requests: int, total_weight: int):
        self.n, self.requests, self.total = num_shards, total_requests, total_weight
        self.cumulative = 0
        self.position = 0
        self.shard = 0

    def assign(self, weight: int) -> int:
        midpoint = (2 * self.cumulative + weight) * self.n // (2 * self.total)
        must_reach = self.n - (self.requests - self.position)
        if self.position > 0:
            self.shard = max(must_reach, min(self.shard + 1, max(self.shard, midpoint)))
        self.cumulative += weight
        self.position += 1
        return self.shard


class _ShardFileWriter:
    """Writes one shard's requests file and records what its plan entry needs."""

    def __init__(self, layout: JobLayout, k: int, start: int):
        self.shard = layout.shard(k)
        self.k, self.start = k, start
        self.count = self.weight = 0
        self.first_line = self.last_line = b""
        self._context = storage.open_write(self.shard.requests)
        self._out = ChunkedWriter(self._context.__enter__())

    def add(self, line: bytes, weight: int) -> None:
        if not self.count:
            self.first_line = line
        self.last_line = line
        self.count += 1
        self.weight += weight
        self._out.write(line + b"\n")

    def close(self) -> ShardPlan:
        self._out.flush()
        context, self._context = self._context, None
        context.__exit__(None, None, None)  # publishes the file
        return ShardPlan(
            index=self.k, start=self.start, count=self.count,
            first_index=orjson.loads(self.first_line)["index"],
            last_index=orjson.loads(self.last_line)["index"],
            weight=self.weight, requests_uri=self.shard.requests,
            results_uri=self.shard.results, progress_uri=self.shard.progress,
        )

    def abort(self, exc: BaseException) -> None:
        """Discard the unfinished file (the storage context does not publish it)."""
        if self._context is not None:
            context, self._context = self._context, None
            context.__exit__(type(exc), exc, exc.__traceback__)


def plan_shards(layout: JobLayout, num_shards: int, *, by: ShardBy = "count") -> list[ShardPlan]:
    """Write the shards' request files and the manifest; return the (non-empty) shards."""
    if not 1 <= num_shards <= MAX_SHARDS:
        raise ShardingError(f"number of shards must be 1..{MAX_SHARDS}, got {num_shards}")
    if by not in ("count", "tokens"):
        raise ShardingError(f"shards balance by 'count' or 'tokens', got {by!r}")

    total_requests = total_weight = 0
    for line in stored_lines(layout.validated):
        total_requests += 1
        total_weight += _weight(line, by)

    plans: list[ShardPlan] = []
    writer: _ShardFileWriter | None = None
    assigner = _Assigner(num_shards, total_requests, total_weight)
    try:
        for position, line in enumerate(stored_lines(layout.validated)):
            weight = _weight(line, by)
            k = assigner.assign(weight)
            if writer is None or k != writer.k:
                if writer is not None:
                    plans.append(writer.close())
                writer = _ShardFileWriter(layout, k, position)
            writer.add(line, weight)
        if writer is not None:
            plans.append(writer.close())
    except BaseException as exc:
        if writer is not None:
            writer.abort(exc)
        raise
    if assigner.position != total_requests:
        raise ShardingError(f"{layout.validated}: changed while shards were planned")

    manifest = ShardManifest(job_id=layout.job_id, by=by, num_shards=num_shards,
                             total_requests=total_requests, total_weight=total_weight,
                             shards=plans)
    _discard_stale_shards(layout, manifest)
    storage.write_bytes(layout.shard_manifest, manifest.model_dump_json(indent=2).encode())
    return plans


def _discard_stale_shards(layout: JobLayout, manifest: ShardManifest) -> None:
    """Drop results planned against a different plan: they no longer match the requests."""
    uri = layout.shard_manifest
    if not storage.exists(uri):
        return
    previous = ShardManifest.model_validate_json(storage.read_bytes(uri))
    if previous.shards == manifest.shards:
        return
    for plan in manifest.shards:
        storage.delete_prefix(plan.results_uri.rstrip("/") + "/")
        if storage.exists(plan.progress_uri):
            storage.delete(plan.progress_uri)
    for plan in previous.shards[len(manifest.shards):]:
        storage.delete_prefix(layout.shard(plan.index).root.rstrip("/") + "/")
