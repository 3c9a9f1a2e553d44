"""``api.http.uploads`` against a real server: a small FastAPI app under uvicorn in a
subprocess on 127.0.0.1 (so its RSS is its own), driven by ``httpx`` and raw sockets.

The test app maps ``UploadTooLargeError`` to 413 and ``MalformedUploadError`` to 400
(JSON), as the service's error table does, and sends ``Connection: close`` with a 413
so the client stops sending the rest of a refused body. Caps come from the query string.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

ROOT = Path(__file__).resolve().parents[3]
KiB = 1024
MiB = 1024 * KiB
BOUNDARY = "pie-media-test-boundary"
MULTIPART = f"multipart/form-data; boundary={BOUNDARY}"

pytestmark = pytest.mark.timeout(60)


# -- the app the subprocess serves ---------------------------------------------------


def make_app(state_dir: Path) -> FastAPI:
    from api.http.stores.uploads import MediaStore
    from api.http.uploads import MalformedUploadError, UploadTooLargeError, receive_multipart

    store = MediaStore(state_dir)
    app = FastAPI()

    async def receive(request: Request):
        q = request.query_params
        return await receive_multipart(
            request,
            store.spool_dir,
            max_file_bytes=int(q.get("max_file", 8 * MiB)),
            max_total_bytes=int(q.get("max_total", 32 * MiB)),
            max_files=int(q.get("max_files", 4)),
            max_field_bytes=int(q.get("max_field", 64 * KiB)),
        )

    @app.exception_handler(UploadTooLargeError)
    async def _too_large(request: Request, exc: UploadTooLargeError) -> JSONResponse:
        return JSONResponse({"error": exc.to_dict()}, 413, headers={"connection": "close"})

    @app.exception_handler(MalformedUploadError)
    async def _malformed(request: Request, exc: MalformedUploadError) -> JSONResponse:
        return JSONResponse({"error": exc.to_dict()}, 400)

    @app.get("/health")
    async def health() -> dict:
        return {"ok": True}

    @app.post("/upload")
    async def upload(request: Request) -> dict:
        keep = request.query_params.get("keep") == "1"
        async with await receive(request) as form:
            files = []
            for f in form.files:
                if keep:
                    form.claim(f)
                files.append(
                    {
                        "field_name": f.field_name,
                        "filename": f.filename,
                        "content_type": f.content_type,
                        "path": str(f.path),
                        "size": f.size,
                        "sha256": f.sha256,
                    }
                )
            return {"files": files, "fields": form.fields}

    @app.post("/store")
    async def store_upload(request: Request) -> dict:
        async with await receive(request) as form:
            out = []
            for f in form.files:
                record, created = await asyncio.to_thread(
                    store.put,
                    f.path,
                    content_hash=f.sha256[:32],
                    kind="blob",
                    size=f.size,
                    filename=f.filename,
                    content_type=f.content_type,
                    metadata={"fields": form.fields},
                )
                out.append({**record.to_dict(), "created": created})
            return {"data": out}

    return app


def serve(port: int, state_dir: str) -> None:  # runs in the subprocess
    import uvicorn

    uvicorn.run(make_app(Path(state_dir)), host="127.0.0.1", port=port, log_level="warning")


# -- the server ----------------------------------------------------------------------


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    state_dir: Path
    port: int

    @property
    def spool(self) -> Path:
        return self.state_dir / "spool"

    def spool_files(self) -> list[str]:
        return sorted(p.name for p in self.spool.iterdir())

    def status(self, key: str) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * KiB
        raise RuntimeError(f"no {key}")

    def reset_peak_rss(self) -> bool:
        try:
            Path(f"/proc/{self.process.pid}/clear_refs").write_text("5")
            return True
        except OSError:
            return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    state = tmp_path_factory.mktemp("uploads") / "state"
    port = _free_port()
    code = (
        "import sys, importlib.util as u\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        f"spec = u.spec_from_file_location('uploads_test_app', {__file__!r})\n"
        "m = sys.modules['uploads_test_app'] = u.module_from_spec(spec); spec.loader.exec_module(m)\n"
        f"m.serve({port}, {str(state)!r})\n"
    )
    log = state.parent / "server.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    srv = Server(f"http://127.0.0.1:{port}", proc, state, port)
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"test server exited: {log.read_text(errors='replace')[-3000:]}")
            try:
                if httpx.get(f"{srv.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"test server not ready: {log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.05)
        yield srv
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


@pytest.fixture()
def srv(server: Server) -> Iterator[Server]:
    """The server, checked alive and with an empty spool before and after each test."""
    assert server.process.poll() is None
    assert server.spool_files() == []
    yield server
    assert server.process.poll() is None, "the test server died"
    assert server.spool_files() == [], "spool files left behind"


# -- body builders -------------------------------------------------------------------


def part_head(
    name: str, filename: str | None = None, content_type: str | None = None, extra: str = ""
) -> bytes:
    disp = f'Content-Disposition: form-data; name="{name}"'
    if filename is not None:
        disp += f'; filename="{filename}"'
    lines = [f"--{BOUNDARY}", disp]
    if content_type:
        lines.append(f"Content-Type: {content_type}")
    if extra:
        lines.append(extra)
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


CLOSE = f"\r\n--{BOUNDARY}--\r\n".encode()
SEP = b"\r\n"


def streamed_file(size: int, chunk: int = 256 * KiB, counter: list[int] | None = None) -> Iterator[bytes]:
    """A multipart body with one ``size``-byte file, generated lazily (never in memory)."""
    yield part_head("file", "big.bin", "application/octet-stream")
    sent = 0
    block = bytes(range(256)) * (chunk // 256)
    while sent < size:
        piece = block[: min(chunk, size - sent)]
        sent += len(piece)
        if counter is not None:
            counter[0] = sent
        yield piece
    yield CLOSE


def streamed_size(size: int) -> int:
    return len(part_head("file", "big.bin", "application/octet-stream")) + size + len(CLOSE)


def streamed_sha256(size: int, chunk: int = 256 * KiB) -> str:
    h = hashlib.sha256()
    block = bytes(range(256)) * (chunk // 256)
    sent = 0
    while sent < size:
        piece = block[: min(chunk, size - sent)]
        h.update(piece)
        sent += len(piece)
    return h.hexdigest()


def raw_request(srv: Server, head: bytes, body: bytes = b"", *, read_timeout: float = 10) -> bytes:
    """Send ``head`` (+ ``body``) on a raw socket and read until the server closes or
    a full response arrived."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=read_timeout) as s:
        s.sendall(head + body)
        data = b""
        while True:
            try:
                chunk = s.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            data += chunk
            if b"\r\n\r\n" in data:
                headers, _, rest = data.partition(b"\r\n\r\n")
                for line in headers.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:") and len(rest) >= int(line.split(b":")[1]):
                        return data
    return data


