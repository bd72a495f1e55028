"""/v1/audio/transcriptions and /v1/ocr lines tried as an attacker would: the file each line
names is resolved for the job's owner at validation (llm_batch.infra.media) or the line fails alone
with an error naming the line and field. Another owner's file id, paths outside the owner's
namespace or the roots, traversal, internal state, symlinks, web URLs, garbage and non-WAV
audio, PDFs, malformed base64 and missing fields: never a crash, never a dropped line."""

from __future__ import annotations

import io
import os
from pathlib import Path

import orjson
import pytest

from llm_batch.core.config import get_settings
from llm_batch.core.endpoints import Endpoint, endpoints_served, serving_problem
from llm_batch.infra.jobstore import JobStore
from llm_batch.infra.media import MediaResolver
from llm_batch.infra.model_registry import load_registry
from llm_batch.pipeline.validation import ValidationLimits, validate_batch
from tests.fixtures.media import b64, data_url, image_bytes, pdf_bytes, wav_bytes

LIMITS = ValidationLimits(max_requests=1000, max_input_bytes=10**8, max_line_bytes=2**24, max_reported_errors=100)
TRANSCRIPTIONS, OCR = Endpoint.TRANSCRIPTIONS.value, Endpoint.OCR.value


@pytest.fixture
def store(sqlite_store_url: str):
    store = JobStore(sqlite_store_url)
    yield store
    store.close()


@pytest.fixture
def media(llm_batch_home: Path) -> dict[str, Path]:
    """alice's and bob's files in their folders of the user root, an upload area file, and
    a symlink in alice's folder to bob's audio."""
    settings = get_settings()
    made = {}
    for owner in ("alice", "bob"):
        folder = settings.local_roots[0] / owner / "media"
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in (("a.wav", wav_bytes(0.2)), ("page.png", image_bytes()), ("doc.pdf", b"%PDF-1.7\n..."),
                           ("notes.txt", b"hello, not audio"), ("empty.wav", b"")):
            (folder / name).write_bytes(data)
            made[f"{owner}/{name}"] = folder / name
    link = made["alice/a.wav"].parent / "link.wav"
    if not link.is_symlink():
        os.symlink(made["bob/a.wav"], link)
    made["alice/link.wav"] = link
    return made


def _upload(store: JobStore, owner: str, data: bytes, name: str) -> str:
    uri = f"{get_settings().files_uri}/{owner}-{name}"
    Path(uri).parent.mkdir(parents=True, exist_ok=True)
    Path(uri).write_bytes(data)
    return store.create_file(owner=owner, purpose="batch", filename=name, bytes=len(data), uri=uri).id


def _validate(endpoint: str, bodies: list, store: JobStore | None, owner: str | None = "alice"):
    """The report and the validated lines (as dicts) of one JSONL batch of ``bodies``."""
    data = b"".join(orjson.dumps({"custom_id": f"r{i}", "body": b}) + b"\n" for i, b in enumerate(bodies))
    validated, errors = io.BytesIO(), io.BytesIO()
    resolver = MediaResolver(owner, store) if owner else None
    try:
        report = validate_batch(io.BytesIO(data), fmt="jsonl", endpoint=endpoint, limits=LIMITS,
                                validated_out=validated, errors_out=errors, media=resolver)
    except Exception as exc:  # BatchRejected when no line is valid: the report is on it
        report = exc.report
    valid = [orjson.loads(line) for line in validated.getvalue().splitlines()]
    return report, valid


def _errors(report) -> dict[int, str]:
    return {e.line: f"{e.code}: {e.message}" for e in report.errors}


def test_the_registry_serves_transcriptions_and_ocr_with_their_own_tasks():
    registry = load_registry()
    assert registry.models["tiny-random-whisper"].task == "transcribe"
    assert registry.models["tiny-random-idefics3"].task == "ocr"
    assert endpoints_served("transcribe") == [Endpoint.TRANSCRIPTIONS]
    assert endpoints_served("ocr") == [Endpoint.OCR]
    assert "serves /v1/ocr, not /v1/chat/completions" in serving_problem("/v1/chat/completions", "v", "ocr")
    assert "(generate task)" in serving_problem(TRANSCRIPTIONS, "g", "generate")


