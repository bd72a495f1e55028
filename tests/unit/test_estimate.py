"""A job's estimate (llm_batch.pipeline.estimate) on the real parts: the real tokenizer and
chat template of the prepared tiny-random-llama, a real SQLite job store whose ended jobs
give the measured tokens/s, and the prepare step keeping a real job's estimate."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
import pytest

from llm_batch.core.config import Settings
from llm_batch.core.endpoints import Endpoint
from llm_batch.core.jobs import JobStatus
from llm_batch.core.model_choice import ModelChoice
from llm_batch.infra.jobstore import JobStore
from llm_batch.pipeline import estimate as estimates
from llm_batch.pipeline import steps

MODEL = "tiny-random-llama"
NOW = datetime(2027, 3, 22, 12, 0, tzinfo=UTC)


@pytest.fixture
def settings() -> Settings:
    return Settings()


@pytest.fixture
def store(sqlite_store_url: str) -> JobStore:
    store = JobStore(sqlite_store_url)
    yield store
    store.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _chat_tokens(tokenizer, content: str) -> int:
    """What the engine sees of one user message: the chat template's text, tokenized as vLLM does."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _finished_job(store: JobStore, model: str, *, tokens: tuple[int, int], seconds: float,
                  ran: float | None = None) -> str:
    """A job of `model` ended through the store's public API, as the pipeline moves one;
    `ran`: the seconds from RUNNING to its end (its in_progress_at moved back that far)."""
    job = store.create_job(dialect="airflow", endpoint="/v1/chat/completions", model=model, owner="alice")
    store.transition(job.id, JobStatus.VALIDATING)
    store.set_counts(job.id, total=1, completed=0, succeeded=0, failed=0)
    store.transition(job.id, JobStatus.RUNNING)
    store.report_shard(job.id, 0, state="done", total=1, done=1, succeeded=1, prompt_tokens=tokens[0],
                       completion_tokens=tokens[1], engine_seconds=seconds)
    store.transition(job.id, JobStatus.FINALIZING)
    ended = store.end_job(job.id, JobStatus.SUCCEEDED, "1 succeeded")
    if ran is not None:  # arranging the timeline: no test waits `ran` seconds
        from sqlalchemy import update

        from llm_batch.infra.jobstore.models import JOBS

        with store.engine.begin() as connection:
            connection.execute(update(JOBS).where(JOBS.c.id == job.id)
                               .values(in_progress_at=ended.completed_at - timedelta(seconds=ran)))
    return job.id


def _dry_job(store: JobStore, **fields):
    """The transient job of a dry run (never stored)."""
    from llm_batch.infra.jobstore import Job

    values = {"id": "dry-run", "dialect": "airflow", "endpoint": "/v1/chat/completions", "model": MODEL,
              "owner": "alice", "status": JobStatus.QUEUED, "created_at": NOW, "updated_at": NOW, **fields}
    return Job(**values)


def _lines(n: int, bad: tuple[int, ...] = (), max_tokens: int | None = 4) -> list[dict]:
    lines = []
    for i in range(n):
        body = {"messages": [{"role": "user", "content": f"question number {i} " * (i + 1)}]}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        lines.append({"custom_id": f"r{i}", "body": {"messages": "not a list"} if i in bad else body})
    return lines


def _estimate(store, settings, job, lines):
    return estimates.estimate_input(store, settings, job, source=lines, fmt="inline",
                                    models=ModelChoice(base=job.model, names={job.model: None}), now=NOW)


# -- counting with the model's own tokenizer -------------------------------------------------


def test_chat_prompts_are_counted_with_the_models_tokenizer_and_chat_template(tiny_model_dir, tokenizer, settings):
    counter = estimates.load_counter(MODEL, {}, Endpoint.CHAT_COMPLETIONS, settings)
    assert counter.count({"messages": [{"role": "user", "content": "say 1"}]}) == _chat_tokens(tokenizer, "say 1")
    # Text parts are joined as vLLM renders them; the template adds its own tokens to the text's.
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "say "}, {"type": "text", "text": "1"}]}]}
    assert counter.count(parts) == _chat_tokens(tokenizer, "say 1")
    assert counter.count(parts) > len(tokenizer("say 1", add_special_tokens=False)["input_ids"])
    assert counter.context == 1024  # the registry's max_model_len


