"""Pie's protocol, the parts a test reaches from the server's side: files both ways
(``transfer_file`` to the run's ``InferletRun``, files the run sends out as ``file``
chunks), the MCP relay (``api/http/pie_protocol/mcp_relay.py``) against a small stdio MCP
server run by the real ``pie-client``, 1,000 launches from one connection, per-key limits
and audit lines for WebSocket launches.

The server here is the real app under uvicorn on 127.0.0.1, in this process (a thread with
its own loop), so the test can look at a run's control and call the relay as the WIT host
will. No models: the example component's ``echo`` needs none."""

from __future__ import annotations

import asyncio
import json
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import httpx
import msgpack
import pytest

from tests.api.http.conftest import free_port

pie_client = pytest.importorskip("pie_client")
from pie_client import PieClient  # noqa: E402

from tests.api.http.pie_events import recv_all, recv_until  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[3] / "inferlets" / "examples"
PROGRAM = "examples@0.1.0"
MANIFEST = '[package]\nname = "examples"\nversion = "0.1.0"\n'
T = 60
LIMITED, FREE = "sk-limited-1234567", "sk-free-123456789"


@dataclass
class App:
    url: str
    app: Any
    loop: asyncio.AbstractEventLoop
    server: Any
    thread: threading.Thread

    @property
    def ws(self) -> str:
        return self.url.replace("http://", "ws://")

    @property
    def service(self) -> Any:
        return self.app.state.service

    def call(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on the server's loop; its result."""
        fut: Future = Future()

        def go() -> None:
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the test
                fut.set_exception(e)

        self.loop.call_soon_threadsafe(go)
        return fut.result(timeout=T)

    async def run(self, coro: Any) -> Any:
        """``coro`` on the server's loop, awaited from the test's (which must go on: the
        client answers the server from it)."""
        return await asyncio.wait_for(
            asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop)), T
        )

    def rec(self, run_id: str) -> Any:
        return self.service.inferlet_runs.get(run_id)


def start_app(tmp: Path, **settings: Any) -> App:
    import uvicorn

    from api.http.app import create_app
    from api.http.settings import ServeSettings
    from fixtures.paths import cache_root

    port = free_port()
    s = ServeSettings(
        models=settings.pop("models", []),
        port=port,
        state_dir=tmp / "state",
        inferlet_cache_dir=cache_root(),
        pie_upload_timeout_s=2,
        **settings,
    )
    app = create_app(s)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", ws="websockets")
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the in-process server did not start"
        time.sleep(0.05)
    return App(f"http://127.0.0.1:{port}", app, loop, server, thread)


def stop_app(a: App) -> None:
    a.server.should_exit = True
    a.thread.join(timeout=30)


@pytest.fixture(scope="module")
def wasm() -> Path:
    from fixtures.paths import cache_root
    from inferlets import build_component

    return build_component(EXAMPLES, cache_root() / "inferlets-build")


@pytest.fixture(scope="module")
def manifest(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pie-relay") / "Pie.toml"
    path.write_text(MANIFEST)
    return path


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, wasm: Path, manifest: Path) -> Iterator[App]:
    a = start_app(tmp_path_factory.mktemp("pie-relay-open"))

    async def install() -> None:
        async with PieClient(a.ws) as c:
            await c.authenticate("tester")
            await c.install_program(wasm, manifest)

    asyncio.run(asyncio.wait_for(install(), T))
    yield a
    stop_app(a)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 240))


def next_file(a: App, run_id: str, timeout: float = T) -> bytes | None:
    """The next file the run's guest would get from ``session.receive-file``."""
    return a.rec(run_id).control.file_future().result(timeout=timeout)


# -- files ----------------------------------------------------------------------------------


def test_transfer_file_reaches_the_run(srv: App) -> None:
    big = bytes(range(256)) * 2600  # 650 KiB: three 256 KiB chunks

    async def go() -> str:
        async with PieClient(srv.ws) as c:
            await c.authenticate("tester")
            p = await c.launch_process(PROGRAM, ["echo"])
            await recv_until(p, ("stderr", "err:\n"))
            await p.transfer_file(big)
            await p.transfer_file(b"")
            await p.transfer_file(b"small")
            assert await asyncio.to_thread(next_file, srv, p.process_id) == big
            assert await asyncio.to_thread(next_file, srv, p.process_id) == b""
            assert await asyncio.to_thread(next_file, srv, p.process_id) == b"small"
            await p.signal("bye")
            assert (await recv_all(p))[-1] == ("return", "0 words, 0 messages")
            return p.process_id

    run(go())


