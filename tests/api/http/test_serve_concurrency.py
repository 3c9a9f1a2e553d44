"""Many clients at once, and clients that leave: answers stay exact, pages come back."""

from __future__ import annotations

import asyncio
import base64
import re
import time
from pathlib import Path

import httpx
import openai

from tests.api.http.conftest import Server

QWEN = "tiny-qwen3-vl"


def _used_pages(server: Server, model: str = QWEN) -> int:
    text = httpx.get(f"{server.url}/metrics").text
    m = re.search(rf'pie_media_kv_pages\{{model="{re.escape(model)}",state="used"\}} (\S+)', text)
    assert m, text[:2000]
    return int(float(m.group(1)))


def _long_story(*, stream: bool) -> dict:
    """A request that generates far longer than any test waits (4000 tokens)."""
    return {
        "model": QWEN,
        "messages": [{"role": "user", "content": "Write a very long story."}],
        "max_tokens": 4000,
        "temperature": 0,
        "stream": stream,
        "ignore_eos": True,
    }


def _requests(samples: Path) -> list[dict]:
    images = [samples / "images" / n for n in ("photo_640x480.jpg", "rgba.png", "cmyk.jpg", "gray.png")]
    urls = [f"data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}" for p in images]
    out = []
    for i in range(32):
        if i % 2:
            content: list | str = [
                {"type": "image_url", "image_url": {"url": urls[i % 4]}},
                {"type": "text", "text": f"Picture {i}?"},
            ]
        else:
            content = f"Question number {i}."
        out.append(
            {
                "messages": [{"role": "user", "content": content}],
                "stream": i % 4 in (0, 1),
                "max_tokens": 6 + i % 5,
            }
        )
    return out


async def _ask(client: openai.AsyncOpenAI, req: dict) -> str:
    if req["stream"]:
        parts = []
        async for c in await client.chat.completions.create(model=QWEN, temperature=0, **req):
            if c.choices:
                parts.append(c.choices[0].delta.content or "")
        return "".join(parts)
    r = await client.chat.completions.create(model=QWEN, temperature=0, **req)
    return r.choices[0].message.content


def test_32_concurrent_clients_equal_alone(server: Server, samples: Path) -> None:
    reqs = _requests(samples)

    async def main() -> tuple[list[str], list[str]]:
        client = openai.AsyncOpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=300)
        alone = [await _ask(client, r) for r in reqs]
        together = await asyncio.gather(*(_ask(client, r) for r in reqs))
        await client.close()
        return alone, list(together)

    baseline = _used_pages(server)
    alone, together = asyncio.run(main())
    assert together == alone
    assert _used_pages(server) == baseline


def test_disconnect_mid_stream_returns_the_pages(server: Server) -> None:
    baseline = _used_pages(server)
    body = _long_story(stream=True)
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{server.v1}/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
            if seen >= 5:
                break  # leave mid-generation: the connection closes here
    deadline = time.monotonic() + 10
    while _used_pages(server) != baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _used_pages(server) == baseline


def test_disconnect_while_waiting_for_a_whole_answer_returns_the_pages(server: Server) -> None:
    """A non-streaming request whose client gives up: its generation is cancelled, its
    pages and its admission slot come back (api/http/disconnect.py)."""
    baseline = _used_pages(server)
    body = _long_story(stream=False)
    started = time.monotonic()
    try:
        httpx.post(f"{server.v1}/chat/completions", json=body, timeout=1.0)
        raise AssertionError("4000 tokens came back within a second")
    except httpx.ReadTimeout:
        pass  # the client closes the connection here
    deadline = time.monotonic() + 10
    while _used_pages(server) != baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _used_pages(server) == baseline
    in_flight = re.search(
        r'pie_media_requests_in_flight\{model="tiny-qwen3-vl"\} (\S+)',
        httpx.get(f"{server.url}/metrics").text,
    )
    assert in_flight and float(in_flight.group(1)) == 0
    assert time.monotonic() - started < 11
    # It ends as a counted 499 (client closed request), not as an error in the server's log.
    assert _count(server, "/v1/chat/completions", "499") >= 1
    assert "Exception in ASGI application" not in server.log_text()


def _count(server: Server, route: str, status: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    m = re.search(
        rf'pie_media_http_requests_total\{{method="POST",route="{re.escape(route)}",status="{status}"\}} (\S+)',
        text,
    )
    return float(m.group(1)) if m else 0.0


def test_queue_full_is_429_with_retry_after(tmp_path: Path) -> None:
    from tests.api.http.conftest import start_server, stop_server

    srv = start_server(tmp_path, "--max-concurrency", "1", models=("tiny",))
    try:
        body = _long_story(stream=True)
        with (
            httpx.Client(timeout=60) as http,
            http.stream("POST", f"{srv.v1}/chat/completions", json=body) as r,
        ):
            assert r.status_code == 200
            lines = r.iter_lines()  # keep it referenced: a collected iterator closes the stream
            next(lines)
            second = httpx.post(f"{srv.v1}/chat/completions", json={**body, "stream": False}, timeout=30)
            assert second.status_code == 429
            assert second.headers["retry-after"] == "1"
            assert second.json()["error"]["code"] == "queue_full"
    finally:
        stop_server(srv)
