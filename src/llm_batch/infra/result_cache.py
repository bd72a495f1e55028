"""The result cache's data plane: which requests may be cached, their content address, and
the answer objects in storage.

A request is cached only when its answer is determined: a chat or completion request with
``temperature`` 0 (greedy) or a ``seed``, or an embedding request; one that names a file
(audio, an image) never is, since the file may change under its name. Its key is the
SHA-256 of everything that decides the answer, serialised canonically: the model's identity
(its registry entry and the job's engine configuration, ``identity``), the endpoint, the
body (the line's ``model``, adapters included) and where an owner's adapter lives.

An answer is one object, ``{"key": ..., "body": ...}``, under ``Settings.result_cache_uri``
(a folder of each owner's digest, then the key's first two characters), published whole
(``storage.open_write``); a read checks the key it holds, so a wrong or torn object is a
miss, never an answer.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from llm_batch.core.config import Settings
from llm_batch.core.layout import join_uri
from llm_batch.core.records import BatchRequest
from llm_batch.infra import storage

CACHE_FORMAT = 1  # part of every key: a change of what is cached makes every old entry a miss
_SAMPLED = frozenset({"/v1/chat/completions", "/v1/completions"})
_DETERMINED = frozenset({"/v1/embeddings"})
CACHEABLE_ENDPOINTS = _SAMPLED | _DETERMINED


def cacheable(endpoint: str, request: BatchRequest) -> bool:
    """Whether the request's answer is determined by what it says (see the module doc)."""
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


def cache_key(identity: dict[str, Any], endpoint: str, request: BatchRequest) -> str:
    """The request's content address (hex SHA-256)."""
    decided_by = {"format": CACHE_FORMAT, "identity": identity, "endpoint": endpoint, "body": request.body,
                  "adapter": request.adapter, "adapter_uri": request.adapter_uri}
    return hashlib.sha256(orjson.dumps(decided_by, option=orjson.OPT_SORT_KEYS)).hexdigest()


def entry_uri(settings: Settings, owner: str, key: str) -> str:
    owner_dir = hashlib.sha256(owner.encode()).hexdigest()[:24]  # any owner spelling, one safe name
    return join_uri(settings.result_cache_uri, owner_dir, key[:2], f"{key}.json")


def write_answer(uri: str, key: str, body: dict[str, Any]) -> int:
    """Publish the answer object whole; returns its size in bytes."""
    data = orjson.dumps({"key": key, "body": body})
    storage.write_bytes(uri, data)
    return len(data)


def read_answer(uri: str, key: str) -> dict[str, Any] | None:
    """The answer's body, None when the object is missing, unreadable or not this key's."""
    try:
        entry = orjson.loads(storage.read_bytes(uri))
    except (storage.ObjectNotFound, orjson.JSONDecodeError):
        return None
    if not isinstance(entry, dict) or entry.get("key") != key or not isinstance(entry.get("body"), dict):
        return None
    return entry["body"]