class Raw:
    def __init__(self, conn: Any):
        self.conn, self.corr = conn, 1000

    async def send(self, msg: dict) -> None:
        await self.conn.send(msgpack.packb(msg, use_bin_type=True))

    async def recv(self, want: str = "response", timeout: float = T) -> dict:
        while True:
            msg = msgpack.unpackb(await asyncio.wait_for(self.conn.recv(), timeout), raw=False)
            if msg.get("type") == want:
                return msg

    async def request(self, msg: dict) -> dict:
        self.corr += 1
        await self.send({**msg, "corr_id": self.corr})
        reply = await self.recv()
        assert reply["corr_id"] == self.corr, reply
        return reply

    async def transfer(self, pid: str, data: bytes, *, order=None, hash_=None, total=None) -> None:
        chunks = [data[i : i + 1000] for i in range(0, len(data), 1000)] or [b""]
        for i in order if order is not None else range(len(chunks)):
            await self.send(
                {
                    "type": "transfer_file",
                    "process_id": pid,
                    "file_hash": hash_ or blake3.blake3(data).hexdigest(),
                    "chunk_index": i,
                    "total_chunks": total or len(chunks),
                    "chunk_data": chunks[i],
                }
            )


def test_bad_transfers_are_told_and_the_process_runs_on(srv: App) -> None:
    import websockets

    def data(i: int) -> bytes:  # 4 chunks of at most 1000 bytes, a hash of its own
        return bytes([i]) + bytes(range(256)) * 12

    async def notice(r: Raw, i: int, want: str, digest: str | None = None) -> str:
        """The next of the server's notices (stderr events) on ``data(i)`` (its hash, or the
        one the upload gave) that says ``want``."""
        head = f"[pie-media] transfer_file {(digest or blake3.blake3(data(i)).hexdigest())[:16]}..."
        while True:
            ev = await r.recv("process_event")
            if ev["event"] == "stderr" and ev["value"].startswith(head) and want in ev["value"]:
                return ev["value"]

    async def go() -> None:
        async with websockets.connect(srv.ws) as conn:
            r = Raw(conn)
            assert (await r.request({"type": "auth_identify", "username": "x"}))["ok"]
            pid = (
                await r.request(
                    {
                        "type": "launch_process",
                        "inferlet": PROGRAM,
                        "input": '["echo"]',
                        "capture_outputs": True,
                    }
                )
            )["result"]
            await r.transfer(pid, data(1), order=[1, 0, 2, 3])
            await notice(r, 1, "chunk 1 came first")
            await r.transfer(pid, data(2), order=[0, 2, 1, 3])
            await notice(r, 2, "chunk 2 out of order (expected chunk 1 of 4)")
            await r.transfer(pid, data(3), hash_="ab" * 32)
            await notice(r, 3, "file_hash mismatch", "ab" * 32)
            await r.transfer(pid, data(4), order=[0, 1])  # then nothing: stalled
            await notice(r, 4, "2 of 4 chunks came, then nothing for 2 s")
            await r.transfer("run-000000000000000000000000", data(5))
            await notice(r, 5, "no process 'run-000000000000000000000000'")
            assert len(srv.rec(pid).control._files) == 0  # nothing from the bad ones
            await r.transfer(pid, data(2))  # a file refused before, sent again whole: taken
            await r.transfer(pid, data(6))
            assert await asyncio.to_thread(next_file, srv, pid, 10) == data(2)
            assert await asyncio.to_thread(next_file, srv, pid, 10) == data(6)
            assert (await r.request({"type": "ping"}))["ok"]
            await r.request({"type": "terminate_process", "process_id": pid})

    run(go())


