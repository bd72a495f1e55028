"""The engine loop: feed a shard's requests to vLLM continuously, hand back results in order.

``EngineRunner.run`` keeps at most ``window`` requests between fed and written, so memory is
bounded whatever the shard size, and tops the engine up after every ``step()``; results
leave in input order through a reorder buffer. A request the engine refuses becomes its own
400 ``ResultRecord``; anything ``step()`` raises is an engine failure and propagates.
Everything here is vLLM's public API; the rest is in ``vllm_api``.
"""

from __future__ import annotations

import itertools
import logging
import os
import uuid
import zlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError
from vllm import LLM
from vllm.exceptions import VLLMClientError, VLLMValidationError
from vllm.lora.request import LoRARequest
from vllm.outputs import PoolingRequestOutput, RequestOutput

from llm_batch.core.config import Settings, get_settings
from llm_batch.core.endpoints import MEDIA_ENDPOINTS, Endpoint
from llm_batch.core.job_spec import ModerationShape
from llm_batch.core.output_check import CHECKED_ENDPOINTS, INVALID_OUTPUT, OutputCheck, answer_text
from llm_batch.core.records import BatchRequest, RequestError, ResultRecord
from llm_batch.infra import media
from llm_batch.infra.adapters import ResolvedAdapter
from llm_batch.infra.model_registry import FimTemplate, ModerationMap, Serving
from llm_batch.infra.model_resolution import ResolvedModel
from llm_batch.pipeline.sharding import PREFIX_KEY_CHARS, prefix_key
from llm_batch.runtime.engine import StopReason, ocr, responses, transcription, vllm_api
from llm_batch.runtime.engine.responses import Usage
from llm_batch.runtime.engine.sampling import (
    Body,
    ChatBody,
    ChatClassifyBody,
    ClassifyBody,
    CompletionBody,
    EmbeddingBody,
    FimBody,
    InvalidRequest,
    OcrBody,
    ResponsesBody,
    TranscribeBody,
    media_sampling_params,
    parse_body,
    pooling_params,
    sampling_params,
)

log = logging.getLogger("llm_batch.runtime.engine")

# Requests in the window per sequence the scheduler runs at once: enough queued work that
# the engine never idles between steps, small enough to keep the reorder buffer short.
WINDOW_PER_SEQ = 4


Emit = Callable[[ResultRecord, Usage], None]


def start_engine(model: ResolvedModel, in_process: bool | None = None) -> LLM:
    """Load ``model`` into vLLM's offline engine, its engine core placed by ``place_engine_core``."""
    vllm_api.check_vllm_version()
    in_process = place_engine_core(in_process)
    log.info("starting vLLM for model %s (%s), engine core %s", model.name, model.path,
             "in this process" if in_process else "in its own process")
    if model.engine_args.get("enable_lora"):
        vllm_api.guard_cpu_lora()
    args = dict(model.engine_args)
    if in_process:
        # With the core in this process vLLM's two multi-modal processor caches drift apart
        # (MultiModalCacheMissError) and there is no IPC to save: none, unless the registry asks.
        args.setdefault("mm_processor_cache_gb", 0)
    return LLM(**args)


def place_engine_core(in_process: bool | None = None) -> bool:
    """Tell vLLM where the next engine's core runs (default: ``engine_in_process()``); the
    choice made. vLLM freezes its environment once an in-process engine exists: a process
    keeps its first choice."""
    in_process = engine_in_process() if in_process is None else in_process
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    return in_process


def engine_in_process(settings: Settings | None = None) -> bool:
    """Whether the engine core runs in the worker's process: ``Settings.engine_in_process``,
    else exactly on CPU, where a busy-polling engine-core process of its own costs a core
    (docs/benchmarks.md, "Worker"); on GPU it overlaps output processing with the steps."""
    setting = (settings or get_settings()).engine_in_process
    if setting is not None:
        return setting
    from vllm.platforms import current_platform  # vllm

    return current_platform.is_cpu()


def stop_engine(llm: LLM) -> None:
    """Stop the engine's processes at once: every kept result is in this process already, and
    a graceful shutdown spends ~5 s per shard waiting for the engine's workers."""
    try:
        vllm_api.shutdown_now(llm)
    except Exception:  # noqa: BLE001 - best effort: the shard's outcome is already decided
        log.warning("vLLM engine shutdown failed", exc_info=True)


class ModelCannotServe(ValueError):
    """The loaded model cannot serve the endpoint as its registry entry says: no request can run."""


