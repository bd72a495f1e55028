"""Owner names: one spelling per owner.

An owner is whom a job, file, key or webhook endpoint belongs to: an API key's owner or an
Airflow user. The name is the owner's row filter and its storage folder
(``<root>/<owner>/``, ``llm_batch.infra.user_paths``), so it must have exactly one spelling:
names that a case-insensitive filesystem or a careless comparison would read as one
(``Alice3``, ``alice3.``, ``alice3 ``) must never be two owners.

The rule is an allow-list, ``OWNER_NAME``: 1 to 64 characters of lower-case ASCII letters,
digits, ``-``, ``_``, ``.`` and ``@`` (e-mail-like SSO user names), starting with a letter
or digit and not ending with ``.``. No two such names fold together (``fold``), and each is
its own folder name as it is. Keys are made only for such names
(``JobStore.create_api_key``, which also refuses a name that folds to an owner already
recorded); a caller whose name is not canonical is refused (the API's ``auth.py``, a DAG
run's ``steps.register``).
"""

from __future__ import annotations

import hashlib
import re

OWNER_NAME = re.compile(r"[a-z0-9](?:[a-z0-9._@-]{0,62}[a-z0-9_@-])?")
RULE = "1-64 lower-case letters, digits, '-', '_', '.' or '@', starting with a letter or digit, not ending with '.'"


class OwnerNameRefused(ValueError):
    """A name that cannot be an owner; the message says why."""


def is_canonical(name: object) -> bool:
    return isinstance(name, str) and OWNER_NAME.fullmatch(name) is not None


def check(name: object) -> str:
    """`name` if it is an owner name, else OwnerNameRefused naming the rule."""
    if not is_canonical(name):
        raise OwnerNameRefused(f"{name!r} is not an owner name: owner names are {RULE}")
    return name  # type: ignore[return-value]


def fold(name: str) -> str:
    """The spelling-blind form two names share when they would be read as one: case
    folded, trailing dots and spaces dropped (as Windows-style filesystems do)."""
    return name.rstrip(". ").casefold()


def twin(name: str, existing: list[str]) -> str | None:
    """An owner of `existing` that is spelled differently but folds to `name`, else None."""
    return next((other for other in existing if other != name and fold(other) == fold(name)), None)


def cache_salt(owner: str) -> str:
    """The owner's namespace in a shared engine's prefix cache (vLLM's ``cache_salt``): what
    one owner's prompts left cached is reused by that owner's requests only, and
    ``cached_tokens`` tells nobody about another's prompts. Set by the server on every engine
    request of the owner's shards; a request's own ``cache_salt`` field never reaches an engine."""
    return hashlib.sha256(f"llm-batch prefix cache of {owner}".encode()).hexdigest()[:32]
