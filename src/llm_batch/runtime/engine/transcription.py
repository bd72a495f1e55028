"""Whisper on vLLM's offline engine: WAV bytes -> encoder-decoder prompts, outputs -> transcript.

The audio is read by the standard library's ``wave`` (PCM 8/16/24/32-bit, any channel count),
its channels averaged, resampled by scipy's polyphase filter; anything else is ``AudioError``,
the request's 400 result. The encoder takes one window of the audio (``chunk_length`` s, 30
for Whisper), the decoder Whisper's task tokens
(``<|startoftranscript|><|en|><|transcribe|><|notimestamps|>``); a longer audio is cut into
consecutive windows, one engine request each, whose texts are joined. Without a language the
decoder prompt stops after ``<|startoftranscript|>`` and the model names it; with segments,
``<|notimestamps|>`` is left out. Outputs keep special tokens, so language and timestamp tokens
can be read back.
"""

from __future__ import annotations

import io
import json
import math
import re
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Longest audio one request may carry, in seconds: a guard against a header claiming billions of frames.
MAX_AUDIO_SECONDS = 4 * 3600


class AudioError(ValueError):
    """The bytes are not audio this module can decode."""


def decode_wav(data: bytes, sample_rate: int) -> np.ndarray:
    """``data`` (a WAV file) as mono float32 in [-1, 1] at ``sample_rate`` Hz."""
    try:
        with wave.open(io.BytesIO(data), "rb") as wav:
            channels, width, rate, frames = wav.getnchannels(), wav.getsampwidth(), wav.getframerate(), wav.getnframes()
            if rate <= 0 or channels <= 0:
                raise AudioError(f"a WAV header with {channels} channels at {rate} Hz")
            if frames > MAX_AUDIO_SECONDS * rate:
                raise AudioError(f"the audio is over {MAX_AUDIO_SECONDS} s long")
            raw = wav.readframes(frames)
    except (wave.Error, EOFError) as exc:
        raise AudioError(f"not a WAV file this system can read: {exc} (only uncompressed PCM WAV)") from None
    usable = len(raw) // (width * channels) * width * channels
    if usable == 0:
        raise AudioError("the WAV file holds no audio frames")
    samples = _pcm_to_float(raw[:usable], width).reshape(-1, channels).mean(axis=1)
    return _resample(samples, rate, sample_rate).astype(np.float32)


def _pcm_to_float(raw: bytes, width: int) -> np.ndarray:
    if width == 1:  # 8-bit WAV is unsigned
        return (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    if width == 2:
        return np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    if width == 3:  # 24-bit: widen each little-endian sample to 32 bits
        bytes3 = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3)
        wide = np.zeros((len(bytes3), 4), dtype=np.uint8)
        wide[:, 1:] = bytes3
        return wide.view("<i4").reshape(-1).astype(np.float32) / 2147483648.0
    if width == 4:
        return np.frombuffer(raw, dtype="<i4").astype(np.float32) / 2147483648.0
    raise AudioError(f"{8 * width}-bit WAV samples are not supported (8, 16, 24 or 32-bit PCM)")


def _resample(samples: np.ndarray, rate: int, target: int) -> np.ndarray:
    if rate == target:
        return samples
    try:
        from scipy.signal import resample_poly  # optional
    except ImportError:  # an image without the vllm extra's scipy: this line fails, not the shard
        raise AudioError(f"audio at {rate} Hz needs resampling to {target} Hz, and scipy is not installed") from None

    divisor = math.gcd(rate, target)
    return resample_poly(samples, target // divisor, rate // divisor)


_TOKEN = re.compile(r"<\|([^|<>]*)\|>")
_TIMESTAMP = re.compile(r"\d+\.\d+")


@dataclass(frozen=True)
class SpeechInput:
    """What the model's feature extractor takes: its sample rate and window length."""

    sample_rate: int = 16000
    window_seconds: int = 30

    @classmethod
    def of_checkpoint(cls, path: str | Path) -> SpeechInput:
        """From the checkpoint's preprocessor_config.json (Whisper's defaults without one)."""
        try:
            config = json.loads((Path(path) / "preprocessor_config.json").read_text())
        except (OSError, ValueError):
            return cls()
        return cls(int(config.get("sampling_rate") or 16000), int(config.get("chunk_length") or 30))

    def windows(self, audio: np.ndarray) -> list[np.ndarray]:
        size = self.sample_rate * self.window_seconds
        return [audio[start:start + size] for start in range(0, max(len(audio), 1), size)]


def decoder_prompt(language: str | None, timestamps: bool, context: list[str] | None = None) -> str:
    """Whisper's task tokens (and ``context`` as its previous-text prompt, which biases the
    spelling of the words it holds)."""
    previous = f"<|startofprev|> {' '.join(context)}" if context else ""
    if language is None:  # the model says the language, then its task and timestamp tokens
        return f"{previous}<|startoftranscript|>"
    return f"{previous}<|startoftranscript|><|{language}|><|transcribe|>{'' if timestamps else '<|notimestamps|>'}"


def prompts(audio: np.ndarray, speech: SpeechInput, language: str | None, timestamps: bool,
            context: list[str] | None = None) -> list[dict[str, Any]]:
    """One explicit encoder-decoder prompt per window of ``audio``, in order."""
    text = decoder_prompt(language, timestamps, context)
    return [{"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": (window, speech.sample_rate)}},
             "decoder_prompt": text} for window in speech.windows(audio)]


@dataclass
class Transcript:
    text: str
    language: str | None
    segments: list[dict[str, Any]]


def read_outputs(texts: list[str], speech: SpeechInput, languages: frozenset[str]) -> Transcript:
    """The transcript of the windows' output texts (special tokens kept): the text, the first
    language token the model gave, and the segments its timestamp tokens bound (a segment
    left open ends None)."""
    parts: list[str] = []
    language = None
    segments: list[dict[str, Any]] = []
    for window, text in enumerate(texts):
        offset = float(window * speech.window_seconds)
        start, pending, last, stamped = offset, "", 0, False
        for match in _TOKEN.finditer(text):
            pending += text[last:match.start()]
            last = match.end()
            token = match.group(1)
            if _TIMESTAMP.fullmatch(token):
                stamp = offset + float(token)
                if pending.strip():  # a timestamp after text closes its segment ...
                    segments.append(_segment(pending, start, stamp))
                start, pending, stamped = stamp, "", True  # ... and opens the next one
            elif language is None and token in languages:
                language = token
        pending += text[last:]
        if pending.strip() and stamped:
            segments.append(_segment(pending, start, None))
        if window_text := _TOKEN.sub("", text).strip():
            parts.append(window_text)
    return Transcript(" ".join(parts), language, segments)


def _segment(text: str, start: float, end: float | None) -> dict[str, Any]:
    return {"type": "transcription_segment", "text": text.strip(), "start": round(start, 2),
            "end": None if end is None else round(max(end, start), 2)}
