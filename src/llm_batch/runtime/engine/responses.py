"""vLLM outputs -> OpenAI-compatible response bodies (the openai SDK's models parse them).

Token logprobs come as one ``{token_id: Logprob}`` dict per generated token (sampled and top-k).
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput

from llm_batch.core.job_spec import ModerationShape
from llm_batch.infra.model_registry import ModerationMap
from llm_batch.runtime.engine.transcription import Transcript

# vLLM's finish reasons that OpenAI has no word for, mapped to the nearest one.
_FINISH_REASONS = {"repetition": "stop", "abort": "stop"}


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Prompt tokens the prefix cache served; None when the engine did not say.
    cached_prompt_tokens: int | None = None

    def to_dict(self) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        if self.cached_prompt_tokens is not None:  # OpenAI's CompletionUsage field
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_prompt_tokens}
        return usage

    def to_responses_dict(self) -> dict[str, Any]:
        """The Responses API's usage names (``ResponseUsage``: every detail is required, so
        an unknown cached count is 0; no reasoning parser runs, so reasoning tokens are 0)."""
        return {
            "input_tokens": self.prompt_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_prompt_tokens or 0,
                                     "cache_write_tokens": 0},
            "output_tokens": self.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


def generation_usage(output: RequestOutput) -> Usage:
    return Usage(prompt_tokens=len(output.prompt_token_ids or ()), cached_prompt_tokens=output.num_cached_tokens,
                 completion_tokens=sum(len(c.token_ids) for c in output.outputs))


def _finish_reason(completion: CompletionOutput) -> str:
    reason = completion.finish_reason or "stop"
    return _FINISH_REASONS.get(reason, reason)


def _token_text(token_id: int, logprob: Logprob) -> str:
    # decoded_token is None only when detokenization is off; keep the id visible then.
    return logprob.decoded_token if logprob.decoded_token is not None else f"token_id:{token_id}"


def _finite(value: float) -> float:
    # JSON has no -inf; OpenAI clamps to a very small number the same way.
    return max(value, -9999.0)


def _tokens(completion: CompletionOutput,
            top_logprobs: int) -> Iterator[tuple[str, Logprob, list[tuple[int, Logprob]]]]:
    """Per generated token: its text, its Logprob and the ``top_logprobs`` best candidates."""
    for token_id, candidates in zip(completion.token_ids, completion.logprobs or ()):
        sampled = candidates[token_id]
        ranked = sorted(candidates.items(), key=lambda kv: kv[1].rank or 0)[:top_logprobs]
        yield _token_text(token_id, sampled), sampled, ranked


def chat_logprobs(completion: CompletionOutput, top_logprobs: int) -> dict[str, Any] | None:
    """``choices[].logprobs`` of a chat completion: ``{"content": [per-token entries]}``."""
    if completion.logprobs is None:
        return None
    content = []
    for text, sampled, top in _tokens(completion, top_logprobs):
        content.append({
            "token": text,
            "logprob": _finite(sampled.logprob),
            "bytes": list(text.encode()),
            "top_logprobs": [
                {"token": (t := _token_text(tid, lp)), "logprob": _finite(lp.logprob), "bytes": list(t.encode())}
                for tid, lp in top
            ],
        })
    return {"content": content}


def completion_logprobs(completion: CompletionOutput, top_logprobs: int) -> dict[str, Any] | None:
    """``choices[].logprobs`` of a text completion (the legacy parallel-lists object)."""
    if completion.logprobs is None:
        return None
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = 0
    for text, sampled, top in _tokens(completion, top_logprobs):
        tokens.append(text)
        token_logprobs.append(_finite(sampled.logprob))
        tops.append({_token_text(tid, lp): _finite(lp.logprob) for tid, lp in top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def _completion(prefix: str, kind: str, output: RequestOutput, model: str,
                choice: Callable[[CompletionOutput], dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": c.index, **choice(c), "finish_reason": _finish_reason(c)}
                    for c in sorted(output.outputs, key=lambda c: c.index)],
        "usage": generation_usage(output).to_dict(),
    }


def chat_completion(output: RequestOutput, model: str, role: str, top_logprobs: int = 0) -> dict[str, Any]:
    return _completion("chatcmpl", "chat.completion", output, model, lambda c: {
        "message": {"role": role, "content": c.text}, "logprobs": chat_logprobs(c, top_logprobs)})


def text_completion(output: RequestOutput, model: str, top_logprobs: int = 0) -> dict[str, Any]:
    return _completion("cmpl", "text_completion", output, model, lambda c: {
        "text": c.text, "logprobs": completion_logprobs(c, top_logprobs)})


def embedding_list(outputs: Sequence[PoolingRequestOutput], model: str,
                   encoding_format: str = "float") -> dict[str, Any]:
    """One ``embedding`` entry per input, in input order (``outputs`` are in that order)."""
    data = []
    for i, output in enumerate(outputs):
        vector = output.outputs.data
        embedding: list[float] | str
        if encoding_format == "base64":
            # OpenAI's base64 format: little-endian float32 bytes.
            embedding = base64.b64encode(np.asarray(vector.float(), dtype="<f4").tobytes()).decode()
        else:
            embedding = vector.tolist()
        data.append({"object": "embedding", "index": i, "embedding": embedding})
    return {"object": "list", "data": data, "model": model, "usage": _prompt_only_usage(outputs)}


def pooling_usage(outputs: Sequence[PoolingRequestOutput]) -> Usage:
    return Usage(prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs))


def _prompt_only_usage(outputs: Sequence[PoolingRequestOutput]) -> dict[str, int]:
    prompt_tokens = pooling_usage(outputs).prompt_tokens
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}


def class_scores(output: PoolingRequestOutput, labels: Sequence[str]) -> dict[str, float]:
    """label -> score of one classification (the pooler's probabilities, in label order;
    a score past the known labels is ``LABEL_<i>``, transformers' name for it)."""
    scores = output.outputs.data.float().tolist()
    return {(labels[i] if i < len(labels) else f"LABEL_{i}"): score for i, score in enumerate(scores)}


def classification_response(outputs: Sequence[PoolingRequestOutput], model: str, target: str,
                            labels: Sequence[str]) -> dict[str, Any]:
    """Mistral's ClassificationResponse: one result per input (in order), each the model's
    one target with its label scores; ``usage`` (prompt tokens) as embeddings have it."""
    return {
        "id": f"classif-{uuid.uuid4().hex}",
        "object": "classification",
        "model": model,
        "results": [{target: {"scores": class_scores(o, labels)}} for o in outputs],
        "usage": _prompt_only_usage(outputs),
    }


def moderation_response(
    outputs: Sequence[PoolingRequestOutput], model: str, moderation: ModerationMap, labels: Sequence[str],
    *, shape: ModerationShape = ModerationShape.SCORES,
) -> dict[str, Any]:
    """A ModerationResponse: per input, each category's score (the highest of the labels the
    registry maps to it) and whether it reaches its threshold (Mistral's shape);
    ``ModerationShape.FLAGGED`` (OpenAI's) adds ``flagged`` and ``category_applied_input_types``."""
    results = []
    for output in outputs:
        scores = class_scores(output, labels)
        category_scores: dict[str, float] = {}
        for label, category in moderation.pairs():
            category_scores[category] = max(category_scores.get(category, 0.0), scores[label])
        flags = {c: score >= moderation.threshold_of(c) for c, score in category_scores.items()}
        result: dict[str, Any] = {"categories": flags, "category_scores": category_scores}
        if shape is ModerationShape.FLAGGED:
            result = {"flagged": any(flags.values()), **result,
                      "category_applied_input_types": {c: ["text"] for c in category_scores}}
        results.append(result)
    return {"id": f"modr-{uuid.uuid4().hex}", "model": model, "results": results, "usage": _prompt_only_usage(outputs)}


def response_object(
    output: RequestOutput, model: str, *, instructions: str | None = None, metadata: dict[str, str] | None = None,
    max_output_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
    text_format: dict[str, Any] | None = None, parallel_tool_calls: bool = True, tool_choice: str = "auto",
) -> dict[str, Any]:
    """A /v1/responses ``Response`` (openai.types.responses.Response): one assistant message
    with one output_text part. Cut off at the token limit, it is ``incomplete`` with
    ``incomplete_details.reason`` "max_output_tokens", as OpenAI reports it."""
    (completion,) = output.outputs  # a Responses request samples one sequence
    cut = completion.finish_reason == "length"
    status = "incomplete" if cut else "completed"
    now = int(time.time())
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": now,
        "completed_at": None if cut else now,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "model": model,
        "instructions": instructions,
        "metadata": metadata or {},
        "output": [{
            "type": "message",
            "id": f"msg_{uuid.uuid4().hex}",
            "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": completion.text, "annotations": [], "logprobs": []}],
        }],
        "parallel_tool_calls": parallel_tool_calls,
        "tool_choice": tool_choice,
        "tools": [],
        "temperature": temperature,
        "top_p": top_p,
        "max_output_tokens": max_output_tokens,
        "previous_response_id": None,
        "reasoning": None,
        "background": False,
        "store": False,
        "text": {"format": text_format or {"type": "text"}},
        "truncation": "disabled",
        "usage": generation_usage(output).to_responses_dict(),
    }


