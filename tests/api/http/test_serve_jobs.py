"""Caption jobs over HTTP: resume after SIGKILL of the real server with nothing lost or
duplicated, results equal to in-process captions, per-item errors as records."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.api.http.conftest import Server, start_server, stop_server

IMAGES = (
    "photo_640x480.jpg",
    "rgba.png",
    "cmyk.jpg",
    "gray.png",
    "bilevel.png",
    "la.png",
    "odd_7x13.png",
    "image.bmp",
    "lossy.webp",
    "exif_rotated_6.jpg",
)
PROMPT, MAX_TOKENS = "Describe this image.", 24


@pytest.fixture(scope="module")
def expected(samples: Path) -> dict[str, str]:
    """Captions of each distinct image computed in-process, greedy."""
    from api.model_ref import load_model
    from engine import caption

    model = load_model("tiny", device="cpu")
    return {n: caption(model, samples / "images" / n, prompt=PROMPT, max_tokens=MAX_TOKENS) for n in IMAGES}


def _wait(server: Server, job_id: str, until, timeout: float = 240) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = httpx.get(f"{server.v1}/jobs/{job_id}", timeout=30).json()
        if until(job):
            return job
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} did not get there in {timeout} s: {job}")


def _results(server: Server, job_id: str) -> list[dict]:
    r = httpx.get(f"{server.v1}/jobs/{job_id}/results", params={"follow": "false"}, timeout=60)
    return [json.loads(line) for line in r.text.splitlines() if line]


def test_sigkill_mid_job_resumes_with_nothing_lost_or_duplicated(
    tmp_path: Path, samples: Path, expected
) -> None:
    files = [
        ("file", (f"{i:02d}-{n}", (samples / "images" / n).read_bytes(), "application/octet-stream"))
        for i in range(4)
        for n in IMAGES
    ]
    first = start_server(tmp_path, models=("tiny",))
    try:
        job = httpx.post(
            f"{first.v1}/jobs/captions",
            files=files,
            data={"max_tokens": str(MAX_TOKENS), "concurrency": "2", "prompt": PROMPT},
            timeout=120,
        ).json()
        assert job["total"] == 40 and job["status"] in ("queued", "running")
        seen = _wait(first, job["id"], lambda j: j["done"] + j["failed"] >= 4)
        assert seen["done"] + seen["failed"] < 40, "the job finished before the kill; make it longer"
    finally:
        os.killpg(first.process.pid, signal.SIGKILL)
        first.process.wait(timeout=30)
    second = start_server(tmp_path, models=("tiny",))  # same state dir: resumes by itself
    try:
        done = _wait(second, job["id"], lambda j: j["status"] == "completed")
        assert (done["done"], done["failed"], done["total"]) == (40, 0, 40)
        results = _results(second, job["id"])
        assert sorted(r["index"] for r in results) == list(range(40))  # each item exactly once
        for r in results:
            assert r["caption"] == expected[r["file"][3:]], r["file"]
            assert (r["model"], r["prompt"], r["max_tokens"]) == ("tiny-qwen3-vl", PROMPT, MAX_TOKENS)
    finally:
        stop_server(second)


def test_job_by_media_ids_with_errors_as_records(server: Server, samples: Path, expected) -> None:
    up = httpx.post(
        f"{server.v1}/media",
        files=[
            ("file", ("a.png", (samples / "images" / "rgba.png").read_bytes(), "image/png")),
            ("file", ("t.wav", (samples / "audio" / "tone_16k_mono.wav").read_bytes(), "audio/wav")),
        ],
    ).json()["data"]
    ids = [d["media"]["id"] for d in up] + ["media-0123456789abcdef"]
    job = httpx.post(
        f"{server.v1}/jobs/captions", json={"media_ids": ids, "max_tokens": MAX_TOKENS, "prompt": PROMPT}
    ).json()
    _wait(server, job["id"], lambda j: j["status"] == "completed")
    results = {r["index"]: r for r in _results(server, job["id"])}
    assert results[0]["caption"] == expected["rgba.png"]
    assert results[1]["error"]["code"] == "unsupported_media"
    assert results[2]["error"]["code"] == "media_not_found"
    listed = httpx.get(f"{server.v1}/jobs").json()["data"]
    assert job["id"] in {j["id"] for j in listed}


def test_results_follow_a_running_job_and_cancel(server: Server, samples: Path) -> None:
    files = [
        ("file", (f"{i}.png", (samples / "images" / "gray.png").read_bytes(), "image/png")) for i in range(12)
    ]
    job = httpx.post(
        f"{server.v1}/jobs/captions", files=files, data={"max_tokens": "200", "concurrency": "1"}, timeout=60
    ).json()
    with httpx.stream("GET", f"{server.v1}/jobs/{job['id']}/results", timeout=120) as r:
        lines = r.iter_lines()
        first = json.loads(next(lines))  # arrives while the job still runs
        assert first["file"].endswith(".png")
        cancelled = httpx.post(f"{server.v1}/jobs/{job['id']}/cancel").json()
        assert cancelled["status"] == "cancelled"
        rest = [json.loads(x) for x in lines if x]  # the stream ends with the job
    assert 1 + len(rest) < 12


def test_bad_job_requests(server: Server, tmp_path: Path) -> None:
    assert httpx.get(f"{server.v1}/jobs/job-nope").status_code == 404
    assert httpx.post(f"{server.v1}/jobs/captions", json={}).status_code == 400
    assert httpx.post(f"{server.v1}/jobs/captions", json={"directory": str(tmp_path)}).status_code == 400
    assert (
        httpx.post(f"{server.v1}/jobs/captions", json={"media_ids": ["x"], "model": "nope"}).status_code
        == 404
    )
    assert httpx.post(f"{server.v1}/jobs/captions", json={"media_ids": ["x"], "bogus": 1}).status_code == 400
