"""An estimate of a job before (or as) it runs: its lines, its prompt tokens by the model's own
tokenizer, its most output tokens, the engine seconds this deployment's measured tokens/s make
of them, and when it should start and end in its lane (docs/api.md, "Estimates (dry run)")."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from llm_batch.core.config import Settings
from llm_batch.core.endpoints import MEDIA_ENDPOINTS, TASK_OF_ENDPOINT, Endpoint
from llm_batch.core.estimates import EXACT_LINES, SHOWN_ERRORS, Estimate, LineError
from llm_batch.core.model_choice import ModelChoice
from llm_batch.core.placement import GPU_TYPES, priority_band
from llm_batch.infra import storage
from llm_batch.infra.media import MediaResolver
from llm_batch.pipeline.validation import BatchRejected, ValidationLimits, ValidationReport, validate_batch

if TYPE_CHECKING:  # the store pulls in SQLAlchemy
    from llm_batch.infra.jobstore import AdapterRepository, EstimatesRepository, Job, JobStore


# /v1/completions without max_tokens: OpenAI's default, the engine's (runtime.engine.sampling).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
_CHAT_RENDERED = (Endpoint.CHAT_COMPLETIONS, Endpoint.RESPONSES)
_CONVERSATIONS = (Endpoint.CHAT_CLASSIFICATIONS, Endpoint.CHAT_MODERATIONS)


@dataclass
class PromptCounter:
    """Counts a valid body's prompt tokens for one endpoint, with the engine's tokenizer."""

    tokenizer: Any
    endpoint: Endpoint
    chat_template: str | None = None
    fim: Any = None  # model_registry.FimTemplate
    context: int | None = None  # the model's context length (max_model_len)

    def count(self, body: dict[str, Any]) -> int:
        if self.endpoint in _CHAT_RENDERED:
            return self._chat(_messages_of(body), add_generation_prompt=True)
        if self.endpoint is Endpoint.FIM_COMPLETIONS and self.fim is not None:
            return self._text(self.fim.render(body.get("prompt") or "", body.get("suffix") or ""))
        if self.endpoint in _CONVERSATIONS:
            return sum(self._chat(c, add_generation_prompt=False) for c in _conversations(body.get("input")))
        return self._text(body.get("prompt", body.get("input")))

    def _chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> int:
        text = self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])  # as vLLM tokenizes a chat

    def _text(self, value: Any) -> int:
        if isinstance(value, str):
            return len(self.tokenizer(value)["input_ids"])
        if isinstance(value, int):
            return 1  # a token id
        if isinstance(value, list):
            return len(value) if value and all(isinstance(v, int) for v in value) else sum(map(self._text, value))
        return 0


def _text_of(content: Any) -> Any:
    """A message's content as one string when it is a list of text parts (as vLLM renders it)."""
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return content


