"""Settings, read once from the environment (prefix ``LLM_BATCH_``).

Everything has an embedded default under ``LLM_BATCH_HOME`` (``~/.llm-batch``) so a fresh
machine runs with no configuration; production points the URIs at S3 and the database URL
at PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, NoDecode, SettingsConfigDict

from llm_batch.core import owners

# The roles of Airflow's simple auth manager, least to most (docs/api.md, "Security model").
AIRFLOW_ROLES = ("viewer", "user", "op", "admin")

# The file under the home the CLI reads its admin API key from (beside the job store it is
# valid for); `llm-batch up` writes it, and it is never a user path.
API_KEY_FILE = "api-key"


def parse_address(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) -> (host, port); ValueError naming what is wrong.
    (An engine service's address: a setting, and what ``engine-host --listen`` takes.)"""
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"not a host:port address: {text!r}")
    return host, int(port)


def _split(value: object) -> object:
    if isinstance(value, str):
        return [v.strip() for v in value.replace(",", ":").split(":") if v.strip()] if value else []
    return value


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LLM_BATCH_", extra="ignore")

    home: Path = Field(default_factory=lambda: Path.home() / ".llm-batch")
    # Local paths users may name are confined to these roots (colon or comma separated);
    # default $LLM_BATCH_HOME/data, which holds no internal state (llm_batch.infra.user_paths).
    local_roots: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    # Each non-admin owner names only <root>/<owner>/... and s3://<bucket>/<owner>/...;
    # False: one namespace for all (a single-tenant deployment).
    owner_namespaces: bool = True
    # s3:// URIs users may name are confined to these buckets.
    allowed_buckets: Annotated[list[str], NoDecode] = Field(default_factory=list)
    s3_endpoint_url: str | None = None
    # Where job intermediates and uploaded files live (local path or s3:// prefix).
    work_uri: str = ""
    files_uri: str = ""
    database_url: str = ""
    model_registry: Path | None = None
    model_cache: Path | None = None
    # The API refuses a job whose registered model is not prepared in model_cache, and engine
    # arguments its checkpoint's config.json rules out (llm_batch.infra.model_registry.
    # submission_problems). False where the api-server does not see the workers' model cache
    # (the Celery shape's workers, Kubernetes pods with their own volume).
    check_models_at_submit: bool = True
    # vLLM without graph compilation: ~20 s start instead of ~60 s on CPU (tests, CI, embedded).
    enforce_eager: bool = False
    # Run vLLM's engine core inside the worker's process (None: yes on CPU, no on GPU).
    # See llm_batch.runtime.engine.runner.engine_in_process for why.
    engine_in_process: bool | None = None

    # Limits of one batch.
    max_requests: int = 1_000_000
    max_input_bytes: int = 2 * 1024**3
    max_line_bytes: int = 1024**2
    # One audio or image file a /v1/audio/transcriptions or /v1/ocr line names (llm_batch.infra.media).
    max_media_bytes: int = 100 * 1024**2
    # Per-owner limits (admins exempt; 0 = none): bytes of stored uploaded files, jobs not
    # yet ended, requests of those jobs. OWNER_LIMITS overrides them per owner (JSON:
    # {"alice": {"max_live_jobs": 50}}). Exceeding one answers 429 naming it.
    owner_max_file_bytes: int = 20 * 1024**3
    owner_max_live_jobs: int = 1000
    owner_max_requests_in_flight: int = 10_000_000
    owner_limits: dict[str, dict[str, int]] = Field(default_factory=dict)
    # How many error records `llm-batch validate` prints (counts are never capped).
    max_reported_errors: int = 100

    # --- Prefix-aware sharding (src/llm_batch/pipeline/sharding.py, docs/data-plane.md) ---
    # Requests whose prompts share their first characters go to one shard, and each shard
    # feeds them to vLLM together, so its prefix cache serves the siblings.
    # False: the contiguous plan, requests fed in file order.
    prefix_aware_sharding: bool = True
    # Within a shard: "grouped" feeds a prefix group's requests one after another;
    # "leaders_first" feeds one request per group first, the siblings after.
    prefix_feed_order: Literal["grouped", "leaders_first"] = "grouped"

    # --- Orchestration: the batch DAG, shard runners, housekeeping (dags/, src/llm_batch/airflow/operators/) ---
    # Which operator runs a shard: a local subprocess (embedded) or a GPU pod (production).
    shard_runner: Literal["local", "kubernetes"] = "local"
    # Kubernetes: the inference image (its entrypoint is `llm-batch`), where pods go, and
    # the Airflow connection to the cluster (None: in-cluster or KUBECONFIG).
    worker_image: str = "llm-batch-worker:0.1.0"
    k8s_namespace: str = "default"
    k8s_conn_id: str | None = None
    # gpu_type -> node selector {gpu_node_label_key: value}; a type missing from the map
    # uses its own name as the value (JSON in the environment).
    gpu_node_label_key: str = "llm-batch.io/gpu-type"
    gpu_node_label_values: dict[str, str] = Field(default_factory=dict)
    # A ReadWriteMany PVC holding downloaded checkpoints, mounted at model_cache_mount_path.
    model_cache_claim: str | None = "llm-batch-model-cache"
    model_cache_mount_path: str = "/models"
    # Secret whose keys (AWS_ACCESS_KEY_ID, ...) become the worker's storage credentials.
    storage_secret_name: str = "llm-batch-storage"
    # A multi-node worker's pods all in one domain of this node label (e.g. a rack or a
    # network block: pipeline stages talk every step), one group per domain: the LWS
    # exclusive-topology annotation. None: anywhere the scheduler puts them.
    group_topology_key: str | None = None
    # Job priority (a free string in the Scale contract) -> Airflow priority_weight and
    # pod PriorityClass; unknown names get the "normal" weight and no class.
    priority_weights: dict[str, int] = Field(
        default_factory=lambda: {"low": 1, "normal": 10, "high": 100}
    )
    priority_classes: dict[str, str] = Field(default_factory=dict)
    # Airflow pools cap concurrent shards: one for local workers, one per gpu_type.
    # local_pool_slots: local engines at once (with warm engines, each runs
    # warm_engine_seats shards: local_shard_slots).
    local_pool: str = "llm_batch_local"
    local_pool_slots: int = 1
    # Local shards run on warm engines (llm_batch.runtime.warm_engines): one long-lived engine process
    # per model and pool slot on each machine takes the shards of many jobs in turn, so a
    # small job pays no engine start. Off by default, on by default on the embedded stack
    # (devstack.stack.Stack.create): an idle warm engine keeps its memory (on a GPU, the KV
    # cache a dedicated engine would need) for warm_engine_idle_seconds.
    warm_engines: bool = False
    warm_engine_idle_seconds: float = 300.0
    # Warm engines per model configuration on one machine (each runs one shard at a time);
    # None: local_pool_slots (one machine: the pool's slots are its engines). The Celery shape
    # sets 1 per worker and lets a second task wait for it, so the engine never waits on
    # Airflow's dispatch of the next shard (docs/production-shape.md).
    warm_engine_slots: int | None = None
    # Shards one warm engine runs at once, stepped together in its continuous batch (so a
    # one-request shard does not hold an engine alone, and the next shard's task starts
    # while one runs); with warm engines the local pool has local_pool_slots x this many
    # slots. 2: 100 one-request jobs ended in 135-152 s, not 175-182 (docs/benchmarks.md).
    warm_engine_seats: int = Field(default=2, ge=1, le=64)
    # Engine services (llm_batch.runtime.engine_service; the Kubernetes runner): long-lived engines,
    # a Deployment per model and GPU type, that take the small shards of many jobs instead of
    # a pod each. JSON: {"<model>": "host:port", "<model>@<gpu_type>": "host:port"}; the more
    # specific entry wins. A shard goes to its model's service when it has at most
    # engine_service_max_requests requests and one node; bigger shards still get pods.
    engine_services: dict[str, str] = Field(default_factory=dict)
    engine_service_max_requests: int = Field(default=256, ge=0)
    # The services' shared secret (a Secret in the Deployment and the Airflow workers' env).
    engine_token: SecretStr | None = None
    gpu_pool_slots: int = 8
    # LoRA adapters (llm_batch.infra.adapters): the highest rank admitted (registered or
    # uploaded), the adapters one engine holds at once (a shard needing more swaps them),
    # and the size of an uploaded adapter's weights.
    max_lora_rank: int = Field(default=64, ge=1, le=512)
    max_loras: int = Field(default=4, ge=1, le=64)
    max_adapter_bytes: int = Field(default=512 << 20, ge=1)
    # The result cache (llm_batch.pipeline.result_cache): answers of deterministic requests
    # served to the same owner's later jobs; where its entries live (local path or s3://
    # prefix; default $LLM_BATCH_HOME/result-cache), their total size and their age at most.
    result_cache: bool = True
    # One cache for every owner (a single-tenant deployment); by default each owner's own.
    result_cache_shared: bool = False
    result_cache_uri: str = ""
    result_cache_max_bytes: int = Field(default=2 << 30, ge=0)
    result_cache_ttl_hours: int = Field(default=7 * 24, ge=1)
    # A shard that has not stopped this long after cancel / deadline is killed.
    cancel_grace_seconds: int = 60
    # Job deadline when a run names none (the Scale contract: one day).
    default_max_runtime_sec: int = 86_400
    # Retries of a failed shard attempt (each resumes from the shard's results).
    shard_retries: int = 2
    shard_retry_delay_seconds: int = 10
    # Input, output and error files older than this are deleted by housekeeping.
    retention_days: int = 30
    # Folder of recurring batch specs (YAML); None: dags/recurring_specs beside the DAGs.
    recurring_specs: Path | None = None

    # --- Metrics: GET /batch/metrics (src/llm_batch/api/routers/metrics.py, docs/metrics.md) ---
    # A token a scraper sends as "Authorization: Bearer <token>" instead of an admin key; None:
    # admins only. Compared in constant time; give it 32 random characters or more.
    metrics_token: SecretStr | None = None
    # Thresholds of the alert rules (deploy/monitoring/alerts.yml reads them from the metrics,
    # so one rules file serves every deployment): a live job still this long (not waiting
    # in a queue); a job waiting this long for a slot; the oldest pending webhook delivery;
    # the failed share of the requests ended in the last 30 min; the scheduler's heartbeat age.
    alert_job_stuck_s: float = 1800.0
    alert_queue_oldest_s: float = 3600.0
    alert_webhook_pending_s: float = 900.0
    alert_failed_ratio: float = 0.2
    alert_scheduler_heartbeat_s: float = 120.0

    # --- Webhooks: signed job-end events (src/llm_batch/infra/webhooks.py, docs/api.md "Webhooks") ---
    # Hosts, addresses and networks (comma separated: hooks.internal, 10.0.0.5, 10.1.0.0/16,
    # 127.0.0.1) webhooks may go to although they are not public: only globally routable
    # unicast addresses are allowed otherwise (src/llm_batch/infra/webhook_destinations.py), checked at
    # create and again at each delivery after DNS resolution.
    webhook_allowed_hosts: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # False: only the allowed hosts above, no public address either.
    webhook_allow_public: bool = True
    # The whole of one attempt: DNS, connect, send, the receiver's status (its body is not read).
    webhook_timeout_s: float = 5.0
    # Test events (POST .../test) of one owner: at most this many a minute, this many at once;
    # and this many at once in one api-server process. Past any of them: 429 with Retry-After.
    webhook_test_per_minute: int = 10
    webhook_test_concurrency: int = 2
    webhook_test_concurrency_total: int = 8
    # A job-end event is retried with exponential backoff (from base, capped at an hour) for this long.
    webhook_retry_window_s: int = 86_400
    webhook_retry_base_s: float = 10.0
    # How long a deliverer holds a claimed row (another takes it over after that).
    webhook_lease_s: float = 60.0
    webhook_poll_interval_s: float = 2.0
    # Run the delivery thread in the api-server (False: run `llm-batch webhook deliver`).
    webhook_deliverer: bool = True
    # The embedded stack's Airflow users beside its admin (Airflow's simple auth manager):
    # `name:role` pairs, comma separated, role viewer, user, op or admin; names are owner
    # names (a user's runs are her jobs). Airflow writes their passwords to
    # $LLM_BATCH_HOME/airflow/passwords.json when its api-server starts.
    airflow_users: Annotated[list[str], NoDecode] = Field(default_factory=list)

    @property
    def local_shard_slots(self) -> int:
        """The local pool's slots: shards at once on local engines."""
        return self.local_pool_slots * (self.warm_engine_seats if self.warm_engines else 1)

    @model_validator(mode="before")
    @classmethod
    def _webhook_hosts(cls, data: dict) -> dict:
        value = data.get("webhook_allowed_hosts") if isinstance(data, dict) else None
        if isinstance(value, str):
            data["webhook_allowed_hosts"] = [v.strip() for v in value.replace(" ", ",").split(",") if v.strip()]
        return data

    @model_validator(mode="before")
    @classmethod
    def _airflow_users(cls, data: dict) -> dict:
        if not isinstance(data, dict) or not data.get("airflow_users"):
            return data
        if isinstance(data["airflow_users"], str):
            data["airflow_users"] = [v.strip() for v in data["airflow_users"].split(",") if v.strip()]
        for pair in data["airflow_users"]:
            name, _, role = str(pair).partition(":")
            if not owners.is_canonical(name) or role.lower() not in AIRFLOW_ROLES:
                raise ValueError(f"airflow_users: {pair!r} is not name:role with an owner name ({owners.RULE}) and "
                                 f"a role of {', '.join(AIRFLOW_ROLES)}")
        return data

    @model_validator(mode="before")
    @classmethod
    def _lists(cls, data: dict) -> dict:
        for key in ("local_roots", "allowed_buckets"):
            if key in data:
                data[key] = _split(data[key])
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
