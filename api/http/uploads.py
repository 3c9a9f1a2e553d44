"""Streaming multipart reception for ``POST /v1/media`` and ``POST /v1/captions``.

The body is read chunk by chunk from ``request.stream()`` into ``python_multipart``'s
streaming ``MultipartParser``; each file part is written to its own spool file as it
arrives (SHA-256 computed while writing), so a request never holds more than one
network chunk of file data in memory. Every cap is enforced while streaming:

- a ``Content-Length`` over :func:`multipart_body_cap` is refused before any byte of
  the body is read;
- a file part passing ``max_file_bytes``, the files together passing
  ``max_total_bytes``, a text field passing ``max_field_bytes`` or the raw body passing
  the body cap stops reading at once (:class:`UploadTooLargeError`, code ``too_large``);
- a body that is not ``multipart/form-data``, has no usable boundary, does not parse,
  ends early, has too many parts or no file part is a :class:`MalformedUploadError`
  (code ``invalid_request``). No parser exception escapes untyped.

Spool files are removed on every error path (cancellation included) and by
:meth:`ReceivedForm.cleanup` for the files nobody claimed.

Conventions: files come in the field ``file`` (repeatable, as OpenAI's ``/v1/files``);
a part with a ``filename`` in another field is refused rather than silently ignored; a
file part with an empty filename and no bytes (an HTML file input left empty) is
dropped; text fields are UTF-8 and each name may appear once.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect, Request

from media.errors import InvalidRequestError, PieMediaError

KiB = 1024
MiB = 1024 * KiB

DEFAULT_MAX_FIELD_BYTES = 64 * KiB
"""Largest text field (``prompt``, ``max_tokens``, ...)."""
DEFAULT_MAX_FIELDS = 16
"""Most text fields in one form."""
PART_OVERHEAD_BYTES = 4 * KiB
"""Allowance per part for its boundary line and headers in :func:`multipart_body_cap`."""
MAX_PART_HEADERS = 8
MAX_PART_HEADER_BYTES = 4 * KiB
MAX_FILENAME_CHARS = 255
# Chunks at least this large are parsed (hashed, written) in a worker thread so a big
# upload does not hold the event loop; small ones are parsed inline.
_THREAD_CHUNK_BYTES = 64 * KiB

SPOOL_PREFIX = "upload-"
SPOOL_SUFFIX = ".part"
_SPOOL_NAME = re.compile(r"^upload-(\d+)-[0-9a-f]{32}\.part$")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class UploadTooLargeError(PieMediaError, ValueError):
    """The upload (a file, a text field, all files, or the raw body) is over a cap.
    ``limit`` is the cap in bytes, ``actual`` the bytes seen so far (or the declared
    ``Content-Length``); ``what`` says which cap (file, files, field, body)."""

    code = "too_large"


class MalformedUploadError(InvalidRequestError):
    """The request is not a usable ``multipart/form-data`` upload."""

    code = "invalid_request"


@dataclass(frozen=True)
class SpooledFile:
    """One received file part, already complete on disk."""

    field_name: str
    filename: str | None
    content_type: str | None
    path: Path
    size: int
    sha256: str  # hex digest of the bytes in ``path``


@dataclass
class ReceivedForm:
    """The files (spooled) and text fields of one multipart request.

    Use as a context manager (``async with`` or ``with``), or call :meth:`cleanup`:
    it deletes every spool file not :meth:`claim`-ed. A file that was moved away (for
    example by ``MediaStore.put``) is simply gone already, which is fine."""

    files: list[SpooledFile] = field(default_factory=list)
    fields: dict[str, str] = field(default_factory=dict)
    _claimed: set[Path] = field(default_factory=set, init=False, repr=False)

    def claim(self, spooled: SpooledFile) -> Path:
        """Keep ``spooled``'s file past :meth:`cleanup` (the caller now owns it)."""
        if spooled not in self.files:
            raise ValueError(f"{spooled.path} is not a file of this form")
        self._claimed.add(spooled.path)
        return spooled.path

    def cleanup(self) -> None:
        """Delete the spool files not claimed (idempotent)."""
        for f in self.files:
            if f.path not in self._claimed:
                _unlink(f.path)

    def __enter__(self) -> ReceivedForm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    async def __aenter__(self) -> ReceivedForm:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cleanup()


