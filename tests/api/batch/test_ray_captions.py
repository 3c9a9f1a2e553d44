"""The Ray Data pipeline on a local Ray (2 engine actors, tiny model) writes the same
records as the single-process job, errors included; a rerun skips what is done."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="the ray extra (pip install .[ray]) is part of the dev install")

NAMES = (
    "images/rgba.png",
    "images/cmyk.jpg",
    "images/gray.png",
    "images/photo_640x480.jpg",
    "images/la.png",
    "images/odd_7x13.png",
    "hostile/image_truncated.jpg",
    "hostile/text_file.txt",
)


def _records(path: Path) -> dict[str, dict]:
    out = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        rec.pop("elapsed_s", None)
        out[rec["file"]] = rec
    return out


def test_ray_pipeline_equals_single_process_job(tmp_path: Path, samples: Path) -> None:
    from api.batch.job import run_caption_job
    from api.batch.ray_runner import caption_with_ray
    from api.model_ref import load_model

    src = tmp_path / "in"
    src.mkdir()
    for name in NAMES:
        shutil.copy(samples / name, src / Path(name).name)
    single = tmp_path / "single.jsonl"
    run_caption_job([src], single, model=load_model("tiny"), max_tokens=8, progress=False)
    ray_out = tmp_path / "ray.jsonl"
    summary = caption_with_ray([str(src)], ray_out, model="tiny", max_tokens=8, replicas=2)
    assert (summary.total, summary.captioned, summary.errors) == (8, 6, 2)
    got, want = _records(ray_out), _records(single)
    assert got == want
    assert {r["error"]["code"] for r in got.values() if "error" in r} == {"corrupt", "unsupported_format"}
    again = caption_with_ray([str(src)], ray_out, model="tiny", max_tokens=8, replicas=1)
    assert (again.skipped, again.captioned) == (8, 0)  # resume: nothing runs twice
    assert len(ray_out.read_text().splitlines()) == 8

    # Parquet: the same records as columns (the error as JSON text).
    import pyarrow.parquet as pq

    table = pq.read_table(_parquet(caption_with_ray, src, tmp_path)).to_pylist()
    by_file = {row["file"]: row for row in table}
    assert set(by_file) == set(want)
    for name, rec in want.items():
        row = by_file[name]
        assert row["caption"] == rec.get("caption")
        assert (json.loads(row["error"]) if row["error"] else None) == rec.get("error")


def _parquet(caption_with_ray, src: Path, tmp_path: Path) -> Path:
    out = tmp_path / "ray.parquet"
    caption_with_ray([str(src)], out, model="tiny", max_tokens=8, replicas=1)
    return out
