"""Run one shard: read its requests, run them on vLLM in-process, write ordered results.

``run_worker(config) -> exit code`` (``llm_batch.core.exit_codes``) is the whole contract:
USAGE before anything loads when the shard cannot run as asked; a rerun skips the requests
that already have results (each result written exactly once); cancel and deadline, checked
between engine steps, flush what is finished and return CANCELLED / DEADLINE; any other error
returns FAILED. vLLM is imported only when a shard runs.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, Any, Protocol

import orjson
from pydantic import ValidationError

from llm_batch.core import exit_codes
from llm_batch.core.config import get_settings
from llm_batch.core.endpoints import Endpoint, UnsupportedEndpointError, parse_endpoint, serving_problem
from llm_batch.core.job_spec import JobOptions, spec_problem
from llm_batch.core.layout import JobLayout
from llm_batch.core.records import BatchRequest, ResultRecord
from llm_batch.infra import storage
from llm_batch.infra.progress import ProgressReporter, ShardProgress, ShardState, read_progress
from llm_batch.infra.results import ResultsWriter, read_results
from llm_batch.runtime.engine import StopReason
from llm_batch.runtime.multinode import DEFAULT_MASTER_PORT, NodeGroup, NodeGroupError

if TYPE_CHECKING:
    from vllm import LLM

    from llm_batch.infra.adapters import ResolvedAdapter
    from llm_batch.infra.model_resolution import ResolvedModel
    from llm_batch.runtime.engine.responses import Usage

log = logging.getLogger("llm_batch.runtime.worker")


class WorkerUsageError(ValueError):
    """Bad arguments or configuration: the shard cannot run as asked, retrying won't help."""


@dataclass
class WorkerConfig:
    """Everything one shard run needs (see ``llm_batch.runtime.worker_args`` for the flags)."""

    job_id: str
    shard: int
    requests: str
    results: str
    endpoint: Endpoint
    model_config: dict[str, Any]
    progress: str | None = None
    cancel_marker: str | None = None
    deadline: float | None = None  # epoch seconds
    # The job's options (its /v1/moderations results' shape, its checked outputs, ...).
    options: JobOptions = dataclasses.field(default_factory=JobOptions)
    cache_salt: str | None = None  # the owner's prefix-cache namespace on a shared engine
    window: int | None = None  # requests between fed and written; default 4 x max_num_seqs
    flush_every_s: float = 2.0
    flush_every_records: int = 1000
    # How long results may fail to reach storage (kept buffered meanwhile) before the shard
    # fails and its retry resumes from the last published part: rides out an S3 restart.
    storage_outage_s: float = 300.0
    progress_interval_s: float = 2.0
    cancel_check_s: float = 1.0
    node_group: NodeGroup | None = None  # the leader's place in a multi-node worker
    hold_marker: str | None = None  # a fault drill's hold point (HoldPoint); default the job layout's


class EngineSource(Protocol):
    """Where a shard's engine comes from, and goes back to."""

    def get(self, model: ResolvedModel) -> LLM: ...

    def release(self, llm: LLM, healthy: bool) -> None: ...


class DedicatedEngine:
    """An engine started for the shard and stopped after it."""

    def get(self, model: ResolvedModel) -> LLM:
        from llm_batch.runtime.engine.runner import start_engine  # vllm

        return start_engine(model)

    def release(self, llm: LLM, healthy: bool) -> None:
        from llm_batch.runtime.engine.runner import stop_engine  # vllm

        stop_engine(llm)