def test_files_the_run_sends_reach_the_client_chunked(srv: App) -> None:
    big = bytes(range(251)) * 10_000  # 2.4 MiB: over the client's 1 MiB frame, so chunked

    async def go() -> None:
        async with PieClient(srv.ws) as c:
            await c.authenticate("tester")
            p = await c.launch_process(PROGRAM, ["echo"])
            await recv_until(p, ("stderr", "err:\n"))
            rec = srv.rec(p.process_id)
            srv.call(srv.service.inferlet_runs.deliver_file, rec, big)
            srv.call(srv.service.inferlet_runs.deliver_file, rec, b"")
            assert await recv_until(p, ("file", big)) == [("file", big)]
            assert await recv_until(p, ("file", b"")) == [("file", b"")]

            # a detached process: its file, with the events around it, kept for the first attach
            d = await c.launch_process(PROGRAM, ["echo", "w"], capture_outputs=False)
            deadline = time.monotonic() + T
            while srv.rec(d.process_id).sends != ["w"]:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            srv.call(srv.service.inferlet_runs.deliver_file, srv.rec(d.process_id), b"kept file")
            await c.signal_process(d.process_id, "after")
            while srv.rec(d.process_id).sends != ["w", "echo: after"]:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            other = PieClient(srv.ws)  # (this one holds a queue for it since its launch)
            await other.connect()
            await other.authenticate("tester")
            a = await other.attach_process(d.process_id)
            assert await recv_until(a, ("message", "echo: after")) == [
                ("stdout", "out: w\n"),
                ("stderr", "err: w\n"),
                ("message", "w"),
                ("file", b"kept file"),
                ("message", "echo: after"),
            ]
            await a.signal("bye")
            assert (await recv_all(a))[-1] == ("return", "1 words, 1 messages")
            await other.close()
            assert srv.rec(p.process_id).files == 2
            await p.terminate()

    run(go())


# -- the MCP relay ------------------------------------------------------------------------------

MCP_SERVER = textwrap.dedent(
    """
    import json, sys, time

    TOOLS = [{"name": "add", "description": "a + b", "inputSchema": {"type": "object"}},
             {"name": "slow", "description": "sleeps", "inputSchema": {"type": "object"}}]

    def answer(req):
        m, p = req["method"], req.get("params") or {}
        if m == "initialize":
            return {"protocolVersion": "2024-11-05", "capabilities": {"tools": {}},
                    "serverInfo": {"name": "test-mcp", "version": "1"}}
        if m == "tools/list":
            return {"tools": TOOLS}
        if m == "tools/call":
            if p["name"] == "add":
                a = p["arguments"]
                return {"content": [{"type": "text", "text": str(a["a"] + a["b"])}], "isError": False}
            if p["name"] == "slow":
                time.sleep(float(p["arguments"].get("s", 3)))
                return {"content": [{"type": "text", "text": "slept"}]}
            raise KeyError(p["name"])
        if m == "resources/list":
            return {"resources": [{"uri": "mem://greeting", "name": "greeting"}]}
        if m == "resources/read":
            return {"contents": [{"uri": p["uri"], "text": "hello " + p["uri"]}]}
        if m == "prompts/list":
            return {"prompts": [{"name": "greet", "arguments": [{"name": "who"}]}]}
        if m == "prompts/get":
            who = p["arguments"]["who"]
            return {"messages": [{"role": "user", "content": {"type": "text", "text": "Hi " + who}}]}
        raise LookupError(m)

    for line in sys.stdin:
        req = json.loads(line)
        if "id" not in req:
            continue
        try:
            out = {"jsonrpc": "2.0", "id": req["id"], "result": answer(req)}
        except KeyError as e:
            out = {"jsonrpc": "2.0", "id": req["id"],
                   "error": {"code": -32602, "message": f"unknown tool {e.args[0]}", "data": {"tool": e.args[0]}}}
        except LookupError as e:
            out = {"jsonrpc": "2.0", "id": req["id"], "error": {"code": -32601, "message": f"no method {e}"}}
        print(json.dumps(out), flush=True)
    """
)


