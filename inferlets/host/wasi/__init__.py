"""The WASI interfaces the host implements itself instead of wasmtime's (see
docs/pie_world_wasi_poll.md): every function whose type mentions a pollable or a stream,
so that Pie's futures are pollables the guest's ``poll`` understands. The rest of WASI
(random, clocks' ``now``, environment, exit) stays wasmtime's. ``wasi:http`` (daemons) is
the host's alone."""

from inferlets.host.wasi.cli import Stderr, Stdin, Stdout
from inferlets.host.wasi.clocks import MonotonicClock
from inferlets.host.wasi.filesystem import FilesystemPreopens, FilesystemTypes
from inferlets.host.wasi.http import HttpOutgoingHandler, HttpTypes
from inferlets.host.wasi.poll import Poll, Pollable, Waiter
from inferlets.host.wasi.sockets import IpNameLookup, Tcp, Udp
from inferlets.host.wasi.streams import InputStream, OutputStream, Streams
from inferlets.host.wasi.version import wasmtime_wasi_version

INTERFACES = (
    Poll,
    Streams,
    Stdout,
    Stderr,
    Stdin,
    MonotonicClock,
    FilesystemTypes,
    FilesystemPreopens,
    Tcp,
    Udp,
    IpNameLookup,
    HttpTypes,
    HttpOutgoingHandler,
)

HOST_ONLY = frozenset({HttpTypes.NAME, HttpOutgoingHandler.NAME})
"""WASI interfaces wasmtime-py's linker does not have at all (``add_wasip2`` has no
wasi:http): every function and resource of them is the host's."""

__all__ = [
    "HOST_ONLY",
    "INTERFACES",
    "InputStream",
    "OutputStream",
    "Pollable",
    "Waiter",
    "wasmtime_wasi_version",
]