def test_a_jobs_own_inline_template_is_never_rendered_outside_the_engine(tiny_model_dir, tokenizer, settings):
    """Issue 43, finding 5: a template that never ends (or repeats a string 10^10 times) in a
    job's model_config is not rendered by the API or the prepare step: the lines are counted
    with the model's own template; a registry template (chatml) is rendered as the engine will."""
    endless = "{% for i in range(10**12) %}{% for j in range(10**12) %}x{% endfor %}{% endfor %}"
    body = {"messages": [{"role": "user", "content": "say 1"}]}
    own = estimates.load_counter(MODEL, {"chat_template": endless}, Endpoint.CHAT_COMPLETIONS, settings)
    assert own.chat_template is None and own.count(body) == _chat_tokens(tokenizer, "say 1")  # at once
    named = estimates.load_counter(MODEL, {"chat_template": "chatml"}, Endpoint.CHAT_COMPLETIONS, settings)
    assert named.chat_template and "<|im_start|>" in named.chat_template and named.count(body) > 0


def test_completions_and_embeddings_count_text_and_token_ids(tiny_model_dir, tokenizer, settings):
    counter = estimates.load_counter(MODEL, {}, Endpoint.COMPLETIONS, settings)
    assert counter.count({"prompt": "once upon a time"}) == len(tokenizer("once upon a time")["input_ids"])
    assert counter.count({"prompt": [5, 6, 7, 8]}) == 4  # a tokenized prompt is its ids
    assert counter.count({"prompt": ["a b", "c"]}) == len(tokenizer("a b")["input_ids"]) + len(tokenizer("c")["input_ids"])


def test_an_adapter_is_counted_with_its_bases_tokenizer(tiny_model_dir, settings):
    body = {"messages": [{"role": "user", "content": "hello there"}]}
    base = estimates.load_counter(MODEL, {}, Endpoint.CHAT_COMPLETIONS, settings).count(body)
    assert estimates.load_counter("tiny-lora-a", {}, Endpoint.CHAT_COMPLETIONS, settings).count(body) == base
    owned = {"my-lora": MODEL}  # an owner's own adapter: its base from the store
    assert estimates.load_counter("my-lora", {}, Endpoint.CHAT_COMPLETIONS, settings, owned).count(body) == base


def test_what_cannot_be_counted_says_so(settings):
    with pytest.raises(estimates.NotCounted, match="audio"):
        estimates.load_counter("tiny-random-whisper", {}, Endpoint.TRANSCRIPTIONS, settings)
    with pytest.raises(estimates.NotCounted, match="s3"):
        estimates.load_counter(MODEL, {"checkpoint_path": "s3://bucket/model/"}, Endpoint.CHAT_COMPLETIONS, settings)


# -- the arithmetic --------------------------------------------------------------------------


def test_counts_tokens_and_engine_seconds_from_the_measured_rate(tiny_model_dir, tokenizer, store, settings):
    _finished_job(store, MODEL, tokens=(600, 400), seconds=10.0)  # 100 tokens/s
    _finished_job(store, MODEL, tokens=(200, 100), seconds=3.0)  # 100 tokens/s too
    _finished_job(store, "another-model", tokens=(10, 10), seconds=100.0)  # not this model's
    lines = _lines(5, bad=(1, 3))
    est = _estimate(store, settings, _dry_job(store), lines)

    assert (est.total, est.valid, est.invalid) == (5, 3, 2)
    assert [(e.line, e.custom_id, e.code) for e in est.errors] == [(2, "r1", "invalid_body"), (4, "r3", "invalid_body")]
    prompt = sum(_chat_tokens(tokenizer, lines[i]["body"]["messages"][0]["content"]) for i in (0, 2, 4))
    assert (est.prompt_tokens, est.prompt_tokens_exact, est.max_output_tokens) == (prompt, True, 3 * 4)
    assert (est.tokens_per_s, est.rate_jobs) == (100.0, 2)
    assert est.engine_seconds == round((prompt + 12) / 100, 1)
    assert (est.jobs_ahead, est.expected_start) == (0, int(NOW.timestamp()))
    assert est.overhead_seconds is not None and est.overhead_seconds < 5  # these jobs ended at once
    assert est.expected_end == int(NOW.timestamp() + est.engine_seconds / 1 + est.overhead_seconds)


def test_the_expected_end_includes_what_recent_jobs_took_beyond_their_engine(tiny_model_dir, store, settings):
    """A cold engine's start (and the merge, and scheduling) is in the expected end: the median
    of the model's newest ended jobs' time running beyond their engine seconds; on a warm
    stack those jobs took little beyond it, and so does the estimate."""
    for ran, engine in ((40.0, 10.0), (35.0, 3.0), (12.0, 10.0)):  # 30, 32 and 2 s beyond
        _finished_job(store, MODEL, tokens=(600, 400), seconds=engine, ran=ran)
    est = _estimate(store, settings, _dry_job(store), _lines(2))
    assert est.overhead_seconds == 30.0
    assert est.expected_end == int(est.expected_start + est.engine_seconds + 30.0)


