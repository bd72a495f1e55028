"""Which model a batch line (its ``body.model``) runs on: the job's base model or one of its
LoRA adapters. A name outside the job's ``ModelChoice`` is that line's error at validation."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

# A registered or uploaded adapter's name: what a line's body.model gives.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class ModelRefused(ValueError):
    """A line names a model its job cannot run (its message says which names it may give)."""


@dataclass(frozen=True)
class ModelChoice:
    """The names lines of one job may give (``names``: name -> adapter, None for the base
    model), the adapter of a line that names none (``default``), the base model's name as
    results say it (``base``), and where the owner's own adapters are (``locations``: URIs)."""

    base: str
    names: Mapping[str, str | None] = field(default_factory=dict)
    default: str | None = None
    locations: Mapping[str, str] = field(default_factory=dict)

    def adapter_of(self, named: object) -> str | None:
        """The adapter a line naming ``named`` (its body.model; None: not given) runs on."""
        if named is None:
            return self.default
        if isinstance(named, str) and named in self.names:
            return self.names[named]
        adapters = sorted(name for name, adapter in self.names.items() if adapter)
        usable = f"; its adapters you may use: {', '.join(adapters)}" if adapters else " (it has no adapter you may use)"
        shown = repr(named[:80]) if isinstance(named, str) else type(named).__name__
        raise ModelRefused(f"model {shown} is not this job's model {self.base!r}{usable}")

    @property
    def adapters(self) -> list[str]:
        return sorted({adapter for adapter in self.names.values() if adapter})