def test_mcp_relay_through_the_real_client(srv: App, tmp_path: Path) -> None:
    from api.http.pie_protocol import mcp_relay
    from api.http.pie_protocol.mcp_relay import RELAY, McpError, client_for, mcp_call

    script = tmp_path / "mcp_server.py"
    script.write_text(MCP_SERVER)

    def wait(fut: Future) -> Any:
        return json.loads(fut.result(timeout=T))

    async def go() -> None:
        async with PieClient(srv.ws) as c, PieClient(srv.ws) as other:
            await c.authenticate("tester")
            await other.authenticate("tester")
            await c.register_mcp_server("calc", "stdio", sys.executable, [str(script)])
            p = await c.launch_process(PROGRAM, ["echo"])
            q = await other.launch_process(PROGRAM, ["echo"])
            control = srv.rec(p.process_id).control
            mcp = client_for(control)  # what the WIT host's pie:mcp/client will hold

            def host_side() -> None:  # the guest's worker thread: blocking on futures
                assert mcp.available_servers() == ["calc"]
                assert mcp_relay.available_servers(srv.rec(q.process_id).control) == []  # another connection
                s = mcp.connect("calc")
                assert [t["name"] for t in wait(s.list_tools())["tools"]] == ["add", "slow"]
                added = wait(s.call_tool("add", json.dumps({"a": 2, "b": 40})))
                assert added == {"content": [{"type": "text", "text": "42"}], "isError": False}
                assert wait(s.list_resources())["resources"][0]["uri"] == "mem://greeting"
                assert (
                    wait(s.read_resource("mem://greeting"))["contents"][0]["text"] == "hello mem://greeting"
                )
                assert wait(s.list_prompts())["prompts"][0]["name"] == "greet"
                got = wait(s.get_prompt("greet", json.dumps({"who": "Ada"})))
                assert got["messages"][0]["content"]["text"] == "Hi Ada"
                with pytest.raises(McpError) as e:  # the MCP server's own error, passed back
                    s.call_tool("nope", "{}").result(timeout=T)
                assert (e.value.code, e.value.message, e.value.data) == (
                    -32602,
                    "unknown tool nope",
                    {"tool": "nope"},
                )
                with pytest.raises(McpError) as e:
                    s.call_tool("add", "not json").result(timeout=T)
                assert e.value.code == -32602
                with pytest.raises(McpError) as e:
                    mcp.connect("nobody")
                assert e.value.code == -32000 and "'nobody' is not registered" in e.value.message
                assert "(registered: calc)" in e.value.message

            await asyncio.to_thread(host_side)

            # mcp_call on the server's loop, for the run and for the connection itself
            endpoint = RELAY.endpoints(control)[0][0]
            added = await srv.run(
                mcp_call(control, "calc", "tools/call", {"name": "add", "arguments": {"a": 1, "b": 2}})
            )
            assert added["content"][0]["text"] == "3"
            listed = await srv.run(mcp_call(endpoint, "calc", "tools/list"))
            assert len(listed["tools"]) == 2
            with pytest.raises(McpError) as e:
                await srv.run(mcp_call(endpoint, "calc", "no/such/method"))
            assert e.value.code == -32601
            with pytest.raises(McpError) as e:  # no answer in time
                await srv.run(
                    mcp_call(
                        control, "calc", "tools/call", {"name": "slow", "arguments": {"s": 3}}, timeout_s=0.5
                    )
                )
            assert e.value.code == -32001 and "within 0.5 s" in e.value.message

            # the client goes away with a call in flight: the call fails at once, clearly
            slow = mcp_relay.submit(control, "calc", "tools/call", {"name": "slow", "arguments": {"s": 30}})
            await asyncio.sleep(0.3)
            await c.ws.close()  # the connection drops (c.close() would stop the MCP server first)
            with pytest.raises(McpError) as e:
                await asyncio.wait_for(asyncio.wrap_future(slow), 10)
            assert e.value.code == -32000 and "connection closed" in e.value.message
            assert client_for(control).available_servers() == []
            with pytest.raises(McpError, match="not registered"):
                await srv.run(mcp_call(control, "calc", "tools/list"))
            await q.terminate()

    run(go())


# -- many launches, limits, audit -----------------------------------------------------------------


def test_a_thousand_launches_from_one_connection_are_all_answered(srv: App) -> None:
    from api.http.pie_protocol.session import MAX_LIVE_PROCESSES

    async def go() -> tuple[list, list]:
        async with PieClient(srv.ws) as c:
            await c.authenticate("tester")

            async def one(i: int) -> Any:
                try:
                    return await c.launch_process(PROGRAM, ["echo", str(i)], capture_outputs=False)
                except Exception as e:  # noqa: BLE001 - counted
                    return str(e)

            results = await asyncio.gather(*(one(i) for i in range(1000)))
            ok = [r for r in results if not isinstance(r, str)]
            refused = [r for r in results if isinstance(r, str)]
            for p in ok:
                await c.terminate_process(p.process_id)
            await c.ping()
            return ok, refused

    t = time.monotonic()
    ok, refused = run(go())
    assert len(ok) + len(refused) == 1000
    assert len(ok) == MAX_LIVE_PROCESSES, refused[:3]
    assert all("processes running, its maximum" in r for r in refused), refused[:3]
    assert time.monotonic() - t < 120
    assert httpx.get(f"{srv.url}/health").status_code == 200


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory, wasm: Path, manifest: Path) -> Iterator[tuple[App, Path]]:
    tmp = tmp_path_factory.mktemp("pie-relay-keyed")
    keys = tmp / "keys.toml"
    keys.write_text(
        f'[[keys]]\nname = "limited"\nkey = "{LIMITED}"\nrequests_per_minute = 3\nmax_concurrent_streams = 2\n'
        f'[[keys]]\nname = "free"\nkey = "{FREE}"\n'
    )
    audit_log = tmp / "audit.log"
    a = start_app(tmp, api_key_file=keys, audit_log=audit_log)
    yield a, audit_log
    stop_app(a)


