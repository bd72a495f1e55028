"""Plan a job's shards: one requests file each, in input-index order, and the manifest
(``{job}/shards.json``) that merge and the DAG read (docs/data-plane.md, "sharding").

Three plans, each of ``min(n, requests)`` non-empty shards numbered from 0 (but see the third):
- contiguous: balanced ranges of the validated file, by count or estimated prompt tokens;
- prefix-aware (``Settings.prefix_aware_sharding``): requests sharing their first
  ``PREFIX_KEY_CHARS`` characters on one shard, whose prefix cache then computes the prefix
  once; kept only if it saves ``MIN_PREFIX_SAVING`` of the prompt tokens;
- adapter-grouped (lines on two or more models: the base and LoRA adapters): lines ordered by
  adapter, then cut into balanced consecutive pieces, so each shard loads few adapters. A job
  mixing base-model and adapter lines gets at least one shard for each (two when one was
  asked): a shard without adapters runs on an engine without LoRA, at the base model's speed.

Planning is deterministic: a re-plan with the same input keeps the shards' results; a
different plan discards them, as they no longer match their requests.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from pydantic import BaseModel

from llm_batch.core.config import Settings, get_settings
from llm_batch.core.layout import JobLayout
from llm_batch.core.schemas import prompt_chars
from llm_batch.infra import storage
from llm_batch.infra.storage import ChunkedWriter, stored_lines

MAX_SHARDS = 64
# Requests whose prompts share this many first characters form a prefix group (the worker
# orders its feed by the same key: llm_batch.runtime.engine.runner).
PREFIX_KEY_CHARS = 1024
# The prefix-aware plan's least saving of prompt tokens (its merge opens every shard at once).
MIN_PREFIX_SAVING = 0.05
ShardBy = Literal["count", "tokens"]
# The longer prefix (in PREFIX_KEY_CHARS) an oversized prefix group is split along.
LONG_PREFIX_FACTOR = 4


class ShardPlan(BaseModel):
    """One shard: ``count`` requests, the first at position ``start`` of the validated file (a
    contiguous range, or whole prefix groups spread over the file)."""

    index: int  # k, as in JobLayout.shard(k)
    start: int  # position of its first request in the validated file (0-based)
    count: int
    first_index: int  # input index of its first and last request
    last_index: int
    weight: int  # what was balanced: requests, or estimated prompt tokens
    requests_uri: str
    results_uri: str
    progress_uri: str
    # Prefix-aware plans: a re-plan keeps a shard's results only if it holds the same lines.
    digest: str | None = None
    # The LoRA adapters its lines run on (sorted; lines on the base model name none).
    adapters: list[str] = []


class ShardManifest(BaseModel):
    job_id: str
    by: ShardBy
    num_shards: int  # as asked: len(shards) may be fewer (fewer requests), or 2 for a mixed job's 1
    total_requests: int
    total_weight: int
    shards: list[ShardPlan]
    prefix_aware: bool = False
    prefix_groups: int = 0  # groups of requests sharing a long prefix (0 when not looked for)
    # Estimated prompt tokens the plan saves over the contiguous plan.
    estimated_saved_tokens: int = 0
    adapter_grouped: bool = False


class ShardingError(ValueError):
    pass


def read_manifest(layout: JobLayout) -> ShardManifest:
    return ShardManifest.model_validate_json(storage.read_bytes(layout.shard_manifest))


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """A tokenizer-free estimate (~4 characters a token), at least 1 per request."""
    return max(1, prompt_chars(body) // 4)


def _weight(line: bytes, by: ShardBy) -> int:
    return estimate_prompt_tokens(orjson.loads(line)["body"]) if by == "tokens" else 1


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", "") if isinstance(part, dict) and isinstance(part.get("text"), str)
            else orjson.dumps(part, option=orjson.OPT_SORT_KEYS).decode()
            for part in content)
    if content is None:
        return ""
    return orjson.dumps(content, option=orjson.OPT_SORT_KEYS).decode()


def _prompt_pieces(body: dict[str, Any], limit: int) -> Iterator[str]:
    """The text the prompt is rendered from, in rendering order: tools, then each message's role
    and content (or the responses API's instructions and input, or a completion's prompt). The
    chat template is the same for every request of a job: it does not change which share a prefix."""
    if body.get("tools"):
        yield "\x00tools" + orjson.dumps(body["tools"], option=orjson.OPT_SORT_KEYS).decode()
    if isinstance(body.get("instructions"), str):
        yield "\x00system\x1f" + body["instructions"] + "\x1e"
    if isinstance(body.get("messages"), list):
        yield from (_message_text(message) for message in body["messages"] if isinstance(message, dict))
        return
    for field_name in ("prompt", "input"):
        value = body.get(field_name)
        if isinstance(value, str):
            yield value
            return
        if isinstance(value, list) and value:
            ids = value if all(type(v) is int for v in value) else (
                value[0] if isinstance(value[0], list) else None)  # token ids
            if ids is not None:
                yield "\x00ids" + ",".join(str(t) for t in ids[:limit])
            else:  # texts, or the Responses API's input items
                yield from (_message_text(item) if isinstance(item, dict) else _content_text(item) for item in value)
            return


def _message_text(message: dict[str, Any]) -> str:
    return f"\x00{message.get('role')}\x1f" + _content_text(message.get("content")) + "\x1e"


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True) or 1


def prefix_key(body: dict[str, Any], chars: int) -> tuple[int, int] | None:
    """(hash of the prompt's first ``chars`` characters, hash of its first
    ``LONG_PREFIX_FACTOR * chars`` or 0 if it is shorter), or None for a prompt shorter
    than ``chars``: it shares no long prefix."""
    long_chars = LONG_PREFIX_FACTOR * chars
    text = ""
    for piece in _prompt_pieces(body, long_chars):
        text += piece
        if len(text) >= long_chars:
            break
    if len(text) < chars:
        return None
    return _hash(text[:chars]), (_hash(text[:long_chars]) if len(text) >= long_chars else 0)


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

    def __init__(self, layout: JobLayout, k: int, start: int, *, digest: bool = False):
        self.shard = layout.shard(k)
        self.k, self.start = k, start
        self.count = self.weight = 0
        self._digest = hashlib.blake2b(digest_size=12) if digest else None
        self.first_line = self.last_line = b""
        self.adapters: set[str] = set()
        self._open = ExitStack()
        self._out = ChunkedWriter(self._open.enter_context(storage.open_write(self.shard.requests)))

    def add(self, line: bytes, weight: int) -> None:
        if not self.count:
            self.first_line = line
        self.last_line = line
        self.count += 1
        self.weight += weight
        if b'"adapter"' in line and (adapter := orjson.loads(line).get("adapter")):
            self.adapters.add(adapter)
        self._out.write(line + b"\n")
        if self._digest is not None:
            self._digest.update(line + b"\n")

    def close(self) -> ShardPlan:
        self._out.flush()
        self._open.close()  # publishes the file
        return ShardPlan(
            index=self.k, start=self.start, count=self.count,
            first_index=orjson.loads(self.first_line)["index"],
            last_index=orjson.loads(self.last_line)["index"],
            weight=self.weight, requests_uri=self.shard.requests,
            results_uri=self.shard.results, progress_uri=self.shard.progress,
            digest=self._digest.hexdigest() if self._digest is not None else None,
            adapters=sorted(self.adapters),
        )

    def abort(self, exc: BaseException) -> None:
        """Discard the unfinished file (unless closed: the storage context does not publish it)."""
        self._open.__exit__(type(exc), exc, exc.__traceback__)


def _write_contiguous(layout: JobLayout, source: str, num_shards: int, by: ShardBy, total_requests: int,
                      total_weight: int) -> list[ShardPlan]:
    plans: list[ShardPlan] = []
    writer: _ShardFileWriter | None = None
    # min(): with more shards asked than requests, one request per shard, numbered 0..
    assigner = _Assigner(min(num_shards, total_requests), total_requests, total_weight)
    try:
        for position, line in enumerate(stored_lines(source)):
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
        raise ShardingError(f"{source}: changed while shards were planned")
    return plans


@dataclass
class _Lines:
    """Pass 1's compact view of the validated file: a few integers per line, never the lines."""

    weight: array = field(default_factory=lambda: array("q"))  # what is balanced
    group: array = field(default_factory=lambda: array("q"))  # prefix group id, -1 for none
    long_key: array = field(default_factory=lambda: array("q"))  # longer-prefix hash, 0 if none
    prompt_tokens: int = 0  # estimated, all lines
    # per group: its weight and first position
    g_weight: array = field(default_factory=lambda: array("q"))
    g_first: array = field(default_factory=lambda: array("q"))
    # per line: its model's rank in order of first appearance (the base, or an adapter)
    model: array = field(default_factory=lambda: array("l"))
    models: int = 0  # distinct models (the base counts as one)
    base: int = -1  # the base model's rank, -1 when no line is on it

    @property
    def total(self) -> int:
        return len(self.weight)


