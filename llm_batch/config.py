"""Settings, read once from the environment (prefix ``LLM_BATCH_``).

Everything has an embedded default under ``LLM_BATCH_HOME`` (``~/.llm-batch``) so a fresh
machine runs with no configuration; production points the URIs at S3 and the database URL
at PostgreSQL.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from typing import Annotated


def _split(value: object) -> object:
    if isinstance(value, str):
        return [v.strip() for v in value.replace(",", ":").split(":") if v.strip()] if value else []
    return value


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LLM_BATCH_", extra="ignore")

    home: Path = Field(default_factory=lambda: Path.home() / ".llm-batch")
    # Local paths users may name are confined to these roots (colon or comma separated).
    local_roots: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    # s3:// URIs users may name are confined to these buckets.
    allowed_buckets: Annotated[list[str], NoDecode] = Field(default_factory=list)
    s3_endpoint_url: str | None = None
    # Where job intermediates and uploaded files live (local path or s3:// prefix).
    work_uri: str = ""
    files_uri: str = ""
    database_url: str = ""
    model_registry: Path | None = None
    model_cache: Path | None = None

    # Limits of one batch.
    max_requests: int = 1_000_000
    max_input_bytes: int = 2 * 1024**3
    max_line_bytes: int = 1024**2
    # How many error records `llm-batch validate` prints (counts are never capped).
    max_reported_errors: int = 100

    @model_validator(mode="before")
    @classmethod
    def _lists(cls, data: dict) -> dict:
        for key in ("local_roots", "allowed_buckets"):
            if key in data:
                data[key] = _split(data[key])
        return data

    @model_validator(mode="after")
    def _defaults(self) -> Settings:
        self.home = self.home.expanduser().resolve()
        if not self.local_roots:
            self.local_roots = [self.home]
        self.local_roots = [Path(p).expanduser().resolve() for p in self.local_roots]
        self.work_uri = self.work_uri or str(self.home / "work")
        self.files_uri = self.files_uri or str(self.home / "files")
        self.database_url = self.database_url or f"sqlite:///{self.home / 'jobs.db'}"
        self.model_cache = (self.model_cache or self.home / "models").expanduser()
        return self


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
