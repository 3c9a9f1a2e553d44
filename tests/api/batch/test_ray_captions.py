"""The Ray Data pipeline on a local Ray (2 engine actors, tiny model) writes the same
records as the single-process job, errors included; a rerun skips what is done. A Ray
worker SIGKILLed mid-shard costs nothing: the shard is redone, nothing written twice.

One Ray session for the module (``ray_session``; starting one takes ~10 s), which
``caption_with_ray`` uses as it finds it and leaves up."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
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


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Ray for the module, with ``_kill_hook`` installed in every worker; yields the kill's
    marker file. The hook fires only on WebDataset sample ``k4`` (the shards test's), once."""
    import ray

    marker = tmp_path_factory.mktemp("ray-kill") / "killed.pid"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"worker_process_setup_hook": _kill_hook(str(marker), "k4")},
    )
    try:
        yield marker
    finally:
        ray.shutdown()


def test_ray_pipeline_equals_single_process_job(tmp_path: Path, samples: Path, ray_session: Path) -> None:
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


def _wds_shard(path: Path, members: list[tuple[str, bytes]]) -> str:
    import io
    import tarfile

    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def _kill_hook(marker: str, marker_key: str):
    """The setup hook: built here, so pickled by value into the Ray workers."""

    def install() -> None:
        import os as _os
        import signal

        import api.batch.item_records as item_records_mod

        records = item_records_mod.item_records

        async def killing_records(item, spec, settings, outcomes):  # type: ignore[no-untyped-def]
            if item.key == marker_key:
                try:
                    fd = _os.open(marker, _os.O_CREAT | _os.O_EXCL | _os.O_WRONLY)
                except FileExistsError:  # killed once already: this is the retry
                    return await records(item, spec, settings, outcomes)
                _os.write(fd, str(_os.getpid()).encode())
                _os.close(fd)
                _os.kill(_os.getpid(), signal.SIGKILL)
            return await records(item, spec, settings, outcomes)

        item_records_mod.item_records = killing_records

    return install


def test_ray_shards_equal_single_process_and_resume_without_duplicates(
    tmp_path: Path, samples: Path, ray_session: Path
) -> None:
    """WebDataset tars through ray.data.read_webdataset, a Parquet file with a key column
    through ray.data.read_parquet, a tar cut off mid-member through the package's own
    reader: the records equal the single-process job's. The output already holds a killed
    run's part (one shard whole, one record of another): nothing is written twice, and a
    rerun skips every shard by the ledger.

    On top of that, the run's engine worker is SIGKILLed mid-shard: Ray Data fuses
    ``Map(prepare_wds_row)->MapBatches(CaptionItems)`` into the engine actor's tasks, and
    the actor's process kills itself (a ``worker_process_setup_hook`` of the module's Ray
    session, ``_kill_hook``) when it reaches sample ``k4`` of shard ``b``, the batch
    (of two) after ``k3``'s. Ray restarts the actor and runs the lost task again: the
    records are still complete and once each."""
    import tarfile

    import pyarrow as pa
    import pyarrow.parquet as pq

    from api.batch.job import run_caption_job
    from api.batch.ray_runner import caption_with_ray
    from api.model_ref import load_model

    img = {n: (samples / "images" / n).read_bytes() for n in ("rgba.png", "cmyk.jpg", "gray.png", "la.png")}
    bad = (samples / "hostile/image_truncated.jpg").read_bytes()
    a = _wds_shard(
        tmp_path / "a.tar",
        [("k0.png", img["rgba.png"]), ("k0.json", b'{"n": 0}'), ("k1.jpg", img["cmyk.jpg"]), ("k2.jpg", bad)],
    )
    b = _wds_shard(
        tmp_path / "b.tar", [("k3.png", img["gray.png"]), ("k4.png", img["la.png"]), ("k5.txt", b"x")]
    )
    cut = tmp_path / "c.tar"
    whole = Path(
        _wds_shard(tmp_path / "c_whole.tar", [("k6.png", img["rgba.png"]), ("k7.png", img["gray.png"])])
    )
    with tarfile.open(whole) as t:
        last = t.getmember("k7.png")
    cut.write_bytes(whole.read_bytes()[: last.offset_data + last.size // 2])  # cut inside k7's data
    whole.unlink()
    table = pa.table({"key": ["p0", "p1"], "jpg": [img["cmyk.jpg"], img["la.png"]], "lang": ["en", "de"]})
    pq.write_table(table, tmp_path / "d.parquet")
    inputs = [a, b, str(cut), str(tmp_path / "d.parquet")]

    single = tmp_path / "single.jsonl"
    run_caption_job(inputs, single, model=load_model("tiny"), max_tokens=8, progress=False)
    want = [json.loads(line) for line in single.read_text().splitlines()]

    def key(r: dict) -> tuple:
        return (r["shard"], r["key"], r["prompt"])

    out = tmp_path / "ray.jsonl"  # a killed run's output: shard a whole, one record of b
    killed = [r for r in want if r["shard"] == a] + [r for r in want if r["shard"] == b][:1]
    out.write_text("".join(json.dumps(r) + "\n" for r in killed))
    import psutil
    import ray

    from api.batch.ray_runner import _init_ray

    marker = ray_session
    started: list = []
    assert _init_ray(None, 1, started) is ray and not started  # caption_with_ray takes this session
    summary = caption_with_ray(inputs, out, model="tiny", max_tokens=8, replicas=1, batch_size=2)
    assert ray.is_initialized()  # and leaves it up for whoever started it
    pid = int(marker.read_text())  # the kill happened, and its process is gone
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(got) == len({key(r) for r in got}) == len(want)  # nothing twice, nothing lost
    strip = lambda r: {k: v for k, v in r.items() if k != "elapsed_s"}  # noqa: E731
    assert sorted(map(strip, got), key=key) == sorted(map(strip, want), key=key)
    assert {r["error"]["code"] for r in got if "error" in r} == {
        "corrupt",
        "missing_media",
        "truncated_shard",
    }
    assert (summary.total, summary.skipped, summary.shards_by_own_reader) == (10, 4, 1)

    again = caption_with_ray(inputs, out, model="tiny", max_tokens=8, replicas=1)
    assert (again.shards_skipped, again.captioned, again.total) == (4, 0, 10)
    assert len(out.read_text().splitlines()) == len(want)
