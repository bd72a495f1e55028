"""Owner names: one spelling per owner.

An owner (an API key's owner or an Airflow user) names its rows and its storage folder
(``<root>/<owner>/``), so names a case-insensitive filesystem or a careless comparison would
read as one (``Alice3``, ``alice3.``) must never be two owners. ``OWNER_NAME`` is an
allow-list in which no two names fold together (``fold``) and each is its own folder name.
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
    """The owner's namespace in a shared engine's prefix cache (vLLM's ``cache_salt``): one
    owner's cached prompts serve, and ``cached_tokens`` tells of, that owner's requests only."""
    return hashlib.sha256(f"llm-batch prefix cache of {owner}".encode()).hexdigest()[:32]
