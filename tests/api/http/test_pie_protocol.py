"""Pie's client protocol on ``pie-media serve``'s port (api/http/pie_protocol), driven by
the real ``pie-client==0.4.0``: sign-in (auth off, API key, Ed25519 / ECDSA / RSA), ping,
query, installing the repo's example component, processes (events to ``return``, signals,
terminate, list, attach, detach, token budget) seen from HTTP's ``/v1/inferlets/runs`` and
back, two tenants that do not see each other, bad frames and uploads, and the CLI's ping.

Two servers for the module, started side by side: one without keys (auth off) and one
with a key file. One component (inferlets/examples, built and compiled once, cached)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest

from tests.api.http.conftest import Server, start_server, stop_server

pie_client = pytest.importorskip("pie_client")
from pie_client import PieClient  # noqa: E402
from pie_client.crypto import ParsedPrivateKey  # noqa: E402

from tests.api.http.pie_events import recv_all, recv_until  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[3] / "inferlets" / "examples"
QWEN = "tiny-qwen3-vl"
PROGRAM = "examples@0.1.0"
MANIFEST = '[package]\nname = "examples"\nversion = "0.1.0"\ndescription = "pie-media example inferlets"\n'
ALICE, BOB = "sk-alice-12345678", "sk-bob-123456789"
T = 60  # generous per-step timeout (2 shared cores)


def _private_keys() -> dict[str, tuple[str, str]]:
    """name -> (private key PEM/OpenSSH text, public key text for the key file)."""
    from cryptography.hazmat.primitives import serialization as s
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

    out = {}
    ed = ed25519.Ed25519PrivateKey.generate()
    out["carol"] = (
        ed.private_bytes(s.Encoding.PEM, s.PrivateFormat.OpenSSH, s.NoEncryption()).decode(),
        ed.public_key().public_bytes(s.Encoding.OpenSSH, s.PublicFormat.OpenSSH).decode(),
    )
    ecdsa = ec.generate_private_key(ec.SECP256R1())
    out["dave"] = (
        ecdsa.private_bytes(s.Encoding.PEM, s.PrivateFormat.PKCS8, s.NoEncryption()).decode(),
        ecdsa.public_key().public_bytes(s.Encoding.PEM, s.PublicFormat.SubjectPublicKeyInfo).decode(),
    )
    r = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    out["erin"] = (
        r.private_bytes(s.Encoding.PEM, s.PrivateFormat.TraditionalOpenSSL, s.NoEncryption()).decode(),
        r.public_key().public_bytes(s.Encoding.OpenSSH, s.PublicFormat.OpenSSH).decode(),
    )
    return out


@pytest.fixture(scope="module")
def keypairs() -> dict[str, tuple[str, str]]:
    return _private_keys()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, keypairs) -> Iterator[tuple[Server, Server]]:
    """(no keys, keys) -- started at once; short sign-in and upload deadlines to test them."""
    open_dir, keyed_dir = tmp_path_factory.mktemp("pie-open"), tmp_path_factory.mktemp("pie-keyed")
    key_file = keyed_dir / "keys.toml"
    entries = [
        f'[[keys]]\nname = "alice"\nkey = "{ALICE}"\n',
        f'[[keys]]\nname = "bob"\nkey = "{BOB}"\n',
        *(f'[[keys]]\nname = "{name}"\npublic_key = """{pub}"""\n' for name, (_, pub) in keypairs.items()),
    ]
    key_file.write_text("\n".join(entries))
    env = {"PIE_MEDIA_PIE_AUTH_TIMEOUT_S": "2", "PIE_MEDIA_PIE_UPLOAD_TIMEOUT_S": "2"}
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(start_server, open_dir, models=("tiny",), env=env)
        b = pool.submit(start_server, keyed_dir, "--api-key-file", str(key_file), models=("tiny",), env=env)
        started = []
        try:
            for f in (a, b):
                started.append(f.result())
        except BaseException:
            for s in started:
                stop_server(s)
            raise
    yield started[0], started[1]
    for s in started:
        stop_server(s)


@pytest.fixture(scope="module")
def open_server(servers) -> Server:
    return servers[0]


@pytest.fixture(scope="module")
def keyed(servers) -> Server:
    return servers[1]


def ws(server: Server) -> str:
    return server.url.replace("http://", "ws://")


@pytest.fixture(scope="module")
def program_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from fixtures.paths import cache_root
    from inferlets import build_component

    wasm = build_component(EXAMPLES, cache_root() / "inferlets-build")
    manifest = tmp_path_factory.mktemp("pie-program") / "Pie.toml"
    manifest.write_text(MANIFEST)
    return wasm, manifest


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 240))


@pytest.fixture(scope="module")
def installed(open_server: Server, program_files) -> str:
    """The example component installed (no keys: the anonymous tenant); its store id."""
    wasm, manifest = program_files

    async def go() -> None:
        async with PieClient(ws(open_server)) as c:
            await c.authenticate("tester")
            assert await c.check_program(PROGRAM) is False
            await c.install_program(wasm, manifest)
            assert await c.check_program(PROGRAM, wasm, manifest) is True
            await c.install_program(wasm, manifest)  # the same bytes again: kept, ok

    run(go())
    listed = httpx.get(f"{open_server.v1}/inferlets").json()["data"]
    assert len(listed) == 1 and listed[0]["bytes"] == wasm.stat().st_size
    return listed[0]["id"]


def http_runs(server: Server, key: str | None = None) -> dict[str, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(f"{server.v1}/inferlets/runs", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return {run["id"]: run for run in r.json()["data"]}


def wait_status(server: Server, run_id: str, key: str | None = None) -> dict:
    deadline = time.monotonic() + T
    while time.monotonic() < deadline:
        run_ = http_runs(server, key).get(run_id)
        if run_ is not None and run_["status"] != "running":
            return run_
        time.sleep(0.1)
    raise AssertionError(f"{run_id} still running")


# -- auth off -------------------------------------------------------------------------------


def test_auth_off_ping_query_and_http_root(open_server: Server) -> None:
    async def go() -> tuple[bool, str]:
        async with PieClient(ws(open_server)) as c:
            await c.authenticate("alice")  # the magic reply: no key needed
            await c.ping()
            return await c.query("model_status", "")

    ok, status = run(go())
    assert ok and json.loads(status) == {f"{QWEN}.kv_pages_used": 0}
    root = httpx.get(open_server.url + "/", follow_redirects=False)
    assert root.status_code == 307 and root.headers["location"] == "/ui"  # HTTP GET / as before


def test_run_to_return_equals_the_http_run(open_server: Server, installed: str) -> None:
    args = ["chat", QWEN, "Describe a cat.", 10]

    async def go() -> tuple[str, list]:
        async with PieClient(ws(open_server)) as c:
            await c.authenticate("tester")
            p = await c.launch_process(PROGRAM, args)
            return p.process_id, await recv_all(p)

    pid, events = run(go())
    http = httpx.post(
        f"{open_server.v1}/inferlets/{installed}/runs", json={"args": [str(a) for a in args]}, timeout=T
    ).json()
    assert events == [("return", http["result"])]
    seen = http_runs(open_server)[pid]
    assert (seen["origin"], seen["status"], seen["inferlet_id"]) == ("pie", "succeeded", installed)
    assert seen["args"] == ["chat", QWEN, "Describe a cat.", "10"] and seen["result"] == http["result"]


def test_echo_stdout_stderr_messages_and_signals(open_server: Server, installed: str) -> None:
    async def go() -> tuple[list, list, dict]:
        async with PieClient(ws(open_server)) as c:
            await c.authenticate("tester")
            p = await c.launch_process(PROGRAM, ["echo", "a", "b"])
            first = await recv_until(p, ("message", "b"))
            await p.signal("hi")
            first += await recv_until(p, ("message", "echo: hi"))
            mid = http_runs(open_server)[p.process_id]
            await p.signal("bye")
            return first, await recv_all(p), mid

    first, rest, mid = run(go())
    assert first == [
        ("stdout", "out: a b\n"),
        ("stderr", "err: a b\n"),
        ("message", "a"),
        ("message", "b"),
        ("message", "echo: hi"),
    ]
    assert rest == [("return", "2 words, 1 messages")]
    assert mid["status"] == "running" and mid["sends"] == ["a", "b", "echo: hi"]


def test_terminate_list_and_cancel_both_ways(open_server: Server, installed: str) -> None:
    async def go() -> None:
        async with PieClient(ws(open_server)) as c:
            await c.authenticate("tester")
            p = await c.launch_process(PROGRAM, ["echo"])
            await recv_until(p, ("stderr", "err:\n"))
            assert p.process_id in await c.list_processes()
            await p.terminate()
            assert (await recv_all(p))[-1] == ("error", "Signal")
            assert p.process_id not in await c.list_processes()
            assert wait_status(open_server, p.process_id)["status"] == "cancelled"

            # launched here, cancelled over HTTP
            q = await c.launch_process(PROGRAM, ["echo"])
            await recv_until(q, ("stderr", "err:\n"))
            r = httpx.post(f"{open_server.v1}/inferlets/{installed}/runs/{q.process_id}/cancel", timeout=T)
            assert r.json()["status"] == "cancelled"
            assert (await recv_all(q))[-1] == ("error", "Signal")

            # launched over HTTP, found, attached to, signalled and terminated here
            h = httpx.post(
                f"{open_server.v1}/inferlets/{installed}/runs",
                json={"args": ["echo", "x"], "background": True, "close_input": False},
                timeout=T,
            ).json()
            assert h["id"] in await c.list_processes()
            a = await c.attach_process(h["id"])
            assert await recv_until(a, ("message", "x")) == [("message", "x")]  # what it sent before
            await a.signal("over")
            await recv_until(a, ("message", "echo: over"))
            await c.terminate_process(h["id"])
            assert (await recv_all(a))[-1] == ("error", "Signal")
            assert wait_status(open_server, h["id"])["status"] == "cancelled"
            with pytest.raises(Exception, match="no process"):
                await c.attach_process("run-000000000000000000000000")

    run(go())


def test_detached_process_outlives_its_launcher(open_server: Server, installed: str) -> None:
    async def go() -> None:
        async with PieClient(ws(open_server)) as c:
            await c.authenticate("tester")
            detached = await c.launch_process(PROGRAM, ["echo", "kept"], capture_outputs=False)
            captured = await c.launch_process(PROGRAM, ["echo"], capture_outputs=True)
            await recv_until(captured, ("stderr", "err:\n"))
        # the launcher has gone: its captured process ends, the detached one runs on
        assert wait_status(open_server, captured.process_id)["status"] == "cancelled"
        async with PieClient(ws(open_server)) as c:
            await c.authenticate("tester")
            assert detached.process_id in await c.list_processes()
            p = await c.attach_process(detached.process_id)
            # its events from before anyone attached, in order
            assert await recv_until(p, ("message", "kept")) == [
                ("stdout", "out: kept\n"),
                ("stderr", "err: kept\n"),
                ("message", "kept"),
            ]
            await p.signal("bye")
            assert await recv_all(p) == [("return", "1 words, 0 messages")]

    run(go())


def test_token_budget_and_many_processes(open_server: Server, installed: str) -> None:
    async def go() -> None:
        async with PieClient(ws(open_server)) as c:
            await c.authenticate("tester")
            cut = await c.launch_process(PROGRAM, ["chat", QWEN, "Name a fruit.", 10], token_budget=3)
            short = await c.launch_process(PROGRAM, ["chat", QWEN, "Name a fruit.", 3])
            whole = await c.launch_process(PROGRAM, ["chat", QWEN, "Name a fruit.", 10])
            (cut_ev,), (short_ev,), (whole_ev,) = [await recv_all(p) for p in (cut, short, whole)]
            assert cut_ev == short_ev != whole_ev  # generation stopped at the budget
            spent = await c.launch_process(PROGRAM, ["chat", QWEN, "Name a fruit.", 4], token_budget=0)
            (ev, value), *_ = await recv_all(spent)
            assert ev == "error" and value.startswith("inferlet_limit: the run's token budget of 0 is spent")

            inputs = [["chat", QWEN, "Name a fruit.", 3], ["echo", "z"]]
            ps = await c.launch_processes(PROGRAM, inputs, token_budgets=[None, 5])
            assert len({p.process_id for p in ps}) == 2
            assert await recv_all(ps[0]) == [short_ev]
            await recv_until(ps[1], ("message", "z"))
            await ps[1].signal("bye")
            assert (await recv_all(ps[1]))[-1] == ("return", "1 words, 0 messages")
            results = await c.run_processes(PROGRAM, [inputs[0], ["chat", QWEN, "Name a fruit.", 10]])
            assert results == [short_ev[1], whole_ev[1]]
            with pytest.raises(Exception, match="not installed"):
                await c.run_processes("nothing@1.0.0", [{}])
            with pytest.raises(Exception, match="token_budget"):
                await c.launch_process(PROGRAM, ["echo"], token_budget=-1)
            with pytest.raises(Exception, match="is not a daemon: its component exports no wasi:http"):
                await c.launch_daemon(PROGRAM, 9999)
            with pytest.raises(Exception, match="not installed"):
                await c.launch_daemon("nothing@1.0.0", 9999)

    run(go())


# -- bad input over a raw socket -------------------------------------------------------------


class Raw:
    """A bare WebSocket: frames as we choose them."""

    def __init__(self, conn: Any):
        self.conn = conn
        self.corr = 100

    async def send(self, msg: dict | bytes | str) -> None:
        await self.conn.send(msg if isinstance(msg, bytes | str) else msgpack.packb(msg, use_bin_type=True))

    async def recv(self, timeout: float = T) -> dict:
        while True:
            raw = await asyncio.wait_for(self.conn.recv(), timeout)
            msg = msgpack.unpackb(raw, raw=False)
            if msg.get("type") == "response":
                return msg

    async def request(self, msg: dict, timeout: float = T) -> dict:
        self.corr += 1
        await self.send({**msg, "corr_id": self.corr})
        reply = await self.recv(timeout)
        assert reply["corr_id"] == self.corr, reply
        return reply

    async def upload(self, data: bytes, manifest: str, *, hash_: str | None = None, order=None, total=None):
        import blake3

        self.corr += 1
        chunks = [data[i : i + 4096] for i in range(0, len(data), 4096)] or [b""]
        for i in order if order is not None else range(len(chunks)):
            await self.send(
                {
                    "type": "add_program",
                    "corr_id": self.corr,
                    "program_hash": hash_ or blake3.blake3(data).hexdigest(),
                    "manifest": manifest,
                    "force_overwrite": False,
                    "chunk_index": i,
                    "total_chunks": total or len(chunks),
                    "chunk_data": chunks[i],
                }
            )
        return self.corr


def test_bad_frames_and_uploads_are_answered_and_the_server_goes_on(open_server: Server) -> None:
    import websockets

    data = bytes(range(256)) * 40  # 10 KiB, 3 chunks of 4 KiB
    manifest = '[package]\nname = "bad"\nversion = "1.0.0"\n'

    async def go() -> None:
        async with websockets.connect(ws(open_server), max_size=1 << 20) as conn:
            r = Raw(conn)
            assert "authenticate first" in (await r.request({"type": "ping"}))["result"]
            assert (await r.request({"type": "auth_identify", "username": "x"}))["ok"]
            for junk in (
                b"\xc1\xc1 not msgpack",
                b"",
                msgpack.packb([1, 2]),
                msgpack.packb({"no": "type"}),
                "text",
            ):
                await r.send(junk)  # dropped
            assert (await r.request({"type": "ping"}))["ok"]
            unknown = await r.request({"type": "fly_to_the_moon"})
            assert not unknown["ok"] and "fly_to_the_moon" in unknown["result"]

            corr = await r.upload(data, manifest, order=[1, 0, 2])
            reply = await r.recv()
            assert (reply["corr_id"], reply["ok"]) == (corr, False) and "chunk 0" in reply["result"]
            corr = await r.upload(data, manifest, order=[0, 2, 1])
            reply = await r.recv()
            assert (reply["corr_id"], reply["ok"]) == (corr, False) and "out of order" in reply["result"]
            corr = await r.upload(data, manifest, hash_="0" * 64)
            reply = await r.recv()
            assert (reply["corr_id"], reply["ok"]) == (corr, False) and "mismatch" in reply["result"]
            corr = await r.upload(data, "this is [not toml")
            reply = await r.recv()
            assert (reply["corr_id"], reply["ok"]) == (corr, False) and "not valid TOML" in reply["result"]
            corr = await r.upload(data, '[package]\nname = "bad"\n')
            reply = await r.recv()
            assert not reply["ok"] and "version" in reply["result"]
            corr = await r.upload(data, manifest)  # well formed, but no component
            reply = await r.recv()
            assert (reply["corr_id"], reply["ok"]) == (corr, False)
            assert "not a WebAssembly component" in reply["result"]
            corr = await r.upload(data, manifest, order=[0])  # then nothing
            assert (await r.request({"type": "ping"}))["ok"]  # still serving meanwhile
            reply = await r.recv(timeout=15)
            assert (reply["corr_id"], reply["ok"]) == (corr, False) and "incomplete" in reply["result"]
            check = await r.request({"type": "check_program", "name": "bad", "version": "1.0.0"})
            assert check["result"] == "false"
            assert (await r.request({"type": "ping"}))["ok"]

    run(go())
    assert httpx.get(f"{open_server.url}/health").status_code == 200


def test_frames_the_server_sends_fit_the_client() -> None:
    from api.http.pie_protocol import framing

    big = "x" * (3 << 20)
    assert len(framing.response(1, True, big)) < framing.CLIENT_MAX_FRAME
    assert len(framing.process_event("run-1", "message", big)) < framing.CLIENT_MAX_FRAME
    chunks = framing.file_chunks("run-1", "h", b"\1" * (700 << 10))
    assert len(chunks) == 3 and all(len(c) < framing.CLIENT_MAX_FRAME for c in chunks)
    parts = [msgpack.unpackb(c, raw=False) for c in chunks]
    assert [p["chunk_index"] for p in parts] == [0, 1, 2] and {p["total_chunks"] for p in parts} == {3}
    assert b"".join(p["chunk_data"] for p in parts) == b"\1" * (700 << 10)


# -- keys: tenants, tokens, public keys --------------------------------------------------------


def test_tenants_do_not_see_each_other(keyed: Server, program_files) -> None:
    wasm, manifest = program_files

    async def go() -> str:
        async with PieClient(ws(keyed)) as alice, PieClient(ws(keyed)) as bob:
            await alice.auth_by_token(ALICE)
            await bob.auth_by_token(BOB)
            await alice.install_program(wasm, manifest)
            assert await alice.check_program(PROGRAM) is True
            assert await bob.check_program(PROGRAM) is False
            p = await alice.launch_process(PROGRAM, ["echo", "secret"])
            await recv_until(p, ("message", "secret"))
            assert await alice.list_processes() == [p.process_id]
            assert await bob.list_processes() == []
            with pytest.raises(Exception, match="not installed"):
                await bob.launch_process(PROGRAM, ["echo"])
            for call in (bob.attach_process, bob.terminate_process):
                with pytest.raises(Exception, match="no process"):
                    await call(p.process_id)
            await bob.signal_process(p.process_id, "from bob")  # dropped: not bob's
            await p.signal("from alice")
            assert await recv_until(p, ("message", "echo: from alice")) == [("message", "echo: from alice")]
            assert p.process_id in http_runs(keyed, ALICE) and p.process_id not in http_runs(keyed, BOB)
            assert (
                httpx.get(f"{keyed.v1}/inferlets", headers={"Authorization": f"Bearer {BOB}"}).json()["data"]
                == []
            )
            await p.terminate()
            await recv_all(p)
            with pytest.raises(Exception, match="Invalid token"):
                async with PieClient(ws(keyed)) as eve:
                    await eve.auth_by_token("sk-not-a-key-at-all")
            return p.process_id

    run(go())


def test_public_key_sign_in(keyed: Server, keypairs) -> None:
    async def go() -> None:
        for name, (private, _) in keypairs.items():  # Ed25519 (OpenSSH), ECDSA P-256, RSA 2048
            async with PieClient(ws(keyed)) as c:
                await c.authenticate(name, ParsedPrivateKey.parse(private))
                await c.ping()
                assert await c.list_processes() == []  # its own tenant: nothing
        carol, dave = (ParsedPrivateKey.parse(keypairs[n][0]) for n in ("carol", "dave"))
        async with PieClient(ws(keyed)) as c:
            with pytest.raises(Exception, match="Signature verification failed"):
                await c.authenticate("carol", dave)  # another key's signature
            with pytest.raises(Exception, match="authenticate first"):
                await c.ping()
            await c.authenticate("carol", carol)  # a fresh challenge: fine now
            await c.ping()
        async with PieClient(ws(keyed)) as c:
            with pytest.raises(Exception, match="not authorized"):
                await c.authenticate("mallory", carol)
            with pytest.raises(Exception, match="no private key"):
                await c.authenticate("carol")
            with pytest.raises(Exception, match="not authorized"):
                await c.authenticate("alice", carol)  # alice has a bearer key, no public key

    run(go())


def test_a_connection_that_never_signs_in_is_closed(keyed: Server) -> None:
    import websockets

    async def go() -> float:
        t = time.monotonic()
        async with websockets.connect(ws(keyed)) as conn:
            with pytest.raises(websockets.ConnectionClosed) as e:
                while True:
                    await asyncio.wait_for(conn.recv(), 20)
            assert e.value.rcvd is not None and e.value.rcvd.code == 1008
        return time.monotonic() - t

    assert 1.5 < run(go()) < 15  # PIE_MEDIA_PIE_AUTH_TIMEOUT_S=2


def test_key_file_public_keys() -> None:
    from api.http.security.keys import ApiKeys, KeyFileError, parse_key_file

    keys = _private_keys()
    text = (
        f'[[keys]]\nname = "a"\nkey = "sk-a-12345678"\npublic_key = "{keys["carol"][1]}"\n'
        f'[[keys]]\nname = "b"\npublic_key = """{keys["dave"][1]}"""\ntenant = "team"\n'
    )
    named, plain = parse_key_file(text)
    assert [c.name for _, c in named] == ["a"] and plain == []  # b has no bearer key
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"pie-keys-{os.getpid()}.toml"
    path.write_text(text)
    try:
        k = ApiKeys.from_sources(path, environ={})
        assert k.enabled and k.public_key("b")[1].tenant == "team" and k.public_key("nobody") is None
        assert k.identify_token("sk-a-12345678").name == "a"
    finally:
        path.unlink()
    with pytest.raises(KeyFileError, match="public key"):
        parse_key_file('[[keys]]\nname = "c"\npublic_key = "ssh-ed25519 not-base64-at-all"\n')


# -- the CLI --------------------------------------------------------------------------------


def test_cli_ping_submit_and_abort_with_a_no_auth_config(
    open_server: Server, installed: str, program_files, tmp_path: Path
) -> None:
    wasm, manifest = program_files
    cli = Path(sys.executable).parent / "pie-client"
    env = {**os.environ, "PIE_CLI_HOME": str(tmp_path)}
    port = open_server.url.rsplit(":", 1)[1]

    def pie(*args: str) -> subprocess.CompletedProcess:
        read, write = os.pipe()  # stdin left open: EOF would make `submit` detach
        try:
            return subprocess.run(
                [cli, *args], env=env, stdin=read, capture_output=True, text=True, timeout=T
            )
        finally:
            os.close(read), os.close(write)

    init = pie("config", "init", "--no-auth")
    assert init.returncode == 0, init.stderr
    r = pie("ping", "--port", port)
    assert r.returncode == 0 and "alive" in r.stdout, r.stdout + r.stderr
    r = pie(
        "submit",
        "--port",
        port,
        "--path",
        str(wasm),
        "--manifest",
        str(manifest),
        "--",
        "chat",
        QWEN,
        "Hi.",
        "4",
    )
    http = httpx.post(
        f"{open_server.v1}/inferlets/{installed}/runs", json={"args": ["chat", QWEN, "Hi.", "4"]}, timeout=T
    ).json()
    assert r.returncode == 0 and f"Completed: {http['result']}" in r.stdout, r.stdout + r.stderr

    async def launch() -> str:
        async with PieClient(ws(open_server)) as c:
            await c.authenticate("tester")
            return (await c.launch_process(PROGRAM, ["echo"], capture_outputs=False)).process_id

    pid = run(launch())
    r = pie("abort", "--port", port, pid[:12])  # list_processes' strings: matched by prefix
    assert r.returncode == 0 and pid in r.stdout, r.stdout + r.stderr
    assert wait_status(open_server, pid)["status"] == "cancelled"


def test_signatures_are_checked_over_the_raw_challenge(keypairs) -> None:
    from api.http.pie_protocol.auth import verify
    from api.http.security.keys import load_public_key

    for private, public in keypairs.values():
        key = ParsedPrivateKey.parse(private)
        challenge = os.urandom(32)
        sig = key.sign(challenge)
        assert verify(load_public_key(public), sig, challenge)
        assert not verify(load_public_key(public), sig, challenge[::-1])
        assert base64.b64encode(sig)  # what auth_prove carries