def _messages_of(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation a chat or /v1/responses body asks about (instructions as a system message)."""
    if "messages" in body:
        messages = body["messages"]
    else:
        messages = [{"role": "system", "content": body["instructions"]}] if body.get("instructions") else []
        given = body.get("input")
        messages += [{"role": "user", "content": given}] if isinstance(given, str) else list(given or [])
    return [{**m, "content": _text_of(m.get("content"))} for m in messages]


def _conversations(value: Any) -> list[list[dict[str, Any]]]:
    """Chat classification / moderation input: one conversation or a list of them (messages, or
    ``{"messages": [...]}``)."""
    several = isinstance(value, list) and value and not (isinstance(value[0], dict) and "role" in value[0])
    items = value if several else [value]
    conversations = [item.get("messages") if isinstance(item, dict) else item for item in items]
    return [[{**m, "content": _text_of(m.get("content"))} for m in c or []] for c in conversations]


class NotCounted(Exception):
    """The prompt tokens cannot be counted here; the message says why."""


def load_counter(model: str, model_config: dict[str, Any], endpoint: Endpoint, settings: Settings,
                 owned: dict[str, str] | None = None) -> PromptCounter:
    """The counter for a job of `model` (an owner's adapter: `owned` maps it to its base) on
    `endpoint`, with the tokenizer and chat template the worker's engine will use; ``NotCounted``
    saying why when there is none here."""
    from llm_batch.core.model_config import ModelError  # heavy
    from llm_batch.infra.model_registry import load_registry  # heavy
    from llm_batch.infra.model_resolution import resolve_model  # heavy

    if endpoint in MEDIA_ENDPOINTS:
        raise NotCounted(f"{endpoint} lines are {'audio' if endpoint is Endpoint.TRANSCRIPTIONS else 'images'}: "
                         "their prompt tokens are not counted before the engine reads them")
    config = {**model_config, "model": (owned or {}).get(model, model)}
    try:
        registry = load_registry(settings=settings)
        checkpoint = config.get("checkpoint_path") or registry.get(config["model"]).checkpoint
        if str(checkpoint).startswith("s3://"):
            raise NotCounted(f"the checkpoint is in s3 ({checkpoint}): its tokenizer is not fetched for an estimate")
        resolved = resolve_model(config, registry=registry, settings=settings)
    except ModelError as exc:
        raise NotCounted(f"the model's tokenizer is not readable here: {exc}") from None
    args = resolved.engine_args
    # A template the registry names (an admin's) is rendered here as the engine will; a job's
    # own inline template only by the engine (no bound fits rendering a user's Jinja once per
    # line in the API or the prepare step): its lines are counted with the model's own.
    named = config.get("chat_template") in (None, *registry.templates)
    template = Path(args["chat_template"]).read_text() if args.get("chat_template") and named else None
    try:
        tokenizer = _tokenizer(str(args.get("tokenizer") or resolved.path))
    except (OSError, ValueError) as exc:
        raise NotCounted(f"the model's tokenizer cannot be loaded: {exc}") from None
    if endpoint in (*_CHAT_RENDERED, *_CONVERSATIONS) and not (template or tokenizer.chat_template):
        raise NotCounted("the model has no chat template to render the conversations with")
    return PromptCounter(tokenizer, endpoint, template, resolved.fim,
                         args.get("max_model_len") or _context_of(resolved.path))


@lru_cache(maxsize=4)
def _tokenizer(path: str) -> Any:
    """A tokenizer, loaded once per process: ``tokenizer.json`` with the ``tokenizers`` library
    (``_LightTokenizer``: importing transformers costs every job's prepare step seconds), else
    transformers."""
    if (Path(path) / "tokenizer.json").is_file():
        try:
            return _LightTokenizer(Path(path))
        except ImportError:  # no tokenizers library here: transformers below
            pass
    from transformers import AutoTokenizer  # heavy

    return AutoTokenizer.from_pretrained(path)


class _LightTokenizer:
    """The two calls PromptCounter makes of a transformers tokenizer, from ``tokenizer.json`` and the
    checkpoint's chat template, rendered in a jinja2 environment set up as transformers' own."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer  # optional

        self._tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        config_file = path / "tokenizer_config.json"
        config = orjson.loads(config_file.read_bytes()) if config_file.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        jinja_file = path / "chat_template.jinja"
        self.chat_template = jinja_file.read_text() if jinja_file.is_file() else template
        # A special token as tokenizer_config.json gives it: a string, or an AddedToken's dict.
        self._specials = {name: token.get("content") if isinstance(token := config.get(name), dict) else token
                          for name in ("bos_token", "eos_token", "unk_token", "pad_token")}

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids}

    def apply_chat_template(self, messages: list[dict[str, Any]], chat_template: str | None = None,
                            tokenize: bool = False, add_generation_prompt: bool = False) -> str:
        template = _jinja().from_string(chat_template or self.chat_template or "")
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self._specials)


@lru_cache(maxsize=1)
def _jinja() -> Any:
    """transformers' chat template environment (sandboxed, its filters and globals)."""
    from jinja2.ext import loopcontrols  # heavy
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # heavy

    def raise_exception(message: str) -> None:
        raise ValueError(f"the chat template refused the conversation: {message}")

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        import json  # heavy

        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _context_of(checkpoint: Path) -> int | None:
    """The checkpoint's context length (its config.json's max_position_embeddings)."""
    try:
        config = orjson.loads((checkpoint / "config.json").read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    limit = text.get("max_position_embeddings")
    return limit if isinstance(limit, int) else None


def _most_output(endpoint: Endpoint, body: dict[str, Any], prompt: int | None, context: int | None) -> int | None:
    """The most tokens one line may generate (see the module docstring); None when unknown."""
    if TASK_OF_ENDPOINT[endpoint] in ("embed", "classify"):
        return 0
    if endpoint in MEDIA_ENDPOINTS:
        return None
    limit = body.get("max_completion_tokens") or body.get("max_tokens") or body.get("max_output_tokens")
    if limit is None and endpoint is Endpoint.COMPLETIONS:
        limit = COMPLETIONS_DEFAULT_MAX_TOKENS
    left = context - prompt if context is not None and prompt is not None else None
    if limit is None and left is None:
        return None
    most = min(v for v in (limit, left) if v is not None)
    n = body.get("n")
    return max(0, most) * (n if isinstance(n, int) and n > 0 else 1)


@dataclass
class _Tally:
    """Sums over valid records (the validated file's lines), streaming."""

    endpoint: Endpoint
    counter: PromptCounter | None
    exact_lines: int
    lines: int = 0
    counted_lines: int = 0
    counted_tokens: int = 0
    counted_bytes: int = 0
    guessed_tokens: float = 0.0
    output: int | None = 0
    notes: list[str] = field(default_factory=list)
    _pending: bytes = b""

    def add(self, record_line: bytes) -> None:
        body = orjson.loads(record_line)["body"]
        self.lines += 1
        prompt: int | None = None
        if self.counter is not None:
            if self.counted_lines < self.exact_lines:
                prompt = self.counter.count(body)
                self.counted_lines += 1
                self.counted_tokens += prompt
                self.counted_bytes += len(record_line)
            else:  # past the exact lines: this line's bytes at the counted tokens per byte
                guess = len(record_line) * self.counted_tokens / max(1, self.counted_bytes)
                self.guessed_tokens += guess
                prompt = round(guess)
        if self.output is not None:
            most = _most_output(self.endpoint, body, prompt, self.counter.context if self.counter else None)
            self.output = None if most is None else self.output + most

    def write(self, data: bytes) -> int:
        """A sink for ``validate_batch``'s valid records: whole lines are tallied as they come."""
        *whole, self._pending = (self._pending + data).split(b"\n")
        for line in whole:
            if line.strip():
                self.add(line)
        return len(data)

    @property
    def prompt_tokens(self) -> int | None:
        return None if self.counter is None else self.counted_tokens + round(self.guessed_tokens)


def _tally(store: AdapterRepository, settings: Settings, job: Job) -> _Tally:
    tally = _Tally(Endpoint(job.endpoint), None, EXACT_LINES)
    try:
        owned = {a.name: a.base for a in store.list_adapters(job.owner)}
        tally.counter = load_counter(job.model, job.model_config or {}, Endpoint(job.endpoint), settings, owned)
    except NotCounted as exc:
        tally.notes.append(f"prompt tokens not counted: {exc}")
    return tally


def estimate_input(store: JobStore, settings: Settings, job: Job, *, source: Any, fmt: str, models: ModelChoice,
                   now: datetime) -> Estimate:
    """A dry run's estimate: `source` is validated as the prepare step validates it, writing
    nothing. No valid line: the counts and ``would_fail``; a limit passed or an unreadable input
    raises ``BatchRejected``."""
    tally = _tally(store, settings, job)
    try:
        report = validate_batch(source, fmt=fmt, endpoint=job.endpoint,
                                limits=ValidationLimits.from_settings(settings), validated_out=tally, errors_out=None,
                                media=MediaResolver(job.owner, store, settings), models=models)
    except BatchRejected as exc:
        if exc.report is None:  # a limit or unreadable input: nothing to count
            raise
        return _estimate(store, settings, job, exc.report, tally, now).model_copy(update={"would_fail": str(exc)})
    return _estimate(store, settings, job, report, tally, now)


def estimate_validated(store: JobStore, settings: Settings, job: Job, report: ValidationReport, validated_uri: str,
                       *, now: datetime) -> Estimate:
    """A real job's estimate, from its validated file (one streamed pass) and its report."""
    tally = _tally(store, settings, job)
    with storage.open_read(validated_uri) as lines:
        for line in lines:
            if line.strip():
                tally.add(line)
    return _estimate(store, settings, job, report, tally, now)


def _estimate(store: JobStore, settings: Settings, job: Job, report: ValidationReport, tally: _Tally,
              now: datetime) -> Estimate:
    notes, prompt = tally.notes, tally.prompt_tokens
    exact = tally.counter is not None and tally.counted_lines == tally.lines
    if tally.counter is not None and not exact:
        notes.append(f"prompt tokens of the first {tally.counted_lines} valid lines counted exactly, the other "
                     f"{tally.lines - tally.counted_lines} at their tokens per byte")
    if tally.output is None:
        notes.append("the most output tokens are unknown: lines without max_tokens may generate up to a context "
                     "length not known here" if Endpoint(job.endpoint) not in MEDIA_ENDPOINTS else
                     f"the most output tokens of {job.endpoint} lines are not counted (up to the context length)")
    rate = store.measured_rate(job.model)
    if rate is None:
        notes.append(f"no ended job of {job.model} has run an engine here yet: no measured tokens/s")
    seconds = None
    if rate is not None and prompt is not None and tally.output is not None:
        seconds = round((prompt + tally.output) / rate.tokens_per_s, 1)
    ahead, unknown, wait = _work_ahead(store, settings, job)
    slots = max(1, settings.local_shard_slots if settings.shard_runner == "local" else settings.gpu_pool_slots)
    start = end = None
    if seconds is not None:
        start = now.timestamp() + wait / slots
        end = start + seconds / max(1, min(slots, job.data_parallelism or 1)) + rate.overhead_seconds
    if unknown:
        notes.append(f"{unknown} of the {ahead} jobs ahead have no estimate yet: their time is not in the wait")
    return Estimate(
        model=job.model, endpoint=job.endpoint, total=report.total, valid=report.valid, invalid=report.invalid,
        errors=[LineError(line=e.line, custom_id=e.custom_id, code=e.code, message=e.message)
                for e in report.errors[:SHOWN_ERRORS]],
        prompt_tokens=prompt, prompt_tokens_exact=exact, max_output_tokens=tally.output,
        tokens_per_s=round(rate.tokens_per_s, 1) if rate else None, rate_jobs=rate.jobs if rate else 0,
        overhead_seconds=round(rate.overhead_seconds, 1) if rate else None,
        engine_seconds=seconds, jobs_ahead=ahead, jobs_ahead_unknown=unknown,
        expected_start=None if start is None else int(start), expected_end=None if end is None else int(end),
        estimated_at=int(now.timestamp()), notes=notes,
    )


def _pool_of(settings: Settings, gpu_type: str | None) -> str:
    """The pool a job's shards wait in (as ``llm_batch.airflow.lanes.lane_for`` places them)."""
    if settings.shard_runner == "local":
        return settings.local_pool
    return gpu_type if gpu_type in GPU_TYPES else GPU_TYPES[0]


def _band_weight(settings: Settings, priority: int) -> int:
    """The weight of a stored priority's band (0, "not given", is the middle band's)."""
    return settings.priority_weights[priority_band(settings, priority)]


def _work_ahead(store: EstimatesRepository, settings: Settings, job: Job) -> tuple[int, int, float]:
    """(jobs ahead, of them without an estimate, their engine seconds not yet run)."""
    pool = _pool_of(settings, (job.resources or {}).get("gpu_type"))
    band = _band_weight(settings, job.priority)
    ahead = unknown = 0
    wait = 0.0
    for other in store.live_work():
        if other.id == job.id or _pool_of(settings, other.gpu_type) != pool:
            continue
        other_band = _band_weight(settings, other.priority)
        if other_band < band or (other_band == band and other.created_at >= job.created_at):
            continue
        ahead += 1
        seconds = (other.estimate or {}).get("engine_seconds")
        if not isinstance(seconds, int | float):
            unknown += 1
            continue
        wait += max(0.0, seconds - other.engine_seconds)
    return ahead, unknown, wait
