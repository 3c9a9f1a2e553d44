"""Dataset-scale captioning on this machine: the same images through the WebDataset
pipeline (``api.batch``: tar shards read and prepared ahead of the engine behind a bounded
queue) and through the folder path (the same images as files in a folder, the per-file
job's source, as ``run_caption_job`` runs it by default), with the tiny Qwen3-VL and a
short ``max_tokens``.

It reports samples/s, the engine's wait for input (the time the engine had room for
another sample and none was prepared yet / wall time; also the time with no caption in
flight at all), and RSS sampled as each shard is finished (shard 1 vs the last shard:
memory must stay flat however many shards go by), then the ratios WebDataset / folder.

How it is measured, so that both paths meet the same conditions:

- speed: one process; each path is first warmed up on 64 other images (the engine's
  first passes, the media kernels, its source's code), then the two paths run
  alternately, ABBA per round (``--repeats`` rounds), so the machine's changing load and
  any drift within the process fall on both alike; the median of each path's runs;
- memory: each path also runs once in a fresh process of its own after the same warm-up
  (``--rss-path``), so neither meets a heap or a KV pool another run has already grown.
  RSS is sampled as each shard ends and at its peak (every 50 ms), whole and less the KV
  pool's pages used for the first time: the pool (256 MiB on the CPU) is allocated at
  load and becomes resident page by page as pages are first used (the job keeps at most
  ``JOB_CACHED_KV_PAGES`` cached, so its images' pages do not fill it).

    .venv/bin/python -m bench.dataset_captions [--images 2000] [--shards 8] [--max-tokens 8]

The images (mixed sizes 64..640 px, JPEG/PNG/WebP, 1% corrupt members) are generated
once under the cache folder (``--cache``, default: the temp folder) and reused.
Aims (issue 31): engine waiting <= 5%, samples/s >= the folder path's, RSS +<= 100 MB from
the first shard to the last.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import platform
import shutil
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FORMATS = (("JPEG", "jpg"), ("PNG", "png"), ("WEBP", "webp"))
CORRUPT_EVERY = 100
"""One member in this many is cut to a third of its bytes: a ``corrupt`` record."""


def _image_bytes(i: int, rng: Any) -> tuple[bytes, str]:
    """A distinct image (gradient + blocks, so PNGs stay small) of a random size and format."""
    import numpy as np
    from PIL import Image

    w, h = (int(x) for x in rng.integers(64, 641, size=2))
    y, x = np.mgrid[0:h, 0:w]
    base = rng.integers(0, 256, size=3)
    rgb = np.stack(
        [(x * 255 // w + base[0]) % 256, (y * 255 // h + base[1]) % 256, (x + y + base[2]) % 256], -1
    )
    for _ in range(3):
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        rgb[y0 : y0 + h // 4, x0 : x0 + w // 4] = rng.integers(0, 256, size=3)
    rgb[0, 0] = (i % 256, (i // 256) % 256, 7)  # distinct content: no caption is reused by hash
    fmt, ext = FORMATS[int(rng.integers(0, len(FORMATS)))]
    buf = io.BytesIO()
    Image.fromarray(rgb.astype(np.uint8)).save(buf, fmt, quality=85)
    data = buf.getvalue()
    if i % CORRUPT_EVERY == CORRUPT_EVERY // 2:
        data = data[: len(data) // 3]
    return data, ext


def generate(root: Path, images: int, shards: int) -> tuple[list[Path], Path]:
    """``root/wds/{00000..}.tar`` and ``root/files/`` with the same images (made once)."""
    import numpy as np

    wds, files, done = root / "wds", root / "files", root / "done.json"
    tars = [wds / f"{s:05d}.tar" for s in range(shards)]
    warm = root / "warm.tar"  # other images: the measured runs find none of them in the prefix cache
    if done.exists():
        if not warm.exists():
            _warm_tar(warm, images, np.random.default_rng(32))
        _warm_files(warm, root / "warm_files")
        return tars, files
    shutil.rmtree(root, ignore_errors=True)
    wds.mkdir(parents=True)
    files.mkdir()
    rng = np.random.default_rng(31)
    per = -(-images // shards)
    for s, tar_path in enumerate(tars):
        with tarfile.open(tar_path, "w") as tar:
            for i in range(s * per, min(images, (s + 1) * per)):
                data, ext = _image_bytes(i, rng)
                key = f"{i:06d}"
                meta = json.dumps({"index": i, "format": ext}).encode()
                for name, blob in ((f"{key}.{ext}", data), (f"{key}.json", meta)):
                    info = tarfile.TarInfo(name)
                    info.size = len(blob)
                    tar.addfile(info, io.BytesIO(blob))
                (files / f"{key}.{ext}").write_bytes(data)
    _warm_tar(warm, images, np.random.default_rng(32))
    _warm_files(warm, root / "warm_files")
    done.write_text(json.dumps({"images": images, "shards": shards}))
    return tars, files


def _warm_tar(path: Path, first: int, rng: Any) -> None:
    with tarfile.open(path, "w") as tar:
        for i in range(first, first + 64):
            data, ext = _image_bytes(i, rng)
            info = tarfile.TarInfo(f"{i:06d}.{ext}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _warm_files(tar_path: Path, folder: Path) -> None:
    """The warm-up tar's images as files, for the folder path's warm-up."""
    if folder.exists():
        return
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    with tarfile.open(tar_path) as tar:
        for info in tar:
            f = tar.extractfile(info)
            assert f is not None
            (tmp / Path(info.name).name).write_bytes(f.read())
    tmp.rename(folder)


def _rss_mb() -> tuple[float, float]:
    """(this process, this process + its children) resident MB."""
    import psutil

    me = psutil.Process()
    own = me.memory_info().rss
    kids = 0
    for c in me.children(recursive=True):
        try:
            kids += c.memory_info().rss
        except psutil.Error:
            pass
    return own / 2**20, (own + kids) / 2**20


def run(
    model: Any, inputs: list[Any], out: Path, *, spec: Any, concurrency: int, workers: int, **kw: Any
) -> dict:
    from api.batch.job import caption_job_async
    from api.batch.sink_open import open_sink
    from api.batch.sinks import format_for
    from api.batch.sources import open_shards

    shards = open_shards(inputs, exclude=out, **kw)
    sink = open_sink(out, format_for(out, None), spec.fingerprint(model.name), spec.settings(model.name))
    rss: list[tuple[float, float]] = []
    finish = sink.finish_shard

    kv: list[float] = []
    peaks: list[float] = []
    peak = [0.0]
    sampling = threading.Event()

    def sample_peak() -> None:  # the highest RSS (with workers) between two shard ends
        while not sampling.wait(0.05):
            peak[0] = max(peak[0], _rss_mb()[1])

    def finish_and_sample(shard: Any, samples: int, errors: int) -> None:
        finish(shard, samples, errors)
        rss.append(_rss_mb())
        kv.append(_kv_touched_mb(model))
        peaks.append(max(peak[0], rss[-1][1]))
        peak[0] = 0.0

    sink.finish_shard = finish_and_sample  # type: ignore[method-assign]
    sampler = threading.Thread(target=sample_peak, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    try:
        s = asyncio.run(
            caption_job_async(
                model, shards, sink, spec, concurrency=concurrency, workers=workers, progress=False
            )
        )
    finally:
        sampling.set()
        sampler.join()
    wall = time.perf_counter() - t0
    return {
        "shards": len(shards),
        "samples": s.total,
        "errors": s.errors,
        "captioned": s.captioned,
        "wall_s": round(wall, 2),
        "samples_per_s": round(s.total / wall, 2),
        "engine_input_wait_fraction": round(s.input_wait_s / wall, 4),
        "nothing_in_flight_fraction": round(s.idle_s / wall, 4),
        "rss_mb_per_shard": [round(r[0], 1) for r in rss],
        "rss_mb_with_workers_per_shard": [round(r[1], 1) for r in rss],
        # the most the process grew past its size after shard 1 (the last sample of "with
        # workers" is taken after the workers left, so the peak, not the last)
        "rss_growth_mb": round(max(r[0] for r in rss) - rss[0][0], 1),
        "rss_growth_with_workers_mb": round(max(r[1] for r in rss) - rss[0][1], 1),
        "kv_pool_touched_mb_per_shard": [round(x, 1) for x in kv],
        # the highest RSS seen (every 50 ms) while each shard ran, and its growth from shard 1
        # (whole, and less the KV pool's pages used for the first time since shard 1)
        "rss_peak_mb_per_shard": [round(x, 1) for x in peaks],
        "rss_peak_growth_mb": round(max(peaks) - peaks[0], 1),
        "rss_peak_growth_less_kv_pool_mb": round(
            max(p - k for p, k in zip(peaks, kv, strict=True)) - (peaks[0] - kv[0]), 1
        ),
        # the growth less the KV pool's pages written for the first time in the run: the
        # pool (256 MiB on the CPU) is allocated at load and becomes resident page by page
        # as contexts first use its pages; bounded, and not the pipeline's
        "rss_growth_less_kv_pool_mb": round(
            max(r[1] - k for r, k in zip(rss, kv, strict=True)) - (rss[0][1] - kv[0]), 1
        ),
    }


_TOUCHED: dict[int, int] = {}


def _kv_touched_mb(model: Any) -> float:
    """The KV pool's pages this process has handed out, in MB: the pool's free pages are a
    stack (page 0 first, a freed page next), so the pages ever handed out are the most
    seen out of the free stack at once (cached or held); each was written, so resident."""
    st = model.pool_stats()
    used = st.num_pages - st.free
    _TOUCHED[id(model)] = max(_TOUCHED.get(id(model), 0), used)
    return _TOUCHED[id(model)] * st.bytes_per_page / 2**20


_GROWTH = (
    "rss_growth_mb",
    "rss_growth_with_workers_mb",
    "rss_growth_less_kv_pool_mb",
    "rss_peak_growth_mb",
    "rss_peak_growth_less_kv_pool_mb",
)


def _summary(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median samples/s of the runs, the worst input wait of any; the RSS growth of the
    last run (RSS is judged on the fresh-process runs, saved beside)."""
    import statistics

    return {
        "samples_per_s": round(statistics.median(r["samples_per_s"] for r in rs), 2),
        "engine_input_wait_fraction": max(r["engine_input_wait_fraction"] for r in rs),
        "nothing_in_flight_fraction": max(r["nothing_in_flight_fraction"] for r in rs),
        **{k: rs[-1][k] for k in _GROWTH},
        "shards": rs[0]["shards"],
        "samples": rs[0]["samples"],
        "errors": rs[0]["errors"],
    }


