"""``wasi:cli/stdout|stderr|stdin``: the guest's output goes to the run's ``stdout`` /
``stderr`` events (``host.output_stream(name)``); stdin is empty."""

from __future__ import annotations

from inferlets.host.binding import Interface, wit
from inferlets.host.wasi.streams import InputStream, OutputStream


class Stdout(Interface):
    NAME = "wasi:cli/stdout"

    @wit("get-stdout")
    def get(self) -> OutputStream:
        return self.host.output_stream("stdout")


class Stderr(Interface):
    NAME = "wasi:cli/stderr"

    @wit("get-stderr")
    def get(self) -> OutputStream:
        return self.host.output_stream("stderr")


class Stdin(Interface):
    NAME = "wasi:cli/stdin"

    @wit("get-stdin")
    def get(self) -> InputStream:
        return InputStream(lambda n: b"")
