"""Dataset-scale captioning on this machine: the same images through the WebDataset
pipeline (``api.batch``: tar shards read and prepared in worker processes behind a bounded
queue) and through the folder path (the same images as files in a folder, the per-file
job's source, run as ``run_caption_job`` runs it by default: prepared by a thread of the
engine's process), with the tiny Qwen3-VL and a short ``max_tokens``.

It reports samples/s, the engine's idle fraction (the time the engine had room for
another sample and none was prepared yet / wall time; also the time with no caption in
flight at all), and RSS sampled as each shard is finished (shard 1 vs the last shard: memory must stay
flat however many shards go by), then the ratios WebDataset / folder.

    .venv/bin/python -m bench.dataset_captions [--images 2000] [--shards 8] [--max-tokens 8]

The images (mixed sizes 64..640 px, JPEG/PNG/WebP, 1% corrupt members) are generated
once under the cache folder (``--cache``, default: the temp folder) and reused.
Aims (issue 31): idle <= 5%, samples/s >= the folder path's, RSS +<= 100 MB from the
first shard to the last.
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
    done.write_text(json.dumps({"images": images, "shards": shards}))
    return tars, files


def _warm_tar(path: Path, first: int, rng: Any) -> None:
    with tarfile.open(path, "w") as tar:
        for i in range(first, first + 64):
            data, ext = _image_bytes(i, rng)
            info = tarfile.TarInfo(f"{i:06d}.{ext}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


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

    def finish_and_sample(shard: Any, samples: int, errors: int) -> None:
        finish(shard, samples, errors)
        rss.append(_rss_mb())
        kv.append(_kv_touched_mb(model))

    sink.finish_shard = finish_and_sample  # type: ignore[method-assign]
    t0 = time.perf_counter()
    s = asyncio.run(
        caption_job_async(model, shards, sink, spec, concurrency=concurrency, workers=workers, progress=False)
    )
    wall = time.perf_counter() - t0
    return {
        "shards": len(shards),
        "samples": s.total,
        "errors": s.errors,
        "captioned": s.captioned,
        "wall_s": round(wall, 2),
        "samples_per_s": round(s.total / wall, 2),
        "engine_idle_fraction": round(s.input_wait_s / wall, 4),
        "nothing_in_flight_fraction": round(s.idle_s / wall, 4),
        "rss_mb_per_shard": [round(r[0], 1) for r in rss],
        "rss_mb_with_workers_per_shard": [round(r[1], 1) for r in rss],
        # the most the process grew past its size after shard 1 (the last sample of "with
        # workers" is taken after the workers left, so the peak, not the last)
        "rss_growth_mb": round(max(r[0] for r in rss) - rss[0][0], 1),
        "rss_growth_with_workers_mb": round(max(r[1] for r in rss) - rss[0][1], 1),
        "kv_pool_touched_mb_per_shard": [round(x, 1) for x in kv],
        # the growth less the KV pool's pages written for the first time in the run: the
        # pool (256 MiB on the CPU) is allocated at load and becomes resident page by page
        # as contexts first use its pages; bounded, and not the pipeline's
        "rss_growth_less_kv_pool_mb": round(
            max(r[1] - k for r, k in zip(rss, kv, strict=True)) - (rss[0][1] - kv[0]), 1
        ),
    }


_TOUCHED: dict[int, int] = {}


def _kv_touched_mb(model: Any) -> float:
    """The most KV pool pages this process has seen in use at once (cached or held), in
    MB: a page the pool has handed out has been written, so it is resident."""
    st = model.pool_stats()
    used = st.num_pages - st.free
    _TOUCHED[id(model)] = max(_TOUCHED.get(id(model), 0), used)
    return _TOUCHED[id(model)] * st.bytes_per_page / 2**20


_GROWTH = ("rss_growth_mb", "rss_growth_with_workers_mb", "rss_growth_less_kv_pool_mb")


def _summary(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median samples/s of the repeats, the worst idle of any; the RSS growth of the last
    round (the process after a whole pass of every variant: the first round also holds
    one-time growth, new malloc arenas and the KV pool's first use, saved beside)."""
    import statistics

    return {
        "samples_per_s": round(statistics.median(r["samples_per_s"] for r in rs), 2),
        "engine_idle_fraction": max(r["engine_idle_fraction"] for r in rs),
        "nothing_in_flight_fraction": max(r["nothing_in_flight_fraction"] for r in rs),
        **{k: rs[-1][k] for k in _GROWTH},
        "shards": rs[0]["shards"],
        "samples": rs[0]["samples"],
        "errors": rs[0]["errors"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each variant, round-robin")
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
    print(f"data: {data} ({time.perf_counter() - t0:.1f}s)", file=sys.stderr)
    model = load_model("tiny")
    spec = CaptionSpec(max_tokens=args.max_tokens)
    work = Path(tempfile.mkdtemp(prefix="pie-bench-dataset-"))
    try:
        # warm-up: the engine's first passes and the media kernels, off the clock
        run(
            model,
            [data / "warm.tar"],
            work / "warm.jsonl",
            spec=spec,
            concurrency=args.concurrency,
            workers=0,
        )
        per_shard = -(-args.images // args.shards)
        variants: dict[str, tuple[list[Any], int, dict[str, Any]]] = {
            "webdataset": (tars, args.workers, {}),
            "folder": ([folder], args.folder_workers, {"files_per_shard": per_shard}),
        }
        if args.compare_workers is not None:
            variants[f"webdataset_{args.compare_workers}_workers"] = (tars, args.compare_workers, {})
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
        for r in range(args.repeats):  # round-robin: the machine's changing load hits each alike
            for name, (inputs, workers, kw) in variants.items():
                runs[name].append(
                    run(
                        model,
                        inputs,
                        work / f"{name}-{r}.jsonl",
                        spec=spec,
                        concurrency=args.concurrency,
                        workers=workers,
                        **kw,
                    )
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = {name: _summary(rs) for name, rs in runs.items()}
    first_round = {name: {k: rs[0][k] for k in _GROWTH} for name, rs in runs.items()}
    new, old = rows["webdataset"], rows["folder"]
    ratios = {
        "samples_per_s": round(new["samples_per_s"] / old["samples_per_s"], 3),
        "rss_growth_less_kv_pool_mb_diff": round(
            new["rss_growth_less_kv_pool_mb"] - old["rss_growth_less_kv_pool_mb"], 1
        ),
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
        "rss_growth_first_round": first_round,
        "runs": runs,
        "ratios_webdataset_over_folder": ratios,
        "aims": {
            "engine_idle_le_5pct": new["engine_idle_fraction"] <= 0.05,
            "samples_per_s_ge_folder": new["samples_per_s"] >= old["samples_per_s"],
            "rss_growth_le_100mb": new["rss_growth_with_workers_mb"] <= 100,
            "rss_growth_less_kv_pool_le_100mb": new["rss_growth_less_kv_pool_mb"] <= 100,
        },
    }
    print(
        f"{args.images} images in {args.shards} shards, {args.max_tokens} tokens, tiny Qwen3-VL, "
        f"concurrency {args.concurrency}"
    )
    for name, r in rows.items():
        print(
            f"{name:<22} {r['samples_per_s']:7.2f} samples/s  engine idle {100 * r['engine_idle_fraction']:5.1f}%  "
            f"(nothing in flight {100 * r['nothing_in_flight_fraction']:4.1f}%)  RSS shard 1 -> {r['shards']}: "
            f"{r['rss_growth_with_workers_mb']:+.1f} MB, less the KV pool's first touches "
            f"{r['rss_growth_less_kv_pool_mb']:+.1f} MB"
        )
    print(f"webdataset / folder: {ratios['samples_per_s']:.2f}x samples/s")
    for name, r in rows.items():
        if name.startswith("webdataset_"):
            print(f"{name} / folder: {r['samples_per_s'] / old['samples_per_s']:.2f}x samples/s")
    if args.before is not None:
        result["before"] = json.loads(args.before.read_text())
    if args.save:
        args.save.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