def test_transcription_lines_resolve_own_files_and_refuse_everything_else(store, media):
    settings = get_settings()
    mine = _upload(store, "alice", wav_bytes(0.1), "mine.wav")
    bobs = _upload(store, "bob", wav_bytes(0.1), "bobs.wav")
    text = _upload(store, "alice", b"not audio at all", "notes.txt")
    alice = settings.local_roots[0] / "alice" / "media"
    bodies = [
        {"file_id": mine, "language": "en"},                                    # 1 ok: her upload
        {"file_url": str(alice / "a.wav"), "timestamp_granularities": ["segment"]},  # 2 ok: her path
        {"file_url": "media/a.wav"},                                            # 3 ok: relative to her folder
        {"file": {"file_name": "x.wav", "content": b64(wav_bytes(0.1))}},       # 4 ok: inline
        {"file_id": bobs},                                                      # 5 bob's upload
        {"file_id": "file-does-not-exist"},                                     # 6
        {"file_url": str(media["bob/a.wav"])},                                  # 7 bob's folder
        {"file_url": str(alice / ".." / ".." / "bob" / "media" / "a.wav")},     # 8 traversal
        {"file_url": "/etc/passwd"},                                            # 9 outside the roots
        {"file_url": str(alice / "link.wav")},                                  # 10 symlink to bob's
        {"file_url": "https://example.com/a.wav"},                              # 11 never fetched
        {"file_url": "http://169.254.169.254/latest/meta-data"},               # 12
        {"file_url": str(settings.home / "jobs.db")},                           # 13 internal state
        {"file_url": str(alice / "notes.txt")},                                 # 14 not WAV
        {"file_id": text},                                                      # 15 an upload, not WAV
        {"file_url": str(alice / "empty.wav")},                                 # 16 empty
        {"file": {"file_name": "x.wav", "content": "not base64!!"}},            # 17
        {"file": {"file_name": "x.wav", "content": b64(b"GARBAGE" * 100)}},     # 18 garbage bytes
        {},                                                                     # 19 nothing named
        {"file_id": mine, "file_url": str(alice / "a.wav")},                    # 20 two named
        {"file_id": mine, "diarize": True},                                     # 21
        {"file_id": mine, "timestamp_granularities": ["word"]},                 # 22
        {"file_url": str(alice / "missing.wav")},                               # 23
        {"file_url": "ftp://host/a.wav"},                                       # 24
        {"file_id": 7},                                                         # 25
    ]
    report, valid = _validate(TRANSCRIPTIONS, bodies, store)
    assert (report.total, report.valid, report.invalid) == (25, 4, 21)  # every line accounted for
    assert [v["line"] for v in valid] == [1, 2, 3, 4]
    assert valid[0]["media"]["uri"].endswith("alice-mine.wav")
    assert valid[1]["media"] == valid[2]["media"] == {"uri": str((alice / "a.wav").resolve()), "bytes": len(wav_bytes(0.2))}
    assert valid[3]["media"]["inline"] == "body.file.content"
    errors = _errors(report)
    assert set(errors) == set(range(5, 26))
    for line in (5, 6):
        assert errors[line].startswith("invalid_media: body.file_id: file ") and "does not exist (or is not yours)" in errors[line]
    assert "outside your storage namespace" in errors[7] and "outside" in errors[9]
    assert "body.file_url" in errors[8] and errors[8].startswith("invalid_media")
    assert "no such file that you may use" in errors[10] and "no such file that you may use" in errors[23]
    assert "https:// URLs are never fetched" in errors[11] and "http:// URLs are never fetched" in errors[12]
    assert "ftp:// URLs are never fetched" in errors[24]
    assert "outside the allowed roots" in errors[13]  # the job database
    assert "not a WAV file" in errors[14] and "not a WAV file" in errors[15] and "not a WAV file" in errors[18]
    assert "empty" in errors[16]
    assert errors[17].startswith("invalid_body: body.file.content") and "base64" in errors[17]
    assert "exactly one of file_id, file_url and file" in errors[19] and "(got file_id, file_url)" in errors[20]
    assert "body.diarize" in errors[21] and "word" in errors[22]
    assert errors[25].startswith("invalid_body: body.file_id")


def test_an_admin_resolver_reads_any_owners_upload_and_the_limit_holds(store, media, monkeypatch):
    bobs = _upload(store, "bob", wav_bytes(0.1), "b2.wav")
    assert MediaResolver("root", store, is_admin=True).resolve(Endpoint.TRANSCRIPTIONS, {"file_id": bobs})["bytes"] > 0
    small = get_settings().model_copy(update={"max_media_bytes": 100})
    report, _ = _validate(TRANSCRIPTIONS, [{"file_id": bobs}], store, owner="bob")
    assert report.valid == 1
    from llm_batch.infra.media import MediaRefused

    with pytest.raises(MediaRefused, match="over the limit of 100"):
        MediaResolver("bob", store, small).resolve(Endpoint.TRANSCRIPTIONS, {"file_id": bobs})