def _read_lines(source: str, by: ShardBy, chars: int) -> _Lines:
    lines = _Lines()
    group_of: dict[int, int] = {}  # prefix hash -> group id (only lines with a long prompt)
    model_rank: dict[str | None, int] = {}
    for position, line in enumerate(stored_lines(source)):
        record = orjson.loads(line)
        body = record["body"]
        # No adapter (or an empty name, as the worker reads it): the base.
        lines.model.append(model_rank.setdefault(record.get("adapter") or None, len(model_rank)))
        lines.models = len(model_rank)
        lines.base = model_rank.get(None, -1)
        tokens = estimate_prompt_tokens(body)
        lines.prompt_tokens += tokens
        weight = tokens if by == "tokens" else 1
        lines.weight.append(weight)
        key = prefix_key(body, chars) if chars else None
        if key is None:
            lines.group.append(-1)
            lines.long_key.append(0)
            continue
        short, long = key
        g = group_of.setdefault(short, len(group_of))
        if g == len(lines.g_weight):
            lines.g_weight.append(0)
            lines.g_first.append(position)
        lines.g_weight[g] += weight
        lines.group.append(g)
        lines.long_key.append(long)
    return lines


def _pieces(lines: _Lines, target: float) -> tuple[array, list[tuple[int, int]]]:
    """Each line's piece (-1: a filler, no long prefix) and each piece's (weight, first position). A
    group heavier than ``target`` (a shard's fair share) is split by its longer prefix, and what
    is still too heavy into consecutive runs of at most ``target``."""
    piece_of = array("q", [-1]) * lines.total
    weights: list[int] = []  # per piece
    firsts: list[int] = []
    group_piece = array("q", [-1]) * len(lines.g_weight)
    for g, weight in enumerate(lines.g_weight):
        if weight <= target:
            group_piece[g] = len(weights)
            weights.append(weight)
            firsts.append(lines.g_first[g])
    # Oversized groups: (group, long key or 0 for none) -> the piece being filled
    open_piece: dict[tuple[int, int], int] = {}
    for position in range(lines.total):
        g = lines.group[position]
        if g < 0:
            continue
        piece = group_piece[g]
        if piece < 0:  # a member of an oversized group
            sub = (g, lines.long_key[position])
            piece = open_piece.get(sub, -1)
            weight = lines.weight[position]
            if piece < 0 or weights[piece] + weight > target:
                piece = open_piece[sub] = len(weights)
                weights.append(0)
                firsts.append(position)
            weights[piece] += weight
        piece_of[position] = piece
    return piece_of, list(zip(weights, firsts))


