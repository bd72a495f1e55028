"""Owners' own LoRA adapters (the ``adapters`` table; the files live in storage under each
record's ``uri``, a prefix ending in ``/``).

An adapter is its owner's alone: every call takes the owner, and another owner's adapter
looks exactly like a missing one. One name per owner; deleting removes the row (the name is
free again), the files are the caller's to delete. Getters return None for an unknown
adapter; ``delete_adapter`` raises ``AdapterNotFound``, ``create_adapter`` ``AdapterExists``.
"""

from __future__ import annotations

import uuid
from typing import Protocol

from sqlalchemy import Row, delete, insert, select
from sqlalchemy.exc import IntegrityError

from llm_batch.infra.jobstore.errors import AdapterExists, AdapterNotFound
from llm_batch.infra.jobstore.repository import Repository, utcnow
from llm_batch.infra.jobstore.snapshots import OwnerAdapter
from llm_batch.infra.jobstore.tables import ADAPTERS


def new_adapter_id() -> str:
    return f"adapter-{uuid.uuid4().hex}"


def _adapter(row: Row) -> OwnerAdapter:
    return OwnerAdapter(**row._asdict())


class Adapters(Protocol):
    """Owners' adapters, as the adapter routes, job submission and the pipeline use them
    (AdapterRepository)."""

    def create_adapter(self, *, owner: str, name: str, base: str, uri: str, rank: int, bytes: int) -> OwnerAdapter: ...
    def list_adapters(self, owner: str) -> list[OwnerAdapter]: ...
    def get_adapter(self, owner: str, name: str) -> OwnerAdapter | None: ...
    def delete_adapter(self, owner: str, name: str) -> OwnerAdapter: ...


class AdapterRepository(Repository):
    """Owners' adapters (see the module docstring)."""

    def create_adapter(self, *, owner: str, name: str, base: str, uri: str, rank: int, bytes: int) -> OwnerAdapter:
        """Record `owner`'s adapter `name` on `base` (its files already at `uri`);
        ``AdapterExists`` if the owner has one of that name."""
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        if bytes < 0:
            raise ValueError(f"bytes must be >= 0, got {bytes}")
        values = dict(id=new_adapter_id(), owner=owner, name=name, base=base, uri=uri, rank=rank, bytes=bytes,
                      created_at=utcnow())
        try:
            with self._transaction(write=True) as connection:
                row = connection.execute(insert(ADAPTERS).values(**values).returning(*ADAPTERS.c)).one()
        except IntegrityError as exc:
            raise AdapterExists(f"{owner!r} already has an adapter named {name!r}") from exc
        return _adapter(row)

    def list_adapters(self, owner: str) -> list[OwnerAdapter]:
        """`owner`'s adapters, by name."""
        query = select(ADAPTERS).where(ADAPTERS.c.owner == owner).order_by(ADAPTERS.c.name)
        return self._read_all(query, _adapter)

    def get_adapter(self, owner: str, name: str) -> OwnerAdapter | None:
        """`owner`'s adapter `name`, None if the owner has none of that name."""
        return self._read_one(select(ADAPTERS).where(ADAPTERS.c.owner == owner, ADAPTERS.c.name == name), _adapter)

    def delete_adapter(self, owner: str, name: str) -> OwnerAdapter:
        """Remove `owner`'s adapter `name` and return what it was (its files are the
        caller's to delete); ``AdapterNotFound`` if the owner has none of that name."""
        with self._transaction(write=True) as connection:
            row = connection.execute(
                delete(ADAPTERS).where(ADAPTERS.c.owner == owner, ADAPTERS.c.name == name).returning(*ADAPTERS.c)
            ).one_or_none()
        if row is None:
            raise AdapterNotFound(f"{owner!r} has no adapter {name!r}")
        return _adapter(row)
