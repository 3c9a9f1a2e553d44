"""Inferlets over HTTP against the real server: upload once (same bytes, same id), run
whole / streamed (SSE) / in the background, talk to a run, cancel it; each answer equals
the same program run in-process on the engine, token for token; failures are typed 4xx."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from pathlib import Path

import httpx
import pytest

from tests.api.http.conftest import Server
from tests.inferlets import direct

EXAMPLES = Path(__file__).resolve().parents[3] / "inferlets" / "examples"
QWEN = "tiny-qwen3-vl"


@pytest.fixture(scope="module")
def wasm() -> bytes:
    from fixtures.paths import cache_root
    from inferlets import build_component

    return build_component(EXAMPLES, cache_root() / "inferlets-build").read_bytes()


@pytest.fixture(scope="module")
def local():
    from api.model_ref import load_model

    return load_model("tiny", device="cpu")


@pytest.fixture(scope="module")
def inferlet_id(server: Server, wasm: bytes) -> str:
    r = httpx.post(
        f"{server.v1}/inferlets", content=wasm, headers={"content-type": "application/wasm"}, timeout=300
    )
    assert r.status_code == 200, r.text
    return r.json()["id"]


def _sse(response: httpx.Response) -> list[tuple[str, dict]]:
    events, kind = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            kind = line[len("event: ") :]
        elif line.startswith("data: "):
            events.append((kind, json.loads(line[len("data: ") :])))
    return events


def _wait(server: Server, inferlet_id: str, run_id: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = httpx.get(f"{server.v1}/inferlets/{inferlet_id}/runs/{run_id}").json()
        if run["status"] != "running":
            return run
        time.sleep(0.1)
    raise AssertionError(f"run {run_id} still running after {timeout} s")


def test_upload_is_content_addressed(server: Server, wasm: bytes, inferlet_id: str) -> None:
    again = httpx.post(
        f"{server.v1}/inferlets", files=[("file", ("app.wasm", wasm, "application/wasm"))], timeout=120
    )
    assert again.status_code == 200 and again.json()["id"] == inferlet_id
    assert again.json()["bytes"] == len(wasm)
    listed = httpx.get(f"{server.v1}/inferlets").json()["data"]
    assert [i["id"] for i in listed].count(inferlet_id) == 1
    assert httpx.get(f"{server.v1}/inferlets/{inferlet_id}").json()["sha256"].startswith(inferlet_id[9:])


def test_whole_run_equals_engine(server: Server, inferlet_id: str, local) -> None:
    from engine import SyncContext

    r = httpx.post(
        f"{server.v1}/inferlets/{inferlet_id}/runs",
        json={"args": ["chat", QWEN, "Describe a cat.", "10"]},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    run = r.json()
    assert run["status"] == "succeeded" and run["object"] == "inferlet.run"
    want = SyncContext(local).user("Describe a cat.").cue().generate(max_tokens=10).text
    assert run["result"] == want


def test_streamed_best_of_equals_engine(server: Server, inferlet_id: str, local) -> None:
    args = ["best-of", QWEN, "Name a fruit.", "6", "3", "0.8", "5"]
    with httpx.stream(
        "POST", f"{server.v1}/inferlets/{inferlet_id}/runs", json={"args": args, "stream": True}, timeout=120
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _sse(r)
    kinds = [k for k, _ in events]
    assert kinds[0] == "run" and kinds[-1] == "result" and kinds.count("send") == 3
    want_sends, want_best = asyncio.run(direct.best_of(local, "Name a fruit.", 6, 3, 0.8, 5))
    assert [d["text"] for k, d in events if k == "send"] == want_sends
    assert events[-1][1]["result"] == want_best


def test_messages_reach_receive_in_a_background_run(server: Server, inferlet_id: str, local) -> None:
    from media import Video

    data = direct.mp4()
    r = httpx.post(
        f"{server.v1}/inferlets/{inferlet_id}/runs",
        json={
            "args": ["video-qa", QWEN, "What happens?", "8", "4", "-"],
            "background": True,
            "close_input": False,
        },
    )
    assert r.status_code == 202 and r.json()["status"] == "running"
    run_id = r.json()["id"]
    posted = httpx.post(
        f"{server.v1}/inferlets/{inferlet_id}/runs/{run_id}/messages",
        json={"text": base64.b64encode(data).decode()},
    )
    assert posted.status_code == 200
    run = _wait(server, inferlet_id, run_id)
    assert run["status"] == "succeeded", run
    want_facts, want = asyncio.run(
        direct.media_qa(local, Video.from_bytes(data), "What happens?", 8, max_frames=4)
    )
    assert json.loads(run["sends"][0]) == want_facts
    assert json.loads(run["result"]) == want


def test_cancel_stops_a_waiting_run(server: Server, inferlet_id: str) -> None:
    r = httpx.post(
        f"{server.v1}/inferlets/{inferlet_id}/runs",
        json={"args": ["video-qa", QWEN, "?", "4", "2", "-"], "background": True, "close_input": False},
    )
    run_id = r.json()["id"]
    t0 = time.monotonic()
    c = httpx.post(f"{server.v1}/inferlets/{inferlet_id}/runs/{run_id}/cancel", timeout=30)
    assert c.status_code == 200 and c.json()["status"] == "cancelled"
    assert c.json()["error"]["code"] == "inferlet_cancelled"
    assert time.monotonic() - t0 < 10
    late = httpx.post(f"{server.v1}/inferlets/{inferlet_id}/runs/{run_id}/messages", json={"text": "x"})
    assert late.status_code == 400


def test_failures_are_typed_4xx(server: Server, inferlet_id: str) -> None:
    runs = f"{server.v1}/inferlets/{inferlet_id}/runs"
    bad = httpx.post(f"{server.v1}/inferlets", content=b"\0asm not really", timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_inferlet"
    assert httpx.get(f"{server.v1}/inferlets/inferlet-{'0' * 32}").status_code == 404
    assert httpx.post(f"{server.v1}/inferlets/nope/runs", json={}).status_code == 404
    assert httpx.get(f"{runs}/run-missing").status_code == 404
    forged = httpx.post(runs, json={"args": ["forged", QWEN]}, timeout=60)
    # The guest let the host's typed error end it: the run fails with the guest's code kept.
    error = forged.json()["error"]
    assert forged.status_code == 422 and error["code"] == "inferlet_failed"
    assert error["guest_code"] == "inferlet_bad_handle" and error["run_id"].startswith("run-")
    loop = httpx.post(runs, json={"args": ["loop", QWEN], "limits": {"wall_s": 1.0}}, timeout=60)
    assert loop.status_code == 422 and loop.json()["error"]["code"] in ("inferlet_timeout", "inferlet_trap")
    assert httpx.post(runs, json={"limits": {"wall_s": -1}}).status_code == 400
    # A run that never existed for this inferlet, and a good run right after: unaffected.
    ok = httpx.post(runs, json={"args": ["chat", QWEN, "Hi", "3"]}, timeout=60)
    assert ok.status_code == 200 and ok.json()["status"] == "succeeded"


def test_oversized_upload_is_413(server: Server) -> None:
    big = b"\0" * ((64 << 20) + 1)
    r = httpx.post(
        f"{server.v1}/inferlets", content=big, headers={"content-type": "application/wasm"}, timeout=60
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"


def test_client_leaving_a_stream_cancels_its_run(server: Server, inferlet_id: str) -> None:
    body = {"args": ["video-qa", QWEN, "?", "4", "2", "-"], "stream": True, "close_input": False}
    with httpx.stream("POST", f"{server.v1}/inferlets/{inferlet_id}/runs", json=body, timeout=60) as r:
        lines = r.iter_lines()
        first = next(lines)
        while not first.startswith("data: "):
            first = next(lines)
        run_id = json.loads(first[len("data: ") :])["id"]
    run = _wait(server, inferlet_id, run_id, timeout=30)
    assert run["status"] == "cancelled"


def test_client_leaving_a_whole_run_cancels_it(server: Server, inferlet_id: str) -> None:
    """A run awaited whole (not streamed, not in the background) whose client gives up is
    cancelled with it, and the request ends as a counted 499, not a logged error."""

    def running() -> float:
        text = httpx.get(f"{server.url}/metrics").text
        line = next(x for x in text.splitlines() if x.startswith("pie_media_inferlet_runs_running "))
        return float(line.split()[1])

    before = running()
    body = {"args": ["video-qa", QWEN, "?", "4", "2", "-"], "close_input": False}  # waits for input
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.v1}/inferlets/{inferlet_id}/runs", json=body, timeout=1.5)
    deadline = time.monotonic() + 20
    while running() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running() == before
    assert "Exception in ASGI application" not in server.log_text()


def test_delete_is_last(server: Server, inferlet_id: str) -> None:
    """(Last in this file: the other tests use the uploaded component.)"""
    r = httpx.delete(f"{server.v1}/inferlets/{inferlet_id}")
    assert r.status_code == 200 and r.json() == {"id": inferlet_id, "object": "inferlet", "deleted": True}
    assert httpx.get(f"{server.v1}/inferlets/{inferlet_id}").status_code == 404
    assert (
        httpx.post(f"{server.v1}/inferlets/{inferlet_id}/runs", json={"args": ["ping", "1"]}).status_code
        == 404
    )
    assert httpx.delete(f"{server.v1}/inferlets/{inferlet_id}").status_code == 404


def test_a_pie_world_component_runs_with_its_input(server: Server, tmp_path: Path) -> None:
    """Pie's examples (one component, see tests/inferlets/pie_examples.py) over HTTP: the
    run's ``input`` is the component's one JSON argument."""
    from fixtures.paths import cache_root
    from inferlets.build import build_pie_component
    from tests.inferlets.pie_examples import EXAMPLES as PIE_EXAMPLES
    from tests.inferlets.pie_examples import write_bundle

    if not (PIE_EXAMPLES / "py-concurrency-test" / "main.py").is_file():
        pytest.skip(f"Pie 0.4.0's examples are not at {PIE_EXAMPLES}")
    wasm = build_pie_component(
        write_bundle(tmp_path / "pie-examples"), cache_root() / "pie-build"
    ).read_bytes()
    r = httpx.post(
        f"{server.v1}/inferlets", content=wasm, headers={"content-type": "application/wasm"}, timeout=300
    )
    assert r.status_code == 200, r.text
    pie_id = r.json()["id"]
    run = httpx.post(
        f"{server.v1}/inferlets/{pie_id}/runs",
        json={"input": {"__example__": "py-concurrency-test"}},
        timeout=300,
    )
    assert run.status_code == 200, run.text
    body = run.json()
    assert body["result"] == "done" and "[test] verdict: CONCURRENT" in body["sends"]
    both = httpx.post(f"{server.v1}/inferlets/{pie_id}/runs", json={"input": {}, "args": ["x"]}, timeout=60)
    assert both.status_code == 400 and both.json()["error"]["param"] == "input"