def test_ocr_lines_take_images_and_pdfs_and_refuse_web_urls_and_others_files(store, media):
    settings = get_settings()
    page = _upload(store, "alice", image_bytes(), "page.png")
    pdf = _upload(store, "alice", pdf_bytes(), "doc.pdf")
    bobs = _upload(store, "bob", image_bytes(), "bob.png")
    alice = settings.local_roots[0] / "alice" / "media"
    bodies = [
        {"document": {"type": "file", "file_id": page}},                                         # 1
        {"document": {"type": "image_url", "image_url": str(alice / "page.png")}},              # 2
        {"document": {"type": "image_url", "image_url": {"url": data_url(image_bytes(fmt="JPEG"), "image/jpeg")}}},  # 3
        {"document": {"type": "document_url", "document_url": f"file://{alice / 'page.png'}"}, "pages": [0]},  # 4
        {"document": {"type": "file", "file_id": pdf}},                                          # 5 a PDF
        {"document": {"type": "document_url", "document_url": str(alice / "doc.pdf")}},         # 6 a PDF
        {"document": {"type": "document_url", "document_url": data_url(b"%PDF-1.5 x", "application/pdf")}},  # 7
        {"document": {"type": "image_url", "image_url": "https://example.com/p.png"}},          # 8
        {"document": {"type": "file", "file_id": bobs}},                                         # 9
        {"document": {"type": "image_url", "image_url": str(media["bob/page.png"])}},           # 10
        {"document": {"type": "image_url", "image_url": "data:image/png,rawbytes"}},            # 11 not base64
        {"document": {"type": "image_url", "image_url": "data:image/png;base64,%%%"}},          # 12 bad base64
        {"document": {"type": "image_url"}},                                                     # 13
        {"document": {"type": "video", "url": "x"}},                                             # 14
        {},                                                                                      # 15
        {"document": {"type": "file", "file_id": page}, "document_annotation_format": {"type": "json_schema"}},  # 16
        {"document": {"type": "file", "file_id": page}, "pages": "zero"},                        # 17
    ]
    report, valid = _validate(OCR, bodies, store)
    assert (report.total, report.valid, report.invalid) == (17, 7, 10)
    # PDFs pass validation (their pages are read, and a broken one refused, by the worker).
    assert [v["line"] for v in valid] == [1, 2, 3, 4, 5, 6, 7]
    assert valid[2]["media"] == {"inline": "body.document.image_url.url", "bytes": len(image_bytes(fmt="JPEG"))}
    errors = _errors(report)
    assert "https:// URLs are never fetched" in errors[8]
    assert "does not exist (or is not yours)" in errors[9] and "outside your storage namespace" in errors[10]
    assert "data: URL must be base64" in errors[11] and "not valid base64" in errors[12]
    assert errors[13].startswith("invalid_body: body.document.image_url: field required")
    assert 'got type "video"' in errors[14] and "body.document: field required" in errors[15]
    assert "document_annotation_format is not supported" in errors[16] and "body.pages" in errors[17]


def test_offline_validation_checks_the_form_and_inline_bytes_only(tmp_path):
    """llm-batch validate: no owner and no job store; ids and paths are not looked up."""
    bodies = [{"file_id": "file-anything"}, {"file_url": "/some/local/a.wav"},
              {"file": {"file_name": "a.wav", "content": b64(wav_bytes(0.1))}},
              {"file_url": "https://example.com/a.wav"}, {"file": {"file_name": "a.wav", "content": b64(b"nope")}}]
    report, valid = _validate(TRANSCRIPTIONS, bodies, None, owner=None)
    assert (report.valid, report.invalid) == (3, 2)
    assert [v.get("media") for v in valid] == [None, None, {"inline": "body.file.content", "bytes": len(wav_bytes(0.1))}]
    assert "never fetched" in _errors(report)[4] and "not a WAV file" in _errors(report)[5]


def test_the_worker_reads_only_what_validation_recorded(media):
    from llm_batch.infra import media as media_module
    from llm_batch.infra.media import MediaRefused

    body = {"file_url": "/etc/passwd"}  # what the body says is never read by the worker
    with pytest.raises(MediaRefused, match="not resolved at validation"):
        media_module.load(Endpoint.TRANSCRIPTIONS, body, None)
    data = media_module.load(Endpoint.TRANSCRIPTIONS, body, {"uri": str(media["alice/a.wav"]), "bytes": 1})
    assert data == media["alice/a.wav"].read_bytes()
    with pytest.raises(MediaRefused, match="cannot be read any more"):
        media_module.load(Endpoint.TRANSCRIPTIONS, body, {"uri": str(media["alice/a.wav"]) + ".gone", "bytes": 1})


