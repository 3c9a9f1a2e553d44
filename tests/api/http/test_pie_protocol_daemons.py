"""Pie's ``launch_daemon`` through Pie's own client: a daemon inferlet (a Pie-SDK project whose
``main.py`` defines ``IncomingHandler``, built with stock componentize-py) installed with
``install_program`` and launched on a free port of 127.0.0.1; httpx then talks to it. Its
streamed greedy answer equals the engine's; a program that is not a daemon, a busy port and
a bad port are each an ``ok: false`` with the reason; the server goes on serving."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.http.conftest import free_port
from tests.api.http.test_pie_protocol_relay import App, start_app, stop_app

pie_client = pytest.importorskip("pie_client")
from pie_client import PieClient  # noqa: E402

from tests.api.http.pie_events import recv_all  # noqa: E402

DAEMON_DIR = Path(__file__).resolve().parents[3] / "inferlets" / "pie_daemon_example"
DAEMON = "http-daemon@0.1.0"
T = 120


@pytest.fixture(scope="module")
def built() -> Path:
    from fixtures.paths import cache_root
    from inferlets.build import build_pie_component

    return build_pie_component(DAEMON_DIR, cache_root() / "pie-build")


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, built: Path) -> Iterator[App]:
    a = start_app(tmp_path_factory.mktemp("pie-daemon-srv"), models=["tiny"])

    async def install() -> None:
        async with PieClient(a.ws) as c:
            await c.authenticate("tester")
            await c.install_program(built, DAEMON_DIR / "Pie.toml")

    asyncio.run(asyncio.wait_for(install(), T))
    yield a
    stop_app(a)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 300))


def wait_for_port(port: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens on 127.0.0.1:{port}"
            time.sleep(0.05)


async def launch(srv: App, port: int, program: str = DAEMON) -> None:
    async with PieClient(srv.ws) as c:
        await c.authenticate("tester")
        await c.launch_daemon(program, port)


def engine_greedy(prompt: str, max_tokens: int) -> str:
    from api.model_ref import load_model
    from engine.instruct import InstructFormat
    from tests.inferlets.test_pie_examples import greedy_text

    model = load_model("tiny")
    fmt = InstructFormat.for_model(model)
    return greedy_text(model, fmt.user(prompt) + fmt.cue(), max_tokens)


def test_a_daemon_serves_http_on_its_port(srv: App) -> None:
    port = free_port()
    run(launch(srv, port))
    wait_for_port(port)
    base = f"http://127.0.0.1:{port}"
    with httpx.Client(timeout=T) as http:
        home = http.get(f"{base}/")
        assert home.status_code == 200
        served = [m["id"] for m in http.get(f"{srv.url}/v1/models").json()["data"]]
        # an open server's caller has no key name, as its processes' runtime.username() shows
        assert (
            home.text
            == f"Hello from a Pie daemon inferlet on pie-media, anonymous. Models: {', '.join(served)}\n"
        )

        echo = http.post(f"{base}/echo", content=b"\x00binary \xff payload", headers={"content-type": "x/y"})
        assert (echo.status_code, echo.content, echo.headers["content-type"]) == (
            200,
            b"\x00binary \xff payload",
            "x/y",
        )
        big = bytes(range(256)) * 1024  # 256 KiB: many reads and writes of the guest's streams
        assert http.post(f"{base}/echo", content=big).content == big

        seen = http.get(f"{base}/echo-headers", headers={"X-Trace": "abc", "X-Multi": "1"}).json()
        assert ["x-trace", "abc"] in seen and ["x-multi", "1"] in seen

        missing = http.get(f"{base}/nowhere?x=1")
        assert (missing.status_code, missing.text) == (404, "no route for /nowhere?x=1\n")

        failed = http.get(f"{base}/fail")
        assert failed.status_code == 500 and "trapped" in failed.text, failed.text
        assert http.get(f"{base}/").status_code == 200  # the next request is served

        bad = http.post(f"{base}/generate", content=b"not json")
        assert bad.status_code == 400 and "bad request" in bad.text

        prompt, n = "Name a colour.", 12
        with http.stream("POST", f"{base}/generate", json={"prompt": prompt, "max_tokens": n}) as r:
            assert r.status_code == 200 and "content-length" not in r.headers  # streamed
            text = r.read().decode()
    assert text == engine_greedy(prompt, n)
    assert text  # the tiny model says something


def test_requests_at_once_each_get_their_own_instance(srv: App) -> None:
    port = free_port()
    run(launch(srv, port))
    wait_for_port(port)

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=T) as http:
            return await asyncio.gather(
                *(
                    http.post(f"http://127.0.0.1:{port}/echo", content=f"request {i}".encode())
                    for i in range(8)
                )
            )

    got = run(go())
    assert [r.text for r in got] == [f"request {i}" for i in range(8)]


def test_launch_errors_are_answered_and_the_server_goes_on(srv: App, tmp_path: Path) -> None:
    from fixtures.paths import cache_root
    from inferlets import build_component

    plain = build_component(
        Path(__file__).resolve().parents[3] / "inferlets" / "examples", cache_root() / "inferlets-build"
    )
    toml = tmp_path / "Pie.toml"
    toml.write_text('[package]\nname = "plain"\nversion = "0.1.0"\n')
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    busy_port = busy.getsockname()[1]

    async def go() -> None:
        async with PieClient(srv.ws) as c:
            await c.authenticate("tester")
            await c.install_program(plain, toml)
            with pytest.raises(Exception, match="plain@0.1.0 is not a daemon"):
                await c.launch_daemon("plain@0.1.0", free_port())
            with pytest.raises(Exception, match=f"cannot serve on 127.0.0.1:{busy_port}"):
                await c.launch_daemon(DAEMON, busy_port)
            with pytest.raises(Exception, match="port must be an integer from 1 to 65535"):
                await c.launch_daemon(DAEMON, 70000)
            with pytest.raises(Exception, match="not installed"):
                await c.launch_daemon("nothing@1.0.0", free_port())
            p = await c.launch_process(DAEMON, {})  # a daemon launched as a process: told what it is
            assert (await recv_all(p, T))[-1] == (
                "error",
                "invalid_inferlet: this component is a daemon (it exports wasi:http/incoming-handler, not a run "
                "function): serve it with launch_daemon",
            )
            await c.ping()  # the connection still answers

    try:
        run(go())
    finally:
        busy.close()
    assert httpx.get(f"{srv.url}/health", timeout=T).status_code == 200
    assert json.loads(httpx.get(f"{srv.url}/v1/models", timeout=T).text)["data"]


def test_a_daemon_runs_as_its_launcher(tmp_path: Path, built: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(
        '[[keys]]\nname = "alice"\nkey = "sk-alice-0123456789"\n[[keys]]\nname = "bob"\nkey = "sk-bob-0123456789"\n'
    )
    a = start_app(tmp_path, api_key_file=keys, inferlet_wall_s=3)
    port = free_port()

    async def go() -> None:
        async with PieClient(a.ws) as c:
            await c.auth_by_token("sk-alice-0123456789")
            await c.install_program(built, DAEMON_DIR / "Pie.toml")
            await c.launch_daemon(DAEMON, port)
        async with PieClient(a.ws) as c:
            await c.auth_by_token("sk-bob-0123456789")
            with pytest.raises(Exception, match="not installed"):  # alice's program, not bob's
                await c.launch_daemon(DAEMON, free_port())

    try:
        run(go())
        wait_for_port(port)
        home = httpx.get(f"http://127.0.0.1:{port}/", timeout=T)
        assert home.text == "Hello from a Pie daemon inferlet on pie-media, alice. Models: \n"
        waited = httpx.get(f"http://127.0.0.1:{port}/wait?ms=200", timeout=T)
        # the guest's time.sleep waits as long as asked (its clock is the host's)
        assert waited.status_code == 200 and 200 <= int(waited.text.split()[2]) < 5000, waited.text
        # a request runs under the server's run limits: past its 3 s wall clock, a 500 that says so
        t0 = time.monotonic()
        stuck = httpx.get(f"http://127.0.0.1:{port}/wait?ms=60000", timeout=T)
        assert stuck.status_code == 500 and "deadline" in stuck.text, stuck.text
        assert time.monotonic() - t0 < 20
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=T).status_code == 200

        alice = {"Authorization": "Bearer sk-alice-0123456789"}
        bob = {"Authorization": "Bearer sk-bob-0123456789"}
        listed = httpx.get(f"{a.url}/v1/pie/daemons", headers=alice, timeout=T).json()["data"]
        assert [(d["id"], d["port"], d["program"]) for d in listed] == [(f"daemon-{port}", port, DAEMON)]
        assert listed[0]["requests"] == 4  # /, /wait twice (one past its deadline), / again
        assert httpx.get(f"{a.url}/v1/pie/daemons", headers=bob, timeout=T).json()["data"] == []
        assert httpx.delete(f"{a.url}/v1/pie/daemons/{port}", headers=bob, timeout=T).status_code == 404
        stopped = httpx.delete(f"{a.url}/v1/pie/daemons/{port}", headers=alice, timeout=T)
        assert stopped.json() == {"id": f"daemon-{port}", "object": "pie.daemon", "deleted": True}
        with pytest.raises(httpx.TransportError):  # its port is closed
            httpx.get(f"http://127.0.0.1:{port}/", timeout=5)
        assert httpx.get(f"{a.url}/v1/pie/daemons", headers=alice, timeout=T).json()["data"] == []

        async def again() -> None:
            async with PieClient(a.ws) as c:
                await c.auth_by_token("sk-alice-0123456789")
                await c.launch_daemon(DAEMON, port)  # the port is free again

        run(again())
        wait_for_port(port)
    finally:
        stop_app(a)
    with pytest.raises(httpx.TransportError):  # the daemon stopped with its server
        httpx.get(f"http://127.0.0.1:{port}/", timeout=5)


def test_a_client_that_leaves_stops_the_guest(srv: App) -> None:
    """A client that hangs up (here: its 0.5 s timeout over a 20 s /wait) stops the guest
    answering it (cancelled, it ends at its next host call or in the poll it sleeps in):
    the daemon has no request in flight soon after, not 20 s later."""
    port = free_port()
    run(launch(srv, port))
    wait_for_port(port)

    def in_flight() -> int:
        daemons = httpx.get(f"{srv.url}/v1/pie/daemons", timeout=T).json()["data"]
        return next(d["in_flight"] for d in daemons if d["port"] == port)

    with pytest.raises(httpx.ReadTimeout):
        httpx.get(f"http://127.0.0.1:{port}/wait?ms=20000", timeout=0.5)
    left = time.monotonic()
    while in_flight():
        assert time.monotonic() - left < 8, "the guest went on after its client left"
        time.sleep(0.05)
    assert httpx.get(f"http://127.0.0.1:{port}/", timeout=T).status_code == 200
