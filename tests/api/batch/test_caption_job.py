"""The batch captioning job: JSONL records, resume after a real SIGKILL, dedup by content."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image as PILImage

from api.batch.file_source import expand_paths
from api.batch.job import run_caption_job
from api.batch.journal import read_records

ROOT = Path(__file__).resolve().parents[3]
N_IMAGES = 12


def _write_images(folder: Path, n: int = N_IMAGES) -> None:
    """``n`` distinct 64x48 PNGs (two in a subfolder), one byte-identical copy under another
    name, a truncated JPEG and a text file."""
    rng = np.random.default_rng(0)
    (folder / "sub").mkdir(parents=True)
    for i in range(n):
        px = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
        where = folder / "sub" if i < 2 else folder
        PILImage.fromarray(px).save(where / f"img{i:02d}.png")
    (folder / "copy_of_last.png").write_bytes((folder / f"img{n - 1:02d}.png").read_bytes())
    buf = io.BytesIO()
    PILImage.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(buf, "JPEG")
    (folder / "truncated.jpg").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    (folder / "notes.txt").write_text("not an image\n")


def _cli(folder: Path, out: Path, max_tokens: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "api.cli",
        "caption",
        str(folder),
        "--out",
        str(out),
        "--concurrency",
        "2",
        "--model",
        "tiny",
        "--max-tokens",
        str(max_tokens),
    ]


def _lines(out: Path) -> list[str]:
    if not out.exists():
        return []
    data = out.read_text(encoding="utf-8")
    return data[: data.rfind("\n") + 1].splitlines()


def test_killed_run_resumes_without_losing_or_duplicating(tmp_path):
    folder, out = tmp_path / "media", tmp_path / "captions.jsonl"
    _write_images(folder)
    files = [str(f) for f in expand_paths([folder])]
    assert len(files) == N_IMAGES + 3
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}

    # First run: SIGKILL it as soon as the first records are on disk.
    proc = subprocess.Popen(
        _cli(folder, out, 80), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 120  # generous: start-up on a busy 2-core machine
    while len(_lines(out)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
    before = _lines(out)
    assert 2 <= len(before) < len(files), "the run must be killed part-way"

    # Second run: completes, skipping what the first one recorded.
    done = subprocess.run(_cli(folder, out, 80), cwd=ROOT, env=env, capture_output=True, timeout=120)
    assert done.returncode == 1, done.stderr.decode()[-2000:]  # the two bad files
    assert "already done" in done.stderr.decode()

    after = _lines(out)
    assert after[: len(before)] == before  # earlier records untouched
    recs = [json.loads(line) for line in after]
    names = [r["file"] for r in recs]
    assert sorted(names) == sorted(files)  # every file exactly once
    by_name = {r["file"]: r for r in recs}
    for name in files:
        r = by_name[name]
        assert r["model"] == "tiny-qwen3-vl" and r["max_tokens"] == 80
        if name.endswith((".jpg", ".txt")):
            assert set(r["error"]) >= {"code", "message"}
            assert r["error"]["code"] in ("corrupt", "unsupported_format")
            assert "caption" not in r
        else:
            assert isinstance(r["caption"], str) and len(r["content_hash"]) == 32
            assert r["elapsed_s"] >= 0
    assert by_name[str(folder / "truncated.jpg")]["error"]["code"] == "corrupt"
    assert by_name[str(folder / "notes.txt")]["error"]["code"] == "unsupported_format"
    a, b = by_name[str(folder / f"img{N_IMAGES - 1:02d}.png")], by_name[str(folder / "copy_of_last.png")]
    assert a["content_hash"] == b["content_hash"] and a["caption"] == b["caption"]

    # A third run has nothing left to do and writes nothing.
    again = subprocess.run(_cli(folder, out, 80), cwd=ROOT, env=env, capture_output=True, timeout=120)
    assert _lines(out) == after
    assert f"{len(files)} already done" in again.stderr.decode()


def test_read_records_cuts_a_torn_last_line(tmp_path):
    out = tmp_path / "x.jsonl"
    out.write_text('{"file": "a", "caption": "x"}\nnot json\n{"file": "b", "capt')
    recs, torn = read_records(out)
    assert [r["file"] for r in recs] == ["a"]
    assert torn == len('{"file": "b", "capt')
    assert out.read_text() == '{"file": "a", "caption": "x"}\nnot json\n'


def test_expand_paths_sorted_recursive_skips_hidden_and_output(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.png").write_bytes(b"")
    (tmp_path / "a.png").write_bytes(b"")
    (tmp_path / ".hidden.png").write_bytes(b"")
    (tmp_path / "out.jsonl").write_bytes(b"")
    got = expand_paths([tmp_path], exclude=tmp_path / "out.jsonl")
    assert got == [tmp_path / "a.png", tmp_path / "b" / "z.png"]


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    from engine import Model

    return Model.load(tiny_dir("tiny-qwen3-vl"), kv_pages=256, device="cpu")


def test_in_process_job_matches_engine_and_dedups(tmp_path, tiny):
    from engine import caption

    folder, out = tmp_path / "media", tmp_path / "out.jsonl"
    _write_images(folder, n=3)
    s = run_caption_job([folder], out, model=tiny, max_tokens=5, concurrency=3, progress=False)
    assert (s.captioned, s.errors, s.total) == (3, 2, 6)
    assert s.reused == 1  # the byte-identical copy is captioned once
    recs = {r["file"]: r for r in map(json.loads, out.read_text().splitlines())}
    path = folder / "img02.png"
    assert recs[str(path)]["caption"] == caption(tiny, path, max_tokens=5)
    # Other settings are another job: nothing is skipped.
    s2 = run_caption_job([folder], out, model=tiny, max_tokens=4, concurrency=3, progress=False)
    assert s2.skipped == 0 and s2.captioned == 3
    s3 = run_caption_job([folder], out, model=tiny, max_tokens=4, concurrency=3, progress=False)
    assert s3.skipped == 6 and s3.earlier_errors == 2 and s3.captioned == 0


def test_a_job_keeps_few_cached_kv_pages_and_gives_the_limit_back(tmp_path, tiny, monkeypatch):
    """A job's distinct images' KV pages go back to the free pages as they are released
    (``JOB_CACHED_KV_PAGES``), not into the prefix cache, whose growth made the pool
    resident page by page; the pool's own limit (none) is back after the job."""
    import api.batch.job as job

    rng = np.random.default_rng(7)

    def images(folder: Path) -> Path:
        folder.mkdir()
        for i in range(3):
            pixels = rng.integers(0, 256, size=(224, 224, 3), dtype=np.uint8)
            PILImage.fromarray(pixels).save(folder / f"{i}.png")
        return folder

    tiny.pool.set_cache_limit(0)  # start with nothing cached
    tiny.pool.set_cache_limit(None)
    monkeypatch.setattr(job, "JOB_CACHED_KV_PAGES", None)  # no limit: the pages stay cached
    run_caption_job([images(tmp_path / "a")], tmp_path / "a.jsonl", model=tiny, max_tokens=2, progress=False)
    unlimited = tiny.pool_stats().cached
    assert unlimited >= 6  # two full pages of image rows each, at least

    monkeypatch.setattr(job, "JOB_CACHED_KV_PAGES", 2)
    s = run_caption_job(
        [images(tmp_path / "b")], tmp_path / "b.jsonl", model=tiny, max_tokens=2, progress=False
    )
    assert s.captioned == 3
    stats = tiny.pool_stats()
    assert stats.cached <= 2 and stats.in_use == 0
    assert tiny.pool.set_cache_limit(None) is None  # the job gave the pool's limit back
