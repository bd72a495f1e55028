"""Settings, read once from the environment (prefix ``LLM_BATCH_``). Each has a default under
``LLM_BATCH_HOME`` (``~/.llm-batch``), so a fresh machine runs with no configuration."""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, NoDecode, SettingsConfigDict

from llm_batch.core import owners

# The roles of Airflow's simple auth manager, least to most (docs/api.md, "Security model").
AIRFLOW_ROLES = ("viewer", "user", "op", "admin")

# The file under the home that `llm-batch up` writes the CLI's admin API key to (never a user path).
API_KEY_FILE = "api-key"


def parse_address(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) -> (host, port); ValueError naming what is wrong."""
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"not a host:port address: {text!r}")
    return host, int(port)


# Settings that are lists, given as one string in the environment, and what separates their items.
_LIST_SEPARATORS = {"local_roots": "[,:]", "allowed_buckets": "[,:]", "webhook_allowed_hosts": "[, ]",
                    "airflow_users": ","}


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LLM_BATCH_", extra="ignore")

    home: Path = Field(default_factory=lambda: Path.home() / ".llm-batch")
    # The roots local paths users name must be under (default $LLM_BATCH_HOME/data; docs/storage.md).
    local_roots: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    # Each non-admin owner names only <root>/<owner>/... and s3://<bucket>/<owner>/... (False: single tenant).
    owner_namespaces: bool = True
    # The buckets s3:// URIs users name must be in.
    allowed_buckets: Annotated[list[str], NoDecode] = Field(default_factory=list)
    s3_endpoint_url: str | None = None
    # Where job intermediates and uploaded files live (local path or s3:// prefix).
    work_uri: str = ""
    files_uri: str = ""
    database_url: str = ""
    model_registry: Path | None = None
    model_cache: Path | None = None
    # False where the api-server does not see the workers' model cache (docs/validation.md).
    check_models_at_submit: bool = True
    enforce_eager: bool = False  # vLLM without graph compilation: a faster start on CPU
    # None: in the worker's process on CPU, not on GPU (llm_batch.runtime.engine.runner says why).
    engine_in_process: bool | None = None

    # Limits of one batch.
    max_requests: int = 1_000_000
    max_input_bytes: int = 2 * 1024**3
    max_line_bytes: int = 1024**2
    max_media_bytes: int = 100 * 1024**2  # one file a transcription or OCR line names
    # Per-owner limits, admins exempt, 0 = none; owner_limits overrides them per owner (docs/api.md).
    owner_max_file_bytes: int = 20 * 1024**3
    owner_max_live_jobs: int = 1000
    owner_max_requests_in_flight: int = 10_000_000
    owner_limits: dict[str, dict[str, int]] = Field(default_factory=dict)
    max_reported_errors: int = 100  # error records `llm-batch validate` prints

    # Prefix-aware sharding (docs/data-plane.md; False: the contiguous plan).
    prefix_aware_sharding: bool = True
    prefix_feed_order: Literal["grouped", "leaders_first"] = "grouped"

    # --- Orchestration (docs/orchestration.md) ---
    shard_runner: Literal["local", "kubernetes"] = "local"
    # Kubernetes: the inference image, where pods go, the cluster's Airflow connection (None: in-cluster).
    worker_image: str = "llm-batch-worker:0.1.0"
    k8s_namespace: str = "default"
    k8s_conn_id: str | None = None
    # gpu_type -> node selector {gpu_node_label_key: value} (default: the type's own name).
    gpu_node_label_key: str = "llm-batch.io/gpu-type"
    gpu_node_label_values: dict[str, str] = Field(default_factory=dict)
    # A ReadWriteMany PVC holding downloaded checkpoints.
    model_cache_claim: str | None = "llm-batch-model-cache"
    model_cache_mount_path: str = "/models"
    storage_secret_name: str = "llm-batch-storage"  # its keys become the worker's storage credentials
    group_topology_key: str | None = None  # the node label a multi-node worker's pods share a value of
    # Job priority -> Airflow priority_weight and pod PriorityClass.
    priority_weights: dict[str, int] = Field(default_factory=lambda: {"low": 1, "normal": 10, "high": 100})
    priority_classes: dict[str, str] = Field(default_factory=dict)
    # Airflow pools cap concurrent shards: one for local workers, one per gpu_type.
    local_pool: str = "llm_batch_local"
    local_pool_slots: int = 1
    # Warm engines (docs/worker.md): long-lived local engines that take many jobs' shards in turn.
    warm_engines: bool = False
    warm_engine_idle_seconds: float = 300.0
    warm_engine_slots: int | None = None  # per model configuration on one machine; None: local_pool_slots
    warm_engine_seats: int = Field(default=2, ge=1, le=64)  # shards one warm engine steps together
    # Model configurations warm at once on one machine: a new one stops idle hosts of the others
    # beyond it (on a GPU an idle engine's KV cache leaves another no room: 1).
    warm_engine_configs: int = Field(default=1, ge=1, le=16)
    # Fork hosts from a process that imported vLLM once (llm_batch.runtime.host_starter): a
    # host's start without ~13 s of imports. False: each host a fresh interpreter.
    warm_engine_starter: bool = True
    # Engine services: {"<model>" or "<model>@<gpu_type>": "host:port"}, taking the small shards.
    engine_services: dict[str, str] = Field(default_factory=dict)
    engine_service_max_requests: int = Field(default=256, ge=0)
    engine_token: SecretStr | None = None
    gpu_pool_slots: int = 8
    # LoRA adapters (docs/models.md).
    max_lora_rank: int = Field(default=64, ge=1, le=512)
    max_loras: int = Field(default=4, ge=1, le=64)
    max_adapter_bytes: int = Field(default=512 << 20, ge=1)
    # The result cache: deterministic requests' answers served to later jobs (docs/api.md).
    result_cache: bool = True
    result_cache_shared: bool = False
    result_cache_uri: str = ""
    result_cache_max_bytes: int = Field(default=2 << 30, ge=0)
    result_cache_ttl_hours: int = Field(default=7 * 24, ge=1)
    cancel_grace_seconds: int = 60  # then a shard still running after cancel or deadline is killed
    default_max_runtime_sec: int = 86_400  # a job's deadline when its run names none
    # Retries of a failed shard attempt (each resumes from the shard's results).
    shard_retries: int = 2
    shard_retry_delay_seconds: int = 10
    retention_days: int = 30  # then housekeeping deletes input, output and error files
    recurring_specs: Path | None = None  # None: dags/recurring_specs beside the DAGs

    # --- Metrics (docs/metrics.md) ---
    metrics_token: SecretStr | None = None  # a scraper's bearer token instead of an admin key
    alert_job_stuck_s: float = 1800.0
    alert_queue_oldest_s: float = 3600.0
    alert_webhook_pending_s: float = 900.0
    alert_failed_ratio: float = 0.2
    alert_scheduler_heartbeat_s: float = 120.0

    # --- Webhooks (docs/api.md "Webhooks") ---
    # Hosts, addresses and networks webhooks may go to although not public.
    webhook_allowed_hosts: Annotated[list[str], NoDecode] = Field(default_factory=list)
    webhook_allow_public: bool = True
    webhook_timeout_s: float = 5.0  # one attempt, DNS to the receiver's status
    webhook_test_per_minute: int = 10
    webhook_test_concurrency: int = 2
    webhook_test_concurrency_total: int = 8
    webhook_retry_window_s: int = 86_400
    webhook_retry_base_s: float = 10.0
    webhook_lease_s: float = 60.0  # how long a deliverer holds a claimed row
    webhook_poll_interval_s: float = 2.0
    webhook_deliverer: bool = True  # in the api-server (False: run `llm-batch webhook deliver`)
    # The embedded stack's Airflow users beside its admin: `name:role` pairs (docs/embedded.md).
    airflow_users: Annotated[list[str], NoDecode] = Field(default_factory=list)

    @property
    def local_shard_slots(self) -> int:
        """The local pool's slots: shards at once on local engines."""
        return self.local_pool_slots * (self.warm_engine_seats if self.warm_engines else 1)

    @model_validator(mode="before")
    @classmethod
    def _lists(cls, data: dict) -> dict:
        for key, separators in _LIST_SEPARATORS.items():
            if isinstance(data.get(key), str):
                data[key] = [v.strip() for v in re.split(separators, data[key]) if v.strip()]
        for pair in data.get("airflow_users") or ():
            name, _, role = str(pair).partition(":")
            if not owners.is_canonical(name) or role.lower() not in AIRFLOW_ROLES:
                raise ValueError(f"airflow_users: {pair!r} is not name:role with an owner name ({owners.RULE}) and "
                                 f"a role of {', '.join(AIRFLOW_ROLES)}")
        return data

    @model_validator(mode="after")
    def _engine_services(self) -> Settings:
        for key, address in self.engine_services.items():
            try:
                parse_address(address)
            except ValueError as exc:
                raise ValueError(f"engine_services[{key!r}]: {exc}") from None
        return self

    @model_validator(mode="after")
    def _defaults(self) -> Settings:
        self.home = self.home.expanduser().resolve()
        if not self.local_roots:
            self.local_roots = [self.home / "data"]
        self.local_roots = [Path(p).expanduser().resolve() for p in self.local_roots]
        self.work_uri = self.work_uri or str(self.home / "work")
        self.files_uri = self.files_uri or str(self.home / "files")
        self.result_cache_uri = self.result_cache_uri or str(self.home / "result-cache")
        self.database_url = self.database_url or f"sqlite:///{self.home / 'jobs.db'}"
        self.model_cache = (self.model_cache or self.home / "models").expanduser()
        return self


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()


class _EnvironSource(EnvSettingsSource):
    """The ``LLM_BATCH_*`` variables of a given mapping, parsed as the environment's are."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]):
        self._environ = environ  # read by the base class's __init__
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:  # as DotEnvSettingsSource overrides it
        return {name.lower(): value for name, value in self._environ.items()}


class _GivenSettings(Settings):
    """Settings of the values given only (no environment, no files)."""

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: Any,
                                   **others: Any) -> tuple[Any, ...]:
        return (init_settings,)


def settings_from_env(environ: Mapping[str, str]) -> Settings:
    """The settings a process whose environment is exactly ``environ`` reads, whatever this
    process's environment holds: what a component handed ``environ`` runs with."""
    given = _GivenSettings(**_EnvironSource(Settings, environ)())
    return Settings.model_construct(given.model_fields_set, **dict(given))  # validated: a Settings again
