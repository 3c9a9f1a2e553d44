"""API keys, the SSRF-checked media fetcher and the file:// policy, against real servers.

Every fetch goes over a real socket to a ``ThreadingHTTPServer`` on 127.0.0.x. Tests that
need a "public" hostname use the fetcher's two documented injection points: ``resolve``
(here: a table, so ``allowed.test`` names the local server) and ``trusted_addresses``
(127.0.0.1 passes the address check; nothing else does).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
import secrets
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from fastapi import Depends, FastAPI
from fastapi.testclient import TestClient

from api.http.security.keys import (
    ApiKeys,
    ApiKeysRequiredError,
    LocalMediaPolicy,
    MediaFetcher,
    RemoteMediaFetchError,
    RemoteMediaForbiddenError,
    RemoteMediaTimeoutError,
    RemoteMediaTooLargeError,
    address_refusal,
    bearer_auth,
    require_keys_or_loopback,
)
from media import PieMediaError

Route = Callable[[BaseHTTPRequestHandler], None]


# ---------------------------------------------------------------------------------------
# A real tiny HTTP(S) server


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    routes: dict[str, Route]
    hits: list[tuple[str, dict[str, str]]]
    stop: threading.Event
    state: dict


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def do_GET(self) -> None:
        self.server.hits.append((self.path, dict(self.headers)))
        route = self.server.routes.get(self.path.split("?", 1)[0])
        if route is None:
            self.send_error(404)
        else:
            route(self)

    def log_message(self, *args: object) -> None:
        pass


@dataclass
class Local:
    server: _Server
    host: str
    port: int
    sni: list[str | None] = field(default_factory=list)

    def url(self, path: str = "/", *, host: str | None = None, scheme: str = "http") -> str:
        return f"{scheme}://{host or self.host}:{self.port}{path}"

    @property
    def hits(self) -> list[tuple[str, dict[str, str]]]:
        return self.server.hits

    @property
    def state(self) -> dict:
        return self.server.state


@contextlib.contextmanager
def serve(
    routes: dict[str, Route], host: str = "127.0.0.1", tls: ssl.SSLContext | None = None
) -> Iterator[Local]:
    server = _Server((host, 0), _Handler)
    server.routes, server.hits, server.stop, server.state = routes, [], threading.Event(), {}
    local = Local(server, host, server.server_address[1])
    if tls is not None:
        tls.sni_callback = lambda sock, name, ctx: local.sni.append(name)
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield local
    finally:
        server.stop.set()
        server.shutdown()
        server.server_close()
        thread.join(5)


def body(data: bytes, content_type: str = "application/octet-stream") -> Route:
    def route(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", content_type)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    return route


def redirect(location: str, status: int = 302) -> Route:
    def route(h: BaseHTTPRequestHandler) -> None:
        h.send_response(status)
        h.send_header("Location", location)
        h.send_header("Content-Length", "0")
        h.end_headers()

    return route


def run(coro):
    return asyncio.run(coro)


def table(mapping: dict[str, list[str]]) -> Callable[[str, int], list[str]]:
    """A resolver that answers from ``mapping`` and fails like DNS for anything else."""

    def resolve(host: str, port: int) -> list[str]:
        if host in mapping:
            return mapping[host]
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    return resolve


def trusted_fetcher(**kw) -> MediaFetcher:
    """``allowed.test`` and its subdomains name 127.0.0.1, which this fetcher trusts."""
    names = {"allowed.test": ["127.0.0.1"], "img.allowed.test": ["127.0.0.1"], "other.test": ["127.0.0.1"]}
    kw.setdefault("allow_http", True)
    return MediaFetcher(resolve=table(names), trusted_addresses={"127.0.0.1"}, **kw)


# ---------------------------------------------------------------------------------------
# Addresses


@pytest.mark.parametrize(
    "address, reason",
    [
        ("127.0.0.1", "loopback"),
        ("127.255.0.9", "loopback"),
        ("::1", "loopback"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("fd12::1", "private"),
        ("100.64.0.1", "shared (carrier-grade NAT)"),
        ("169.254.1.1", "link-local"),
        ("fe80::1", "link-local"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("240.0.0.1", "private"),  # Python files 240/4 under is_private too
        ("255.255.255.255", "private"),
        ("192.0.2.7", "private"),  # documentation ranges are not routable
        ("169.254.169.254", "cloud metadata endpoint"),
        ("fd00:ec2::254", "cloud metadata endpoint"),
        ("100.100.100.200", "cloud metadata endpoint"),
        ("::ffff:127.0.0.1", "IPv4-mapped loopback"),
        ("::ffff:169.254.169.254", "IPv4-mapped cloud metadata endpoint"),
        ("::127.0.0.1", "IPv4-compatible loopback"),
        ("::10.0.0.1", "IPv4-compatible private"),
        ("64:ff9b::10.0.0.1", "NAT64 private"),
        ("64:ff9b::127.0.0.1", "NAT64 loopback"),
        ("64:ff9b:1::1", "local-use NAT64"),
        ("2002:7f00:1::1", "6to4 loopback"),
        ("2001:db8::1", "private"),
        ("fec0::1", "site-local"),
    ],
)
def test_non_public_addresses_are_refused(address: str, reason: str) -> None:
    assert address_refusal(address) == reason


@pytest.mark.parametrize(
    "address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "64:ff9b::8.8.8.8", "::ffff:8.8.8.8"]
)
def test_public_addresses_pass(address: str) -> None:
    assert address_refusal(address) is None


# ---------------------------------------------------------------------------------------
# URL rules (no network)


def test_https_only_by_default_and_no_dns_for_refused_urls() -> None:
    asked: list[str] = []

    def resolve(host: str, port: int) -> list[str]:
        asked.append(host)
        return ["8.8.8.8"]

    f = MediaFetcher(resolve=resolve)
    for url, reason in [
        ("http://example.com/a.png", "scheme"),
        ("ftp://example.com/a.png", "scheme"),
        ("file:///etc/passwd", "scheme"),
        ("gopher://example.com/", "scheme"),
        ("https://user:hunter2@example.com/a.png", "credentials"),
        ("https://:hunter2@example.com/a.png", "credentials"),
        ("https:///a.png", "invalid_url"),
        ("https://exa mple.com/", "invalid_url"),
    ]:
        with pytest.raises(RemoteMediaForbiddenError) as e:
            run(f.fetch(url))
        assert e.value.code == "remote_media_forbidden"
        assert e.value.details["reason"] == reason, url
        assert "hunter2" not in str(e.value) and "hunter2" not in repr(e.value.to_dict())
    assert asked == []
    assert "--allow-http-media" in str(
        pytest.raises(RemoteMediaForbiddenError, f.check_url, "http://x.org/").value
    )


def test_domain_allowlist_is_exact_or_subdomain_case_insensitive_idna() -> None:
    f = MediaFetcher(allowed_domains=["Images.Example.COM", "bücher.example", ".cdn.test"])
    assert f.allowed_domains == ("cdn.test", "images.example.com", "xn--bcher-kva.example")
    for ok in [
        "https://images.example.com/a.png",
        "https://IMAGES.example.com./a.png",
        "https://a.b.images.example.com:8443/a.png",
        "https://BÜCHER.example/cover.jpg",
        "https://xn--bcher-kva.example/cover.jpg",
        "https://www.bücher.example/cover.jpg",
        "https://cdn.test/x",
    ]:
        f.check_url(ok)
    for bad in [
        "https://example.com/a.png",
        "https://evilimages.example.com/a.png",
        "https://images.example.com.evil.org/a.png",
        "https://bucher.example/",
        "https://8.8.8.8/a.png",
    ]:
        with pytest.raises(RemoteMediaForbiddenError) as e:
            f.check_url(bad)
        assert e.value.details["reason"] == "domain", bad
        assert "images.example.com" in str(e.value)
    with pytest.raises(ValueError):
        MediaFetcher(allowed_domains=["https://example.com/"])


# ---------------------------------------------------------------------------------------
# Addresses over real sockets


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        "localhost",
        "[::1]",
        "127.1",
        "0x7f.1",
        "2130706433",
        "[::ffff:127.0.0.1]",
        "[::ffff:7f00:1]",
        "0.0.0.0",
        "[::]",
        "127.0.0.2",
    ],
)
def test_loopback_refused_by_default_in_every_spelling(host: str) -> None:
    with serve({"/": body(b"secret")}) as srv:
        f = MediaFetcher(allow_http=True)
        with pytest.raises(RemoteMediaForbiddenError) as e:
            run(f.fetch(srv.url("/", host=host)))
        assert e.value.details["reason"] == "address"
        assert srv.hits == []


def test_private_networks_flag_fetches_exact_bytes() -> None:
    data = secrets.token_bytes(300_000)
    with serve({"/img.bin": body(data, "image/png")}) as srv:
        f = MediaFetcher(allow_http=True, allow_private_networks=True)
        got = run(f.fetch(srv.url("/img.bin?sig=1")))
        assert got.data == data
        assert got.content_type == "image/png"
        assert got.final_url == srv.url("/img.bin?sig=1")
        ((path, headers),) = srv.hits
        assert headers["Connection"] == "close" and headers["Host"] == f"127.0.0.1:{srv.port}"


def test_private_networks_flag_still_refuses_cloud_metadata() -> None:
    f = MediaFetcher(allow_http=True, allow_private_networks=True, total_timeout=2)
    for url in [
        "http://169.254.169.254/latest/meta-data/",
        "http://[::ffff:169.254.169.254]/",
        "http://[fd00:ec2::254]/",
    ]:
        with pytest.raises(RemoteMediaForbiddenError) as e:
            run(f.fetch(url))
        assert "metadata" in str(e.value)


def test_any_non_public_answer_refuses_the_host() -> None:
    f = MediaFetcher(resolve=table({"mixed.test": ["8.8.8.8", "10.0.0.7"]}))
    with pytest.raises(RemoteMediaForbiddenError) as e:
        run(f.fetch("https://mixed.test/a.png"))
    assert e.value.details["address"] == "10.0.0.7"
    assert "mixed.test" in str(e.value) and "private" in str(e.value)


def test_pinned_ip_keeps_the_host_header() -> None:
    with serve({"/a": body(b"ok")}) as srv:
        got = run(trusted_fetcher().fetch(srv.url("/a", host="img.allowed.test")))
        assert got.data == b"ok" and got.final_url == srv.url("/a", host="img.allowed.test")
        assert srv.hits[0][1]["Host"] == f"img.allowed.test:{srv.port}"


def test_domain_allowlist_over_a_real_fetch() -> None:
    with serve({"/a": body(b"ok")}) as srv:
        f = trusted_fetcher(allowed_domains=["allowed.test"])
        assert run(f.fetch(srv.url("/a", host="img.allowed.test"))).data == b"ok"
        with pytest.raises(RemoteMediaForbiddenError):
            run(f.fetch(srv.url("/a", host="other.test")))
        assert len(srv.hits) == 1


# ---------------------------------------------------------------------------------------
# Redirects


def test_relative_redirects_are_followed() -> None:
    with serve({"/start": redirect("/mid"), "/mid": redirect("final", 307), "/final": body(b"done")}) as srv:
        got = run(trusted_fetcher().fetch(srv.url("/start", host="allowed.test")))
        assert got.data == b"done" and got.final_url == srv.url("/final", host="allowed.test")


def test_redirect_to_loopback_is_refused_at_the_hop() -> None:
    with serve({"/secret": body(b"internal")}, host="127.0.0.2") as inner:
        with serve({"/start": redirect(inner.url("/secret"))}) as outer:
            with pytest.raises(RemoteMediaForbiddenError) as e:
                run(trusted_fetcher().fetch(outer.url("/start", host="allowed.test")))
            assert e.value.details == {"reason": "address", "host": "127.0.0.2", "address": "127.0.0.2"}
            assert len(outer.hits) == 1
        assert inner.hits == []


@pytest.mark.parametrize(
    "location, reason",
    [
        ("http://169.254.169.254/latest/meta-data/iam/", "address"),
        ("http://[::ffff:169.254.169.254]/", "address"),
        ("http://10.0.0.1/", "address"),
        ("http://localhost:{port}/x", "address"),
        ("file:///etc/passwd", "scheme"),
        ("http://admin:pw@allowed.test:{port}/x", "credentials"),
        ("https://evil.example/x", "domain"),
    ],
)
def test_every_redirect_hop_is_rechecked(location: str, reason: str) -> None:
    with serve({}) as srv:
        srv.server.routes["/start"] = redirect(location.format(port=srv.port))
        f = MediaFetcher(
            allow_http=True,
            allowed_domains=[
                "allowed.test",
                "localhost",
                "169.254.169.254",
                "10.0.0.1",
                "::ffff:169.254.169.254",
            ],
            resolve=table({"allowed.test": ["127.0.0.1"], "localhost": ["127.0.0.1", "::1"]}),
            trusted_addresses={"127.0.0.1"},
        )
        with pytest.raises(RemoteMediaForbiddenError) as e:
            run(f.fetch(srv.url("/start", host="allowed.test")))
        assert e.value.details["reason"] == reason
        assert "pw" not in str(e.value)
        assert [p for p, _ in srv.hits] == ["/start"]


def test_too_many_redirects() -> None:
    with serve({f"/r{i}": redirect(f"/r{i + 1}") for i in range(10)}) as srv:
        with pytest.raises(RemoteMediaForbiddenError) as e:
            run(trusted_fetcher(max_redirects=3).fetch(srv.url("/r0", host="allowed.test")))
        assert e.value.details == {"reason": "redirects", "limit": 3}
        assert [p for p, _ in srv.hits] == ["/r0", "/r1", "/r2", "/r3"]
        with pytest.raises(RemoteMediaForbiddenError):
            run(trusted_fetcher(max_redirects=0).fetch(srv.url("/r0", host="allowed.test")))


# ---------------------------------------------------------------------------------------
# Failures, timeouts, caps


def test_non_2xx_is_unreachable_with_the_status() -> None:
    def teapot(h: BaseHTTPRequestHandler) -> None:
        h.send_response(503)
        h.send_header("Content-Length", "0")
        h.end_headers()

    with serve({"/busy": teapot, "/nowhere": redirect("")}) as srv:
        f = trusted_fetcher()
        with pytest.raises(RemoteMediaFetchError) as e:
            run(f.fetch(srv.url("/missing?token=s3cr3t", host="allowed.test")))
        assert e.value.code == "remote_media_unreachable" and e.value.details["status"] == 404
        assert "404" in str(e.value) and "s3cr3t" not in str(e.value)
        with pytest.raises(RemoteMediaFetchError) as e:
            run(f.fetch(srv.url("/busy", host="allowed.test")))
        assert e.value.details["status"] == 503
        with pytest.raises(RemoteMediaFetchError) as e:  # a redirect without a Location
            run(f.fetch(srv.url("/nowhere", host="allowed.test")))
        assert e.value.details["status"] == 302


def test_dns_failure_and_refused_connection_are_unreachable() -> None:
    f = trusted_fetcher()
    with pytest.raises(RemoteMediaFetchError) as e:
        run(f.fetch("http://no-such-host.test/a.png"))
    assert "could not be resolved" in str(e.value)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before the fetch: nothing listens there
    with pytest.raises(RemoteMediaFetchError) as e:
        run(f.fetch(f"http://allowed.test:{port}/a.png"))
    assert "ConnectError" in str(e.value)


def test_drip_feeding_server_hits_the_total_deadline() -> None:
    def drip(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Length", "1000")
        h.end_headers()
        while not h.server.stop.wait(0.05):
            try:
                h.wfile.write(b"x")
                h.wfile.flush()
            except OSError:
                return

    with serve({"/drip": drip}) as srv:
        f = trusted_fetcher(read_timeout=0.5, total_timeout=1.0)
        t0 = time.monotonic()
        with pytest.raises(RemoteMediaTimeoutError) as e:
            run(f.fetch(srv.url("/drip", host="allowed.test")))
        elapsed = time.monotonic() - t0
        assert 0.9 < elapsed < 3.0
        assert e.value.code == "remote_media_timeout" and "1 s limit" in str(e.value)


def test_silent_server_hits_the_read_timeout() -> None:
    def silent(h: BaseHTTPRequestHandler) -> None:
        h.server.stop.wait(10)

    with serve({"/silent": silent}) as srv:
        f = trusted_fetcher(read_timeout=0.3, total_timeout=5.0)
        t0 = time.monotonic()
        with pytest.raises(RemoteMediaTimeoutError):
            run(f.fetch(srv.url("/silent", host="allowed.test")))
        assert time.monotonic() - t0 < 2.0


def test_content_length_over_the_cap_is_refused_before_reading() -> None:
    def announce(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Length", str(10**9))
        h.end_headers()
        h.wfile.write(b"0123456789")
        h.wfile.flush()
        h.server.stop.wait(10)  # reading the body would hang until the read timeout

    with serve({"/big": announce}) as srv:
        f = trusted_fetcher(max_bytes=1000, read_timeout=5.0, total_timeout=5.0)
        t0 = time.monotonic()
        with pytest.raises(RemoteMediaTooLargeError) as e:
            run(f.fetch(srv.url("/big", host="allowed.test")))
        assert time.monotonic() - t0 < 1.5
        assert (e.value.code, e.value.limit, e.value.actual) == ("remote_media_too_large", 1000, 10**9)


def test_chunked_body_is_stopped_once_it_passes_the_cap() -> None:
    total = 64 * 1024 * 1024

    def endless(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        chunk = b"x" * 4096
        sent = 0
        try:
            while sent < total and not h.server.stop.is_set():
                h.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                sent += len(chunk)
        except OSError:
            pass
        h.server.state["sent"] = sent
        h.server.state["done"] = True

    with serve({"/endless": endless}) as srv:
        f = trusted_fetcher(max_bytes=50_000)
        with pytest.raises(RemoteMediaTooLargeError) as e:
            run(f.fetch(srv.url("/endless", host="allowed.test")))
        assert e.value.limit == 50_000 and 50_000 < e.value.actual <= 50_000 + 8192
        deadline = time.monotonic() + 3
        while not srv.state.get("done") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert srv.state.get("done") and srv.state["sent"] < total  # the server saw the client go


def test_body_at_the_cap_passes() -> None:
    with serve({"/exact": body(b"y" * 1000)}) as srv:
        got = run(trusted_fetcher(max_bytes=1000).fetch(srv.url("/exact", host="allowed.test")))
        assert len(got.data) == 1000


# ---------------------------------------------------------------------------------------
# TLS with a pinned IP: SNI and the certificate check use the hostname


@pytest.fixture(scope="module")
def tls_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl command to make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(d / "key.pem"),
            "-out",
            str(d / "cert.pem"),
            "-days",
            "1",
            "-subj",
            "/CN=allowed.test",
            "-addext",
            "subjectAltName=DNS:allowed.test,DNS:*.allowed.test",
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(d / "cert.pem", d / "key.pem")
    client = ssl.create_default_context(cafile=str(d / "cert.pem"))
    return server, client


def test_https_to_a_pinned_ip_sends_sni_and_checks_the_certificate(tls_pair) -> None:
    server_ctx, client_ctx = tls_pair
    with serve({"/a.png": body(b"png!", "image/png")}, tls=server_ctx) as srv:
        f = trusted_fetcher(allow_http=False, ssl_context=client_ctx)
        got = run(f.fetch(srv.url("/a.png", host="img.allowed.test", scheme="https")))
        assert got.data == b"png!" and got.final_url.startswith("https://img.allowed.test:")
        assert srv.sni == ["img.allowed.test"]
        assert srv.hits[0][1]["Host"] == f"img.allowed.test:{srv.port}"
        # Same IP and port, a name the certificate does not cover: refused, no request made.
        with pytest.raises(RemoteMediaFetchError) as e:
            run(f.fetch(srv.url("/a.png", host="other.test", scheme="https")))
        assert "certificate" in str(e.value).lower() or "hostname" in str(e.value).lower()
        assert len(srv.hits) == 1


# ---------------------------------------------------------------------------------------
# file://


@pytest.fixture
def media_root(tmp_path: Path) -> Path:
    root = tmp_path / "media"
    (root / "sub").mkdir(parents=True)
    (root / "a.png").write_bytes(b"inside")
    (root / "big.bin").write_bytes(b"z" * 101)
    (tmp_path / "outside.txt").write_bytes(b"secret")
    (root / "escape").symlink_to(tmp_path / "outside.txt")
    (root / "dir-escape").symlink_to(tmp_path)
    (root / "alias.png").symlink_to(root / "a.png")
    return root


def test_file_urls_inside_the_root(media_root: Path) -> None:
    p = LocalMediaPolicy(media_root, max_bytes=100)
    assert p.enabled
    assert p.read(f"file://{media_root}/a.png") == b"inside"
    assert p.read(f"file://localhost{media_root}/sub/../a.png") == b"inside"
    assert p.read(f"file://{media_root}/alias.png") == b"inside"  # a symlink that stays inside
    assert p.read(f"file://{media_root}/%61.png") == b"inside"


def test_file_urls_that_escape_the_root(media_root: Path) -> None:
    p = LocalMediaPolicy(media_root, max_bytes=100)
    for url in [
        f"file://{media_root}/../outside.txt",
        f"file://{media_root}/sub/%2e%2e/%2e%2e/outside.txt",
        f"file://{media_root}/escape",
        f"file://{media_root}/dir-escape/outside.txt",
        "file:///etc/passwd",
        f"file://{media_root}-sibling/a.png",
    ]:
        with pytest.raises(RemoteMediaForbiddenError) as e:
            p.read(url)
        assert e.value.details["reason"] == "path", url
    for url in [
        f"file://evil.example{media_root}/a.png",
        "file:relative.png",
        f"file://{media_root}/a.png?x=1",
    ]:
        with pytest.raises(RemoteMediaForbiddenError) as e:
            p.read(url)
        assert e.value.details["reason"] == "invalid_url", url


def test_file_urls_other_failures(media_root: Path) -> None:
    p = LocalMediaPolicy(media_root, max_bytes=100)
    with pytest.raises(RemoteMediaTooLargeError) as e:
        p.read(f"file://{media_root}/big.bin")
    assert (e.value.limit, e.value.actual) == (100, 101)
    with pytest.raises(RemoteMediaFetchError):
        p.read(f"file://{media_root}/missing.png")
    with pytest.raises(RemoteMediaForbiddenError, match="regular file"):
        p.read(f"file://{media_root}/sub")
    os.mkfifo(media_root / "fifo")
    t0 = time.monotonic()
    with pytest.raises(RemoteMediaForbiddenError, match="regular file"):
        p.read(f"file://{media_root}/fifo")  # refused without waiting for a writer
    assert time.monotonic() - t0 < 1


def test_file_urls_off_without_a_root(media_root: Path) -> None:
    p = LocalMediaPolicy(None)
    assert not p.enabled
    with pytest.raises(RemoteMediaForbiddenError) as e:
        p.read(f"file://{media_root}/a.png")
    assert e.value.details["reason"] == "local_disabled" and "--allowed-local-media-path" in str(e.value)


# ---------------------------------------------------------------------------------------
# Error types


def test_errors_are_typed_with_stable_codes() -> None:
    codes = {
        RemoteMediaForbiddenError: "remote_media_forbidden",
        RemoteMediaTimeoutError: "remote_media_timeout",
        RemoteMediaTooLargeError: "remote_media_too_large",
        RemoteMediaFetchError: "remote_media_unreachable",
        ApiKeysRequiredError: "api_keys_required",
    }
    for cls, code in codes.items():
        assert issubclass(cls, PieMediaError) and cls.code == code


# ---------------------------------------------------------------------------------------
# API keys


def test_api_keys_from_file_and_env(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("# service keys\n\n  sk-one  \n#sk-commented\nsk-two\n")
    keys = ApiKeys.from_sources(f, environ={"PIE_MEDIA_API_KEYS": " sk-env1 ,, sk-env2,"})
    assert keys.enabled and len(keys) == 4
    for k in ["sk-one", "sk-two", "sk-env1", "sk-env2"]:
        assert keys.check(f"Bearer {k}")
    assert not keys.check("Bearer sk-commented") and not keys.check("Bearer # service keys")
    only_env = ApiKeys.from_sources(None, env_var="OTHER", environ={"OTHER": "a,b"})
    assert len(only_env) == 2
    assert not ApiKeys.from_sources(None, environ={}).enabled
    with pytest.raises(OSError):
        ApiKeys.from_sources(tmp_path / "missing")


def test_api_key_check_semantics() -> None:
    keys = ApiKeys(["sk-alpha", "sk-beta"])
    assert keys.check("Bearer sk-alpha") and keys.check("bearer sk-beta") and keys.check("BEARER  sk-beta ")
    for header in [
        None,
        "",
        "Bearer",
        "Bearer ",
        "sk-alpha",
        "Basic sk-alpha",
        "Bearer sk-alph",
        "Bearer sk-alpha2",
        "Bearer SK-ALPHA",
        "Bearer sk-é",
    ]:
        assert not keys.check(header), header
    none = ApiKeys([])
    assert not none.enabled and not none.check("Bearer anything") and not none.check("Bearer ")


def test_api_key_check_compares_every_key_in_constant_time() -> None:
    keys = ApiKeys([f"sk-{i}" for i in range(5)])
    calls: list[object] = []

    def profile(frame, event, arg) -> None:
        if event == "c_call" and arg is hmac.compare_digest:
            calls.append(arg)

    for header, expected in [("Bearer sk-0", True), ("Bearer sk-4", True), ("Bearer nope", False)]:
        calls.clear()
        sys.setprofile(profile)
        try:
            result = keys.check(header)
        finally:
            sys.setprofile(None)
        assert result is expected and len(calls) == 5, header  # no early exit on a match


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "127.3.2.1", "localhost", "LOCALHOST", "::1", "[::1]", "::ffff:127.0.0.1"]
)
def test_loopback_may_run_without_keys(host: str) -> None:
    require_keys_or_loopback(ApiKeys([]), host)


@pytest.mark.parametrize(
    "host", ["0.0.0.0", "::", "", "192.168.1.5", "10.0.0.1", "example.com", "localhost.example"]
)
def test_other_hosts_need_keys(host: str) -> None:
    with pytest.raises(ValueError, match="without API keys") as e:
        require_keys_or_loopback(ApiKeys([]), host)
    assert isinstance(e.value, ApiKeysRequiredError) and "--api-key-file" in str(e.value)
    require_keys_or_loopback(ApiKeys(["k"]), host)


def test_bearer_auth_dependency() -> None:
    app = FastAPI()

    @app.get("/v1/models", dependencies=[Depends(bearer_auth(ApiKeys(["sk-good"])))])
    def models() -> dict:
        return {"ok": True}

    @app.get("/open", dependencies=[Depends(bearer_auth(ApiKeys([])))])
    def open_route() -> dict:
        return {"ok": True}

    with TestClient(app) as client:
        assert client.get("/v1/models", headers={"Authorization": "Bearer sk-good"}).json() == {"ok": True}
        for headers in [{}, {"Authorization": "Bearer sk-bad"}, {"Authorization": "Basic c2stZ29vZA=="}]:
            r = client.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            error = r.json()["detail"]["error"]
            assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
            assert error["param"] is None and "sk-bad" not in error["message"]
        assert "Missing" in client.get("/v1/models").json()["detail"]["error"]["message"]
        assert client.get("/open").status_code == 200
        schemes = client.get("/openapi.json").json()["components"]["securitySchemes"]
        assert schemes["HTTPBearer"]["scheme"] == "bearer"


def test_named_key_files_give_roles_tenants_and_limits(tmp_path: Path) -> None:
    import hashlib

    from api.http.security.keys import KeyFileError

    toml = tmp_path / "keys.toml"
    toml.write_text(
        '[[keys]]\nname = "ops"\nkey = "sk-ops-123456"\nrole = "admin"\n\n'
        '[[keys]]\nname = "alice"\nsha256 = "' + hashlib.sha256(b"sk-alice-1234").hexdigest() + '"\n'
        'tenant = "team-a"\nrequests_per_minute = 5\nmax_concurrent_streams = 2\n'
    )
    keys = ApiKeys.from_sources(toml, environ={})
    ops, alice = keys.identify("Bearer sk-ops-123456"), keys.identify("Bearer sk-alice-1234")
    assert ops.is_admin and ops.scope is None and keys.has_admin
    assert (alice.name, alice.tenant, alice.role, alice.scope) == ("alice", "team-a", "user", "team-a")
    assert alice.limits.requests_per_minute == 5 and alice.limits.max_concurrent_streams == 2
    assert keys.identify("Bearer sk-nobody") is None
    json_file = tmp_path / "keys.json"
    json_file.write_text('[{"name": "bob", "key": "sk-bob-12345678"}]')
    assert ApiKeys.from_sources(json_file, environ={}).identify("Bearer sk-bob-12345678").tenant == "bob"
    for bad, words in (
        ('[[keys]]\nname = "x"\nrole = "root"\nkey = "sk-12345678"\n', "role"),
        ('[[keys]]\nname = "x"\n', "exactly one"),
        ('[[keys]]\nname = "x"\nkey = "sk-12345678"\n[[keys]]\nname = "x"\nkey = "sk-87654321"\n', "twice"),
        ('[[keys]]\nname = "x"\nkey = "sk-12345678"\nrpm = 3\n', "rpm"),
    ):
        toml.write_text(bad)
        with pytest.raises(KeyFileError) as e:
            ApiKeys.from_sources(toml, environ={})
        assert words in str(e.value)


def test_plain_keys_are_users_unless_there_is_only_one(tmp_path: Path) -> None:
    one = ApiKeys(["sk-only"])
    assert one.identify("Bearer sk-only").is_admin  # a single-key server behaves as before
    two = ApiKeys(["sk-a", "sk-b"])
    a, b = two.identify("Bearer sk-a"), two.identify("Bearer sk-b")
    assert not a.is_admin and not b.is_admin and a.tenant != b.tenant
    assert a.tenant.startswith("key-") and "sk-a" not in a.tenant


def test_reload_drops_a_removed_key(tmp_path: Path) -> None:
    f = tmp_path / "keys.txt"
    f.write_text("sk-one\nsk-two\n")
    keys = ApiKeys.from_sources(f, environ={})
    assert keys.check("Bearer sk-two")
    f.write_text("sk-one\n")
    keys.reload()
    assert not keys.check("Bearer sk-two") and keys.check("Bearer sk-one")
    f.write_text("[[keys]]\nname = 'broken'\n")
    with pytest.raises(ValueError):
        keys.reload()
    assert keys.check("Bearer sk-one")  # a bad file leaves the keys as they were
