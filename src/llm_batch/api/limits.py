"""Per-owner limits: stored bytes (files and adapters), jobs not yet ended, requests in flight.

Admins set them (``LLM_BATCH_OWNER_MAX_*`` for everyone, ``LLM_BATCH_OWNER_LIMITS`` JSON
per owner; 0 means no limit) and are not held to them. A create or upload that would pass
one is answered 429 ``limit_exceeded`` naming the limit, its value and the owner's usage.
Requests in flight count the totals of the owner's live jobs once validated, plus the new
job's requests when the create says how many (inline content).
"""

from __future__ import annotations

from llm_batch.api.auth import Caller
from llm_batch.api.errors import ApiError
from llm_batch.core.config import Settings
from llm_batch.infra.jobstore import JobStore

# limit name -> (what it measures in JobStore.owner_usage, how the message says it)
_LIMITS = {
    "max_live_jobs": ("live_jobs", "jobs not yet ended"),
    "max_requests_in_flight": ("requests_in_flight", "requests in jobs not yet ended"),
    "max_file_bytes": ("file_bytes", "bytes of stored files and adapters"),
}


def check_owner_limits(
    store: JobStore, settings: Settings, caller: Caller, *, new_jobs: int = 0, new_requests: int = 0, new_bytes: int = 0
) -> None:
    """429 if what the caller holds plus what this call adds passes one of their limits."""
    if caller.is_admin:
        return
    usage = store.owner_usage(caller.name)
    adding = {"live_jobs": new_jobs, "requests_in_flight": new_requests, "file_bytes": new_bytes}
    for name, (measure, words) in _LIMITS.items():
        limit = int(settings.owner_limits.get(caller.name, {}).get(name, getattr(settings, f"owner_{name}")))
        if limit and adding[measure] and usage[measure] + adding[measure] > limit:
            raise ApiError(
                429,
                f"limit {name} of owner {caller.name!r} exceeded: {usage[measure]} {words} held, "
                f"{adding[measure]} more asked, limit {limit} (set by an admin: LLM_BATCH_OWNER_LIMITS)",
                param=name,
                code="limit_exceeded",
            )