def run_worker(config: WorkerConfig, engines: EngineSource | None = None,
               supervisor_gone: Callable[[], bool] | None = None) -> int:
    """Run the shard; ``supervisor_gone`` stops it as FAILED when the task that asked has gone."""
    try:
        model = resolve_for_endpoint(config.model_config, config.endpoint)
        if config.node_group is not None:
            model = config.node_group.model_for_node(model)
        writer = ResultsWriter.open(
            config.results,
            flush_every_s=config.flush_every_s,
            flush_every_records=config.flush_every_records,
            outage_s=config.storage_outage_s,
        )
        total, adapter_names = scan_requests(config.requests)
        adapters = resolve_shard_adapters(adapter_names)
        model = with_adapters(model, adapters, shared=not isinstance(engines or DedicatedEngine(), DedicatedEngine))
        earlier = _earlier_attempts(config) if writer.done else ShardProgress(
            job_id=config.job_id, shard=config.shard, total=total)
    except (WorkerUsageError, NodeGroupError, storage.PathNotAllowed, storage.ObjectNotFound) as exc:
        log.error("shard %d of job %s cannot run: %s", config.shard, config.job_id, exc)
        return exit_codes.USAGE
    except storage.StorageError as exc:  # unreachable or failing storage: worth a retry
        log.error("shard %d of job %s: storage failed: %s", config.shard, config.job_id, exc)
        return exit_codes.FAILED

    # A resumed attempt reports its earlier results (and their tokens, and the earlier
    # engines' time) too, so live counts never go back.
    progress = ProgressReporter(
        config.progress,
        earlier.model_copy(update={"total": total, "done": writer.done, "resumed": writer.done,
                                   "failed": writer.done - earlier.succeeded}),
        interval=config.progress_interval_s,
    )
    monitor = StopMonitor(config, progress, writer, supervisor_gone=supervisor_gone)
    with writer:
        return _run(config, model, writer, progress, monitor, engines or DedicatedEngine(), adapters)


def _earlier_attempts(config: WorkerConfig) -> ShardProgress:
    """The successes, tokens and engine seconds of earlier attempts."""
    earlier = ShardProgress(job_id=config.job_id, shard=config.shard, total=0)
    for record in read_results(config.results):
        earlier.succeeded += record.ok
        usage = (record.body or {}).get("usage") or {}
        # chat/completions names, else the Responses API's (input/output tokens)
        earlier.prompt_tokens += int(usage.get("prompt_tokens") or usage.get("input_tokens") or 0)
        earlier.completion_tokens += int(usage.get("completion_tokens") or usage.get("output_tokens") or 0)
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
        earlier.cached_prompt_tokens += int(details.get("cached_tokens") or 0)
    if config.progress:
        with suppress(storage.StorageError, ValueError):
            earlier.engine_seconds = read_progress(config.progress).engine_seconds
    return earlier


def _run(config: WorkerConfig, model: ResolvedModel, writer: ResultsWriter,
         progress: ProgressReporter, monitor: StopMonitor, engines: EngineSource,
         adapters: list[ResolvedAdapter] | None = None) -> int:
    if writer.done >= progress.progress.total:
        log.info("shard %d of job %s: all %d requests already have results",
                 config.shard, config.job_id, writer.done)
        progress.publish(ShardState.DONE)
        return exit_codes.DONE
    if (reason := monitor.check_now()) is not None:
        return _finish(writer, progress, *_STOPPED[reason])
    progress.publish(ShardState.STARTING)

    def emit(record: ResultRecord, usage: Usage) -> None:
        writer.write(record)
        progress.record(record.ok, usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens or 0)

    llm = None
    healthy = True
    try:
        from llm_batch.runtime.engine.runner import EngineRunner, ModelCannotServe  # vllm

        llm = engines.get(model)
        try:
            runner = EngineRunner(llm, config.endpoint, model.name, model.response_role, config.window,
                                  serving=model.serving, labels=model.labels,
                                  moderation_shape=config.options.moderation_shape, adapters=adapters or (),
                                  output_check=config.options.output_check, cache_salt=config.cache_salt)
        except ModelCannotServe as exc:
            raise WorkerUsageError(str(exc)) from None
        progress.start_running()
        defaults = config.options.sampling_defaults
        requests = read_requests(config.requests, skip=writer.done,
                                 defaults=defaults.model_dump(exclude_none=True) if defaults else None)
        reason = runner.run(requests, emit, monitor)
        progress.stop_running()
    except WorkerUsageError as exc:
        log.error("shard %d of job %s: %s", config.shard, config.job_id, exc)
        return _finish(writer, progress, ShardState.FAILED, exit_codes.USAGE)
    except Exception:
        # Results finished so far are complete and in order: keep them for the rerun.
        log.exception("shard %d of job %s failed", config.shard, config.job_id)
        healthy = False
        return _finish(writer, progress, ShardState.FAILED, exit_codes.FAILED)
    finally:
        if llm is not None:
            engines.release(llm, healthy)
    if reason is not None:
        return _finish(writer, progress, *_STOPPED[reason])
    return _finish(writer, progress, ShardState.DONE, exit_codes.DONE)


