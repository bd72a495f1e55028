"""OCR on a vision-language model: image bytes -> the chat the model is asked, one page each.

An image is one page. Pillow decodes it (PNG, JPEG, WebP, GIF's first frame, TIFF's first
page, ...; its decompression-bomb guard stays on) and the model is asked the registry's
``ocr_prompt`` about it as a user message with the image before the text, rendered with the
model's chat template exactly as a chat with an image part would be. PDFs are refused before
this (llm_batch.media): no PDF rasteriser runs here.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from typing import Any

from PIL import Image, UnidentifiedImageError

# What Mistral reports as a page image's dots per inch when the file does not say.
DEFAULT_DPI = 72


class ImageError(ValueError):
    """The bytes are not an image Pillow can decode; the message says why."""


@dataclass
class Page:
    image: Image.Image
    width: int
    height: int
    dpi: int


def decode_image(data: bytes) -> Page:
    """``data`` as one RGB page, with its size and resolution."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)  # over the limit: refuse, not warn
            image = Image.open(io.BytesIO(data))
            image.load()
    except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageError(f"not an image this system can read: {exc}") from None
    except (OSError, ValueError, SyntaxError) as exc:  # truncated or corrupt data
        raise ImageError(f"the image cannot be decoded: {exc}") from None
    dpi = image.info.get("dpi")
    resolution = int(round(dpi[0])) if isinstance(dpi, tuple) and dpi and dpi[0] else DEFAULT_DPI
    return Page(image.convert("RGB"), image.width, image.height, resolution)


def page_messages(page: Page, prompt: str) -> list[dict[str, Any]]:
    """The conversation asking the model for ``page`` as markdown (vLLM's ``image_pil``
    content part takes the decoded image: nothing is fetched)."""
    return [{"role": "user", "content": [{"type": "image_pil", "image_pil": page.image},
                                         {"type": "text", "text": prompt}]}]