def summed_usage(outputs: Sequence[RequestOutput]) -> Usage:
    """Prompt and completion tokens of several engine requests of one line."""
    return Usage(prompt_tokens=sum(len(o.prompt_token_ids or ()) for o in outputs),
                 completion_tokens=sum(len(c.token_ids) for o in outputs for c in o.outputs))


def transcription_response(model: str, transcript: Transcript, usage: Usage, audio_seconds: float,
                           segments: bool) -> dict[str, Any]:
    """Mistral's TranscriptionResponse: the text, the language, segments when asked for, and
    usage with the audio's seconds."""
    body: dict[str, Any] = {
        "model": model,
        "text": transcript.text,
        "language": transcript.language,
        "usage": {**usage.to_dict(), "prompt_audio_seconds": int(round(audio_seconds))},
    }
    if segments:
        body["segments"] = transcript.segments
    return body


def ocr_response(outputs: list[RequestOutput], pages: list[Any], model: str, size: int) -> dict[str, Any]:
    """Mistral's OCRResponse: one page per engine output (``pages``: ``ocr.Page``s in the same
    order), its markdown the model's text; no images are extracted."""
    return {
        "pages": [{"index": page.index, "markdown": output.outputs[0].text.strip(), "images": [],
                   "dimensions": {"dpi": page.dpi, "height": page.height, "width": page.width}}
                  for output, page in zip(outputs, pages, strict=True)],
        "model": model,
        "document_annotation": None,
        "usage_info": {"pages_processed": len(pages), "doc_size_bytes": size},
    }
