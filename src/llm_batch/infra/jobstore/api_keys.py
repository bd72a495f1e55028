"""API keys: who may call the API, as which owner, admin or not (the ``api_keys`` table).

A key's plaintext is shown once and never kept: the store holds its sha256 (compared in
constant time) and its first characters to find the row. A new key's owner must not fold to
another owner's name (``owner_names``: every owner the store records).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets
import uuid

from sqlalchemy import select

from llm_batch.core import owners
from llm_batch.core.snapshots import ApiKey
from llm_batch.infra.jobstore.errors import ApiKeyNotFound
from llm_batch.infra.jobstore.models import API_KEYS, ENDPOINTS, FILES, JOBS
from llm_batch.infra.jobstore.paging import matching
from llm_batch.infra.jobstore.repository import Repository, from_row, utcnow

API_KEY_PREFIX = "lbk_"
_API_KEY_LOOKUP_CHARS = 12  # stored in clear: finds the row, reveals nothing useful
# The columns of a snapshot (a key's sha256 never leaves the store).
_API_KEY_COLUMNS = [API_KEYS.c[f.name] for f in dataclasses.fields(ApiKey)]
_api_key = from_row(ApiKey)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


class ApiKeyRepository(Repository):
    def create_api_key(self, owner: str, name: str, is_admin: bool = False) -> tuple[ApiKey, str]:
        """A new key for `owner`: its record and its plaintext (show it once). `owner` must be
        an owner name that folds to no other owner already recorded (OwnerNameRefused)."""
        owners.check(owner)
        if (other := owners.twin(owner, self.owner_names())) is not None:
            raise owners.OwnerNameRefused(
                f"owner {owner!r} would be read as the existing owner {other!r} (names that differ only in case "
                "or trailing dots are one owner): use a name of its own"
            )
        plaintext = API_KEY_PREFIX + secrets.token_urlsafe(32)
        values = dict(id=f"key_{uuid.uuid4().hex}", owner=owner, name=name, prefix=plaintext[:_API_KEY_LOOKUP_CHARS],
                      sha256=_sha256(plaintext), is_admin=is_admin, created_at=utcnow())
        return _api_key(self._insert(API_KEYS, values, _API_KEY_COLUMNS)), plaintext

    def owner_names(self) -> list[str]:
        """Every owner the store records (of keys, jobs, files, webhook endpoints)."""
        tables = (API_KEYS, JOBS, FILES, ENDPOINTS)
        with self._transaction(write=False) as connection:
            return sorted({name for table in tables for name in connection.scalars(select(table.c.owner).distinct())})

    def identify_api_key(self, plaintext: str) -> ApiKey | None:
        """The live (not revoked) key whose secret is `plaintext`, else None."""
        digest = _sha256(plaintext)
        query = select(*_API_KEY_COLUMNS, API_KEYS.c.sha256).where(
            API_KEYS.c.prefix == plaintext[:_API_KEY_LOOKUP_CHARS], API_KEYS.c.revoked_at.is_(None)
        )
        with self._transaction(write=False) as connection:
            for row in connection.execute(query).all():
                if hmac.compare_digest(row.sha256, digest):
                    return ApiKey(**{name: value for name, value in row._asdict().items() if name != "sha256"})
            return None

    def authenticate_api_key(self, plaintext: str) -> str | None:
        """The owner of the live key `plaintext`, or None."""
        key = self.identify_api_key(plaintext)
        return key.owner if key else None

    def revoke_api_key(self, key_id: str, owner: str | None = None) -> ApiKey:
        """Revoke the key (once; repeating is harmless)."""
        missing = ApiKeyNotFound(f"no API key {key_id!r}")
        return _api_key(self._stamp_once(API_KEYS, "revoked_at", key_id, owner, _API_KEY_COLUMNS, missing))

    def list_api_keys(self, owner: str | None = None, include_revoked: bool = False) -> list[ApiKey]:
        filters = matching(API_KEYS, owner=owner)
        if not include_revoked:
            filters.append(API_KEYS.c.revoked_at.is_(None))
        return self._read_all(select(*_API_KEY_COLUMNS).where(*filters).order_by(API_KEYS.c.created_at), _api_key)