def test_key_limits_count_websocket_launches(keyed: tuple[App, Path], wasm: Path, manifest: Path) -> None:
    a, _ = keyed

    async def go() -> None:
        async with PieClient(a.ws) as c:
            await c.auth_by_token(LIMITED)
            await c.install_program(wasm, manifest)
            p1 = await c.launch_process(PROGRAM, ["echo"])
            p2 = await c.launch_process(PROGRAM, ["echo"])
            with pytest.raises(Exception, match="too_many_streams"):  # two running: its stream limit
                await c.launch_process(PROGRAM, ["echo"])
            await p1.signal("bye")
            await recv_all(p1)
            deadline = time.monotonic() + T
            caller = a.app.state.keys.identify(f"Bearer {LIMITED}")
            while a.service.key_limits.streams(caller) != 1:  # its slot given back as it ended
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            p3 = await c.launch_process(PROGRAM, ["echo"])  # the 3rd request this minute
            await p3.terminate()
            await p2.terminate()
            await recv_all(p2), await recv_all(p3)
            with pytest.raises(Exception, match="rate_limit_exceeded.*3 requests per minute"):
                await c.launch_process(PROGRAM, ["echo"])
            r = httpx.get(f"{a.url}/v1/models", headers={"Authorization": f"Bearer {LIMITED}"})
            assert r.status_code == 429  # one bucket for both doors
        async with PieClient(a.ws) as c:  # another key is not held back
            await c.auth_by_token(FREE)
            await c.install_program(wasm, manifest)
            p = await c.launch_process(PROGRAM, ["echo"])
            await p.terminate()
            await recv_all(p)

    run(go())


def test_audit_lines_for_install_launch_and_terminate(
    keyed: tuple[App, Path], wasm: Path, manifest: Path
) -> None:
    a, audit_log = keyed
    before = len(audit_log.read_text().splitlines()) if audit_log.exists() else 0

    async def go() -> tuple[str, str]:
        async with PieClient(a.ws) as c:
            await c.auth_by_token(FREE)
            await c.install_program(wasm, manifest, force_overwrite=True)
            p = await c.launch_process(PROGRAM, ["echo"])
            await c.terminate_process(p.process_id)
            await recv_all(p)
            q = await c.launch_process(PROGRAM, ["echo"])  # ends with its launcher
            await recv_until(q, ("stderr", "err:\n"))
        return p.process_id, q.process_id

    p, q = run(go())
    deadline = time.monotonic() + T
    while True:
        lines = [
            json.loads(ln.split("pie_media.audit ", 1)[1])
            for ln in audit_log.read_text().splitlines()[before:]
        ]
        mine = [ln for ln in lines if ln.get("via") == "pie" and ln["key"] == "free"]
        if any(ln["id"] == q and ln["action"] == "cancel" for ln in mine) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    got = [
        (ln["action"], ln["object"], ln["id"])
        for ln in mine
        if ln["id"] in (p, q) or ln["object"] == "inferlet"
    ]
    assert ("create", "inferlet", got[0][2]) == got[0] and got[0][2].startswith("inferlet-")
    assert got[1:] == [
        ("create", "inferlet_run", p),
        ("cancel", "inferlet_run", p),
        ("create", "inferlet_run", q),
        ("cancel", "inferlet_run", q),
    ]
    assert all(ln["tenant"] == "free" for ln in mine)
    assert [ln.get("reason") for ln in mine if ln["id"] == q][-1] == "its launcher disconnected"
