"""The result cache's use cases: a job's determined lines answered from earlier jobs' answers (no
engine time; ``answer_from_cache``), the cache filled (``fill_cache``), expired and emptied. What
is cacheable, and the key: ``llm_batch.infra.result_cache``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from itertools import chain, islice
from typing import TYPE_CHECKING

import orjson

from llm_batch.core.config import Settings
from llm_batch.core.layout import JobLayout
from llm_batch.core.model_config import ModelError
from llm_batch.core.records import BatchRequest, ResultRecord, dumps_line
from llm_batch.infra import storage
from llm_batch.infra.model_registry import load_registry
from llm_batch.infra.result_cache import CACHEABLE_ENDPOINTS, CacheKeys, cacheable, pack_uri, read_answers, write_pack
from llm_batch.infra.results import paired_results
from llm_batch.infra.storage import stored_lines
from llm_batch.pipeline.sharding import ShardPlan, read_manifest

if TYPE_CHECKING:  # the DAG files import this module: the store loads only in tasks
    from llm_batch.core.snapshots import CachedAnswer, CacheEntry
    from llm_batch.infra.jobstore import Job, JobStore, ResultCacheRepository

_LOOKUP_BATCH = 2000  # validated lines looked up (and their hits read) at once


def enabled(settings: Settings, job: Job) -> bool:
    return settings.result_cache and job.input.result_cache


def _may_look_up(settings: Settings, job: Job) -> bool:
    """Whether the job's lines are looked up at all: the cache on for it, its endpoint cacheable."""
    return enabled(settings, job) and job.endpoint in CACHEABLE_ENDPOINTS


# The one cache every owner shares when the deployment says so (never an owner name: those
# have no spaces).
SHARED_SCOPE = "(every owner)"


def cache_scope(settings: Settings, job: Job) -> str:
    """Whose answers serve the job: its owner's, or every owner's with ``LLM_BATCH_RESULT_CACHE_SHARED``."""
    return SHARED_SCOPE if settings.result_cache_shared else job.owner


class _Keys:
    """Each request's key for one job: the model's registry entry and the job's engine config, the
    line's adapter's entry, and whether the engine had LoRA on. A lookup asks for a line's answer
    from a shard of its own kind (LoRA on for an adapter line, off for a base line); a base line
    computed beside adapters (LoRA on) is therefore never entered (``fill_cache``)."""

    def __init__(self, settings: Settings, job: Job):
        try:
            self.registry = load_registry(settings=settings)
            spec = self.registry.get(job.model).model_dump(mode="json")
        except ModelError:  # a model_config.checkpoint_path job: its config says what it runs
            self.registry, spec = None, None
        identity = {"model": job.model, "spec": spec, "model_config": job.model_config or {}}
        if defaults := job.input.sampling_defaults:  # they decide the answers of the lines that omit them
            identity["sampling_defaults"] = defaults.model_dump(mode="json", exclude_none=True)
        self.endpoint = job.endpoint
        self._keys = CacheKeys(identity, self.endpoint)
        self.prefix = self._keys.prefix  # every key of the job starts so

    def of(self, request: BatchRequest, lora: bool | None = None) -> str | None:
        """The key of ``request``'s answer from an engine with LoRA on or off (``lora``, None: what a
        lookup asks); None if it is not cacheable."""
        if not cacheable(self.endpoint, request):
            return None
        adapter = self.registry.adapters.get(request.adapter) if self.registry and request.adapter else None
        return self._keys.of(request, lora=_lookup_lora(request) if lora is None else lora,
                             adapter_spec=adapter.model_dump(mode="json") if adapter else None)


def _lookup_lora(request: BatchRequest) -> bool:
    """Whether the engine whose answer a lookup asks for had LoRA on (see ``_Keys``)."""
    return request.adapter is not None


def may_answer(store: ResultCacheRepository, settings: Settings, job: Job) -> bool:
    """Whether the cache may answer some of the job's lines (it holds answers of its model,
    config and endpoint for its scope): one indexed question."""
    return _may_look_up(settings, job) and _Lookups(store, settings, job).may_hit()


def answer_from_cache(store: JobStore, settings: Settings, job: Job, layout: JobLayout) -> str:
    """Split the validated requests into cached results and the rest; returns what the shards run
    (``layout.validated`` itself when the cache is off for the job or answers none of its lines).
    The rest is published first, so a retried plan finding both reuses them and finding only
    the first redoes the split: a line is never in both."""
    if not _may_look_up(settings, job):
        return layout.validated
    if storage.exists(layout.cached_results) and storage.exists(layout.uncached):
        return layout.uncached
    lookups = _Lookups(store, settings, job)
    if not lookups.may_hit():
        return layout.validated  # nothing of this model, config and endpoint: no line to look up
    if not any(entry is not None for *_, entry in chain.from_iterable(lookups.batches(layout.validated))):
        return layout.validated
    used: list[str] = []
    with storage.open_write(layout.cached_results) as cached, storage.open_write(layout.uncached) as rest:
        for batch in lookups.batches(layout.validated):
            bodies = read_answers(entry for *_, entry in batch if entry is not None)  # a read per run of neighbours
            for line, request, key, _entry in batch:
                body = bodies.get(key) if key else None
                if body is None:
                    rest.write(line + b"\n")
                    continue
                # A ResultRecord's fields, as a dict: a big rerun builds no model per line.
                cached.write(dumps_line({"index": request.index, "custom_id": request.custom_id, "status_code": 200,
                                         "body": body, "line": request.line, "cached": True}))
            used += bodies
    store.touch_cache_entries(lookups.scope, used)  # one transaction for the job, not one per batch
    return layout.uncached


