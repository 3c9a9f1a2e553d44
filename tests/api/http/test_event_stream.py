"""The chat stream's writes, counted at the ASGI boundary (``asgi_writes.py`` calls the real
app as uvicorn does and records every ``send``). Under uvicorn each body message is one socket
write, and each write is a syscall and a GIL hand-off on the server (``bench/serve.py``), so a
stream of k tokens must cost k writes: the role chunk rides with the first token, [DONE] and
the end of the body with the last, and the n choices' tokens of one pass share a write."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    state = tmp_path_factory.mktemp("event-stream-state")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.api.http.asgi_writes", str(state)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    for value in out.values():
        for m in value["messages"] if isinstance(value, dict) else value:
            if "body" in m:
                m["body"] = base64.b64decode(m["body"])
    return out


def _events(sent: list[dict]) -> list[Any]:
    text = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()
    out = []
    for block in text.split("\n\n"):
        if block:
            assert block.startswith("data: "), block
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.mark.parametrize("usage", [False, True])
def test_k_tokens_leave_in_k_writes(runs: dict, usage: bool) -> None:
    k = 9
    sent = runs[f"k9_usage_{usage}"]
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    headers = dict(sent[0]["headers"])
    assert headers["content-type"].startswith("text/event-stream") and headers["cache-control"] == "no-cache"
    bodies = sent[1:]
    assert len(bodies) == k
    assert all(m["more_body"] for m in bodies[:-1]) and not bodies[-1]["more_body"]
    events = _events(sent)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert bodies[0]["body"].count(b"data: ") == 2  # the role chunk and the first token
    assert chunks[-1 - usage]["choices"][0]["finish_reason"] == "length"
    if usage:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == k


def test_n_choices_of_one_pass_share_a_write(runs: dict) -> None:
    n, k = 3, 10
    sent = runs["n3_k10"]
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    events = _events(sent)
    finished = [c["choices"][0]["index"] for c in events[:-1] if c["choices"][0].get("finish_reason")]
    assert sorted(finished) == list(range(n))
    # n*k tokens in k writes: a pass's three tokens leave together (the first write also
    # carries the three role chunks, the last [DONE])
    assert len(bodies) == k
    assert [b["body"].count(b"data: ") for b in bodies] == [2 * n] + [n] * (k - 2) + [n + 1]


@pytest.mark.parametrize("when", ["leave", "leave_while_writing"])
def test_a_client_leaving_cancels_the_stream_and_frees_everything(runs: dict, when: str) -> None:
    """Between tokens, or while a write waits on a client that stopped reading."""
    leave = runs[when]
    assert leave["seconds"] < 60  # cancelled, not run to 4000 tokens
    bodies = [m for m in leave["messages"] if m["type"] == "http.response.body"]
    assert 3 <= len(bodies) < 50
    if when == "leave_while_writing":
        assert len(bodies) == 3
    assert all(m["more_body"] for m in bodies)  # nothing pretends the stream ended well
    assert leave["in_flight_after"] == 0
    assert leave["pages_after"] == leave["pages_before"]


def test_a_drafted_steps_tokens_share_a_write(runs: dict) -> None:
    """Speculative decoding keeps several tokens per pass; they leave in one write. The tiny
    random model's greedy text repeats itself, so prompt lookup drafts what it says next."""
    plain, drafted = runs["plain_k24"], runs["drafted_k24"]

    def text(sent: list[dict]) -> str:
        chunks = _events(sent)[:-1]
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)

    assert text(drafted) == text(plain)  # the same answer, token for token
    assert len(_events(drafted)) == len(_events(plain))  # an event per token either way
    writes = sum(m["type"] == "http.response.body" for m in drafted)
    assert writes < sum(m["type"] == "http.response.body" for m in plain) == 24
