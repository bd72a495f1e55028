"""WAV bytes -> mono float32 samples at the rate a speech model takes.

The standard library's ``wave`` reads PCM 8/16/24/32-bit with any channel count; channels
are averaged and scipy's polyphase filter resamples. Anything else is ``AudioError``, the
request's 400 result.
"""

from __future__ import annotations

import io
import math
import wave

import numpy as np

# Longest audio one request may carry, in seconds (a guard against a header that claims
# billions of frames; a long file is split into the model's windows, see transcription.py).
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