class _Lookups:
    """Each validated line with its key and the job's scope's unexpired entry of it (or
    None), looked up ``_LOOKUP_BATCH`` lines per query."""

    def __init__(self, store: JobStore, settings: Settings, job: Job):
        self.store, self.keys, self.scope = store, _Keys(settings, job), cache_scope(settings, job)
        self.made_after = datetime.now(UTC) - timedelta(hours=settings.result_cache_ttl_hours)

    def may_hit(self) -> bool:
        """Whether the scope holds any unexpired answer of the job's model, config and endpoint."""
        return self.store.holds_cache_prefix(self.scope, self.keys.prefix, made_after=self.made_after)

    def batches(self, uri: str) -> Iterator[list[tuple[bytes, BatchRequest, str | None, CachedAnswer | None]]]:
        lines = stored_lines(uri)
        while chunk := list(islice(lines, _LOOKUP_BATCH)):
            requests = [BatchRequest.model_validate_json(line) for line in chunk]
            keys = [self.keys.of(request) for request in requests]
            entries = self.store.cached_answers(self.scope, [k for k in keys if k], made_after=self.made_after)
            yield list(zip(chunk, requests, keys, (entries.get(k) if k else None for k in keys), strict=True))


def cached_results(layout: JobLayout) -> Iterator[ResultRecord]:
    """The job's results answered from the cache, in input order (none without a split)."""
    if storage.exists(layout.cached_results):
        for line in stored_lines(layout.cached_results):
            yield ResultRecord.model_validate_json(line)


def _computed(plan: ShardPlan) -> Iterator[tuple[BatchRequest, ResultRecord]]:
    """Each request the shard answered successfully, with its result."""
    for request, result in paired_results(plan.requests_uri, plan.results_uri):
        if result is None:
            break  # a shard's results are a prefix of its requests
        if result.ok and result.body is not None:
            yield BatchRequest.model_validate(request), result


def fill_cache(store: ResultCacheRepository, settings: Settings, job: Job, layout: JobLayout) -> int:
    """Enter the job's computed, cacheable answers in its owner's cache, a pack per shard
    (whole before its rows); returns how many."""
    if not enabled(settings, job) or not storage.exists(layout.shard_manifest):
        return 0
    keys, scope = _Keys(settings, job), cache_scope(settings, job)
    hold = _FillHold(layout.hold_marker)
    filled = 0
    for done, plan in enumerate(read_manifest(layout).shards):
        hold.wait(done)
        lora = bool(plan.adapters)  # the worker turns LoRA on for a shard whose lines name adapters
        answers = ((key, result.body) for request, result in _computed(plan)
                   if lora == _lookup_lora(request) and (key := keys.of(request, lora)) is not None)
        first = next(answers, None)
        if first is None:
            continue
        uri = pack_uri(settings, scope, job.id, plan.index)
        packed = write_pack(uri, chain([first], answers))
        store.put_cache_entries(owner=scope, job_id=job.id, uri=uri, packed=packed)
        filled += len(packed)
    return filled


class _FillHold:
    """A fault drill's hold point in the fill (docs/worker.md, "Fault drills"): while the job's hold
    marker says ``{"cache_fill_after_shards": N}``, the fill waits after N shards' entries."""

    POLL_S = 0.2

    def __init__(self, marker: str):
        self.marker = marker
        self.after = self._read()

    def _read(self) -> int | None:
        try:
            value = orjson.loads(storage.read_bytes(self.marker)).get("cache_fill_after_shards")
        except (storage.StorageError, orjson.JSONDecodeError, AttributeError):
            return None
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def wait(self, done: int) -> None:
        while self.after is not None and done >= self.after:
            time.sleep(self.POLL_S)
            self.after = self._read()


def _delete_unused(store: ResultCacheRepository, entries: list[CacheEntry]) -> None:
    """Delete the objects of removed `entries` that no entry names any more."""
    uris = {entry.uri for entry in entries}
    for uri in uris - store.cache_uris_in_use(uris):
        storage.delete(uri)


def forget_job(store: JobStore, job_id: str) -> int:
    """Remove the entries a (deleted) job computed, rows then objects; returns how many."""
    entries = store.forget_job_cache(job_id)
    _delete_unused(store, entries)
    return len(entries)


def evict(store: JobStore, settings: Settings, now: datetime | None = None) -> int:
    """Remove expired entries, then the least recently used beyond the size bound."""
    now = now or datetime.now(UTC)
    entries = store.evict_cache(made_before=now - timedelta(hours=settings.result_cache_ttl_hours),
                                max_bytes=settings.result_cache_max_bytes)
    _delete_unused(store, entries)
    return len(entries)

