"""The HTTP layer's cost: N concurrent ``openai`` async clients against a running
``pie-media serve`` vs the same requests through the in-process engine, in one run.

Both sides run the same model (tiny Qwen3-VL by default), the same requests (half with
an image, greedy, ``ignore_eos`` so every request generates exactly ``--max-tokens``) at
the same concurrency. Printed: tokens/s, requests/s, TTFT p50/p99 for each, and the
HTTP/in-process throughput ratio (aim: the HTTP overhead under 10% at concurrency 16).
The server runs in a subprocess on 127.0.0.1; the in-process side runs while it idles.

    .venv/bin/python bench/serve.py [--concurrency 16] [--requests 64] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fixtures.samples import ensure_samples  # noqa: E402
from tests.api.http.conftest import start_server, stop_server  # noqa: E402

IMAGES = ("photo_640x480.jpg", "rgba.png", "cmyk.jpg", "gray.png")


def _requests(n: int, samples: Path) -> list[tuple[str | None, str]]:
    """(image file name or None, question) per request."""
    return [(IMAGES[i % len(IMAGES)] if i % 2 else None, f"Question {i}: what do you see?") for i in range(n)]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def _http(base: str, reqs, samples: Path, concurrency: int, max_tokens: int, model: str):
    import openai

    client = openai.AsyncOpenAI(base_url=base, api_key="bench", max_retries=0, timeout=600)
    urls = {
        n: "data:image/png;base64," + base64.b64encode((samples / "images" / n).read_bytes()).decode()
        for n in IMAGES
    }
    gate = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    tokens = 0

    async def one(image: str | None, text: str) -> None:
        nonlocal tokens
        content: list = [{"type": "text", "text": text}]
        if image:
            content.insert(0, {"type": "image_url", "image_url": {"url": urls[image]}})
        async with gate:
            t0 = time.perf_counter()
            stream = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": content}],
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            first = None
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content is not None:
                    first = time.perf_counter() - t0
                if chunk.usage is not None:
                    tokens += chunk.usage.completion_tokens
            ttfts.append(first if first is not None else time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, t) for i, t in reqs))
    wall = time.perf_counter() - t0
    await client.close()
    return wall, tokens, ttfts


async def _in_process(model, reqs, samples: Path, concurrency: int, max_tokens: int):
    from engine import Completion, CompletionParams, Turn
    from media import Image

    images = {n: Image.from_path(samples / "images" / n) for n in IMAGES}
    gate = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    tokens = 0

    async def one(image: str | None, text: str) -> None:
        nonlocal tokens
        parts = (images[image], text) if image else (text,)
        async with gate:
            t0 = time.perf_counter()
            first = None
            params = CompletionParams(max_tokens=max_tokens, ignore_eos=True)
            async with Completion(model, [Turn("user", parts)], params) as c:
                async for _ev in c:
                    if first is None:
                        first = time.perf_counter() - t0
                    tokens += 1
            ttfts.append(first if first is not None else time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, t) for i, t in reqs))
    return time.perf_counter() - t0, tokens, ttfts


def _row(name: str, wall: float, tokens: int, n: int, ttfts: list[float]) -> tuple[str, float]:
    tps = tokens / wall
    line = (
        f"{name:<12} {tps:>9.1f} tok/s {n / wall:>7.2f} req/s   TTFT p50 {statistics.median(ttfts) * 1e3:>7.1f} ms"
        f"  p99 {_pct(ttfts, 0.99) * 1e3:>7.1f} ms"
    )
    return line, tps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument(
        "--rounds", type=int, default=2, help="alternate HTTP / in-process this many times; medians"
    )
    args = ap.parse_args()

    import torch

    from api.model_ref import load_model

    torch.set_num_threads(1)
    samples = ensure_samples()
    reqs = _requests(args.requests, samples)
    model = load_model(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="pie-bench-serve-"))
    server = start_server(tmp, "--max-concurrency", str(max(args.concurrency, 1) * 2), models=(args.model,))
    try:
        import httpx

        served = httpx.get(f"{server.v1}/models").json()["data"][0]["id"]
        http_rows, local_rows = [], []
        for _ in range(args.rounds):
            http_rows.append(
                asyncio.run(_http(server.v1, reqs, samples, args.concurrency, args.max_tokens, served))
            )
            local_rows.append(
                asyncio.run(_in_process(model, reqs, samples, args.concurrency, args.max_tokens))
            )
    finally:
        stop_server(server)

    def median_run(rows):
        return sorted(rows, key=lambda r: r[1] / r[0])[len(rows) // 2]

    print(
        f"{args.requests} requests (half with an image), {args.max_tokens} tokens each, concurrency "
        f"{args.concurrency}, model {args.model}; median of {args.rounds} alternating rounds"
    )
    line_h, tps_h = _row("HTTP", *median_run(http_rows)[:2], args.requests, median_run(http_rows)[2])
    line_l, tps_l = _row("in-process", *median_run(local_rows)[:2], args.requests, median_run(local_rows)[2])
    print(line_h)
    print(line_l)
    print(
        f"HTTP / in-process throughput: {tps_h / tps_l:.3f}  (overhead {100 * (1 - tps_h / tps_l):.1f}%, aim < 10%)"
    )


if __name__ == "__main__":
    main()