def _variants(args: argparse.Namespace, data: Path, tars: list[Path], folder: Path) -> dict[str, Any]:
    """name -> (inputs, workers, source options, warm-up inputs)."""
    per_shard = -(-args.images // args.shards)
    out: dict[str, Any] = {
        "webdataset": (tars, args.workers, {}, [data / "warm.tar"]),
        "folder": ([folder], args.folder_workers, {"files_per_shard": per_shard}, [data / "warm_files"]),
    }
    if args.compare_workers is not None:
        out[f"webdataset_{args.compare_workers}_workers"] = (
            tars,
            args.compare_workers,
            {},
            [data / "warm.tar"],
        )
    return out


def _run_variant(model: Any, v: Any, out: Path, args: argparse.Namespace, spec: Any) -> dict:
    inputs, workers, kw, _ = v
    return run(model, inputs, out, spec=spec, concurrency=args.concurrency, workers=workers, **kw)


def _warm_up(model: Any, v: Any, out: Path, args: argparse.Namespace, spec: Any) -> None:
    """The path's own source and code, the engine's first passes, off the clock."""
    _, workers, _, warm = v
    run(model, warm, out, spec=spec, concurrency=args.concurrency, workers=workers, files_per_shard=64)


def _fresh_process_rss(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """One run of ``name`` in a process of its own (after its warm-up): its RSS per shard."""
    import subprocess

    with tempfile.TemporaryDirectory(prefix="pie-bench-rss-") as d:
        got = Path(d) / "rss.json"
        cmd = [sys.executable, "-m", "bench.dataset_captions", "--rss-path", name, "--save", str(got)]
        for flag in ("images", "shards", "max_tokens", "concurrency", "workers", "folder_workers", "cache"):
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        if args.compare_workers is not None:
            cmd += ["--compare-workers", str(args.compare_workers)]
        subprocess.run(cmd, check=True, cwd=ROOT)
        return json.loads(got.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1, help="rounds of the speed runs, each ABBA")
    ap.add_argument(
        "--workers",
        type=int,
        default=None,
        help="preparation processes of the WebDataset run (default: the job's)",
    )
    ap.add_argument(
        "--compare-workers", type=int, default=None, help="also run the WebDataset job with this many workers"
    )
    ap.add_argument(
        "--folder-workers", type=int, default=0, help="of the folder run (0: the per-file job's thread)"
    )
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "pie-media-bench-dataset")
    ap.add_argument("--save", type=Path, default=None, help="write the result JSON here")
    ap.add_argument("--note", default="", help="a line saved with the result")
    ap.add_argument("--no-rss-processes", action="store_true", help="skip the fresh-process RSS runs")
    ap.add_argument("--rss-path", default=None, help=argparse.SUPPRESS)  # one fresh-process RSS run
    ap.add_argument(
        "--before",
        type=Path,
        default=None,
        help="an earlier result JSON to keep in this one (before a change)",
    )
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    from api.batch.pipeline import default_workers
    from api.batch.spec import CaptionSpec

    if args.workers is None:
        args.workers = default_workers()
    from api.model_ref import load_model

    data = args.cache / f"{args.images}x{args.shards}"
    t0 = time.perf_counter()
    tars, folder = generate(data, args.images, args.shards)
    variants = _variants(args, data, tars, folder)
    model = load_model("tiny")
    from engine import freeze_startup_heap

    freeze_startup_heap()  # as the caption command runs its job (engine/startup_heap.py)
    spec = CaptionSpec(max_tokens=args.max_tokens)
    work = Path(tempfile.mkdtemp(prefix="pie-bench-dataset-"))
    if args.rss_path is not None:
        try:
            v = variants[args.rss_path]
            _warm_up(model, v, work / "warm.jsonl", args, spec)
            args.save.write_text(json.dumps(_run_variant(model, v, work / "run.jsonl", args, spec)))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return
    print(f"data: {data} ({time.perf_counter() - t0:.1f}s)", file=sys.stderr)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    order: list[str] = []
    try:
        for name, v in variants.items():
            _warm_up(model, v, work / f"warm-{name}.jsonl", args, spec)
        names = list(variants)
        for r in range(args.repeats):  # ABBA: the load's drift and the process's hit each alike
            for i, name in enumerate(names + names[::-1]):
                order.append(name)
                runs[name].append(
                    _run_variant(model, variants[name], work / f"{name}-{r}-{i}.jsonl", args, spec)
                )
                print(f"{name}: {runs[name][-1]['samples_per_s']} samples/s", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    del model
    fresh = {} if args.no_rss_processes else {name: _fresh_process_rss(args, name) for name in variants}
    rows = {name: _summary(rs) for name, rs in runs.items()}
    new, old = rows["webdataset"], rows["folder"]
    ratios: dict[str, Any] = {
        "samples_per_s": round(new["samples_per_s"] / old["samples_per_s"], 3),
        "samples_per_s_per_pair": [
            round(w["samples_per_s"] / f["samples_per_s"], 3)
            for w, f in zip(runs["webdataset"], runs["folder"], strict=True)
        ],
    }
    mem = {
        name: {
            k: r[k]
            for k in (*_GROWTH, "rss_mb_per_shard", "rss_peak_mb_per_shard", "kv_pool_touched_mb_per_shard")
        }
        for name, r in fresh.items()
    }
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} shared cores (this CPU)",
        "model": "tiny-qwen3-vl",
        "images": args.images,
        "shards": args.shards,
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "workers": {"webdataset": args.workers, "folder": args.folder_workers},
        "note": args.note,
        "summary": rows,
        "order": order,
        "rss_fresh_process": mem,
        "runs": runs,
        "ratios_webdataset_over_folder": ratios,
    }
    if mem:
        w = mem["webdataset"]
        result["aims"] = {
            "engine_input_wait_le_5pct": new["engine_input_wait_fraction"] <= 0.05,
            "samples_per_s_ge_folder": new["samples_per_s"] >= old["samples_per_s"],
            "rss_growth_le_100mb": max(w["rss_growth_with_workers_mb"], w["rss_peak_growth_mb"]) <= 100,
            "rss_growth_less_kv_pool_le_100mb": max(
                w["rss_growth_less_kv_pool_mb"], w["rss_peak_growth_less_kv_pool_mb"]
            )
            <= 100,
        }
    print(
        f"{args.images} images in {args.shards} shards, {args.max_tokens} tokens, tiny Qwen3-VL, "
        f"concurrency {args.concurrency}; runs in order {' '.join(order)}"
    )
    for name, r in rows.items():
        print(
            f"{name:<22} {r['samples_per_s']:7.2f} samples/s  engine waiting for input "
            f"{100 * r['engine_input_wait_fraction']:5.1f}% (nothing in flight "
            f"{100 * r['nothing_in_flight_fraction']:4.1f}%)"
        )
    for name, m in mem.items():
        print(
            f"{name:<22} fresh process, RSS shard 1 -> {args.shards}: at shard ends "
            f"{m['rss_growth_with_workers_mb']:+.1f} MB, peak {m['rss_peak_growth_mb']:+.1f} MB; less the KV "
            f"pool's first touches {m['rss_growth_less_kv_pool_mb']:+.1f} / {m['rss_peak_growth_less_kv_pool_mb']:+.1f} MB "
            f"(pool resident {m['kv_pool_touched_mb_per_shard'][0]:.0f} -> "
            f"{m['kv_pool_touched_mb_per_shard'][-1]:.0f} MB)"
        )
    print(
        f"webdataset / folder: {ratios['samples_per_s']:.2f}x samples/s (per pair {ratios['samples_per_s_per_pair']})"
    )
    for name, r in rows.items():
        if name.startswith("webdataset_"):
            print(f"{name} / folder: {r['samples_per_s'] / old['samples_per_s']:.2f}x samples/s")
    if args.before is not None:
        result["before"] = json.loads(args.before.read_text())
    if args.save:
        args.save.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
