"""Owners' own LoRA adapters (the ``adapters`` table; their files, the caller's to delete, are
in storage under each record's ``uri``). Every call takes the owner: another owner's adapter
looks exactly like a missing one. One name per owner; deleting frees it."""

from __future__ import annotations

import uuid

from sqlalchemy import delete, select

from llm_batch.core.snapshots import OwnerAdapter
from llm_batch.infra.jobstore.errors import AdapterExists, AdapterNotFound
from llm_batch.infra.jobstore.models import ADAPTERS
from llm_batch.infra.jobstore.repository import Repository, from_row, require_non_negative, utcnow

_adapter = from_row(OwnerAdapter)


class AdapterRepository(Repository):
    def create_adapter(self, *, owner: str, name: str, base: str, uri: str, rank: int, bytes: int) -> OwnerAdapter:
        """Record `owner`'s adapter `name` on `base` (its files already at `uri`)."""
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        require_non_negative({"bytes": bytes})
        values = dict(id=f"adapter-{uuid.uuid4().hex}", owner=owner, name=name, base=base, uri=uri, rank=rank,
                      bytes=bytes, created_at=utcnow())
        taken = AdapterExists(f"{owner!r} already has an adapter named {name!r}")
        return _adapter(self._insert(ADAPTERS, values, ADAPTERS.c, taken))

    def list_adapters(self, owner: str) -> list[OwnerAdapter]:
        query = select(ADAPTERS).where(ADAPTERS.c.owner == owner).order_by(ADAPTERS.c.name)
        return self._read_all(query, _adapter)

    def get_adapter(self, owner: str, name: str) -> OwnerAdapter | None:
        return self._read_one(select(ADAPTERS).where(ADAPTERS.c.owner == owner, ADAPTERS.c.name == name), _adapter)

    def delete_adapter(self, owner: str, name: str) -> OwnerAdapter:
        """Remove `owner`'s adapter `name` and return what it was."""
        with self._transaction(write=True) as connection:
            row = connection.execute(
                delete(ADAPTERS).where(ADAPTERS.c.owner == owner, ADAPTERS.c.name == name).returning(*ADAPTERS.c)
            ).one_or_none()
        if row is None:
            raise AdapterNotFound(f"{owner!r} has no adapter {name!r}")
        return _adapter(row)