def error_result(request: BatchRequest, code: str, message: str, status_code: int = 400) -> ResultRecord:
    return ResultRecord(index=request.index, custom_id=request.custom_id, status_code=status_code,
                        error=RequestError(code=code, message=message))


@dataclass
class _InFlight:
    """One shard request in the engine (several parts: a list input's embeddings, media windows)."""

    request: BatchRequest
    body: Body
    outputs: list[Any] = field(default_factory=list)
    remaining: int = 0
    # What a media request's result reports about its file (audio seconds; the page).
    media_facts: Any = None
    # Checked outputs: answers tried before this one (failed the check), their tokens.
    attempt: int = 0
    retry_tokens: int = 0


class EngineRunner:
    """Runs requests of one endpoint on an ``LLM`` built for that endpoint's task."""

    def __init__(self, llm: LLM, endpoint: Endpoint, model_name: str, response_role: str = "assistant",
                 window: int | None = None, feed_order: str | None = None, serving: Serving | None = None,
                 labels: tuple[str, ...] = (), moderation_shape: ModerationShape = ModerationShape.SCORES,
                 adapters: Iterable[ResolvedAdapter] = (), output_check: OutputCheck | None = None,
                 cache_salt: str | None = None):
        self.llm = llm
        self.engine = llm.llm_engine
        self.endpoint = endpoint
        self.model_name = model_name
        self.response_role = response_role
        self.serving = serving or Serving()
        self.labels = labels
        self.moderation_shape = moderation_shape
        self.loras = {a.name: LoRARequest(a.name, a.lora_int_id, str(a.path)) for a in adapters}
        self.check = output_check if endpoint.value in CHECKED_ENDPOINTS else None
        # The owner's prefix-cache namespace: a shared engine reuses prefixes within one owner only.
        self.cache_salt = cache_salt
        if endpoint is Endpoint.FIM_COMPLETIONS:
            _check_fim_tokens(llm, self.serving.fim, model_name)
        if endpoint in _MODERATION_ENDPOINTS:
            _check_moderation_labels(self.serving.moderation, labels, model_name)
        if endpoint is Endpoint.TRANSCRIPTIONS:
            self.speech = transcription.SpeechInput.of_checkpoint(llm.model_config.model)
            self.languages = _language_tokens(llm)
        max_num_seqs = self.engine.vllm_config.scheduler_config.max_num_seqs
        self.window = window or WINDOW_PER_SEQ * max_num_seqs
        # Unique per run: a warm engine routes each step's outputs to their shard by this prefix.
        self._ids = f"{uuid.uuid4().hex[:8]}-"
        # A shared warm engine's lock (warm_engines.EngineView): rendering uses its one tokenizer.
        self._feeding = getattr(self.engine, "submit_lock", None) or nullcontext()
        settings = get_settings()
        # "file", "grouped" or "leaders_first" (docs/data-plane.md, "Prefix-aware sharding").
        if feed_order is None:
            feed_order = settings.prefix_feed_order if settings.prefix_aware_sharding else "file"
        self.feed_order: str | None = None if feed_order == "file" else feed_order
        # Requests are read (and reordered) in batches of at least this many.
        self.feed_chunk = max(1, self.window // 2) if self.feed_order else 1

    def run(self, requests: Iterable[BatchRequest], emit: Emit,
            should_stop: Callable[[], StopReason | None] = lambda: None) -> StopReason | None:
        """``emit`` each request's result once, in input order; None when all were emitted, else the
        StopReason ``should_stop`` gave between steps (in-flight requests are then aborted). With
        a feed order, requests are read in batches of ``feed_chunk``, each fed in that order."""
        source: Iterator[BatchRequest] = iter(requests)
        in_flight: dict[int, _InFlight] = {}
        finished: dict[int, tuple[ResultRecord, Usage]] = {}
        read = emitted = 0
        exhausted = False
        try:
            while True:
                if (reason := should_stop()) is not None:
                    return reason
                if not exhausted and read - emitted <= self.window - self.feed_chunk:
                    room = self.window - (read - emitted)
                    batch = list(itertools.islice(source, room))
                    exhausted = len(batch) < room
                    with self._feeding:
                        for offset in self._feed_positions(batch):
                            position = read + offset
                            done = self._submit(position, batch[offset], in_flight)
                            if done is not None:
                                finished[position] = done
                    read += len(batch)
                while emitted in finished:
                    emit(*finished.pop(emitted))
                    emitted += 1
                if exhausted and emitted == read:
                    return None
                if in_flight:
                    for output in self.engine.step():
                        self._collect(output, in_flight, finished)
        finally:
            if in_flight:
                self._abort(in_flight)

    def _feed_positions(self, batch: list[BatchRequest]) -> list[int]:
        """The order to feed a batch in (offsets): file order, or prefix groups in the order of
        their first request, each group's requests together, in file order within (requests
        with no long prefix stay put); ``leaders_first``: every group's first, then the rest."""
        if self.feed_order is None or len(batch) < 2:
            return list(range(len(batch)))

        group_first: dict[int, int] = {}
        long_first: dict[tuple[int, int], int] = {}
        order: list[tuple[int, int, int, int]] = []
        leaders = self.feed_order == "leaders_first"
        for offset, request in enumerate(batch):
            key = prefix_key(request.body, PREFIX_KEY_CHARS) if isinstance(request.body, dict) else None
            if key is None:
                order.append((0, offset, offset, offset))
                continue
            first = group_first.setdefault(key[0], offset)
            sub = long_first.setdefault(key, offset) if key[1] else offset
            rank = 1 if leaders and offset != first else 0
            order.append((rank, first, sub, offset))
        order.sort()
        return [offset for *_, offset in order]

    def _submit(self, position: int, request: BatchRequest,
                in_flight: dict[int, _InFlight]) -> tuple[ResultRecord, Usage] | None:
        """Add one request to the engine; a finished error result if it cannot run (its fault)."""
        facts = None
        added: list[str] = []
        try:
            body = parse_body(self.endpoint, request.body)
            if self.endpoint in MEDIA_ENDPOINTS:
                parts, facts = self._media_inputs(body, request)
            else:
                parts = self._engine_inputs(body)
            lora = self._lora(request)
            for part, (prompt, params) in enumerate(parts):
                request_id = self._request_id(position, part, 0)
                self.engine.add_request(request_id, _salted(prompt, self.cache_salt), params, lora_request=lora)
                added.append(request_id)
        except (VLLMClientError, ValueError, TemplateError) as exc:  # InvalidRequest included
            if added:
                self.engine.abort_request(added)
            return error_result(request, _error_code(exc), str(exc)), Usage()
        in_flight[position] = _InFlight(request, body, outputs=[None] * len(parts), remaining=len(parts),
                                        media_facts=facts)
        return None

    def _lora(self, request: BatchRequest) -> LoRARequest | None:
        if request.adapter is None:
            return None
        if request.adapter not in self.loras:  # validation named it, the shard did not load it
            raise InvalidRequest(f"adapter {request.adapter!r} is not loaded for this shard", "model_not_available")
        return self.loras[request.adapter]

    def _engine_inputs(self, body: Body) -> list[tuple[Any, Any]]:
        if isinstance(body, ChatBody):
            prompt = vllm_api.render_chat(self.llm, body.messages)
            return [(prompt, sampling_params(body))]
        if isinstance(body, FimBody):
            text = self.serving.fim.render(body.prompt, body.suffix or "")  # type: ignore[union-attr]
            return [(vllm_api.render_prompt(self.llm, text), sampling_params(body))]
        if isinstance(body, CompletionBody):
            return [(vllm_api.render_prompt(self.llm, body.single_prompt()), sampling_params(body))]
        params = pooling_params(body)
        if isinstance(body, ChatClassifyBody):
            # As vLLM's own chat classify does: the conversation, no generation prompt.
            return [(vllm_api.render_chat(self.llm, messages, add_generation_prompt=False), params.clone())
                    for messages in body.conversations()]
        return [(vllm_api.render_prompt(self.llm, text), params.clone()) for text in body.inputs()]

    def _media_inputs(self, body: Body, request: BatchRequest) -> tuple[list[tuple[Any, Any]], Any]:
        """(prompt, params) per engine request of a transcription (one per audio window) or
        an OCR page, and the facts its result reports."""
        try:
            data = media.load(self.endpoint, request.body, request.media)
            if isinstance(body, TranscribeBody):
                if body.language is not None and body.language not in self.languages:
                    raise InvalidRequest(f"language: {body.language!r} is not a language the model knows")
                audio = transcription.decode_wav(data, self.speech.sample_rate)
                params = media_sampling_params(body.temperature, keep_special_tokens=True)
                prompts = transcription.prompts(audio, self.speech, body.language, body.segments, body.context_bias)
                inputs = [(vllm_api.render_prompt(self.llm, prompt), params.clone()) for prompt in prompts]
                return inputs, len(audio) / self.speech.sample_rate
            pages = ocr.decode_document(data, body.pages)
            params = media_sampling_params()
            inputs = [(vllm_api.render_chat(self.llm, ocr.page_messages(page, self.serving.ocr_prompt)), params.clone())
                      for page in pages]
            return inputs, (pages, len(data))
        except (media.MediaRefused, transcription.AudioError, ocr.ImageError) as exc:
            raise InvalidRequest(str(exc), "invalid_media") from None
        except (KeyError, TypeError) as exc:  # a body validation never saw (a hand-made shard file)
            raise InvalidRequest(f"the body does not name its file as validation requires ({exc!r})") from None

    def _collect(self, output: RequestOutput | PoolingRequestOutput, in_flight: dict[int, _InFlight],
                 finished: dict[int, tuple[ResultRecord, Usage]]) -> None:
        if not output.finished:
            return
        position, part, _ = (int(x) for x in output.request_id.removeprefix(self._ids).split("."))
        entry = in_flight[position]
        entry.outputs[part] = output
        entry.remaining -= 1
        if entry.remaining == 0:
            result, usage = self._result(entry)
            if self.check is not None and result.ok:
                result = self._checked(position, entry, result, usage)
                if result is None:
                    return  # tried again: still in flight
            del in_flight[position]
            finished[position] = result, usage

    def _request_id(self, position: int, part: int, attempt: int) -> str:
        return f"{self._ids}{position}.{part}.{attempt}"

    def _checked(self, position: int, entry: _InFlight, result: ResultRecord, usage: Usage) -> ResultRecord | None:
        """The result of an answer the job's check passed, or an ``invalid_output`` one after
        the last try; None when the request was fed again with a new seed."""
        assert self.check is not None and isinstance(entry.body, ChatBody | CompletionBody)
        text = answer_text(self.endpoint.value, result.body or {})
        problem = self.check.problem(text or "", entry.request.body)
        if problem is None:
            if entry.attempt:
                result = result.model_copy(update={"retries": entry.attempt, "retry_tokens": entry.retry_tokens})
            return result
        greedy = entry.body.temperature == 0  # a new seed cannot change a greedy answer
        if entry.attempt < self.check.max_retries and not greedy:
            entry.attempt += 1
            entry.retry_tokens += usage.prompt_tokens + usage.completion_tokens
            seed = zlib.crc32(f"{entry.request.custom_id}:{entry.attempt}".encode())
            entry.body = entry.body.model_copy(update={"seed": seed})
            ((prompt, params),) = self._engine_inputs(entry.body)
            entry.outputs, entry.remaining = [None], 1
            self.engine.add_request(self._request_id(position, 0, entry.attempt), _salted(prompt, self.cache_salt), params,
                                    lora_request=self._lora(entry.request))
            return None
        return result.model_copy(update={
            "status_code": 422, "error": RequestError(code=INVALID_OUTPUT, message=problem),
            "retries": entry.attempt or None, "retry_tokens": entry.retry_tokens or None})

    def _result(self, entry: _InFlight) -> tuple[ResultRecord, Usage]:
        request, body, outputs = entry.request, entry.body, entry.outputs
        if isinstance(body, EmbeddingBody | ClassifyBody | ChatClassifyBody):
            usage = responses.pooling_usage(outputs)
        else:
            media = isinstance(body, TranscribeBody | OcrBody)
            usage = responses.summed_usage(outputs) if media else responses.generation_usage(outputs[0])
            if any(c.finish_reason == "error" for o in outputs for c in o.outputs):
                # vLLM's request-level internal error (e.g. a KV load failure): retryable.
                return error_result(request, "engine_error", "the engine failed this request", 500), usage
        payload = self._payload(entry, usage)
        return ResultRecord(index=request.index, custom_id=request.custom_id, status_code=200, body=payload), usage

    def _payload(self, entry: _InFlight, usage: Usage) -> dict[str, Any]:
        body, outputs = entry.body, entry.outputs
        model_name = entry.request.adapter or self.model_name  # which model answered
        if isinstance(body, EmbeddingBody):
            return responses.embedding_list(outputs, model_name, body.encoding_format)
        if isinstance(body, ClassifyBody | ChatClassifyBody):
            if self.endpoint in _MODERATION_ENDPOINTS:
                return responses.moderation_response(
                    outputs, model_name, self.serving.moderation, self.labels,  # type: ignore[arg-type]
                    shape=self.moderation_shape)
            return responses.classification_response(outputs, model_name, self.serving.classifier_target,
                                                      self.labels)
        if isinstance(body, TranscribeBody):
            transcript = transcription.read_outputs([o.outputs[0].text for o in outputs], self.speech, self.languages)
            transcript.language = body.language or transcript.language
            return responses.transcription_response(model_name, transcript, usage, entry.media_facts,
                                                    body.segments)
        if isinstance(body, OcrBody):
            pages, size = entry.media_facts
            return responses.ocr_response(outputs, pages, model_name, size)
        (output,) = outputs
        top = body.sample_logprobs or 0
        if isinstance(body, ResponsesBody):  # a ChatBody too: test it first
            return responses.response_object(
                output, model_name, instructions=body.instructions, metadata=body.metadata,
                max_output_tokens=body.max_output_tokens, temperature=body.temperature,
                top_p=body.top_p, text_format=body.text_format,
                parallel_tool_calls=body.parallel_tool_calls, tool_choice=body.tool_choice)
        if isinstance(body, ChatBody):
            return responses.chat_completion(output, model_name, self.response_role, top)
        if isinstance(body, FimBody):
            # Mistral answers FIM with a chat completion object (FIMCompletionResponse).
            return responses.chat_completion(output, model_name, "assistant")
        return responses.text_completion(output, model_name, top)

    def _abort(self, in_flight: dict[int, _InFlight]) -> None:
        ids = [self._request_id(pos, part, entry.attempt)
               for pos, entry in in_flight.items() for part in range(len(entry.outputs))]
        log.info("aborting %d in-flight engine requests", len(ids))
        try:
            self.engine.abort_request(ids)
        except Exception:  # noqa: BLE001 - the engine may be the thing that failed
            log.warning("could not abort in-flight requests", exc_info=True)
        in_flight.clear()


_MODERATION_ENDPOINTS = (Endpoint.MODERATIONS, Endpoint.CHAT_MODERATIONS)


# Engine inputs that carry a cache_salt (an encoder-decoder input keys its cache by its audio).
_SALTED_INPUTS = ("token", "multimodal", "embeds")


def _salted(prompt: Any, salt: str | None) -> Any:
    """``prompt`` (a rendered engine input) in the prefix-cache namespace ``salt``."""
    if salt and isinstance(prompt, dict) and prompt.get("type") in _SALTED_INPUTS:
        return {**prompt, "cache_salt": salt}
    return prompt


def _check_moderation_labels(moderation: ModerationMap | None, labels: tuple[str, ...], model_name: str) -> None:
    """Every label the registry maps to a category must be one of the model's."""
    if moderation is None:
        raise ModelCannotServe(f"model {model_name!r} has no moderation map in the model registry")
    if unknown := [label for label in moderation.categories if label not in labels]:
        raise ModelCannotServe(f"model {model_name!r}: its registry moderation map names labels the checkpoint "
                               f"does not have: {', '.join(unknown)} (its labels: {', '.join(labels) or 'none'})")


def _check_fim_tokens(llm: LLM, fim: FimTemplate | None, model_name: str) -> None:
    """Each token of the model's FIM template must be one token of its tokenizer, or every
    prompt would be rendered wrong."""
    if fim is None:
        raise ModelCannotServe(f"model {model_name!r} has no fim template in the model registry")
    tokenizer = llm.get_tokenizer()
    for token in fim.tokens:
        ids = tokenizer.encode(token, add_special_tokens=False)
        if len(ids) != 1:
            raise ModelCannotServe(f"model {model_name!r}: the fim token {token!r} of its registry entry is "
                                   f"{len(ids)} tokens of its tokenizer, not one (a special token it does not know)")


def _language_tokens(llm: LLM) -> frozenset[str]:
    """The languages a Whisper tokenizer has a token for (``<|en|>`` -> "en")."""
    return frozenset(token[2:-2] for token in llm.get_tokenizer().get_vocab()
                     if len(token) <= 7 and token.startswith("<|") and token.endswith("|>") and token[2:-2].isalpha()
                     and token[2:-2].islower())


def _error_code(exc: Exception) -> str:
    if isinstance(exc, InvalidRequest):
        return exc.code
    if isinstance(exc, VLLMValidationError) and exc.parameter == "input_tokens":
        return "context_length_exceeded"
    return "invalid_request"