# How a stopped shard ends: its progress state and exit code.
_STOPPED = {
    StopReason.ABANDONED: (ShardState.FAILED, exit_codes.FAILED),
    StopReason.CANCELLED: (ShardState.CANCELLED, exit_codes.CANCELLED),
    StopReason.DEADLINE: (ShardState.DEADLINE, exit_codes.DEADLINE),
}


def _finish(writer: ResultsWriter, progress: ProgressReporter, state: ShardState, code: int) -> int:
    """Flush the finished results, then publish the final progress (what it counts is durable)."""
    writer.flush()
    progress.publish(state)
    return code


class HoldPoint:
    """A fault drill's hold point: while the marker (JSON ``{"after_results": N}``) exists, a
    shard's first attempt waits once N results are checkpointed, so a kill or a deadline lands
    mid-shard on any machine's speed. A resumed attempt never holds. It is looked at between
    engine steps while requests remain: requests that all end in one step end the shard unheld,
    so a drill gives its requests lengths apart."""

    def __init__(self, marker: str | None, first_attempt: bool, poll_s: float = 0.2):
        self.marker = marker if first_attempt else None
        self.poll_s = poll_s
        self.after: int | None = None
        self.look()

    def look(self) -> None:
        """Find a marker written since (its read failing: none yet)."""
        if self.marker and self.after is None:
            with suppress(storage.StorageError):
                self.after = self.read()

    def read(self) -> int | None:
        """The marker's N, None when it is gone or unreadable."""
        if not storage.exists(self.marker):
            return None
        try:
            return int(orjson.loads(storage.read_bytes(self.marker))["after_results"])
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("hold marker %s unreadable, ignored: %s", self.marker, exc)
            return None

    def due(self, done: int) -> bool:
        return self.after is not None and done >= self.after


class StopMonitor:
    """Called between engine steps: checkpoints (flush, then progress, so what progress counts
    is durable) and says whether to stop."""

    def __init__(self, config: WorkerConfig, progress: ProgressReporter,
                 writer: ResultsWriter | None = None, clock=time.monotonic, wall_clock=time.time,
                 supervisor_gone: Callable[[], bool] | None = None):
        self.config = config
        self.supervisor_gone = supervisor_gone
        self.progress = progress
        self.writer = writer
        self._clock = clock
        self._wall_clock = wall_clock
        self._next_marker_check = 0.0
        self.hold = HoldPoint(config.hold_marker, first_attempt=writer is None or writer.done == 0)

    def check_now(self) -> StopReason | None:
        self._next_marker_check = 0.0
        return self._reason()

    def __call__(self) -> StopReason | None:
        if self.progress.due:
            self._checkpoint()
            self.hold.look()
        if self.writer is not None and self.hold.due(self.writer.done):
            return self._held()
        return self._reason()

    def _checkpoint(self) -> None:
        if self.writer is not None:
            self.writer.flush()
        self.progress.publish()

    def _held(self) -> StopReason | None:
        """Wait at the hold point (checkpointed first) until it is released or a stop comes."""
        self._checkpoint()
        log.warning("shard %d held after %d results (fault drill: %s)", self.config.shard,
                    self.writer.done, self.hold.marker)
        while (reason := self.check_now()) is None:
            if self.progress.due:  # what a storage outage kept buffered goes out once it is back
                self._checkpoint()
            with suppress(storage.StorageError):  # storage cannot say: still held
                self.hold.after = self.hold.read()
                if not self.hold.due(self.writer.done):
                    log.warning("shard %d released (next hold: %s)", self.config.shard, self.hold.after)
                    return None
            time.sleep(self.hold.poll_s)
        return reason

    def _reason(self) -> StopReason | None:
        if self.supervisor_gone is not None and self.supervisor_gone():
            log.warning("the task running shard %d has gone: stopping it", self.config.shard)
            return StopReason.ABANDONED
        if self.config.deadline is not None and self._wall_clock() >= self.config.deadline:
            log.warning("deadline passed: stopping shard %d", self.config.shard)
            return StopReason.DEADLINE
        marker = self.config.cancel_marker
        now = self._clock()
        if marker and now >= self._next_marker_check:
            self._next_marker_check = now + self.config.cancel_check_s
            try:
                if storage.exists(marker):
                    log.warning("cancel marker %s found: stopping shard %d", marker, self.config.shard)
                    return StopReason.CANCELLED
            except storage.StorageError as exc:
                log.warning("could not check the cancel marker: %s", exc)
        return None


