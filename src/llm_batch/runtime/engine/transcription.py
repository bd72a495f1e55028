"""Whisper on vLLM's offline engine: one audio -> encoder-decoder prompts, outputs -> transcript.

The encoder takes one window of the audio (``chunk_length`` s, 30 for Whisper), the decoder
Whisper's task tokens (``<|startoftranscript|><|en|><|transcribe|><|notimestamps|>``); a
longer audio is cut into consecutive windows, one engine request each, whose texts are
joined. Without a language the decoder prompt stops after ``<|startoftranscript|>`` and the
model names it; with segments, ``<|notimestamps|>`` is left out. Outputs keep special tokens,
so language and timestamp tokens can be read back.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

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
