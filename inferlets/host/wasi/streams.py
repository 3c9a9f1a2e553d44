"""``wasi:io/streams``: the host's own input and output streams (a guest's stdout and
stderr, files of its sandbox). Reads and writes never block: an output stream takes
everything at once, an input stream holds its bytes. A stream past its end, or dropped,
is ``closed``; a file stream whose read or write fails (``StreamFailed``: its sandbox is
full, ...) answers ``last-operation-failed`` with an ``error`` (``wasi:io/error``, the
host's too) that ``wasi:filesystem``'s ``filesystem-error-code`` turns into the error code.

wasmtime-py sees ``stream-error`` as an untagged variant (an own handle or nothing):
``closed`` is None, ``last-operation-failed`` the error's handle."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from inferlets.host.binding import Interface, Resource, WitErr, wit
from inferlets.host.wasi.poll import Pollable, always

WRITE_BUDGET = 1 << 20
CLOSED = None


class StreamFailed(Exception):
    """Raised by a stream's read or write callback: the operation failed with ``code`` (a
    ``wasi:filesystem`` ``error-code`` case name)."""

    def __init__(self, code: str, message: str = ""):
        super().__init__(message or code)
        self.code = code


class StreamError(Resource):
    """``wasi:io/error``'s ``error``: what a failed stream operation hands the guest."""

    WIT = ("wasi:io/error", "error")

    def __init__(self, code: str, message: str):
        self.code = code
        self.message = message


class IoError(Interface):
    NAME = "wasi:io/error"
    RESOURCES = (StreamError,)

    @wit("[method]error.to-debug-string")
    def to_debug_string(self, e: StreamError) -> str:
        return f"{e.code}: {e.message}" if e.message else e.code


class OutputStream(Resource):
    WIT = ("wasi:io/streams", "output-stream")

    def __init__(self, write: Callable[[bytes], None], flush: Callable[[], None] | None = None):
        self._write = write
        self._flush = flush
        self.closed = False

    def write(self, data: bytes) -> None:
        if self.closed:
            raise WitErr(CLOSED)
        self._write(bytes(data))

    def flush(self) -> None:
        if self._flush is not None:
            self._flush()

    def close(self) -> None:
        if not self.closed:
            self.flush()
        self.closed = True


class InputStream(Resource):
    """Bytes from ``read(n) -> bytes`` (b"" at the end)."""

    WIT = ("wasi:io/streams", "input-stream")

    def __init__(self, read: Callable[[int], bytes] | None = None):
        self._read = read

    def read(self, n: int) -> bytes:
        if self._read is None:
            raise WitErr(CLOSED)
        data = self._read(n)
        if not data and n:
            raise WitErr(CLOSED)
        return data


class Streams(Interface):
    NAME = "wasi:io/streams"
    RESOURCES = (InputStream, OutputStream)

    def _io(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, a ``StreamFailed`` made ``last-operation-failed``."""
        try:
            return fn(*args)
        except StreamFailed as e:
            raise WitErr(self.host.table.own(StreamError(e.code, str(e))), str(e)) from None

    # input
    @wit("[method]input-stream.read")
    def read(self, s: InputStream, n: int) -> bytes:
        return self._io(s.read, min(int(n), WRITE_BUDGET))

    @wit("[method]input-stream.blocking-read")
    def blocking_read(self, s: InputStream, n: int) -> bytes:
        return self.read(s, n)

    @wit("[method]input-stream.skip")
    def skip(self, s: InputStream, n: int) -> int:
        return len(self.read(s, n))

    @wit("[method]input-stream.blocking-skip")
    def blocking_skip(self, s: InputStream, n: int) -> int:
        return self.skip(s, n)

    @wit("[method]input-stream.subscribe")
    def in_subscribe(self, s: InputStream) -> Pollable:
        return always()

    # output
    @wit("[method]output-stream.check-write")
    def check_write(self, s: OutputStream) -> int:
        if s.closed:
            raise WitErr(CLOSED)
        return WRITE_BUDGET

    @wit("[method]output-stream.write")
    def write(self, s: OutputStream, data: bytes) -> None:
        self._io(s.write, data)

    @wit("[method]output-stream.blocking-write-and-flush")
    def blocking_write_and_flush(self, s: OutputStream, data: bytes) -> None:
        self._io(s.write, data)
        self._io(s.flush)

    @wit("[method]output-stream.flush")
    def flush(self, s: OutputStream) -> None:
        self._io(s.flush)

    @wit("[method]output-stream.blocking-flush")
    def blocking_flush(self, s: OutputStream) -> None:
        self._io(s.flush)

    @wit("[method]output-stream.subscribe")
    def out_subscribe(self, s: OutputStream) -> Pollable:
        return always()

    @wit("[method]output-stream.write-zeroes")
    def write_zeroes(self, s: OutputStream, n: int) -> None:
        self._io(s.write, bytes(min(int(n), WRITE_BUDGET)))

    @wit("[method]output-stream.blocking-write-zeroes-and-flush")
    def blocking_write_zeroes_and_flush(self, s: OutputStream, n: int) -> None:
        self.write_zeroes(s, n)
        self._io(s.flush)

    @wit("[method]output-stream.splice")
    def splice(self, s: OutputStream, src: InputStream, n: int) -> int:
        data = self._io(src.read, min(int(n), WRITE_BUDGET))
        self._io(s.write, data)
        return len(data)

    @wit("[method]output-stream.blocking-splice")
    def blocking_splice(self, s: OutputStream, src: InputStream, n: int) -> int:
        return self.splice(s, src, n)