def resolve_for_endpoint(model_config: dict[str, Any], endpoint: Endpoint) -> ResolvedModel:
    """The model to load, checked to serve ``endpoint``; WorkerUsageError otherwise."""
    from llm_batch.core.model_config import ModelError  # heavy
    from llm_batch.infra.model_resolution import resolve_model  # heavy

    try:
        model = resolve_model(model_config)
    except ModelError as exc:
        raise WorkerUsageError(str(exc)) from None
    if (problem := serving_problem(endpoint, model.name, model.task, model.features)) is not None:
        raise WorkerUsageError(problem)
    return model


def _request_lines(uri: str) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line) of the non-blank lines of a shard's requests file."""
    with storage.open_read(uri) as stream:
        for number, line in enumerate(storage.iter_lines(stream), start=1):
            if line.strip():
                yield number, line


def scan_requests(uri: str) -> tuple[int, dict[str, str | None]]:
    """The shard's size and its lines' adapters (name -> an owner's adapter's URI or None)."""
    count, adapters = 0, {}
    for _, line in _request_lines(uri):
        count += 1
        if b'"adapter"' in line:
            record = orjson.loads(line)
            if adapter := record.get("adapter"):
                adapters[adapter] = record.get("adapter_uri")
    return count, adapters


def resolve_shard_adapters(names: dict[str, str | None]) -> list[ResolvedAdapter]:
    """The shard's adapters as the engine loads them (WorkerUsageError: not worth a retry)."""
    if not names:
        return []
    from llm_batch.core.model_config import ModelError  # heavy
    from llm_batch.infra.adapters import resolve_adapters  # heavy

    try:
        return resolve_adapters(names, {name: uri for name, uri in names.items() if uri})
    except ModelError as exc:
        raise WorkerUsageError(str(exc)) from None


def with_adapters(model: ResolvedModel, adapters: list[ResolvedAdapter], shared: bool = False) -> ResolvedModel:
    """``model`` with LoRA on for ``adapters``; a ``shared`` (warm) engine takes the deployment's
    limits, so every adapter shard of one base finds it again. The job's engine_args win."""
    if not adapters:
        return model
    if shared:
        return shared_lora(model)
    from llm_batch.infra.adapters import engine_rank  # heavy

    settings = get_settings()
    at_once = min(len(adapters), settings.max_loras)
    lora = {"enable_lora": True, "max_loras": at_once, "max_cpu_loras": max(at_once, len(adapters)),
            "max_lora_rank": engine_rank(a.rank for a in adapters)}
    return dataclasses.replace(model, engine_args={**lora, **model.engine_args})


def shared_lora(model: ResolvedModel) -> ResolvedModel:
    """``model`` with LoRA on as a shared (warm) engine has it, whatever its shard's adapters."""
    from llm_batch.infra.adapters import engine_rank  # heavy

    settings = get_settings()
    lora = {"enable_lora": True, "max_loras": settings.max_loras, "max_lora_rank": engine_rank([settings.max_lora_rank])}
    return dataclasses.replace(model, engine_args={**lora, **model.engine_args})


def read_requests(uri: str, skip: int = 0, defaults: dict[str, Any] | None = None) -> Iterator[BatchRequest]:
    """The shard's requests after the first ``skip``, with the sampling `defaults` they omit."""
    for number, line in islice(_request_lines(uri), skip, None):
        try:
            request = BatchRequest.model_validate_json(line)
        except ValueError as exc:
            # The shard file is written by our own pipeline: a bad line is a broken file.
            raise WorkerUsageError(f"{uri}: line {number} is not a BatchRequest: {exc}") from None
        yield request.model_copy(update={"body": defaults | request.body}) if defaults else request


def parse_config(
    *,
    job_id: str | None,
    shard: int | str | None,
    requests: str | None,
    results: str | None,
    endpoint: str | None,
    model_config: str | dict[str, Any] | None,
    progress: str | None = None,
    cancel_marker: str | None = None,
    deadline: float | str | None = None,
    work_uri: str | None = None,
    options: str | None = None,
    cache_salt: str | None = None,
    nnodes: int | str | None = None,
    master_addr: str | None = None,
    master_port: int | str | None = None,
    gpus_per_node: int | str | None = None,
    **tuning: Any,
) -> WorkerConfig:
    """A WorkerConfig from flag/env strings (URIs left out: the job layout's), or
    WorkerUsageError naming the bad value."""
    if not job_id:
        raise WorkerUsageError("--job-id is required")
    try:
        shard_index = int(shard) if shard is not None else -1
    except ValueError:
        raise WorkerUsageError(f"--shard: not an integer: {shard!r}") from None
    if shard_index < 0:
        raise WorkerUsageError("--shard is required (a shard index >= 0)")
    if not endpoint:
        raise WorkerUsageError("--endpoint is required")
    try:
        parsed_endpoint = parse_endpoint(endpoint)
    except UnsupportedEndpointError as exc:
        raise WorkerUsageError(f"--endpoint: {exc}") from None
    if model_config is None:
        raise WorkerUsageError("--model-config is required (JSON, e.g. '{\"model\": \"smollm2-135m-instruct\"}')")
    if isinstance(model_config, str):
        try:
            model_config = orjson.loads(model_config)
        except orjson.JSONDecodeError as exc:
            raise WorkerUsageError(f"--model-config: not JSON: {exc}") from None
    if not isinstance(model_config, dict):
        raise WorkerUsageError("--model-config: must be a JSON object")
    try:
        deadline_s = float(deadline) if deadline not in (None, "") else None
    except ValueError:
        raise WorkerUsageError(f"--deadline: not epoch seconds: {deadline!r}") from None
    try:
        job_options = JobOptions.model_validate_json(options) if options else JobOptions()
    except ValidationError as exc:
        raise WorkerUsageError(f"--options: {spec_problem(exc)[1]}") from None

    job = JobLayout(work_uri or get_settings().work_uri, job_id)
    shard_layout = job.shard(shard_index)
    return WorkerConfig(
        job_id=job_id,
        shard=shard_index,
        requests=requests or shard_layout.requests,
        results=results or shard_layout.results,
        progress=progress or shard_layout.progress,
        cancel_marker=cancel_marker or job.cancel_marker,
        hold_marker=job.hold_marker,
        endpoint=parsed_endpoint,
        model_config=model_config,
        deadline=deadline_s,
        options=job_options,
        cache_salt=cache_salt or None,
        node_group=node_group(nnodes, 0, master_addr, master_port, gpus_per_node),
        **{k: v for k, v in tuning.items() if v is not None},
    )


def node_group(nnodes: int | str | None, node_rank: int | str | None, master_addr: str | None,
               master_port: int | str | None, gpus_per_node: int | str | None) -> NodeGroup | None:
    """The NodeGroup of the multi-node flags (None without --nnodes)."""
    if nnodes in (None, ""):
        return None
    values: dict[str, int] = {}
    for flag, value, default in (("--nnodes", nnodes, None), ("--node-rank", node_rank, 0),
                                 ("--master-port", master_port, DEFAULT_MASTER_PORT),
                                 ("--gpus-per-node", gpus_per_node, 1)):
        try:
            values[flag] = int(value) if value not in (None, "") else int(default)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise WorkerUsageError(f"{flag}: not an integer: {value!r}") from None
    group = NodeGroup(nnodes=values["--nnodes"], node_rank=values["--node-rank"], master_addr=master_addr or "",
                      master_port=values["--master-port"], gpus_per_node=values["--gpus-per-node"])
    try:
        group.check()
    except NodeGroupError as exc:
        raise WorkerUsageError(str(exc)) from None
    return group
