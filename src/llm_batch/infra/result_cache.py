"""The result cache's data plane: which requests may be cached, their content address, and
the answer packs in storage.

Only a determined answer is cached (greedy or seeded chat and completions, embeddings; no
line naming a file, which may change under its name), keyed by everything that decides it,
LoRA on or off included (an engine with LoRA answers a greedy base line differently).
Answers are kept in packs, one object per shard, a line ``{"key", "body"}`` per answer,
published whole before the index names any by byte range; a read checks the key its range
holds, so a wrong or torn range is a miss."""
from __future__ import annotations

import hashlib
from collections.abc import Iterable
from contextlib import suppress
from dataclasses import dataclass
from itertools import groupby
from typing import Any

import orjson

from llm_batch.core.config import Settings
from llm_batch.core.layout import join_uri
from llm_batch.core.records import BatchRequest
from llm_batch.core.snapshots import CachedAnswer
from llm_batch.infra import storage

CACHE_FORMAT = 4  # part of every key: a change of what is cached makes every old entry a miss
# A key's first digits name the job-wide part of what decides an answer (model, its config,
# endpoint): a first run of a model nobody cached asks one indexed question, not one per line.
PREFIX_DIGITS = 16
_SAMPLED = frozenset({"/v1/chat/completions", "/v1/completions"})
_DETERMINED = frozenset({"/v1/embeddings"})
CACHEABLE_ENDPOINTS = _SAMPLED | _DETERMINED


def cacheable(endpoint: str, request: BatchRequest) -> bool:
    if request.media is not None:
        return False
    if endpoint in _DETERMINED:
        return True
    if endpoint not in _SAMPLED:
        return False
    seed = request.body.get("seed")
    temperature = request.body.get("temperature")
    greedy = isinstance(temperature, int | float) and not isinstance(temperature, bool) and temperature == 0
    return greedy or (isinstance(seed, int) and not isinstance(seed, bool))


class CacheKeys:
    """The content addresses of one identity's requests to one endpoint. The job-wide part of what
    decides an answer (``identity``: model, its config; the endpoint) is serialized and hashed
    once; a key hashes on with the line's own part (body, adapter, LoRA on or off)."""

    def __init__(self, identity: dict[str, Any], endpoint: str):
        shared = orjson.dumps({"format": CACHE_FORMAT, "identity": identity, "endpoint": endpoint},
                              option=orjson.OPT_SORT_KEYS)
        # The first PREFIX_DIGITS hex digits of every key of the job.
        self.prefix = hashlib.sha256(shared).hexdigest()[:PREFIX_DIGITS]
        self._shared = hashlib.sha256(shared + b"\n")

    def of(self, request: BatchRequest, *, lora: bool, adapter_spec: dict[str, Any] | None = None) -> str:
        """``request``'s key (64 hex digits) as an engine with LoRA on or off answers it, with the
        registry entry of its adapter (``adapter_spec``)."""
        digest = self._shared.copy()
        digest.update(orjson.dumps({"lora": lora, "body": request.body, "adapter": request.adapter,
                                    "adapter_uri": request.adapter_uri, "adapter_spec": adapter_spec},
                                   option=orjson.OPT_SORT_KEYS))
        return self.prefix + digest.hexdigest()[PREFIX_DIGITS:]


def pack_uri(settings: Settings, owner: str, job_id: str, shard: int) -> str:
    owner_dir = hashlib.sha256(owner.encode()).hexdigest()[:24]  # any owner spelling, one safe name
    return join_uri(settings.result_cache_uri, owner_dir, "packs", f"{job_id}-{shard}.jsonl")


@dataclass(frozen=True, slots=True)
class Packed:
    key: str
    at_byte: int
    bytes: int
    prompt_tokens: int
    completion_tokens: int


def answer_tokens(body: dict[str, Any]) -> tuple[int, int]:
    usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
    return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)


def write_pack(uri: str, answers: Iterable[tuple[str, dict[str, Any]]]) -> list[Packed]:
    """Publish the ``(key, body)`` answers as one pack at ``uri``; where each one is."""
    packed: list[Packed] = []
    at = 0
    with storage.open_write(uri) as out:
        for key, body in answers:
            line = orjson.dumps({"key": key, "body": body}, option=orjson.OPT_APPEND_NEWLINE)
            out.write(line)
            packed.append(Packed(key, at, len(line), *answer_tokens(body)))
            at += len(line)
    return packed


# Neighbouring answers of one pack closer than this are read in one range request.
READ_GAP_BYTES = 64 * 1024


def read_answers(entries: Iterable[CachedAnswer]) -> dict[str, dict[str, Any]]:
    """The bodies of ``entries`` by key, misses left out; one range read per run of
    neighbouring answers of a pack."""
    found: dict[str, dict[str, Any]] = {}
    located = sorted(entries, key=lambda e: (e.uri, e.at_byte if e.at_byte is not None else -1))
    for uri, group in groupby(located, key=lambda e: e.uri):
        for run in _runs(list(group)):
            if run[0].at_byte is None:  # a one-object entry of before packs, read whole
                with suppress(storage.ObjectNotFound):
                    if (body := _answer_of(storage.read_bytes(uri), run[0].key)) is not None:
                        found[run[0].key] = body
                continue
            start = run[0].at_byte
            try:
                data = storage.read_range(uri, start, run[-1].at_byte + run[-1].bytes - start)
            except storage.StorageError:
                continue
            for entry in run:
                at = entry.at_byte - start
                if (body := _answer_of(data[at:at + entry.bytes], entry.key)) is not None:
                    found[entry.key] = body
    return found


def _runs(members: list[CachedAnswer]) -> Iterable[list[CachedAnswer]]:
    run: list[CachedAnswer] = []
    for entry in members:
        if run and (entry.at_byte is None or run[-1].at_byte is None
                    or entry.at_byte - (run[-1].at_byte + run[-1].bytes) > READ_GAP_BYTES):
            yield run
            run = []
        run.append(entry)
    if run:
        yield run


def _answer_of(data: bytes, key: str) -> dict[str, Any] | None:
    try:
        entry = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(entry, dict) or entry.get("key") != key or not isinstance(entry.get("body"), dict):
        return None
    return entry["body"]
