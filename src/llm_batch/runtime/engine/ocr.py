"""OCR on a vision-language model: a document's bytes -> its pages, and the chat each page is asked.

An image is one page (Pillow, its decompression-bomb guard on); a PDF's pages are rendered
by PDFium at ``PDF_DPI``. Each page is asked the registry's ``ocr_prompt`` as a user message
with the image before the text: one engine request per page.
"""

from __future__ import annotations

import io
import re
import warnings
from dataclasses import dataclass
from typing import Any

from PIL import Image, UnidentifiedImageError

# What Mistral reports as a page image's dots per inch when the file does not say.
DEFAULT_DPI = 72
# PDF pages are rendered at this resolution: enough for print-size text, and a letter page
# (1275 x 1650 px) stays within what a vision-language model's image processor tiles.
PDF_DPI = 150
PDF_MAGIC = b"%PDF-"
# Pages one line may have read (Mistral's OCR takes documents of up to 1,000 pages): a
# page number past it is the line's error, before a range such as "0-99999999" is expanded.
MAX_PAGES = 1000


class ImageError(ValueError):
    """The bytes are not a document this system can read, or ``pages`` names a page it lacks."""


@dataclass
class Page:
    image: Image.Image
    width: int
    height: int
    dpi: int
    index: int = 0


def page_numbers(pages: str | list[int] | None) -> list[int] | None:
    """Mistral's ``pages`` (a list, or a string such as "0,2-4") as sorted page numbers;
    None for every page."""
    if pages is None:
        return None
    if isinstance(pages, str):
        spans = [part.partition("-") for part in re.split(r"\s*,\s*", pages.strip())]
        bounds = [(int(first), int(last or first)) for first, _, last in spans]
    else:
        bounds = [(p, p) for p in pages]
    if any(last >= MAX_PAGES for _, last in bounds):
        raise ImageError(f"pages names a page past the limit of {MAX_PAGES} pages a document")
    return sorted({p for first, last in bounds for p in range(first, last + 1)})


def decode_document(data: bytes, pages: str | list[int] | None = None) -> list[Page]:
    """The pages of ``data`` (an image or a PDF) that ``pages`` names, in page order."""
    wanted = page_numbers(pages)
    if data.startswith(PDF_MAGIC):
        return _pdf_pages(data, wanted)
    if wanted is not None and set(wanted) - {0}:
        raise ImageError(f"an image has one page (0); pages names {sorted(set(wanted) - {0})}")
    return [decode_image(data)]


def decode_image(data: bytes) -> Page:
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


def _pdf_pages(data: bytes, wanted: list[int] | None) -> list[Page]:
    import pypdfium2 as pdfium  # optional

    try:
        document = pdfium.PdfDocument(data)
    except pdfium.PdfiumError as exc:
        raise ImageError(f"the PDF cannot be read: {exc}") from None
    try:
        count = len(document)
        if count == 0:
            raise ImageError("the PDF has no pages")
        if wanted is None and count > MAX_PAGES:
            raise ImageError(f"the PDF has {count} pages, over {MAX_PAGES}: name the pages to read (pages)")
        missing = [p for p in wanted or () if p >= count]
        if missing:
            raise ImageError(f"the PDF has {count} page(s), 0 to {count - 1}; pages names {missing}")
        rendered = []
        scale = PDF_DPI / 72
        for index in range(count) if wanted is None else wanted:
            page = document[index]
            width, height = page.get_size()  # points
            if width * scale * height * scale > (Image.MAX_IMAGE_PIXELS or float("inf")):
                # Pillow's decompression-bomb limit holds for rendered pages too.
                raise ImageError(f"page {index} of the PDF is {width:.0f} x {height:.0f} points: over "
                                 f"{Image.MAX_IMAGE_PIXELS} pixels at {PDF_DPI} dpi")
            try:
                image = page.render(scale=scale).to_pil().convert("RGB")
            except pdfium.PdfiumError as exc:
                raise ImageError(f"page {index} of the PDF cannot be rendered: {exc}") from None
            rendered.append(Page(image, image.width, image.height, PDF_DPI, index))
        return rendered
    finally:
        document.close()


def page_messages(page: Page, prompt: str) -> list[dict[str, Any]]:
    """The conversation asking the model for ``page`` as markdown (the decoded image: nothing is fetched)."""
    return [{"role": "user", "content": [{"type": "image_pil", "image_pil": page.image},
                                         {"type": "text", "text": prompt}]}]