def _prefix_assignment(lines: _Lines, num_shards: int) -> tuple[array, int] | None:
    """Each line's shard under the prefix-aware plan and its number of shards, or None if
    that plan would leave a shard empty."""
    m = min(num_shards, lines.total)
    total_weight = sum(lines.weight)
    target = total_weight / m
    piece_of, pieces = _pieces(lines, target)
    # Largest first, each to the lightest shard (ties: the lower shard): deterministic.
    order = sorted(range(len(pieces)), key=lambda p: (-pieces[p][0], pieces[p][1]))
    loads = [(0, k) for k in range(m)]
    piece_shard = array("q", [0]) * len(pieces)
    for p in order:
        load, k = heapq.heappop(loads)
        piece_shard[p] = k
        heapq.heappush(loads, (load + pieces[p][0], k))
    load_of = [load for load, _k in sorted(loads, key=lambda shard: shard[1])]
    # Fillers (no long prefix) top the shards up towards the fair share, in file order: each
    # shard below target takes a run of them in proportion to what it lacks.
    filler_weight = sum(w for w, p in zip(lines.weight, piece_of) if p < 0)
    lack = [max(0.0, target - load) for load in load_of]
    if not sum(lack):
        lack = [1.0] * m
    scale = filler_weight / sum(lack)
    bounds: list[tuple[float, int]] = []  # cumulative filler weight where shard k's run ends
    cumulative = 0.0
    for k in range(m):
        if lack[k] > 0:
            cumulative += lack[k] * scale
            bounds.append((cumulative, k))
    shard_of = array("b", [0]) * lines.total
    counts = [0] * m
    filled = 0
    run = 0
    for position in range(lines.total):
        p = piece_of[position]
        if p >= 0:
            k = piece_shard[p]
        else:
            weight = lines.weight[position]
            midpoint = filled + weight / 2
            while run < len(bounds) - 1 and midpoint > bounds[run][0]:
                run += 1
            k = bounds[run][1]  # never empty: some shard lacks weight
            filled += weight
        shard_of[position] = k
        counts[k] += 1
    if min(counts) == 0:
        return None
    # Number the shards by their first line, so shard 0 holds the first request.
    order = list(dict.fromkeys(shard_of))
    if order != list(range(m)):
        number = {k: i for i, k in enumerate(order)}
        shard_of = array("b", (number[k] for k in shard_of))
    return shard_of, m


