"""``wasi:sockets``: refused. The functions that mention a stream or pollable are the
host's (so the types line up); wasmtime's own socket calls are denied by its default
configuration, so no socket ever opens."""

from __future__ import annotations

from inferlets.host.binding import Interface, WitErr, wit
from inferlets.host.wasi.poll import Pollable, always


def _denied() -> WitErr:
    return WitErr("access-denied", "sockets are not available to inferlets")


class Tcp(Interface):
    NAME = "wasi:sockets/tcp"

    @wit("[method]tcp-socket.accept")
    def accept(self, sock: object) -> None:
        raise _denied()

    @wit("[method]tcp-socket.finish-connect")
    def finish_connect(self, sock: object) -> None:
        raise _denied()

    @wit("[method]tcp-socket.subscribe")
    def subscribe(self, sock: object) -> Pollable:
        return always()


class Udp(Interface):
    NAME = "wasi:sockets/udp"

    @wit("[method]udp-socket.subscribe")
    def subscribe(self, sock: object) -> Pollable:
        return always()

    @wit("[method]incoming-datagram-stream.subscribe")
    def in_subscribe(self, s: object) -> Pollable:
        return always()

    @wit("[method]outgoing-datagram-stream.subscribe")
    def out_subscribe(self, s: object) -> Pollable:
        return always()


class IpNameLookup(Interface):
    NAME = "wasi:sockets/ip-name-lookup"

    @wit("[method]resolve-address-stream.subscribe")
    def subscribe(self, s: object) -> Pollable:
        return always()
