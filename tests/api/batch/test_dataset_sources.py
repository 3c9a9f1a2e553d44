"""Dataset-scale captioning: every source (folder, WebDataset tar, Parquet, URL list)
into every output (JSONL, Parquet, WebDataset tars) gives the folder path's records for
the same media; bad input is a record; several prompts share a prefill; video segments
and subtitles; a SIGKILLed run resumes without losing or duplicating, per format."""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

from api.batch.job import run_caption_job
from api.batch.records import from_row
from api.batch.spec import CaptionSpec
from api.batch.webdataset_sink import read_tar_records

ROOT = Path(__file__).resolve().parents[3]
MEDIA = (
    "images/rgba.png",
    "images/cmyk.jpg",
    "images/odd_7x13.png",
    "video/h264_320x240_30fps_3s.mp4",
    "audio/tone_44k1_stereo.mp3",
    "hostile/image_truncated.jpg",
)
TOKENS = 4


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    from engine import Model

    return Model.load(tiny_dir("tiny-qwen3-vl"), kv_pages=512, device="cpu")


@pytest.fixture(scope="module")
def folder(samples, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("media")
    for i, name in enumerate(MEDIA):
        shutil.copy(samples / name, d / f"{i:02d}{Path(name).suffix}")
    return d


def _tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _wds(folder: Path, out: Path) -> list[Path]:
    """The folder's media as two WebDataset shards (keys 000000.., a .json each)."""
    out.mkdir()
    files = sorted(folder.iterdir())
    shards = []
    for s, chunk in enumerate((files[:3], files[3:])):
        members = []
        for f in chunk:
            key = f"{int(f.stem):06d}"
            members += [
                (f"{key}{f.suffix}", f.read_bytes()),
                (f"{key}.json", json.dumps({"src": f.name}).encode()),
            ]
        shards.append(_tar(out / f"{s:05d}.tar", members))
    return shards


def _parquet(folder: Path, out: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    files = sorted(folder.iterdir())
    table = pa.table({"key": [f.stem for f in files], "jpg": [f.read_bytes() for f in files]})
    pq.write_table(table, out, row_group_size=2)
    return out


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # noqa: D102
        pass


@contextlib.contextmanager
def _server(root: Path):
    handler = lambda *a, **k: _Quiet(*a, directory=str(root), **k)  # noqa: E731
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def _read(out: Path, fmt: str) -> list[dict]:
    if fmt == "jsonl":
        return [json.loads(line) for line in out.read_text().splitlines()]
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return [from_row(r) for r in pq.read_table(out).to_pylist()]
    return [r for tar in sorted(out.glob("*.tar")) for r in read_tar_records(tar)]


def _by_content(recs: list[dict]) -> dict:
    return {r["content_hash"]: r.get("caption", r.get("error", {}).get("code")) for r in recs}


def _url_options():
    from api.batch.sources import UrlOptions

    return UrlOptions(allow_http=True, trusted_addresses=("127.0.0.1",), retries=1, total_timeout=5)


def test_every_source_into_every_format_equals_the_folder_path(tiny, folder, tmp_path):
    ref_out = tmp_path / "folder.jsonl"
    s = run_caption_job([folder], ref_out, model=tiny, max_tokens=TOKENS, progress=False)
    ref = _read(ref_out, "jsonl")
    assert (s.total, s.errors) == (6, 2)
    codes = {Path(r["file"]).suffix: r.get("error", {}).get("code") for r in ref}
    assert codes[".mp4"] is None and isinstance(
        next(r for r in ref if r["file"].endswith(".mp4"))["caption"], str
    )
    assert codes[".mp3"] == "unsupported_media"  # Qwen3-VL takes no audio: a typed record
    jpgs = {Path(r["file"]).name: r.get("error", {}).get("code") for r in ref if r["file"].endswith(".jpg")}
    assert (
        jpgs["01.jpg"] is None and jpgs["05.jpg"] is not None
    )  # cmyk decodes, the truncated one is an error
    want = _by_content(ref)

    wds = _wds(folder, tmp_path / "wds")
    pq_in = _parquet(folder, tmp_path / "in.parquet")
    urls = tmp_path / "list.urls"
    with _server(folder) as base:
        urls.write_text("".join(f"{base}/{f.name}\n" for f in sorted(folder.iterdir())))
        sources = {
            "wds": [str(tmp_path / "wds" / "{00000..00001}.tar")],
            "parquet": [str(pq_in)],
            "urls": [str(urls)],
        }
        for name, inputs in sources.items():
            for fmt, out in (("jsonl", "o.jsonl"), ("parquet", "o.parquet"), ("webdataset", "o_wds")):
                dest = tmp_path / f"{name}-{out}"
                run_caption_job(
                    inputs,
                    dest,
                    model=tiny,
                    max_tokens=TOKENS,
                    progress=False,
                    out_format=fmt,
                    url_options=_url_options(),
                )
                got = _read(dest, fmt)
                assert _by_content(got) == want, (name, fmt)
                assert len(got) == len(ref), (name, fmt)
                if name == "wds":
                    assert {r["shard"] for r in got} == {str(p) for p in wds}
                    assert {r["key"] for r in got} == {f"{i:06d}" for i in range(6)}
    if True:  # the caption tars mirror the input's shards and keys
        names = tarfile.open(tmp_path / "wds-o_wds" / "00000.tar").getnames()
        assert "000000.json" in names and "000000.txt" in names


def test_bad_input_is_a_record_and_the_job_goes_on(tiny, folder, tmp_path):
    good = (folder / "00.png").read_bytes()
    shard = _tar(
        tmp_path / "bad.tar",
        [
            ("a.png", good),
            ("b.json", b'{"only": "metadata"}'),  # a sample with no media
            ("c.png", b"\x89PNG\r\n\x1a\n" + b"\0" * 40),  # a corrupt member
            ("d.png", good),
        ],
    )
    data = shard.read_bytes()
    cut = _tar(tmp_path / "cut_src.tar", [("x.png", good), ("y.png", good)]).read_bytes()
    truncated = tmp_path / "truncated.tar"
    truncated.write_bytes(cut[: 2 * 512 + 512 + len(good) // 2])  # ends inside y.png's data
    urls = tmp_path / "dead.urls"
    urls.write_text("http://127.0.0.1:9/nothing.png\n")  # the discard port: refused
    out = tmp_path / "out.jsonl"
    s = run_caption_job(
        [str(shard), str(truncated), str(urls)],
        out,
        model=tiny,
        max_tokens=TOKENS,
        progress=False,
        url_options=_url_options(),
    )
    recs = {(Path(r["shard"]).name, r["key"]): r for r in _read(out, "jsonl")}
    assert len(data) > 0
    code = {k: r.get("error", {}).get("code") for k, r in recs.items()}
    assert code[("bad.tar", "a")] is None and code[("bad.tar", "d")] is None
    assert code[("bad.tar", "b")] == "missing_media"
    assert code[("bad.tar", "c")] == "corrupt"
    assert code[("truncated.tar", "x")] is None
    assert code[("truncated.tar", "y")] == "truncated_shard"
    assert (
        code[(next(k[0] for k in recs if k[0].startswith("dead.urls")), "000000000")]
        == "remote_media_unreachable"
    )
    assert s.errors == 4 and s.failed == 4


def test_prompts_share_the_prefill_and_equal_separate_runs(tiny, folder, tmp_path):
    img = folder / "00.png"
    prompts = ("Describe this image.", "List the colours.")
    out = tmp_path / "two.jsonl"
    run_caption_job([img], out, model=tiny, spec=CaptionSpec(prompts=prompts, max_tokens=6), progress=False)
    both = {r["prompt"]: r["caption"] for r in _read(out, "jsonl")}
    for p in prompts:
        one = tmp_path / f"{len(p)}.jsonl"
        run_caption_job([img], one, model=tiny, prompt=p, max_tokens=6, progress=False)
        assert _read(one, "jsonl")[0]["caption"] == both[p]


def test_prompt_field_sampling_and_json_schema(tiny, folder, tmp_path):
    shard = _tar(
        tmp_path / "p.tar",
        [
            ("k1.png", (folder / "00.png").read_bytes()),
            ("k1.json", b'{"ask": "What is it?"}'),
            ("k2.png", (folder / "02.png").read_bytes()),
        ],
    )
    out = tmp_path / "field.jsonl"
    run_caption_job(
        [str(shard)], out, model=tiny, spec=CaptionSpec(prompt_field="ask", max_tokens=3), progress=False
    )
    recs = {r["key"]: r for r in _read(out, "jsonl")}
    assert recs["k1"]["prompt"] == "What is it?" and "caption" in recs["k1"]
    assert recs["k2"]["error"]["code"] == "missing_prompt_field"

    schema = {
        "type": "object",
        "properties": {"tag": {"enum": ["cat", "dog"]}},
        "required": ["tag"],
        "additionalProperties": False,
    }
    spec = CaptionSpec(
        max_tokens=24, json_schema=schema, temperature=0.8, top_p=0.9, seed=7, presence_penalty=0.5
    )
    out2 = tmp_path / "schema.jsonl"
    run_caption_job([folder / "00.png"], out2, model=tiny, spec=spec, progress=False)
    (rec,) = _read(out2, "jsonl")
    assert rec["structured"]["tag"] in ("cat", "dog") and json.loads(rec["caption"]) == rec["structured"]
    assert rec["temperature"] == 0.8 and rec["seed"] == 7 and len(rec["json_schema"]) == 16
    run_caption_job([folder / "00.png"], out2, model=tiny, spec=spec, progress=False)
    assert len(_read(out2, "jsonl")) == 1  # same settings: resumed, nothing twice


def test_video_segments_with_times_and_subtitles(tiny, folder, tmp_path):
    out = tmp_path / "seg.jsonl"
    spec = CaptionSpec(max_tokens=3, segments=3, max_frames=4)
    run_caption_job([folder / "03.mp4"], out, model=tiny, spec=spec, progress=False, subtitles="vtt")
    recs = _read(out, "jsonl")
    assert [r["segment"] for r in recs] == [0, 1, 2]
    assert recs[0]["start"] == 0 and recs[-1]["end"] == pytest.approx(3.0, abs=0.05)
    assert all(a["end"] == b["start"] for a, b in zip(recs, recs[1:], strict=False))
    vtt = (
        tmp_path / "seg.subtitles" / f"{str(folder / '03.mp4').strip('/').replace('/', '_')}.vtt"
    ).read_text()
    assert vtt.startswith("WEBVTT") and vtt.count("-->") == 3
    from api.batch.video_segments import scene_bounds
    from media import Video

    bounds = scene_bounds(Video.from_bytes((folder / "03.mp4").read_bytes()))
    assert bounds[0][0] == 0 and bounds[-1][1] == 90


def _cli(inputs: list[str], out: Path, fmt: str, workers: int = 1) -> list[str]:
    return [
        sys.executable,
        "-m",
        "api.cli",
        "caption",
        *inputs,
        "--out",
        str(out),
        "--out-format",
        fmt,
        "--max-tokens",
        "16",
        "--concurrency",
        "2",
        "--workers",
        str(workers),
        "--no-progress",
    ]


def _written(out: Path, fmt: str) -> int:
    """Records on disk so far, journals included."""
    paths = (
        list(out.parent.glob(out.name + ".parts/*.jsonl"))
        if fmt == "parquet"
        else list(out.glob(".0*.jsonl"))
    )
    return sum(p.read_bytes().count(b"\n") for p in paths if p.exists())


@pytest.mark.parametrize("fmt", ["parquet", "webdataset"])
def test_killed_run_resumes_per_format(tiny, folder, tmp_path, fmt):
    """SIGKILL at a random moment after the first record, then a rerun: every sample's
    records exactly once, equal to an uninterrupted run's."""
    images = tmp_path / "imgs"
    images.mkdir()
    for i in range(8):
        shutil.copy(folder / ("00.png" if i % 2 else "02.png"), images / f"{i:02d}.png")
        with open(images / f"{i:02d}.png", "ab") as f:
            f.write(bytes([i]))  # distinct bytes: no caption is reused
    shards = _wds(images, tmp_path / "wds")
    out = tmp_path / ("o.parquet" if fmt == "parquet" else "o_wds")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        _cli([str(p) for p in shards], out, fmt),
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    while _written(out, fmt) < 1 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(random.uniform(0, 1.5))
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
    done = subprocess.run(
        _cli([str(p) for p in shards], out, fmt, workers=0),
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    got = _read(out, fmt)
    keys = sorted((r["shard"], r["key"]) for r in got)
    assert keys == sorted(
        (str(s), f"{i:06d}") for s, r in ((shards[0], range(3)), (shards[1], range(3, 8))) for i in r
    )
    ref = tmp_path / "ref.jsonl"
    run_caption_job([str(p) for p in shards], ref, model=tiny, max_tokens=16, progress=False)
    assert _by_content(got) == _by_content(_read(ref, "jsonl"))


class _Slow(_Quiet):
    """Serves each file after a pause: preparation (the fetch) is slower than the engine."""

    def do_GET(self):  # noqa: N802
        time.sleep(0.5)
        super().do_GET()


def test_progress_bar_shows_the_engines_wait_for_input(tiny, folder, tmp_path, capsys):
    """URLs fetched one at a time, 0.5 s each, ahead of an engine that captions in a
    fraction of that: the job's ``input_wait_s`` holds that wait and the bar's line shows
    it as ``input_wait=N%`` of the run."""
    import re
    from dataclasses import replace

    names = sorted(f.name for f in folder.iterdir())[:3]  # the three images
    handler = lambda *a, **k: _Slow(*a, directory=str(folder), **k)  # noqa: E731
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        urls = tmp_path / "list.urls"
        urls.write_text("".join(f"http://127.0.0.1:{srv.server_address[1]}/{n}\n" for n in names))
        capsys.readouterr()
        s = run_caption_job(
            [urls],
            tmp_path / "out.jsonl",
            model=tiny,
            max_tokens=TOKENS,
            url_options=replace(_url_options(), per_host=1),
            progress=True,
        )
    finally:
        srv.shutdown()
        srv.server_close()
    err = capsys.readouterr().err
    assert s.total == 3 and s.input_wait_s >= 1.2  # three fetches of 0.5 s before any sample
    shown = [int(x) for x in re.findall(r"input_wait=(\d+)%", err)]
    assert shown, err
    assert shown[-1] >= 50 and abs(shown[-1] - 100 * s.input_wait_fraction) <= 25