def _saved_tokens(lines: _Lines, shard_of: array, num_shards: int, chars: int) -> int:
    """Estimated prompt tokens the plan saves over the contiguous one: per group, (shards it spans
    there - shards here) x ``chars`` / 4, and likewise per longer shared prefix for the further
    (``LONG_PREFIX_FACTOR`` - 1) x ``chars`` / 4 tokens."""
    # (0, group id) and (1, longer prefix's hash) -> [the shard it was last seen on in the
    # contiguous plan, its span there, the shards it is on here (a bit mask: <= 64 shards)]
    spans: dict[tuple[int, int], list[int]] = {}
    assigner = _Assigner(num_shards, lines.total, sum(lines.weight))
    for position in range(lines.total):
        k = assigner.assign(lines.weight[position])
        g, long = lines.group[position], lines.long_key[position]
        if g < 0:
            continue
        for key in ((0, g), (1, long)) if long else ((0, g),):
            span = spans.setdefault(key, [-1, 0, 0])
            if span[0] != k:
                span[0] = k
                span[1] += 1
            span[2] |= 1 << shard_of[position]
    tokens = (chars // 4, (LONG_PREFIX_FACTOR - 1) * chars // 4)
    return sum((runs - here.bit_count()) * tokens[level] for (level, _), (_, runs, here) in spans.items())


def _adapter_assignment(lines: _Lines, num_shards: int) -> tuple[array, int]:
    """Each line's shard in the adapter-grouped plan and its number of shards. Lines are ordered
    by model (in order of first appearance), a prefix group's lines together, then file order,
    and cut into ``m = min(num_shards, lines)`` consecutive pieces of about equal weight.

    Base-model and adapter lines never share a shard: on CPU an engine without LoRA runs base
    lines several times faster (docs/benchmarks.md, "LoRA adapters"). So a mixed job gets
    ``max(m, 2)`` shards, each side a share by its weight (at least one, at most its lines), the
    first line's side first (shard 0 holds the first request). One LoRA engine serves any adapters."""
    n = lines.total
    m = min(num_shards, n)
    first_side = lines.model[0] == lines.base

    def place(p: int) -> tuple[bool, int, int, int]:
        g = lines.group[p]
        return (lines.model[p] == lines.base) != first_side, lines.model[p], lines.g_first[g] if g >= 0 else p, p

    order = sorted(range(n), key=place)
    shard_of = array("q", bytes(8 * n))
    if lines.base < 0:  # adapter lines only (this plan is for lines on two or more models)
        _cut(order, lines.weight, 0, m, shard_of)
        return shard_of, m
    m = max(m, 2)
    split = next(i for i, p in enumerate(order) if (lines.model[p] == lines.base) != first_side)
    head, tail = order[:split], order[split:]
    head_weight = sum(lines.weight[p] for p in head)
    total = head_weight + sum(lines.weight[p] for p in tail)
    share = (2 * m * head_weight + total) // (2 * total)  # m x the head's part of the weight, rounded
    share = max(1, m - len(tail), min(share, m - 1, len(head)))
    _cut(head, lines.weight, 0, share, shard_of)
    _cut(tail, lines.weight, share, m - share, shard_of)
    return shard_of, m


def _cut(order: list[int], weights: array, first: int, m: int, shard_of: array) -> None:
    """Give the lines at positions ``order`` shards ``first .. first + m - 1`` (in ``shard_of``):
    ``m`` consecutive, non-empty pieces of about equal weight."""
    n = len(order)
    total = sum(weights[p] for p in order) or 1
    k = done = 0
    for i, p in enumerate(order):
        # Move on once this shard has its share, and always while the lines left are only
        # enough to give each later shard one.
        while k < m - 1 and (done * m >= (k + 1) * total or n - i <= m - 1 - k):
            k += 1
        shard_of[p] = first + k
        done += weights[p]


def _write_assigned(layout: JobLayout, source: str, shard_of: array, m: int, weights: array) -> list[ShardPlan]:
    writers: list[_ShardFileWriter | None] = [None] * m
    position = -1
    try:
        for position, line in enumerate(stored_lines(source)):
            if position >= len(shard_of):
                break
            k = shard_of[position]
            writer = writers[k]
            if writer is None:
                writer = writers[k] = _ShardFileWriter(layout, k, position, digest=True)
            writer.add(line, weights[position])
        if position + 1 != len(shard_of) or any(w is None for w in writers):
            raise ShardingError(f"{source}: changed while shards were planned")
        plans = [w.close() for w in writers]  # type: ignore[union-attr]
    except BaseException as exc:
        for writer in writers:
            if writer is not None:
                writer.abort(exc)
        raise
    return plans


def plan_shards(layout: JobLayout, num_shards: int, *, by: ShardBy = "count",
                prefix_aware: bool | None = None, min_saving: float | None = None,
                source: str | None = None, settings: Settings | None = None) -> list[ShardPlan]:
    """Write the shards' request files and the manifest (one of the module's three plans); return the
    (non-empty) shards. ``prefix_aware`` defaults to ``settings.prefix_aware_sharding`` (default
    ``get_settings()``), ``min_saving`` to MIN_PREFIX_SAVING; ``source`` (default
    ``layout.validated``) is the file to plan (``layout.uncached`` when the cache answered some)."""
    source = source or layout.validated
    if not 1 <= num_shards <= MAX_SHARDS:
        raise ShardingError(f"number of shards must be 1..{MAX_SHARDS}, got {num_shards}")
    if by not in ("count", "tokens"):
        raise ShardingError(f"shards balance by 'count' or 'tokens', got {by!r}")
    if prefix_aware is None:
        prefix_aware = (settings or get_settings()).prefix_aware_sharding
    min_saving = MIN_PREFIX_SAVING if min_saving is None else min_saving

    assignment = None
    groups = saved = 0
    by_adapter = False
    lines: _Lines | None = None
    if num_shards > 1:
        lines = _read_lines(source, by, PREFIX_KEY_CHARS if prefix_aware else 0)
    else:
        total_requests, total_weight, mixed = _count(source, by)
        if mixed:  # base and adapter lines: a shard for each
            lines = _read_lines(source, by, 0)
    if lines is not None:
        total_requests, total_weight = lines.total, sum(lines.weight)
        groups = len(lines.g_weight)
        if lines.models > 1 and total_requests > 1:
            assignment, by_adapter = _adapter_assignment(lines, num_shards), True
        elif groups and total_requests > 1:
            assignment = _prefix_assignment(lines, num_shards)
            if assignment is not None:
                saved = _saved_tokens(lines, *assignment, PREFIX_KEY_CHARS)
                if saved <= 0 or saved < min_saving * lines.prompt_tokens:
                    assignment, saved = None, 0

    if assignment is None:
        plans = _write_contiguous(layout, source, num_shards, by, total_requests, total_weight)
    else:
        assert lines is not None
        plans = _write_assigned(layout, source, *assignment, lines.weight)

    manifest = ShardManifest(job_id=layout.job_id, by=by, num_shards=num_shards,
                             total_requests=total_requests, total_weight=total_weight,
                             shards=plans, prefix_aware=assignment is not None and not by_adapter,
                             prefix_groups=groups, estimated_saved_tokens=saved, adapter_grouped=by_adapter)
    _discard_stale_shards(layout, manifest)
    storage.write_bytes(layout.shard_manifest, manifest.model_dump_json(indent=2).encode())
    return plans


def _count(source: str, by: ShardBy) -> tuple[int, int, bool]:
    """Pass 1 of a one-shard plan: the requests, their total weight, and whether they mix
    base-model and adapter lines (a line is parsed for its adapter only if it mentions one)."""
    requests = weight = 0
    sides: set[bool] = set()  # True: a line on an adapter
    for line in stored_lines(source):
        requests += 1
        weight += _weight(line, by)
        sides.add(b'"adapter"' in line and bool(orjson.loads(line).get("adapter")))
    return requests, weight, len(sides) == 2


def _discard_stale_shards(layout: JobLayout, manifest: ShardManifest) -> None:
    """Drop results planned against a different plan: they no longer match the requests."""
    if not storage.exists(layout.shard_manifest):
        return
    previous = read_manifest(layout)
    if previous.shards == manifest.shards and (previous.prefix_aware, previous.adapter_grouped) == (
            manifest.prefix_aware, manifest.adapter_grouped):
        return
    for plan in manifest.shards:
        storage.delete_prefix(plan.results_uri.rstrip("/") + "/")
        storage.delete(plan.progress_uri)  # a missing one: no-op
    for plan in previous.shards[len(manifest.shards):]:
        storage.delete_prefix(layout.shard(plan.index).root.rstrip("/") + "/")
