"""``wasi:filesystem``: the three calls whose types mention a stream are the host's; with
no stream over wasmtime's descriptors they answer ``unsupported`` (directory calls, stat
and the preopens stay wasmtime's)."""

from __future__ import annotations

from inferlets.host.binding import Interface, WitErr, wit


def _unsupported() -> WitErr:
    return WitErr("unsupported", "file streams are not available")


class FilesystemTypes(Interface):
    NAME = "wasi:filesystem/types"

    @wit("[method]descriptor.read-via-stream")
    def read_via_stream(self, d: object, offset: int) -> None:
        raise _unsupported()

    @wit("[method]descriptor.write-via-stream")
    def write_via_stream(self, d: object, offset: int) -> None:
        raise _unsupported()

    @wit("[method]descriptor.append-via-stream")
    def append_via_stream(self, d: object) -> None:
        raise _unsupported()


class FilesystemPreopens(Interface):
    NAME = "wasi:filesystem/preopens"
