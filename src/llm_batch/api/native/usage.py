"""``GET /v1/usage``: tokens, requests, engine and GPU seconds summed over jobs, grouped by
owner, model or label, for accounting. Admins (an admin API key or an Airflow Admin) see
every owner's jobs, or one owner's with ``owner``; anyone else sees only their own jobs,
whatever ``owner`` they ask for (the answer's ``owner`` says whose jobs were counted)."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query

from llm_batch.api.auth import CallerDep
from llm_batch.api.errors import ApiError
from llm_batch.api.native.usage_models import UsageGroup, UsageGrouping, UsageList
from llm_batch.api.state import StoreDep

router = APIRouter(prefix="/v1/usage", tags=["usage"])


def parse_since(text: str) -> datetime:
    """Unix seconds (``1767225600``, ``1767225600.5``) or ISO 8601 (``2026-01-01``,
    ``2026-01-01T12:00:00+02:00``; no zone means UTC) -> an aware UTC datetime; 400 naming
    ``since`` otherwise."""
    value = text.strip()
    try:
        try:
            seconds = float(value)
        except ValueError:
            when = datetime.fromisoformat(value)
            return (when.replace(tzinfo=UTC) if when.tzinfo is None else when).astimezone(UTC)
        if not math.isfinite(seconds):
            raise ValueError("not a finite number")
        return datetime.fromtimestamp(seconds, UTC)
    except (ValueError, OverflowError, OSError) as exc:
        raise ApiError(400, f"since={text[:64]!r} is not a time: give Unix seconds (1767225600) or ISO 8601 "
                       f"(2026-01-01, 2026-01-01T12:00:00Z) ({exc})", param="since", code="invalid_value") from None


@router.get("", response_model=UsageList,
            summary="Usage summed over jobs, by owner, model or label (your own jobs; admins: every owner's)")
def get_usage(
    caller: CallerDep,
    store: StoreDep,
    by: Annotated[
        UsageGrouping | None,
        Query(description="Group by owner, model or label (one group per label key=value: a job with two labels "
              "counts in both, jobs without labels in `(none)`); omitted: one group `(all)`"),
    ] = None,
    since: Annotated[
        str | None,
        Query(max_length=64, description="Only jobs created at or after this time: Unix seconds or ISO 8601 "
              "(no zone: UTC)"),
    ] = None,
    owner: Annotated[
        str | None,
        Query(max_length=256, description="Admins: only this owner's jobs; others always get only their own"),
    ] = None,
) -> UsageList:
    start = parse_since(since) if since is not None else None
    counted = owner if caller.is_admin else caller.name
    rows = store.usage(by=by, since=start, owner=counted)
    return UsageList(by=by, since=start, owner=counted, data=[UsageGroup.of(row) for row in rows])