@pytest.mark.parametrize("data, message", [
    (b"", "not a WAV file"), (b"RIFF\x00\x00\x00\x00WAVEfmt ", "not a WAV file"),
    (wav_bytes(0.1)[:44], "no audio frames"), (b"\x00" * 5000, "not a WAV file"),
])
def test_audio_decoding_refuses_what_it_cannot_read(data, message):
    from llm_batch.runtime.engine.transcription import AudioError, decode_wav

    with pytest.raises(AudioError, match=message):
        decode_wav(data, 16000)


def test_audio_is_mixed_down_and_resampled():
    from llm_batch.runtime.engine.transcription import decode_wav

    for rate, channels, width in ((16000, 1, 2), (44100, 2, 2), (8000, 1, 1), (22050, 1, 4)):
        samples = decode_wav(wav_bytes(0.5, rate=rate, channels=channels, width=width), 16000)
        assert samples.dtype.name == "float32" and abs(len(samples) - 8000) <= 1
        assert 0.2 < float(abs(samples).max()) < 0.4  # the 0.3 tone survives, in [-1, 1]


def test_image_decoding_refuses_garbage_and_bombs(monkeypatch):
    from PIL import Image

    from llm_batch.runtime.engine.ocr import ImageError, decode_image

    page = decode_image(image_bytes(80, 48))
    assert (page.width, page.height, page.dpi, page.image.mode) == (80, 48, 72, "RGB")
    with pytest.raises(ImageError, match="not an image"):
        decode_image(b"GIF89a but not really")
    with pytest.raises(ImageError):
        decode_image(image_bytes()[:60])  # truncated
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(ImageError, match="not an image"):
        decode_image(image_bytes(80, 48))


def test_pdf_pages_are_rendered_and_pages_checked_against_the_document():
    from llm_batch.runtime.engine.ocr import PDF_DPI, ImageError, decode_document

    pages = decode_document(pdf_bytes((144, 72), (72, 144), (72, 72)))
    assert [(p.index, p.width, p.height, p.dpi, p.image.mode) for p in pages] == [
        (0, 300, 150, PDF_DPI, "RGB"), (1, 150, 300, PDF_DPI, "RGB"), (2, 150, 150, PDF_DPI, "RGB")]
    assert [p.index for p in decode_document(pdf_bytes(*[(72, 72)] * 5), "0, 2-3")] == [0, 2, 3]
    assert [p.index for p in decode_document(pdf_bytes(*[(72, 72)] * 3), [2, 0, 2])] == [0, 2]
    with pytest.raises(ImageError, match=r"has 2 page\(s\), 0 to 1; pages names \[2, 5\]"):
        decode_document(pdf_bytes(), [0, 2, 5])
    with pytest.raises(ImageError, match="past the limit of 1000 pages"):
        decode_document(pdf_bytes(), "0-99999999")  # refused before the range is expanded
    with pytest.raises(ImageError, match=r"page 1 of the PDF is 14400 x 14400 points: over \d+ pixels"):
        decode_document(pdf_bytes((72, 72), (14400, 14400)))  # 900 megapixels: never rendered
    with pytest.raises(ImageError, match="the PDF cannot be read"):
        decode_document(b"%PDF-1.7 but nothing more")
    with pytest.raises(ImageError, match=r"an image has one page \(0\); pages names \[1\]"):
        decode_document(image_bytes(), "0-1")
    assert [p.index for p in decode_document(image_bytes(), [0])] == [0]


def test_segments_and_language_are_read_from_whisper_tokens():
    from llm_batch.runtime.engine.transcription import SpeechInput, decoder_prompt, read_outputs

    speech = SpeechInput()
    out = read_outputs(["<|startoftranscript|><|de|><|transcribe|><|0.00|> Guten Tag<|1.50|><|1.50|> Welt<|3.00|><|endoftext|>",
                        "<|0.00|> noch einmal<|2.00|> offen"], speech, frozenset({"de", "en"}))
    assert out.text == "Guten Tag Welt noch einmal offen" and out.language == "de"
    assert [(s["text"], s["start"], s["end"]) for s in out.segments] == [
        ("Guten Tag", 0.0, 1.5), ("Welt", 1.5, 3.0), ("noch einmal", 30.0, 32.0), ("offen", 32.0, None)]
    assert decoder_prompt("en", False) == "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"
    assert decoder_prompt("en", True, ["Kubernetes"]) == "<|startofprev|> Kubernetes<|startoftranscript|><|en|><|transcribe|>"
    assert decoder_prompt(None, False) == "<|startoftranscript|>"
