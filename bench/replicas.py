"""Replicas on Ray Serve: throughput of 1 vs 2 engine replicas, and the prefix-cache hit
rate that prefix-affinity routing gains over random routing.

1. Throughput: ``api.serve_ray.build_app`` on a local Ray, the tiny Qwen3-VL, N concurrent
   greedy chats; 1 replica, then 2. On this 2-core machine two replicas share the same two
   cores as one (torch already uses both), so expect ~1x here; the printout gives the
   arithmetic for N GPUs (one replica per GPU: the replicas share only the index and the
   gateway, whose cost per request is measured).
2. Hit rate: a workload where 4 system prompts x 4 images repeat (each request = system
   prompt + image + a new question), sent to two in-process engines, routed either at
   random or by the router's own rule (``affinity_key`` + ``rendezvous``). Hit rate =
   prompt rows the engines did not compute (their prefix cache had them) / prompt rows.

    .venv/bin/python bench/replicas.py [--requests 48] [--concurrency 8] [--skip-ray]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import random
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import httpx
from fastapi.testclient import TestClient

from api.http.app import create_app
from api.http.settings import ServeSettings
from api.serve_ray import affinity_key, rendezvous

MODEL = "tiny-qwen3-vl"


def _images() -> list[str]:
    from fixtures.samples import ensure_samples

    root = ensure_samples() / "images"
    names = sorted(p for p in root.iterdir() if p.suffix in (".png", ".jpg"))[:4]
    return [
        f"data:image/{'png' if p.suffix == '.png' else 'jpeg'};base64,{base64.b64encode(p.read_bytes()).decode()}"
        for p in names
    ]


def _workload(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    systems = [f"You are assistant number {i}. " + "Answer briefly and precisely. " * 8 for i in range(4)]
    images = _images()
    out = []
    for i in range(n):
        s, img = rng.randrange(4), rng.randrange(4)
        content = [
            {"type": "image_url", "image_url": {"url": images[img]}},
            {"type": "text", "text": f"Q{i}?"},
        ]
        out.append(
            {
                "model": MODEL,
                "max_tokens": 4,
                "temperature": 0,
                "messages": [{"role": "system", "content": systems[s]}, {"role": "user", "content": content}],
            }
        )
    return out


def hit_rates(n: int) -> None:
    import json

    bodies = _workload(n)
    names = ["replica-0", "replica-1"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for policy in ("random", "affinity"):
            rng = random.Random(1)
            # Fresh replicas for each policy: cold prefix caches.
            engines = [
                TestClient(create_app(ServeSettings(models=["tiny"], state_dir=Path(tmp) / f"{policy}{i}")))
                for i in range(2)
            ]
            for e in engines:
                e.__enter__()
            models = [e.app.state.service.models.get(MODEL, kind="chat").model for e in engines]
            before = [m.metrics().prompt_tokens for m in models]
            total = 0
            for body in bodies:
                if policy == "random":
                    i = rng.randrange(2)
                else:
                    i = names.index(
                        rendezvous(affinity_key("/v1/chat/completions", json.dumps(body).encode()), names)
                    )
                r = engines[i].post("/v1/chat/completions", json=body)
                r.raise_for_status()
                total += r.json()["usage"]["prompt_tokens"]
            computed = sum(m.metrics().prompt_tokens - b for m, b in zip(models, before, strict=True))
            results[policy] = 1 - computed / total
            print(
                f"  {policy:8s}: {total} prompt rows, {computed} computed -> hit rate {results[policy]:.1%}"
            )
            for e in engines:
                e.__exit__(None, None, None)
    print(
        f"  affinity / random hit rate: {results['affinity']:.1%} vs {results['random']:.1%} "
        f"(+{(results['affinity'] - results['random']) * 100:.1f} points)"
    )


async def _load(url: str, bodies: list[dict], concurrency: int) -> float:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:

        async def one(body: dict) -> None:
            async with gate:
                r = await client.post("/v1/chat/completions", json=body)
                r.raise_for_status()

        t0 = time.perf_counter()
        await asyncio.gather(*(one(b) for b in bodies))
        return time.perf_counter() - t0


def throughput(n: int, concurrency: int) -> None:
    import ray
    from ray import serve

    from api.serve_ray import build_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bodies = [
        {
            "model": MODEL,
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": f"Request {i}: say something."}],
        }
        for i in range(n)
    ]
    url = f"http://127.0.0.1:{port}"
    rates = {}
    with tempfile.TemporaryDirectory() as tmp:
        ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        try:
            for replicas in (1, 2):
                settings = ServeSettings(models=["tiny"], state_dir=Path(tmp) / f"s{replicas}")
                serve.run(build_app(settings, replicas=replicas), name="pie-media", route_prefix="/")
                asyncio.run(_load(url, bodies[:4], 4))  # warm up
                took = asyncio.run(_load(url, bodies, concurrency))
                rates[replicas] = n / took
                one_s = asyncio.run(_load(url, bodies[:8], 1)) / 8
                print(
                    f"  {replicas} replica(s): {n} chats in {took:.2f} s = {rates[replicas]:.1f} req/s "
                    f"(one at a time: {one_s * 1000:.0f} ms each)"
                )
                serve.delete("pie-media")
        finally:
            serve.shutdown()
            ray.shutdown()
        with TestClient(create_app(ServeSettings(models=["tiny"], state_dir=Path(tmp) / "direct"))) as c:
            c.post("/v1/chat/completions", json=bodies[0])
            t0 = time.perf_counter()
            for b in bodies[:8]:
                c.post("/v1/chat/completions", json=b)
            direct = (time.perf_counter() - t0) / 8
    print(f"  in-process (no Ray), one at a time: {direct * 1000:.0f} ms each")
    ratio = rates[2] / rates[1]
    print(f"  2 vs 1 replicas here: {ratio:.2f}x ({os.cpu_count()} CPU cores shared by both replicas)")
    print(
        "  N GPUs (one replica each): the replicas share no compute, only the index (none per chat,\n"
        "  a few ms per batch line) and the gateway (the Ray hop per request is the difference between\n"
        "  one-at-a-time through Ray and in-process above); expected throughput ~ N x the 1-replica rate,\n"
        f"  e.g. N=4: ~{4 * rates[1]:.0f} req/s at this model size, if the gateway keeps up (it is one asyncio\n"
        "  process: add gateway replicas past a few thousand requests/s)."
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--skip-ray", action="store_true", help="only the hit-rate part")
    args = ap.parse_args()
    print("Prefix-cache hit rate, 4 system prompts x 4 images repeating, 2 replicas:")
    hit_rates(args.requests)
    if not args.skip_ray:
        print("Throughput on Ray Serve (tiny Qwen3-VL, greedy, 16 tokens each):")
        throughput(args.requests, args.concurrency)


if __name__ == "__main__":
    main()
