"""Run by ``test_event_stream.py`` in a process of its own: the real app (tiny Qwen3-VL, its
lifespan run here) called through the ASGI interface as uvicorn calls it, every ``send``
recorded; prints the scenarios' messages as JSON. A separate process because the app's
lifespan builds the inferlet runtime's wasmtime engine, whose trap handlers must not be
installed in the pytest process before Ray's (a later wasm trap would then kill pytest)."""

from __future__ import annotations

import asyncio
import base64
import json
import sys
import time
from pathlib import Path
from typing import Any

from api.http.app import create_app
from api.http.settings import ServeSettings

QWEN = "tiny-qwen3-vl"


async def _call(app: Any, body: dict, *, leave_after: int | None = None, stall: bool = False) -> list[dict]:
    """POST ``body`` to /v1/chat/completions through the ASGI interface; the recorded
    messages. ``leave_after=m``: the client disconnects once m body messages arrived."""
    raw = json.dumps(body).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},  # what uvicorn's httptools gives
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }
    sent: list[dict] = []
    gone = asyncio.Event()
    body_given = False

    async def receive() -> dict:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        bodies = sum(m["type"] == "http.response.body" for m in sent)
        if leave_after is not None and bodies >= leave_after:
            gone.set()
            if stall:  # the client stopped reading: the write waits on a full socket buffer
                await asyncio.Event().wait()
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            gone.set()  # as uvicorn: a finished response reads as a disconnect

    await asyncio.wait_for(app(scope, receive, send), timeout=120)
    return sent


def _body(**kw: Any) -> dict:
    return {
        "model": QWEN,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        **kw,
    }


def _plain(sent: list[dict]) -> list[dict]:
    """The messages as JSON: bodies in base64, headers as text."""
    out = []
    for m in sent:
        m = dict(m)
        if "body" in m:
            m["body"] = base64.b64encode(m["body"]).decode()
        if "headers" in m:
            m["headers"] = [[k.decode(), v.decode()] for k, v in m["headers"]]
        out.append(m)
    return out


async def main(state: Path) -> dict:
    app = create_app(ServeSettings(models=["tiny"], state_dir=state))
    async with app.router.lifespan_context(app):
        out: dict[str, Any] = {}
        for usage in (False, True):
            sent = await _call(app, _body(max_tokens=9, stream_options={"include_usage": usage}))
            out[f"k9_usage_{usage}"] = _plain(sent)
        out["n3_k10"] = _plain(await _call(app, _body(max_tokens=10, n=3)))
        plain = await _call(app, _body(max_tokens=24))
        drafted = await _call(app, _body(max_tokens=24, speculative={"num_draft": 4}))
        out["plain_k24"], out["drafted_k24"] = _plain(plain), _plain(drafted)
        served = app.state.service.models.get(QWEN, kind="chat")
        used = served.model.pool_stats().in_use
        t0 = time.monotonic()
        sent = await _call(app, _body(max_tokens=4000), leave_after=3)
        out["leave"] = leave = {
            "messages": _plain(sent),
            "seconds": time.monotonic() - t0,
            "in_flight_after": served.in_flight,
            "pages_before": used,
            "pages_after": served.model.pool_stats().in_use,
        }
        t0 = time.monotonic()
        sent = await _call(app, _body(max_tokens=4000), leave_after=3, stall=True)
        out["leave_while_writing"] = {
            **leave,
            "messages": _plain(sent),
            "seconds": time.monotonic() - t0,
            "in_flight_after": served.in_flight,
            "pages_after": served.model.pool_stats().in_use,
        }
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(Path(sys.argv[1])))))