# -- round trips ---------------------------------------------------------------------


def test_one_file_and_fields_round_trip(srv: Server) -> None:
    payload = os.urandom(300 * KiB + 17)
    r = httpx.post(
        f"{srv.url}/upload?keep=1",
        files=[("file", ("photo.png", payload, "image/png"))],
        data={"prompt": "Décris l'image 🖼️", "max_tokens": "32"},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["fields"] == {"prompt": "Décris l'image 🖼️", "max_tokens": "32"}
    (f,) = body["files"]
    assert (f["field_name"], f["filename"], f["content_type"]) == ("file", "photo.png", "image/png")
    assert f["size"] == len(payload)
    assert f["sha256"] == hashlib.sha256(payload).hexdigest()
    path = Path(f["path"])
    assert path.parent == srv.spool
    assert path.read_bytes() == payload
    path.unlink()


def test_three_files_and_fields_round_trip_in_order(srv: Server) -> None:
    payloads = [b"", os.urandom(1), os.urandom(2 * MiB + 7)]
    names = ["empty.txt", "one.bin", "two-megs.bin"]
    files = [("file", (n, p, "application/octet-stream")) for n, p in zip(names, payloads, strict=True)]
    r = httpx.post(
        f"{srv.url}/upload?keep=1",
        files=files,
        data={"model": "tiny", "prompt": "hi", "max_tokens": "8"},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["fields"] == {"model": "tiny", "prompt": "hi", "max_tokens": "8"}
    assert [f["filename"] for f in body["files"]] == names
    for f, payload in zip(body["files"], payloads, strict=True):
        assert f["size"] == len(payload)
        assert f["sha256"] == hashlib.sha256(payload).hexdigest()
        assert Path(f["path"]).read_bytes() == payload
        Path(f["path"]).unlink()
    assert len({f["path"] for f in body["files"]}) == 3


def test_fields_between_files_and_unclaimed_files_are_removed(srv: Server) -> None:
    body = (
        part_head("prompt")
        + b"first"
        + SEP
        + part_head("file", "a.bin")
        + b"A" * 1000
        + SEP
        + part_head("max_tokens")
        + b"7"
        + SEP
        + part_head("file", "b.bin", "text/plain")
        + b"B" * 10
        + CLOSE
    )
    r = httpx.post(f"{srv.url}/upload", content=body, headers={"content-type": MULTIPART}, timeout=10)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["fields"] == {"prompt": "first", "max_tokens": "7"}
    assert [(f["filename"], f["size"], f["content_type"]) for f in out["files"]] == [
        ("a.bin", 1000, None),
        ("b.bin", 10, "text/plain"),
    ]
    assert not any(Path(f["path"]).exists() for f in out["files"])  # not claimed: cleaned up


def test_chunked_body_without_content_length(srv: Server) -> None:
    size = 3 * MiB + 5
    r = httpx.post(
        f"{srv.url}/upload", content=streamed_file(size), headers={"content-type": MULTIPART}, timeout=10
    )
    assert r.status_code == 200, r.text
    (f,) = r.json()["files"]
    assert f["size"] == size and f["sha256"] == streamed_sha256(size)


def test_empty_html_file_input_is_dropped_and_filename_is_only_a_name(srv: Server) -> None:
    body = (
        part_head("file", "", "application/octet-stream")
        + SEP
        + part_head("file", "../../etc/passwd\x07")
        + b"data"
        + CLOSE
    )
    r = httpx.post(f"{srv.url}/upload", content=body, headers={"content-type": MULTIPART}, timeout=10)
    assert r.status_code == 200, r.text
    (f,) = r.json()["files"]
    assert f["filename"] == "passwd" and f["size"] == 4
    assert Path(f["path"]).parent == srv.spool


def test_concurrent_uploads(srv: Server) -> None:
    payloads = [os.urandom(256 * KiB + i) for i in range(8)]

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=20) as client:
            return await asyncio.gather(
                *(
                    client.post(f"{srv.url}/upload", files=[("file", (f"f{i}", p))], data={"i": str(i)})
                    for i, p in enumerate(payloads)
                )
            )

    for i, r in enumerate(asyncio.run(main())):
        assert r.status_code == 200, r.text
        (f,) = r.json()["files"]
        assert r.json()["fields"] == {"i": str(i)}
        assert f["sha256"] == hashlib.sha256(payloads[i]).hexdigest()


def test_spooled_files_move_into_the_store(srv: Server) -> None:
    from api.http.stores.uploads import MediaStore

    payload = os.urandom(100 * KiB)
    files = [("file", ("a.bin", payload, "application/octet-stream"))]
    first = httpx.post(f"{srv.url}/store", files=files, data={"prompt": "p"}, timeout=10).json()["data"][0]
    again = httpx.post(f"{srv.url}/store", files=files, timeout=10).json()["data"][0]
    assert first["created"] is True and again["created"] is False
    assert first["id"] == again["id"] == "media-" + hashlib.sha256(payload).hexdigest()[:32]
    with MediaStore(srv.state_dir) as store:  # a second opener sees the server's record
        assert store.read_bytes(first["id"]) == payload
        assert store.get(first["id"]).metadata == {"fields": {"prompt": "p"}}
        assert store.delete(first["id"])


# -- caps ----------------------------------------------------------------------------


def test_file_over_cap_is_413_without_buffering_the_body(srv: Server) -> None:
    size = 40 * MiB
    httpx.post(f"{srv.url}/upload", files=[("file", ("w", b"warm"))], timeout=10)  # warm the code paths
    can_reset = srv.reset_peak_rss()
    before = srv.status("VmHWM") if can_reset else srv.status("VmRSS")
    sent = [0]
    t0 = time.monotonic()
    r = httpx.post(
        f"{srv.url}/upload?max_file={MiB}&max_total={64 * MiB}",  # the Content-Length passes
        content=streamed_file(size, counter=sent),
        headers={"content-type": MULTIPART, "content-length": str(streamed_size(size))},
        timeout=20,
    )
    elapsed = time.monotonic() - t0
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["code"] == "too_large" and err["what"] == "file"
    assert err["limit"] == MiB and MiB < err["actual"] <= MiB + 512 * KiB
    assert err["filename"] == "big.bin"
    growth = srv.status("VmHWM") - before
    assert growth < 8 * MiB, (
        f"server peak RSS grew by {growth / MiB:.1f} MiB for a refused {size // MiB} MiB upload"
    )
    assert sent[0] < size, "the client had to send the whole refused body"
    assert elapsed < 5


def test_large_upload_within_cap_is_streamed_to_disk(srv: Server) -> None:
    size = 40 * MiB
    httpx.post(f"{srv.url}/upload", files=[("file", ("w", b"warm"))], timeout=10)
    if not srv.reset_peak_rss():
        pytest.skip("cannot reset the server's peak RSS here")
    before = srv.status("VmHWM")
    r = httpx.post(
        f"{srv.url}/upload?max_file={64 * MiB}&max_total={64 * MiB}",
        content=streamed_file(size),
        headers={"content-type": MULTIPART, "content-length": str(streamed_size(size))},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    (f,) = r.json()["files"]
    assert f["size"] == size and f["sha256"] == streamed_sha256(size)
    growth = srv.status("VmHWM") - before
    assert growth < 8 * MiB, f"server peak RSS grew by {growth / MiB:.1f} MiB for a {size // MiB} MiB upload"


def test_content_length_over_cap_is_refused_before_the_body(srv: Server) -> None:
    # Headers only: the server must answer without waiting for a single body byte.
    declared = 1 << 30
    head = (
        f"POST /upload?max_file={MiB}&max_total={MiB}&max_files=1 HTTP/1.1\r\n"
        f"Host: 127.0.0.1\r\nContent-Type: {MULTIPART}\r\nContent-Length: {declared}\r\n\r\n"
    ).encode()
    t0 = time.monotonic()
    data = raw_request(srv, head, read_timeout=5)
    assert time.monotonic() - t0 < 3
    assert data.startswith(b"HTTP/1.1 413"), data[:200]
    err = json.loads(data.partition(b"\r\n\r\n")[2])["error"]
    assert err["code"] == "too_large" and err["what"] == "body" and err["actual"] == declared


def test_content_length_over_cap_with_a_generator_body_answers_quickly(srv: Server) -> None:
    size = 1 << 30  # would take a while to send; the answer must not wait for it
    sent = [0]
    t0 = time.monotonic()
    r = httpx.post(
        f"{srv.url}/upload?max_file={MiB}&max_total={MiB}",
        content=streamed_file(size, counter=sent),
        headers={"content-type": MULTIPART, "content-length": str(streamed_size(size))},
        timeout=20,
    )
    assert r.status_code == 413, r.text
    assert r.json()["error"]["what"] == "body"
    assert time.monotonic() - t0 < 3
    assert sent[0] < 64 * MiB


def test_files_together_over_the_total_cap(srv: Server) -> None:
    files = [("file", (f"f{i}", os.urandom(600 * KiB))) for i in range(2)]
    r = httpx.post(f"{srv.url}/upload?max_file={MiB}&max_total={MiB}", files=files, timeout=10)
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["what"] == "files" and err["limit"] == MiB and err["actual"] > MiB


def test_text_field_over_cap(srv: Server) -> None:
    r = httpx.post(
        f"{srv.url}/upload", files=[("file", ("a", b"x"))], data={"prompt": "p" * (64 * KiB + 1)}, timeout=10
    )
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert (err["what"], err["param"], err["limit"]) == ("field", "prompt", 64 * KiB)


def test_raw_body_cap_holds_while_streaming_without_content_length(srv: Server) -> None:
    def body() -> Iterator[bytes]:
        yield part_head("file", "a") + b"abc" + CLOSE
        for _ in range(64):  # an endless epilogue: ignored by the parser, still counted
            yield b"\0" * (64 * KiB)

    r = httpx.post(
        f"{srv.url}/upload?max_file={KiB}&max_total={KiB}&max_files=1",
        content=body(),
        headers={"content-type": MULTIPART},
        timeout=10,
    )
    assert r.status_code == 413, r.text
    assert r.json()["error"]["what"] == "body"


def test_too_many_files(srv: Server) -> None:
    files = [("file", (f"f{i}", b"x")) for i in range(3)]
    r = httpx.post(f"{srv.url}/upload?max_files=2", files=files, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_request" and err["limit"] == 2 and err["actual"] == 3


# -- malformed requests --------------------------------------------------------------

_FILE = part_head("file", "a.bin") + b"payload"
MALFORMED: dict[str, tuple[bytes, str | None]] = {
    "not multipart (json)": (b'{"file": "x"}', "application/json"),
    "no content type": (b"hello", None),
    "multipart without boundary": (_FILE + CLOSE, "multipart/form-data"),
    "wrong boundary": (_FILE + CLOSE, "multipart/form-data; boundary=other"),
    "overlong boundary": (_FILE + CLOSE, "multipart/form-data; boundary=" + "b" * 300),
    "truncated in a file": (_FILE, MULTIPART),
    "truncated in headers": (b"--" + BOUNDARY.encode() + b"\r\nContent-Disp", MULTIPART),
    "garbage": (bytes(range(256)) * 64, MULTIPART),
    "empty body": (b"", MULTIPART),
    "closing boundary only": (f"--{BOUNDARY}--\r\n".encode(), MULTIPART),
    "no file part": (part_head("prompt") + b"hi" + CLOSE, MULTIPART),
    "file in another field": (part_head("image", "a.png") + b"x" + CLOSE, MULTIPART),
    "no content-disposition": (
        f"--{BOUNDARY}\r\nContent-Type: text/plain\r\n\r\nx".encode() + CLOSE,
        MULTIPART,
    ),
    "not form-data": (
        f'--{BOUNDARY}\r\nContent-Disposition: attachment; name="file"\r\n\r\nx'.encode() + CLOSE,
        MULTIPART,
    ),
    "header without colon": (
        f"--{BOUNDARY}\r\nContent-Disposition form-data\r\n\r\nx".encode() + CLOSE,
        MULTIPART,
    ),
    "too many part headers": (
        f"--{BOUNDARY}\r\n".encode()
        + b"".join(b"X-H%d: v\r\n" % i for i in range(20))
        + b'Content-Disposition: form-data; name="file"; filename="a"\r\n\r\nx'
        + CLOSE,
        MULTIPART,
    ),
    "base64 transfer encoding": (
        part_head("file", "a", extra="Content-Transfer-Encoding: base64") + b"eA==" + CLOSE,
        MULTIPART,
    ),
    "duplicate text field": (
        part_head("p") + b"1" + SEP + part_head("p") + b"2" + SEP + _FILE + CLOSE,
        MULTIPART,
    ),
    "field not utf-8": (part_head("prompt") + b"\xff\xfe" + SEP + _FILE + CLOSE, MULTIPART),
    "file then garbage": (_FILE + b"\r\n--" + BOUNDARY.encode() + b"\x00\x00junk", MULTIPART),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_upload_is_400_never_500(srv: Server, case: str) -> None:
    body, ctype = MALFORMED[case]
    headers = {"content-type": ctype} if ctype else {}
    r = httpx.post(f"{srv.url}/upload", content=body, headers=headers, timeout=10)
    assert r.status_code == 400, f"{case}: {r.status_code} {r.text}"
    err = r.json()["error"]
    assert err["code"] == "invalid_request" and err["message"]


def test_client_disconnect_mid_upload_leaves_no_spool_file(server: Server) -> None:
    assert server.spool_files() == []
    head = (
        f"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Type: {MULTIPART}\r\nContent-Length: {10 * MiB}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(head + part_head("file", "a.bin") + b"x" * (512 * KiB))
        deadline = time.monotonic() + 5
        while not server.spool_files() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.spool_files(), "the upload never reached the spool"
    deadline = time.monotonic() + 5
    while server.spool_files() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.spool_files() == []
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200


# -- pure helpers ----------------------------------------------------------------------


def test_body_cap_and_spool_names() -> None:
    from api.http.uploads import PART_OVERHEAD_BYTES, multipart_body_cap, spool_owner_pid

    assert multipart_body_cap(10 * MiB, 2, max_fields=1, max_field_bytes=KiB) == (
        10 * MiB + KiB + 4 * PART_OVERHEAD_BYTES
    )
    assert spool_owner_pid(f"upload-123-{'a' * 32}.part") == 123
    assert spool_owner_pid("upload-x.part") is None
    assert spool_owner_pid("media.sqlite3") is None