def multipart_body_cap(
    max_total_bytes: int,
    max_files: int,
    *,
    max_fields: int = DEFAULT_MAX_FIELDS,
    max_field_bytes: int = DEFAULT_MAX_FIELD_BYTES,
) -> int:
    """The largest raw multipart body that can carry ``max_total_bytes`` of files in
    ``max_files`` parts plus the text fields: the ``Content-Length`` cap, also fit for
    a server-wide body-size backstop on the upload routes."""
    parts = max_files + max_fields + 1
    return max_total_bytes + max_fields * max_field_bytes + parts * PART_OVERHEAD_BYTES


def spool_owner_pid(name: str) -> int | None:
    """The id of the process that wrote spool file ``name``, None if it is not one."""
    m = _SPOOL_NAME.match(name)
    return int(m.group(1)) if m else None


async def receive_multipart(
    request: Request,
    spool_dir: Path,
    *,
    max_file_bytes: int,
    max_total_bytes: int,
    max_files: int,
    max_field_bytes: int = DEFAULT_MAX_FIELD_BYTES,
    max_fields: int = DEFAULT_MAX_FIELDS,
    file_field: str = "file",
    require_file: bool = True,
) -> ReceivedForm:
    """Read ``request``'s multipart body, spooling each file part into ``spool_dir``.

    Raises :class:`UploadTooLargeError` (``too_large``) or :class:`MalformedUploadError`
    (``invalid_request``); on any error no spool file of this request is left behind.
    """
    for name, value in (
        ("max_file_bytes", max_file_bytes),
        ("max_total_bytes", max_total_bytes),
        ("max_files", max_files),
        ("max_field_bytes", max_field_bytes),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if isinstance(max_fields, bool) or not isinstance(max_fields, int) or max_fields < 0:
        raise ValueError(f"max_fields must be an int >= 0, got {max_fields!r}")

    boundary = _boundary(request.headers.get("content-type"))
    body_cap = multipart_body_cap(
        max_total_bytes, max_files, max_fields=max_fields, max_field_bytes=max_field_bytes
    )
    declared = _content_length(request.headers.get("content-length"))
    if declared is not None and declared > body_cap:
        raise UploadTooLargeError(
            f"the upload is {declared} bytes, over the limit of {body_cap} bytes "
            f"({max_files} files of at most {max_file_bytes} bytes, {max_total_bytes} bytes in all)",
            limit=body_cap,
            actual=declared,
            what="body",
            param=file_field,
        )

    receiver = _Receiver(
        Path(spool_dir),
        boundary,
        max_file_bytes=max_file_bytes,
        max_total_bytes=max_total_bytes,
        max_files=max_files,
        max_field_bytes=max_field_bytes,
        max_fields=max_fields,
        file_field=file_field,
    )
    try:
        received = 0
        async for chunk in request.stream():
            if not chunk:
                continue
            received += len(chunk)
            if received > body_cap:
                raise UploadTooLargeError(
                    f"the upload passed the limit of {body_cap} bytes",
                    limit=body_cap,
                    actual=received,
                    what="body",
                    param=file_field,
                )
            if receiver.ended:
                continue  # the epilogue after the closing boundary is ignored
            if len(chunk) >= _THREAD_CHUNK_BYTES:
                await asyncio.to_thread(receiver.write, chunk)
            else:
                receiver.write(chunk)
        if received == 0:
            raise MalformedUploadError("the upload body is empty: send a multipart form with a file")
        return receiver.finish(require_file=require_file)
    except ClientDisconnect:
        receiver.abort()
        raise MalformedUploadError(
            "the client disconnected before the upload was complete", reason="disconnected"
        ) from None
    except BaseException:
        receiver.abort()
        raise


class _Part:
    __slots__ = ("name", "filename", "content_type", "path", "handle", "hasher", "size", "text")

    def __init__(self, name: str, filename: str | None, content_type: str | None):
        self.name = name
        self.filename = filename
        self.content_type = content_type
        self.path: Path | None = None
        self.handle: BinaryIO | None = None
        self.hasher: Any = None
        self.size = 0
        self.text: bytearray | None = None


class _Receiver:
    """The parser callbacks and the state of one request. ``write`` runs either on the
    event loop or in a worker thread (never both at once); ``abort`` may run while a
    worker thread is inside ``write``, hence the lock."""

    def __init__(
        self,
        spool_dir: Path,
        boundary: bytes,
        *,
        max_file_bytes: int,
        max_total_bytes: int,
        max_files: int,
        max_field_bytes: int,
        max_fields: int,
        file_field: str,
    ):
        self.spool_dir = spool_dir
        self.max_file_bytes = max_file_bytes
        self.max_total_bytes = max_total_bytes
        self.max_files = max_files
        self.max_field_bytes = max_field_bytes
        self.max_fields = max_fields
        self.file_field = file_field
        self.files: list[SpooledFile] = []
        self.fields: dict[str, str] = {}
        self.spooled: list[Path] = []  # every spool file created, for abort
        self.ended = False
        self._lock = threading.Lock()
        self._closed = False
        self._parts = 0
        self._file_parts = 0
        self._file_bytes = 0
        self._part: _Part | None = None
        self._headers: dict[bytes, bytes] = {}
        self._header_name = bytearray()
        self._header_value = bytearray()
        try:
            self._parser = MultipartParser(
                boundary,
                callbacks={
                    "on_part_begin": self._on_part_begin,
                    "on_header_field": self._on_header_field,
                    "on_header_value": self._on_header_value,
                    "on_header_end": self._on_header_end,
                    "on_headers_finished": self._on_headers_finished,
                    "on_part_data": self._on_part_data,
                    "on_part_end": self._on_part_end,
                    "on_end": self._on_end,
                },
                max_header_count=MAX_PART_HEADERS,
                max_header_size=MAX_PART_HEADER_BYTES,
            )
        except (FormParserError, ValueError) as e:
            raise MalformedUploadError(f"unusable multipart boundary: {e}") from None

    # -- driving -------------------------------------------------------------------

    def write(self, chunk: bytes) -> None:
        with self._lock:
            if self._closed:
                raise MalformedUploadError("the upload was abandoned")
            try:
                self._parser.write(chunk)
            except PieMediaError:
                raise
            except FormParserError as e:  # MultipartParseError, header limits, ...
                raise MalformedUploadError(f"malformed multipart body: {e}") from None

    def finish(self, *, require_file: bool) -> ReceivedForm:
        with self._lock:
            if not self.ended:
                raise MalformedUploadError(
                    "the multipart body ended before its closing boundary (truncated upload)"
                )
            if require_file and not self.files:
                raise MalformedUploadError(
                    f"no file in the upload: send the file(s) as multipart field {self.file_field!r}",
                    param=self.file_field,
                )
            self._closed = True  # the form owns the files from here
            return ReceivedForm(files=list(self.files), fields=dict(self.fields))

    def abort(self) -> None:
        with self._lock:
            self._closed = True
            part, self._part = self._part, None
            if part is not None and part.handle is not None:
                _close(part.handle)
            for path in self.spooled:
                _unlink(path)
            self.files.clear()

    # -- parser callbacks ---------------------------------------------------------

    def _on_part_begin(self) -> None:
        self._parts += 1
        if self._parts > self.max_files + self.max_fields:
            raise MalformedUploadError(
                f"too many parts in the upload (more than {self.max_files} files and {self.max_fields} fields)",
                limit=self.max_files + self.max_fields,
                actual=self._parts,
            )
        self._headers = {}
        self._part = None

    def _on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def _on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _on_header_end(self) -> None:
        name = bytes(self._header_name).strip().lower()
        self._headers[name] = bytes(self._header_value).strip(b" \t")
        self._header_name.clear()
        self._header_value.clear()

    def _on_headers_finished(self) -> None:
        disposition = self._headers.get(b"content-disposition")
        if disposition is None:
            raise MalformedUploadError("a multipart part has no Content-Disposition header")
        kind, options = parse_options_header(disposition)
        if kind != b"form-data" or b"name" not in options:
            raise MalformedUploadError(
                f"a multipart part's Content-Disposition is not form-data with a name: {_show(disposition)}"
            )
        name = _utf8(options[b"name"], "a field name")
        raw_filename = options.get(b"filename")
        filename = _clean_filename(raw_filename) if raw_filename is not None else None
        raw_ctype = self._headers.get(b"content-type")
        ctype = _utf8(raw_ctype, "a Content-Type").strip() if raw_ctype is not None else ""
        encoding = self._headers.get(b"content-transfer-encoding", b"binary").strip().lower()
        if encoding not in (b"binary", b"8bit", b"7bit"):
            raise MalformedUploadError(
                f"unsupported Content-Transfer-Encoding {_show(encoding)} in field {name!r}: send the bytes as-is",
                param=name,
            )
        part = _Part(name, filename, ctype or None)
        if name == self.file_field or raw_filename is not None:
            if name != self.file_field:
                raise MalformedUploadError(
                    f"a file came in field {name!r}: send files in field {self.file_field!r}", param=name
                )
            self._file_parts += 1
            if self._file_parts > self.max_files:
                raise MalformedUploadError(
                    f"too many files: at most {self.max_files} per request",
                    limit=self.max_files,
                    actual=self._file_parts,
                    param=self.file_field,
                )
            path = self.spool_dir / f"{SPOOL_PREFIX}{os.getpid()}-{uuid.uuid4().hex}{SPOOL_SUFFIX}"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
            self.spooled.append(path)
            part.path = path
            part.handle = os.fdopen(fd, "wb")
            part.hasher = hashlib.sha256()
        else:
            if name in self.fields:
                raise MalformedUploadError(f"field {name!r} appears twice", param=name)
            if len(self.fields) >= self.max_fields:
                raise MalformedUploadError(
                    f"too many text fields: at most {self.max_fields}", limit=self.max_fields, param=name
                )
            part.text = bytearray()
        self._part = part

    def _on_part_data(self, data: bytes, start: int, end: int) -> None:
        part = self._part
        if part is None:  # data before headers finished cannot happen; be safe
            raise MalformedUploadError("multipart data outside a part")
        n = end - start
        if part.text is not None:
            if len(part.text) + n > self.max_field_bytes:
                raise UploadTooLargeError(
                    f"field {part.name!r} is over the limit of {self.max_field_bytes} bytes",
                    limit=self.max_field_bytes,
                    actual=len(part.text) + n,
                    what="field",
                    param=part.name,
                )
            part.text += memoryview(data)[start:end]
            return
        if part.size + n > self.max_file_bytes:
            raise UploadTooLargeError(
                f"file {part.filename or part.name!r} is over the limit of {self.max_file_bytes} bytes",
                limit=self.max_file_bytes,
                actual=part.size + n,
                what="file",
                filename=part.filename,
                param=self.file_field,
            )
        if self._file_bytes + n > self.max_total_bytes:
            raise UploadTooLargeError(
                f"the uploaded files are over the limit of {self.max_total_bytes} bytes in all",
                limit=self.max_total_bytes,
                actual=self._file_bytes + n,
                what="files",
                param=self.file_field,
            )
        view = memoryview(data)[start:end]
        assert part.handle is not None
        part.handle.write(view)
        part.hasher.update(view)
        part.size += n
        self._file_bytes += n

    def _on_part_end(self) -> None:
        part, self._part = self._part, None
        if part is None:
            return
        if part.text is not None:
            self.fields[part.name] = _utf8(bytes(part.text), f"field {part.name!r}")
            return
        assert part.handle is not None and part.path is not None
        part.handle.close()
        if part.filename == "" and part.size == 0:
            _unlink(part.path)  # an HTML file input left empty
            return
        self.files.append(
            SpooledFile(
                field_name=part.name,
                filename=part.filename or None,
                content_type=part.content_type,
                path=part.path,
                size=part.size,
                sha256=part.hasher.hexdigest(),
            )
        )

    def _on_end(self) -> None:
        self.ended = True


# -- helpers -------------------------------------------------------------------------


def _boundary(content_type: str | None) -> bytes:
    if not content_type:
        raise MalformedUploadError("no Content-Type: send the upload as multipart/form-data")
    kind, options = parse_options_header(content_type)
    if kind != b"multipart/form-data":
        raise MalformedUploadError(
            f"Content-Type is {_show(kind)}, not multipart/form-data: send the upload as a multipart form"
        )
    boundary = options.get(b"boundary")
    if not boundary:
        raise MalformedUploadError("the multipart Content-Type has no boundary")
    if len(boundary) > 200 or any(c in boundary for c in b"\r\n"):
        raise MalformedUploadError("the multipart boundary is too long or not one line")
    return boundary


def _content_length(value: str | None) -> int | None:
    if value is None:
        return None
    value = value.strip()
    if not value.isdigit() or not value.isascii():
        raise MalformedUploadError(f"invalid Content-Length {value[:32]!r}")
    return int(value)


def _utf8(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise MalformedUploadError(f"{what} is not valid UTF-8") from None


def _clean_filename(raw: bytes) -> str:
    """The client's file name as metadata: UTF-8 (replacement for bad bytes), the last
    path component only, no control characters, at most 255 characters. Never a path."""
    name = raw.decode("utf-8", errors="replace")
    name = name.replace("\\", "/").rsplit("/", 1)[-1]
    name = _CONTROL.sub("", name).strip()
    return name[:MAX_FILENAME_CHARS]


def _show(raw: bytes) -> str:
    return repr(raw[:64].decode("latin-1"))


def _close(handle: BinaryIO) -> None:
    try:
        handle.close()
    except OSError:
        pass


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass
