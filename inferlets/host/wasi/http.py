"""``wasi:http/types`` and ``wasi:http/outgoing-handler`` (WASI 0.2): what a daemon inferlet
(a component exporting ``wasi:http/incoming-handler``, served by ``launch_daemon``) uses to
read its request and write its response. Pie 0.4 serves daemons with wasmtime's own
wasi-http; wasmtime-py has no such host, so it is written here on the host's own streams
and pollables.

One request is an ``HttpExchange``: what the server read (method, target, headers, the whole
body, as Pie buffers it) and three callbacks the server gives: the response's head, each
piece of its body as the guest writes it, and its end. The guest gets the request as an
``incoming-request`` and answers through a ``response-outparam``.

Outgoing requests are refused (``HTTP-request-denied``), as sockets are: a daemon reaches
the world only through its own responses.

wasmtime-py's value conventions: ``method``, ``scheme``, ``error-code`` and
``header-error`` are tagged variants (``Variant(tag, payload)``); ``field-value`` is bytes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from wasmtime.component import Variant

from inferlets.host.binding import Err, Interface, Ok, Resource, WitErr, wit
from inferlets.host.wasi.poll import Pollable, always
from inferlets.host.wasi.streams import InputStream, OutputStream

METHODS = ("get", "head", "post", "put", "delete", "connect", "options", "trace", "patch")
MAX_FIELD_NAME = 256
FORBIDDEN_RESPONSE_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "upgrade", "te"})


def method_value(method: str) -> Variant:
    low = method.lower()
    return Variant(low) if low in METHODS else Variant("other", method)


def method_name(v: Any) -> str:
    return (v.payload if v.tag == "other" else v.tag).upper()


def _header_error(tag: str) -> WitErr:
    return WitErr(Variant(tag), f"header error: {tag}")


def _check_name(name: str) -> str:
    if not name or len(name) > MAX_FIELD_NAME or any(c in name for c in ' \t\r\n:()<>@,;\\"/[]?={}'):
        raise _header_error("invalid-syntax")
    return name.lower()


def _check_value(value: bytes) -> bytes:
    if b"\r" in value or b"\n" in value or b"\x00" in value:
        raise _header_error("invalid-syntax")
    return bytes(value)


@dataclass
class HttpExchange:
    """One request to a daemon and the way back for its response (callbacks run on the
    guest's thread; the server makes them thread-safe)."""

    method: str
    path_with_query: str
    headers: list[tuple[str, bytes]]
    body: bytes
    on_head: Callable[[int, list[tuple[str, bytes]]], None]
    on_body: Callable[[bytes], None]
    on_end: Callable[[str | None], None]
    """Called once: None when the body is complete, else why the response failed."""
    scheme: str = "http"
    authority: str | None = None
    answered: bool = field(default=False, init=False)
    ended: bool = field(default=False, init=False)

    def end(self, error: str | None = None) -> None:
        if not self.ended:
            self.ended = True
            self.on_end(error)


# -- resources -------------------------------------------------------------------------------


class Fields(Resource):
    WIT = ("wasi:http/types", "fields")

    def __init__(self, entries: list[tuple[str, bytes]] | None = None, *, immutable: bool = False):
        self.entries = list(entries or [])
        self.immutable = immutable

    def __repr__(self) -> str:
        return f"Fields({len(self.entries)} entries{', immutable' if self.immutable else ''})"

    def mutable(self) -> Fields:
        if self.immutable:
            raise _header_error("immutable")
        return self


class IncomingRequest(Resource):
    WIT = ("wasi:http/types", "incoming-request")

    def __init__(self, exchange: HttpExchange):
        self.exchange = exchange
        self.consumed = False


class IncomingBody(Resource):
    WIT = ("wasi:http/types", "incoming-body")

    def __init__(self, data: bytes):
        self.data = data
        self.streamed = False


class FutureTrailers(Resource):
    WIT = ("wasi:http/types", "future-trailers")

    def __init__(self) -> None:
        self.taken = False


class OutgoingResponse(Resource):
    WIT = ("wasi:http/types", "outgoing-response")

    def __init__(self, headers: Fields):
        self.status = 200
        self.headers = headers
        headers.immutable = True
        self.body: OutgoingBody | None = None


class OutgoingBody(Resource):
    WIT = ("wasi:http/types", "outgoing-body")

    def __init__(self) -> None:
        self.exchange: HttpExchange | None = None  # set when the response is sent
        self.sink: Callable[[bytes], None] | None = None  # set when the response is sent
        self.held: list[bytes] = []  # written before the response was set
        self.stream_taken = False
        self.finished = False

    def write(self, data: bytes) -> None:
        if self.finished:
            raise WitErr(None, "the outgoing-body is finished: its stream is closed")
        if self.sink is None:
            self.held.append(data)
        else:
            self.sink(data)

    def connect(self, sink: Callable[[bytes], None]) -> None:
        self.sink = sink
        held, self.held = self.held, []
        for data in held:
            sink(data)


class ResponseOutparam(Resource):
    WIT = ("wasi:http/types", "response-outparam")

    def __init__(self, exchange: HttpExchange):
        self.exchange = exchange


class OutgoingRequest(Resource):
    WIT = ("wasi:http/types", "outgoing-request")

    def __init__(self, headers: Fields):
        self.method: Any = Variant("get")
        self.path_with_query: str | None = None
        self.scheme: Any = None
        self.authority: str | None = None
        self.headers = headers
        headers.immutable = True
        self.body_taken = False


class RequestOptions(Resource):
    WIT = ("wasi:http/types", "request-options")

    def __init__(self) -> None:
        self.connect: int | None = None
        self.first_byte: int | None = None
        self.between_bytes: int | None = None


class IncomingResponse(Resource):
    """Never made: outgoing requests are refused."""

    WIT = ("wasi:http/types", "incoming-response")


class FutureIncomingResponse(Resource):
    """Never made: outgoing requests are refused."""

    WIT = ("wasi:http/types", "future-incoming-response")


DENIED = Variant("HTTP-request-denied")


class HttpTypes(Interface):
    NAME = "wasi:http/types"
    RESOURCES = (
        Fields,
        IncomingRequest,
        OutgoingRequest,
        RequestOptions,
        ResponseOutparam,
        IncomingResponse,
        IncomingBody,
        FutureTrailers,
        OutgoingResponse,
        OutgoingBody,
        FutureIncomingResponse,
    )

    @wit("http-error-code")
    def http_error_code(self, err: Any) -> Any:
        return None

    # fields
    @wit("[constructor]fields")
    def fields_new(self) -> Fields:
        return Fields()

    @wit("[static]fields.from-list")
    def fields_from_list(self, entries: list[tuple[str, bytes]]) -> Fields:
        return Fields([(_check_name(n), _check_value(v)) for n, v in entries])

    @wit("[method]fields.get")
    def fields_get(self, f: Fields, name: str) -> list[bytes]:
        low = name.lower()
        return [v for n, v in f.entries if n == low]

    @wit("[method]fields.has")
    def fields_has(self, f: Fields, name: str) -> bool:
        low = name.lower()
        return any(n == low for n, _ in f.entries)

    @wit("[method]fields.set")
    def fields_set(self, f: Fields, name: str, values: list[bytes]) -> None:
        low = _check_name(name)
        checked = [_check_value(v) for v in values]
        f.mutable().entries = [(n, v) for n, v in f.entries if n != low] + [(low, v) for v in checked]

    @wit("[method]fields.delete")
    def fields_delete(self, f: Fields, name: str) -> None:
        low = _check_name(name)
        f.mutable().entries = [(n, v) for n, v in f.entries if n != low]

    @wit("[method]fields.append")
    def fields_append(self, f: Fields, name: str, value: bytes) -> None:
        f.mutable().entries.append((_check_name(name), _check_value(value)))

    @wit("[method]fields.entries")
    def fields_entries(self, f: Fields) -> list[tuple[str, bytes]]:
        return list(f.entries)

    @wit("[method]fields.clone")
    def fields_clone(self, f: Fields) -> Fields:
        return Fields(f.entries)

    # incoming-request
    @wit("[method]incoming-request.method")
    def request_method(self, r: IncomingRequest) -> Variant:
        return method_value(r.exchange.method)

    @wit("[method]incoming-request.path-with-query")
    def request_path(self, r: IncomingRequest) -> str | None:
        return r.exchange.path_with_query

    @wit("[method]incoming-request.scheme")
    def request_scheme(self, r: IncomingRequest) -> Variant:
        s = r.exchange.scheme
        return Variant("HTTP") if s == "http" else Variant("HTTPS") if s == "https" else Variant("other", s)

    @wit("[method]incoming-request.authority")
    def request_authority(self, r: IncomingRequest) -> str | None:
        return r.exchange.authority

    @wit("[method]incoming-request.headers")
    def request_headers(self, r: IncomingRequest) -> Fields:
        return Fields(r.exchange.headers, immutable=True)

    @wit("[method]incoming-request.consume")
    def request_consume(self, r: IncomingRequest) -> IncomingBody:
        if r.consumed:
            raise WitErr(None, "the request's body was consumed already")
        r.consumed = True
        return IncomingBody(r.exchange.body)

    # incoming-body, future-trailers
    @wit("[method]incoming-body.stream")
    def body_stream(self, b: IncomingBody) -> InputStream:
        if b.streamed:
            raise WitErr(None, "the body's stream was taken already")
        b.streamed = True
        view = memoryview(b.data)
        at = [0]

        def read(n: int) -> bytes:
            chunk = bytes(view[at[0] : at[0] + n])
            at[0] += len(chunk)
            return chunk

        return InputStream(read)

    @wit("[static]incoming-body.finish")
    def body_finish(self, b: IncomingBody) -> FutureTrailers:
        return FutureTrailers()

    @wit("[method]future-trailers.subscribe")
    def trailers_subscribe(self, f: FutureTrailers) -> Pollable:
        return always()

    @wit("[method]future-trailers.get")
    def trailers_get(self, f: FutureTrailers) -> Any:
        if f.taken:
            return Err(None)
        f.taken = True
        return Ok(Ok(None))  # no trailers (the server read the whole body)

    # outgoing-response, outgoing-body
    @wit("[constructor]outgoing-response")
    def response_new(self, headers: Fields) -> OutgoingResponse:
        return OutgoingResponse(headers)

    @wit("[method]outgoing-response.status-code")
    def response_status(self, r: OutgoingResponse) -> int:
        return r.status

    @wit("[method]outgoing-response.set-status-code")
    def response_set_status(self, r: OutgoingResponse, status: int) -> None:
        if not 100 <= status <= 999:
            raise WitErr(None, f"status {status} is not an HTTP status code")
        r.status = status

    @wit("[method]outgoing-response.headers")
    def response_headers(self, r: OutgoingResponse) -> Fields:
        return r.headers

    @wit("[method]outgoing-response.body")
    def response_body(self, r: OutgoingResponse) -> OutgoingBody:
        if r.body is not None:
            raise WitErr(None, "the response's body was taken already")
        r.body = OutgoingBody()
        return r.body

    @wit("[method]outgoing-body.write")
    def outgoing_write(self, b: OutgoingBody) -> OutputStream:
        if b.stream_taken:
            raise WitErr(None, "the body's stream was taken already")
        b.stream_taken = True
        return OutputStream(b.write)

    @wit("[static]outgoing-body.finish")
    def outgoing_finish(self, b: OutgoingBody, trailers: Fields | None) -> None:
        b.finished = True
        if b.exchange is not None:
            b.exchange.end(None)

    # response-outparam
    @wit("[static]response-outparam.set")
    def outparam_set(self, param: ResponseOutparam, response: Any) -> None:
        ex = param.exchange
        if ex.answered:
            raise RuntimeError("the response was set already")
        ex.answered = True
        if isinstance(response, Err):
            ex.on_head(500, [("content-type", b"text/plain; charset=utf-8")])
            ex.on_body(f"the daemon answered with an error: {_error_text(response.value)}\n".encode())
            ex.end(None)
            return
        r: OutgoingResponse = response.value
        headers = [(n, v) for n, v in r.headers.entries if n not in FORBIDDEN_RESPONSE_HEADERS]
        ex.on_head(r.status, headers)
        if r.body is None:
            r.body = OutgoingBody()
        r.body.exchange = ex
        r.body.connect(ex.on_body)
        if r.body.finished:
            ex.end(None)

    # outgoing-request and request-options: built, never sent (the handler refuses)
    @wit("[constructor]outgoing-request")
    def request_new(self, headers: Fields) -> OutgoingRequest:
        return OutgoingRequest(headers)

    @wit("[method]outgoing-request.body")
    def out_request_body(self, r: OutgoingRequest) -> OutgoingBody:
        if r.body_taken:
            raise WitErr(None, "the request's body was taken already")
        r.body_taken = True
        return OutgoingBody()

    @wit("[method]outgoing-request.method")
    def out_request_method(self, r: OutgoingRequest) -> Variant:
        return r.method

    @wit("[method]outgoing-request.set-method")
    def out_request_set_method(self, r: OutgoingRequest, m: Variant) -> None:
        r.method = m

    @wit("[method]outgoing-request.path-with-query")
    def out_request_path(self, r: OutgoingRequest) -> str | None:
        return r.path_with_query

    @wit("[method]outgoing-request.set-path-with-query")
    def out_request_set_path(self, r: OutgoingRequest, p: str | None) -> None:
        r.path_with_query = p

    @wit("[method]outgoing-request.scheme")
    def out_request_scheme(self, r: OutgoingRequest) -> Any:
        return r.scheme

    @wit("[method]outgoing-request.set-scheme")
    def out_request_set_scheme(self, r: OutgoingRequest, s: Any) -> None:
        r.scheme = s

    @wit("[method]outgoing-request.authority")
    def out_request_authority(self, r: OutgoingRequest) -> str | None:
        return r.authority

    @wit("[method]outgoing-request.set-authority")
    def out_request_set_authority(self, r: OutgoingRequest, a: str | None) -> None:
        r.authority = a

    @wit("[method]outgoing-request.headers")
    def out_request_headers(self, r: OutgoingRequest) -> Fields:
        return r.headers

    @wit("[constructor]request-options")
    def options_new(self) -> RequestOptions:
        return RequestOptions()

    @wit("[method]request-options.connect-timeout")
    def options_connect(self, o: RequestOptions) -> int | None:
        return o.connect

    @wit("[method]request-options.set-connect-timeout")
    def options_set_connect(self, o: RequestOptions, d: int | None) -> None:
        o.connect = d

    @wit("[method]request-options.first-byte-timeout")
    def options_first_byte(self, o: RequestOptions) -> int | None:
        return o.first_byte

    @wit("[method]request-options.set-first-byte-timeout")
    def options_set_first_byte(self, o: RequestOptions, d: int | None) -> None:
        o.first_byte = d

    @wit("[method]request-options.between-bytes-timeout")
    def options_between(self, o: RequestOptions) -> int | None:
        return o.between_bytes

    @wit("[method]request-options.set-between-bytes-timeout")
    def options_set_between(self, o: RequestOptions, d: int | None) -> None:
        o.between_bytes = d

    @wit("[method]future-incoming-response.subscribe")
    def incoming_response_subscribe(self, f: FutureIncomingResponse) -> Pollable:
        return always()

    @wit("[method]future-incoming-response.get")
    def incoming_response_get(self, f: FutureIncomingResponse) -> Any:
        return Ok(Err(DENIED))


class HttpOutgoingHandler(Interface):
    NAME = "wasi:http/outgoing-handler"

    @wit("handle")
    def handle(self, request: OutgoingRequest, options: RequestOptions | None) -> Any:
        raise WitErr(DENIED, "a daemon inferlet makes no outgoing HTTP requests here")


def _error_text(v: Any) -> str:
    if isinstance(v, Variant):
        return v.tag if v.payload is None else f"{v.tag}: {v.payload}"
    return str(v)
