"""bench/serve.py's load client (raw keep-alive connections, httptools framing) counts the
same body bytes and SSE events as httpx does for the same requests, and counts a refused
request as failed without losing its connection."""

from __future__ import annotations

import asyncio
import json

import httpx

from bench.serve import _bodies, _load, _requests


def _httpx_counts(url: str, bodies: list[bytes]) -> tuple[int, int]:
    size = events = 0
    with httpx.Client(timeout=120) as client:
        for body in bodies:
            with client.stream("POST", url, content=body, headers={"content-type": "application/json"}) as r:
                assert r.status_code == 200
                data = r.read()
            size += len(data)
            events += data.count(b"\n\n")
    return size, events


def test_the_load_client_counts_what_httpx_reads(tmp_path, samples):
    from tests.api.http.conftest import start_server, stop_server

    server = start_server(tmp_path, models=("tiny",))
    try:
        url = f"{server.v1}/chat/completions"
        name = httpx.get(f"{server.v1}/models").json()["data"][0]["id"]
        bodies = _bodies(_requests(6), samples, name, 4)  # three with an image
        refused = json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]})
        got = asyncio.run(asyncio.wait_for(_load(url, [*bodies, refused.encode(), *bodies], 2), 300))
        size, events = _httpx_counts(url, bodies)
    finally:
        stop_server(server)
    assert got["failed"] == 1
    assert (got["bytes"], got["events"]) == (2 * size, 2 * events)
    assert events >= 6 * 2  # per request at least a token chunk and [DONE]
    assert len(got["first_byte_s"]) == 12 and all(t > 0 for t in got["first_byte_s"])
