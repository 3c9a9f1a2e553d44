"""The chat stream's writes, counted at the ASGI boundary: the real app (tiny Qwen3-VL, its
lifespan run in this process) called as uvicorn calls it, every ``send`` recorded. Under
uvicorn each body message is one socket write, and each write is a syscall and a GIL
hand-off on the server (``bench/serve.py``), so a stream of k tokens must cost k writes:
the role chunk rides with the first token, [DONE] and the end of the body with the last,
and the n choices' tokens of one pass share a write."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from api.http.app import create_app
from api.http.settings import ServeSettings

QWEN = "tiny-qwen3-vl"


async def _call(app: Any, body: dict, *, leave_after: int | None = None) -> list[dict]:
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
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            gone.set()  # as uvicorn: a finished response reads as a disconnect

    await asyncio.wait_for(app(scope, receive, send), timeout=120)
    return sent


def _events(sent: list[dict]) -> list[Any]:
    text = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()
    out = []
    for block in text.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.fixture(scope="module")
def app_run(tmp_path_factory: pytest.TempPathFactory):
    """(app, run): ``run(coroutine_function)`` runs it on one event loop inside the app's
    lifespan (the models load once for the module)."""
    state: Path = tmp_path_factory.mktemp("event-stream-state")
    app = create_app(ServeSettings(models=["tiny"], state_dir=state))
    loop = asyncio.new_event_loop()
    lifespan = app.router.lifespan_context(app)
    loop.run_until_complete(lifespan.__aenter__())
    try:
        yield app, loop.run_until_complete
    finally:
        loop.run_until_complete(lifespan.__aexit__(None, None, None))
        loop.close()


def _body(**kw: Any) -> dict:
    return {
        "model": QWEN,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        **kw,
    }


@pytest.mark.parametrize("usage", [False, True])
def test_k_tokens_leave_in_k_writes(app_run, usage: bool) -> None:
    app, run = app_run
    k = 9
    sent = run(_call(app, _body(max_tokens=k, stream_options={"include_usage": usage})))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    bodies = sent[1:]
    assert len(bodies) == k
    assert all(m["more_body"] for m in bodies[:-1]) and not bodies[-1]["more_body"]
    events = _events(sent)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert bodies[0]["body"].count(b"data: ") == 2  # the role chunk and the first token
    tokens = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert len(tokens) <= k and chunks[-1 - usage]["choices"][0]["finish_reason"] == "length"
    if usage:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == k


def test_n_choices_of_one_pass_share_a_write(app_run) -> None:
    app, run = app_run
    n, k = 3, 10
    sent = run(_call(app, _body(max_tokens=k, n=n)))
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    events = _events(sent)
    finished = [c["choices"][0]["index"] for c in events[:-1] if c["choices"][0].get("finish_reason")]
    assert sorted(finished) == list(range(n))
    # n*k tokens; past the first few (each fork starts on its own), a pass's three tokens
    # leave together
    assert len(bodies) <= k + n + 1
    assert sum(b["body"].count(b"data: ") == n for b in bodies) >= k - 3


def test_a_client_leaving_cancels_the_stream_and_frees_everything(app_run) -> None:
    app, run = app_run
    served = app.state.service.models.get(QWEN, kind="chat")
    model = served.model
    used = model.pool_stats().in_use
    t0 = time.monotonic()
    sent = run(_call(app, _body(max_tokens=4000), leave_after=3))
    assert time.monotonic() - t0 < 60  # cancelled, not run to 4000 tokens
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    assert 3 <= len(bodies) < 50
    assert all(m["more_body"] for m in bodies)  # nothing pretends the stream ended well
    assert served.in_flight == 0
    assert model.pool_stats().in_use == used
