"""The file a /v1/audio/transcriptions or /v1/ocr line names, resolved for the job's owner: an
uploaded ``file_id`` of the owner's, a path held to the rules of the owner's paths (no other
scheme is ever fetched), or inline base64. ``resolve`` runs at validation; the worker's
``load`` reads what validation recorded, never a path the body itself names."""
from __future__ import annotations

import binascii
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llm_batch.core.config import Settings, get_settings
from llm_batch.core.endpoints import Endpoint
from llm_batch.core.formats import MediaRefused
from llm_batch.infra import storage, user_paths

if TYPE_CHECKING:
    from llm_batch.infra.jobstore import JobStore

WAV_MAGIC, WAVE_TAG = b"RIFF", b"WAVE"
_SNIFF_BYTES = 12


@dataclass(frozen=True)
class MediaRef:
    """What a (schema-valid) body names: ``field`` its path, and one of the three."""

    field: str
    kind: str  # "audio" | "document" (an image or a PDF)
    file_id: str | None = None
    uri: str | None = None
    inline: str | None = None


def media_ref(endpoint: Endpoint, body: dict[str, Any]) -> MediaRef | None:
    if endpoint is Endpoint.TRANSCRIPTIONS:
        if body.get("file_id") is not None:
            return MediaRef("body.file_id", "audio", file_id=body["file_id"])
        if body.get("file_url") is not None:
            return _url_ref("body.file_url", "audio", body["file_url"])
        return MediaRef("body.file.content", "audio", inline=body["file"]["content"])
    if endpoint is Endpoint.OCR:
        document = body["document"]
        if document["type"] == "file":
            return MediaRef("body.document.file_id", "document", file_id=document["file_id"])
        if document["type"] == "document_url":
            return _url_ref("body.document.document_url", "document", document["document_url"])
        url = document["image_url"]
        if isinstance(url, dict):
            return _url_ref("body.document.image_url.url", "document", url["url"])
        return _url_ref("body.document.image_url", "document", url)
    return None


def _url_ref(field: str, kind: str, url: str) -> MediaRef:
    if url[:5].lower() == "data:":
        header, comma, data = url.partition(",")
        if not comma or not header.lower().endswith(";base64"):
            raise MediaRefused(f"{field}: a data: URL must be base64 (data:<type>;base64,<data>)")
        return MediaRef(field, kind, inline=data)
    return MediaRef(field, kind, uri=url)


def _decoded(ref: MediaRef) -> bytes:
    try:
        return binascii.a2b_base64(ref.inline or "", strict_mode=True)
    except (binascii.Error, ValueError) as exc:
        raise MediaRefused(f"{ref.field}: not valid base64 ({exc})") from None


class MediaResolver:
    """Resolves the files of one job's lines for ``owner``; ``offline()`` (``llm-batch
    validate``'s, no owner or store) checks file ids and paths for their form only."""

    def __init__(self, owner: str | None, store: JobStore | None = None, settings: Settings | None = None,
                 *, is_admin: bool = False):
        self.owner = owner
        self.store = store
        self.settings = settings or get_settings()
        self.is_admin = is_admin

    @classmethod
    def offline(cls, settings: Settings | None = None) -> MediaResolver:
        return cls(None, None, settings)

    def resolve(self, endpoint: Endpoint, body: dict[str, Any]) -> dict[str, Any] | None:
        """The ``BatchRequest.media`` record for ``body``, or MediaRefused."""
        ref = media_ref(endpoint, body)
        if ref is None:
            return None
        if ref.inline is not None:
            data = _decoded(ref)
            self._check(ref, len(data), data[:_SNIFF_BYTES])
            return {"inline": ref.field, "bytes": len(data)}
        if self.owner is None:  # offline: the form only
            if ref.uri is not None:
                _refuse_scheme(ref)
            return None
        uri = self._stored_uri(ref)
        try:
            size = storage.size(uri)
            with storage.open_read(uri) as stream:
                head = stream.read(_SNIFF_BYTES)
        except storage.StorageError:
            why = (f"file {ref.file_id!r} cannot be read" if ref.file_id is not None
                   else user_paths.unavailable(ref.uri or "", self.owner or "", self.settings))
            raise MediaRefused(f"{ref.field}: {why}") from None
        self._check(ref, size, head)
        return {"uri": uri, "bytes": size}

    def _stored_uri(self, ref: MediaRef) -> str:
        if ref.file_id is not None:
            file = self.store.get_file(ref.file_id, owner=None if self.is_admin else self.owner) if self.store else None
            if file is None:
                raise MediaRefused(f"{ref.field}: file {ref.file_id!r} does not exist (or is not yours)")
            return file.uri
        _refuse_scheme(ref)
        try:
            return user_paths.check(ref.uri, self.owner, self.settings, is_admin=self.is_admin).uri  # type: ignore[arg-type]
        except (user_paths.PathRefused, user_paths.PathUnavailable) as exc:
            raise MediaRefused(f"{ref.field}: {exc}") from None

    def _check(self, ref: MediaRef, size: int, head: bytes) -> None:
        limit = self.settings.max_media_bytes
        if size > limit:
            raise MediaRefused(f"{ref.field}: the file is {size} bytes, over the limit of {limit} "
                               "(LLM_BATCH_MAX_MEDIA_BYTES)")
        if size == 0:
            raise MediaRefused(f"{ref.field}: the file is empty")
        if ref.kind == "audio" and not (head[:4] == WAV_MAGIC and head[8:12] == WAVE_TAG):
            raise MediaRefused(f"{ref.field}: not a WAV file (only WAV audio is supported)")


def _refuse_scheme(ref: MediaRef) -> None:
    uri = ref.uri or ""
    scheme = uri.partition("://")[0].lower() if "://" in uri else ""
    if scheme not in ("", "file", "s3"):
        raise MediaRefused(f"{ref.field}: {scheme}:// URLs are never fetched; upload the file "
                           "(then name its file id) or name a path under the allowed roots or buckets")


def load(endpoint: Endpoint, body: dict[str, Any], media: dict[str, Any] | None,
         settings: Settings | None = None) -> bytes:
    if not media:
        raise MediaRefused("the line's file was not resolved at validation (validate the batch "
                           "through the API or the DAG, which resolve it for the job's owner)")
    if "inline" in media:
        return _decoded(media_ref(endpoint, body))  # type: ignore[arg-type]
    limit = (settings or get_settings()).max_media_bytes
    try:
        with storage.open_read(media["uri"]) as stream:
            data = stream.read(limit + 1)
    except storage.StorageError as exc:
        raise MediaRefused(f"the line's file cannot be read any more: {exc}") from None
    if len(data) > limit:
        raise MediaRefused(f"the line's file is over the limit of {limit} bytes (LLM_BATCH_MAX_MEDIA_BYTES)")
    return data
