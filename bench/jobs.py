"""The same captioning job three ways, in one run: the single-process job (``api.batch.job``),
the HTTP job (``POST /v1/jobs/captions`` on a ``pie-media serve`` started here) and the
Ray Data pipeline (``api.batch.ray_runner``, N local engine actors); images/s each and the
ratios (aim: the HTTP job within 10% of the in-process job).

    .venv/bin/python -m bench.jobs [--images 64] [--max-tokens 16] [--replicas 2]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NAMES = (
    "photo_640x480.jpg",
    "rgba.png",
    "cmyk.jpg",
    "gray.png",
    "la.png",
    "bilevel.png",
    "lossy.webp",
    "image.bmp",
)


def _inputs(n: int, folder: Path) -> list[Path]:
    from fixtures.samples import ensure_samples

    images = ensure_samples() / "images"
    folder.mkdir(parents=True, exist_ok=True)
    from PIL import Image

    out = []
    for i in range(n):  # distinct images (one pixel differs): no job may reuse a caption by content
        src = images / NAMES[i % len(NAMES)]
        im = Image.open(src).convert("RGB")
        im.putpixel((0, 0), (i % 256, (i * 7) % 256, 255 - i % 256))
        dst = folder / f"{i:03d}-{src.stem}.png"
        im.save(dst)
        out.append(dst)
    return out


def single(files: list[Path], tmp: Path, max_tokens: int, concurrency: int) -> float:
    from api.batch.job import run_caption_job
    from api.model_ref import load_model

    model = load_model("tiny")
    run_caption_job(
        files[:8],
        tmp / "warm.jsonl",
        model=model,
        max_tokens=max_tokens,
        concurrency=concurrency,
        progress=False,
    )  # warm-up, as the server's warm-up job below
    t0 = time.perf_counter()
    run_caption_job(
        files,
        tmp / "single.jsonl",
        model=model,
        max_tokens=max_tokens,
        concurrency=concurrency,
        progress=False,
    )
    return time.perf_counter() - t0


def over_http(files: list[Path], tmp: Path, max_tokens: int, concurrency: int) -> float:
    from tests.api.http.conftest import start_server, stop_server

    (tmp / "serve").mkdir(exist_ok=True)
    server = start_server(tmp / "serve", models=("tiny",))
    try:
        warm = [("file", (f.name, f.read_bytes(), "application/octet-stream")) for f in files[:8]]
        job = httpx.post(
            f"{server.v1}/jobs/captions", files=warm, data={"max_tokens": str(max_tokens)}
        ).json()
        httpx.get(f"{server.v1}/jobs/{job['id']}/results", timeout=600)  # warm-up: the same 8 first images
        parts = [("file", (f.name, f.read_bytes(), "application/octet-stream")) for f in files]
        t0 = time.perf_counter()
        job = httpx.post(
            f"{server.v1}/jobs/captions",
            files=parts,
            timeout=600,
            data={"max_tokens": str(max_tokens), "concurrency": str(concurrency)},
        ).json()
        with httpx.stream("GET", f"{server.v1}/jobs/{job['id']}/results", timeout=600) as r:
            n = sum(1 for line in r.iter_lines() if line)
        wall = time.perf_counter() - t0
        assert n == len(files), (n, len(files))
        return wall
    finally:
        stop_server(server)


def on_ray(files: list[Path], tmp: Path, max_tokens: int, replicas: int) -> float:
    from api.batch.ray_runner import caption_with_ray

    t0 = time.perf_counter()
    caption_with_ray(
        [str(files[0].parent)],
        tmp / f"ray{replicas}.jsonl",
        model="tiny",
        max_tokens=max_tokens,
        replicas=replicas,
    )
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="pie-bench-jobs-"))
    try:
        files = _inputs(args.images, tmp / "in")
        rows = {
            "single-process job": single(files, tmp, args.max_tokens, args.concurrency),
            "HTTP job": over_http(files, tmp, args.max_tokens, args.concurrency),
        }
        for r in args.replicas:
            rows[f"Ray Data, {r} actor(s)"] = on_ray(files, tmp, args.max_tokens, r)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    base = rows["single-process job"]
    print(
        f"{args.images} images, {args.max_tokens} tokens each, tiny Qwen3-VL (wall time includes Ray's start)"
    )
    for name, wall in rows.items():
        print(f"{name:<24} {args.images / wall:8.2f} images/s   {base / wall:6.2f}x of single-process")


if __name__ == "__main__":
    main()
