"""Per-key limits hold for inferlets whichever door they come through: a run launched over
HTTP (``/v1/inferlets/{id}/runs``, ``/v1/pie/programs/{p}/launch``) holds a stream slot
while it runs, as a WebSocket launch does, the tokens a run
generates are charged to its key when it ends, and every request to a daemon counts against
its launcher's key (a 429 past it). A real server (tiny model) on 127.0.0.1, the real
pie-client and httpx."""

from __future__ import annotations

import asyncio
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

ROOT = Path(__file__).resolve().parents[3]
QWEN = "tiny-qwen3-vl"
PROGRAM = "examples@0.1.0"
MANIFEST = '[package]\nname = "examples"\nversion = "0.1.0"\n'
DAEMON = "http-daemon@0.1.0"
STREAMS, TOKENS, REQUESTS = "sk-streams-0123456789", "sk-tokens-0123456789", "sk-requests-0123456789"
T = 120


@pytest.fixture(scope="module")
def components() -> dict[str, Path]:
    from fixtures.paths import cache_root
    from inferlets import build_component
    from inferlets.build import build_pie_component

    return {
        "examples": build_component(ROOT / "inferlets" / "examples", cache_root() / "inferlets-build"),
        "daemon": build_pie_component(ROOT / "inferlets" / "pie_daemon_example", cache_root() / "pie-build"),
    }


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, components: dict[str, Path]) -> Iterator[App]:
    tmp = tmp_path_factory.mktemp("inferlet-key-limits")
    keys = tmp / "keys.toml"
    keys.write_text(
        f'[[keys]]\nname = "streams"\nkey = "{STREAMS}"\nmax_concurrent_streams = 1\n'
        f'[[keys]]\nname = "tokens"\nkey = "{TOKENS}"\ntokens_per_minute = 6\n'
        f'[[keys]]\nname = "requests"\nkey = "{REQUESTS}"\nrequests_per_minute = 4\n'
    )
    manifest = tmp / "Pie.toml"
    manifest.write_text(MANIFEST)
    a = start_app(tmp, models=["tiny"], api_key_file=keys)

    async def install() -> None:
        for key in (STREAMS, TOKENS, REQUESTS):
            async with PieClient(a.ws) as c:
                await c.auth_by_token(key)
                await c.install_program(components["examples"], manifest)
                if key == REQUESTS:
                    await c.install_program(
                        components["daemon"], ROOT / "inferlets" / "pie_daemon_example" / "Pie.toml"
                    )

    asyncio.run(asyncio.wait_for(install(), T))
    yield a
    stop_app(a)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 300))


def inferlet_id(a: App, key: str) -> str:
    listed = httpx.get(f"{a.url}/v1/inferlets", headers={"Authorization": f"Bearer {key}"}, timeout=T).json()
    return listed["data"][0]["id"]


def test_an_http_run_holds_a_stream_slot(srv: App) -> None:
    auth = {"Authorization": f"Bearer {STREAMS}"}
    iid = inferlet_id(srv, STREAMS)
    url = f"{srv.url}/v1/inferlets/{iid}/runs"
    waiting = httpx.post(
        url, json={"args": ["echo"], "background": True, "close_input": False}, headers=auth, timeout=T
    )
    assert waiting.status_code == 202
    second = httpx.post(url, json={"args": ["echo"], "background": True}, headers=auth, timeout=T)
    assert second.status_code == 429 and second.json()["error"]["code"] == "too_many_streams"

    async def ws_launch() -> None:  # one slot for both doors
        async with PieClient(srv.ws) as c:
            await c.auth_by_token(STREAMS)
            with pytest.raises(Exception, match="too_many_streams"):
                await c.launch_process(PROGRAM, ["echo"])

    run(ws_launch())
    pie_http = httpx.post(
        f"{srv.url}/v1/pie/programs/{PROGRAM}/launch", json={"input": ["echo"]}, headers=auth, timeout=T
    )
    assert pie_http.status_code == 429 and pie_http.json()["error"]["code"] == "too_many_streams"
    cancel = httpx.post(f"{url}/{waiting.json()['id']}/cancel", headers=auth, timeout=T)
    assert cancel.json()["status"] == "cancelled"
    deadline = time.monotonic() + T
    while True:  # the slot comes back as the run ends
        r = httpx.post(url, json={"args": ["echo"], "close_input": True}, headers=auth, timeout=T)
        if r.status_code == 200:
            break
        assert r.status_code == 429 and time.monotonic() < deadline
        time.sleep(0.05)


def test_a_runs_tokens_are_charged_to_its_key(srv: App) -> None:
    async def go() -> None:
        async with PieClient(srv.ws) as c:
            await c.auth_by_token(TOKENS)
            p = await c.launch_process(PROGRAM, ["chat", QWEN, "Describe a cat.", "10"])
            assert (await recv_all(p, T))[-1][0] == "return"
            # 10 tokens of a 6-a-minute bucket: spent until it refills
            with pytest.raises(Exception, match="rate_limit_exceeded.*tokens"):
                await c.launch_process(PROGRAM, ["echo"])

    run(go())
    r = httpx.post(
        f"{srv.url}/v1/chat/completions",
        json={"model": QWEN, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers={"Authorization": f"Bearer {TOKENS}"},
        timeout=T,
    )
    assert r.status_code == 429  # one bucket for every door


def test_daemon_requests_count_against_the_launchers_key(srv: App) -> None:
    port = free_port()

    async def go() -> None:
        async with PieClient(srv.ws) as c:
            await c.auth_by_token(REQUESTS)
            await c.launch_daemon(DAEMON, port)

    run(go())
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    got = [httpx.post(f"http://127.0.0.1:{port}/echo", content=b"x", timeout=T) for _ in range(5)]
    assert [r.status_code for r in got] == [200, 200, 200, 200, 429]  # 4 requests a minute
    assert "rate_limit_exceeded" in got[-1].text and "requests" in got[-1].text