def test_no_finished_job_of_the_model_means_no_seconds_and_says_why(tiny_model_dir, store, settings):
    est = _estimate(store, settings, _dry_job(store), _lines(2))
    assert est.prompt_tokens > 0 and est.tokens_per_s is None and est.engine_seconds is None
    assert est.expected_start is None and est.expected_end is None
    assert any("no ended job of tiny-random-llama" in note for note in est.notes)


def test_the_most_output_follows_each_lines_limit_or_the_engines_default(tiny_model_dir, store, settings):
    chat = _estimate(store, settings, _dry_job(store), _lines(2, max_tokens=None))
    # Chat without max_tokens may generate up to the context left after each prompt.
    assert chat.max_output_tokens == 2 * 1024 - chat.prompt_tokens
    completions = [{"custom_id": "a", "body": {"prompt": "x"}}, {"custom_id": "b", "body": {"prompt": "y", "max_tokens": 5, "n": 2}}]
    done = _estimate(store, settings, _dry_job(store, endpoint="/v1/completions"), completions)
    assert done.max_output_tokens == estimates.COMPLETIONS_DEFAULT_MAX_TOKENS + 5 * 2


def test_above_the_exact_lines_the_rest_are_counted_by_bytes(tiny_model_dir, store, settings, monkeypatch):
    lines = [{"custom_id": f"r{i}", "body": {"messages": [{"role": "user", "content": "same words"}], "max_tokens": 1}}
             for i in range(10)]
    exact = _estimate(store, settings, _dry_job(store), lines)
    monkeypatch.setattr(estimates, "EXACT_LINES", 3)
    sampled = _estimate(store, settings, _dry_job(store), lines)
    assert exact.prompt_tokens_exact and not sampled.prompt_tokens_exact
    # Lines alike but for their custom_id's bytes: the extrapolation lands within a token a line.
    assert abs(sampled.prompt_tokens - exact.prompt_tokens) <= 10
    assert any("first 3 valid lines counted exactly" in note for note in sampled.notes)


def test_the_wait_is_the_unrun_seconds_of_the_jobs_ahead_in_its_lane(tiny_model_dir, store, settings):
    _finished_job(store, MODEL, tokens=(500, 500), seconds=10.0)
    older = NOW - timedelta(minutes=5)
    ahead = store.create_job(dialect="airflow", endpoint="/v1/chat/completions", model=MODEL, owner="bob",
                             created_at=older, priority=10)
    store.set_estimate(ahead.id, {"engine_seconds": 50.0})
    store.transition(ahead.id, JobStatus.VALIDATING)
    store.transition(ahead.id, JobStatus.RUNNING)
    store.report_shard(ahead.id, 0, state="running", total=5, done=1, succeeded=1, engine_seconds=20.0)
    store.create_job(dialect="airflow", endpoint="/v1/chat/completions", model=MODEL, owner="bob",
                     created_at=older, priority=10)  # not validated yet: no estimate
    store.create_job(dialect="airflow", endpoint="/v1/chat/completions", model=MODEL, owner="bob",
                     created_at=older, priority=1)  # a lower band: behind it
    est = _estimate(store, settings, _dry_job(store, priority=10, data_parallelism=2), _lines(2))
    assert (est.jobs_ahead, est.jobs_ahead_unknown) == (2, 1)
    slots = settings.local_shard_slots
    assert est.expected_start == int(NOW.timestamp() + 30.0 / slots)  # 50 s estimated, 20 s already run
    assert est.expected_end == int(NOW.timestamp() + 30.0 / slots + est.engine_seconds / min(slots, 2))


def test_the_prepare_step_keeps_a_real_jobs_estimate(tiny_model_dir, store, settings):
    path = settings.local_roots[0] / "airflow" / f"est-{uuid.uuid4().hex[:8]}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\n".join(orjson.dumps(line) for line in _lines(4, bad=(0,))) + b"\n")
    job_id = steps.register(store, settings, {"input_uri": str(path), "model": MODEL}, f"manual__{uuid.uuid4().hex}")
    steps.validate(store, settings, job_id)
    kept = store.get_job(job_id).estimate
    assert (kept["total"], kept["valid"], kept["invalid"]) == (4, 3, 1)
    assert kept["prompt_tokens"] > 0 and kept["max_output_tokens"] == 12 and kept["prompt_tokens_exact"]
    assert kept["engine_seconds"] is None  # no ended job of the model in this store
