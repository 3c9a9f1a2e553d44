"""Replicas on Ray Serve: throughput of 1 vs 2 engine replicas, and the prefix-cache hit
rate of the replica router's choice against older choices.

1. Hit rate (cached_tokens / prompt_tokens, summed over a workload's chats as the API
   reports them) on two in-process engines (fresh, cold caches for each workload and
   policy), for two workloads:
   - ``shared-system``: 6 long system prompts (~190 tokens) and a different question in
     every chat (text only), the case of issue 34;
   - ``system-x-image``: 4 system prompts x 4 images repeating, a new question each.
   Policies: ``random``; ``old-key`` (the router before issue 34: rendezvous hash of the
   model, system prompt and first user part); ``prefix`` (``api.prefix_router.PrefixRouter``
   on ``api.serve_ray.routing_text``, what ``serve --ray`` routes by now); and
   ``one-replica`` (every chat on one engine: the most any routing over 2 can reuse).
   Chats are sent one at a time, so loads are equal and the load bound never acts.
2. Throughput: ``api.serve_ray.build_app`` on a local Ray, the tiny Qwen3-VL, N concurrent
   greedy chats; 1 replica, then 2. On this 2-core machine two replicas share the same two
   cores as one (torch already uses both), so expect ~1x here; the printout gives the
   arithmetic for N GPUs (one replica per GPU: the replicas share only the index and the
   gateway, whose cost per request is measured).

    .venv/bin/python bench/replicas.py [--requests 48] [--concurrency 8] [--skip-ray]
        [--out bench/results/replicas_hit_rate.json]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import json
import os
import platform
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
from api.prefix_router import PrefixRouter
from api.serve_ray import routing_text

MODEL = "tiny-qwen3-vl"
REPLICAS = ["replica-0", "replica-1"]
POLICIES = ("random", "old-key", "prefix", "one-replica")


def _images() -> list[str]:
    from fixtures.samples import ensure_samples

    root = ensure_samples() / "images"
    names = sorted(p for p in root.iterdir() if p.suffix in (".png", ".jpg"))[:4]
    return [
        f"data:image/{'png' if p.suffix == '.png' else 'jpeg'};base64,{base64.b64encode(p.read_bytes()).decode()}"
        for p in names
    ]


def _chat(system: str, content: list[dict] | str) -> dict:
    return {
        "model": MODEL,
        "max_tokens": 4,
        "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": content}],
    }


def shared_system_workload(n: int, seed: int = 0) -> list[dict]:
    """6 long system prompts (~190 tokens), a different question in every chat."""
    rng = random.Random(seed)
    rules = [
        "Answer politely and briefly, cite the policy section that applies, never invent order numbers. ",
        "Reply in plain English, one paragraph at most, and ask for the ticket id when it is missing. ",
        "Explain each step of the procedure, warn about data loss, and link the manual's chapter. ",
        "Use a friendly tone, suggest one related book, and keep prices in the customer's currency. ",
        "List the options as short bullets, say which one you recommend, and why, in one line. ",
        "Check the delivery address first, then the payment status, then answer the question. ",
    ]
    systems = [f"You are support agent {i} of the bookshop. " + rule * 6 for i, rule in enumerate(rules)]
    topics = ["my order", "a refund", "the invoice", "shipping to Norway", "a damaged cover", "gift cards"]
    return [
        _chat(systems[rng.randrange(len(systems))], f"Question {i}: what about {rng.choice(topics)}?")
        for i in range(n)
    ]


def system_x_image_workload(n: int, seed: int = 0) -> list[dict]:
    """4 system prompts x 4 images repeating, a new question each."""
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
        out.append(_chat(systems[s], content))
    return out


def old_key_replica(body: dict) -> str:
    """Where the router before issue 34 sent a chat: the highest hash of (key, replica),
    key = hash of the model and the first two content parts (system prompt, first user part)."""
    head: list[str] = []
    for m in body["messages"]:
        content = m["content"]
        values = (
            [content]
            if isinstance(content, str)
            else [p.get("text") or p["image_url"]["url"] for p in content]
        )
        head += [f"{m['role']}:{v}" for v in values]
        if len(head) >= 2:
            break
    h = hashlib.sha256(str(body["model"]).encode())
    for p in head[:2]:
        h.update(b"\0" + p.encode())
    key = h.hexdigest()[:32]
    return max(REPLICAS, key=lambda n: hashlib.sha256(f"{key}\0{n}".encode()).digest())


def _run(bodies: list[dict], policy: str, state: Path) -> dict:
    """Send ``bodies`` one at a time to fresh engines (cold prefix caches) as ``policy``
    routes them; the API's own usage counts give the hit rate."""
    count = 1 if policy == "one-replica" else 2
    engines = [
        TestClient(create_app(ServeSettings(models=["tiny"], state_dir=state / str(i)))) for i in range(count)
    ]
    for e in engines:
        e.__enter__()
    rng, router = random.Random(1), PrefixRouter()
    prompt = cached = 0
    per_replica = [0] * count
    try:
        for body in bodies:
            if policy == "random":
                i = rng.randrange(2)
            elif policy == "old-key":
                i = REPLICAS.index(old_key_replica(body))
            elif policy == "prefix":
                text = routing_text("/v1/chat/completions", json.dumps(body).encode())
                assert text is not None
                i = REPLICAS.index(router.route(text, dict.fromkeys(REPLICAS, 0)).replica)
            else:
                i = 0
            r = engines[i].post("/v1/chat/completions", json=body)
            r.raise_for_status()
            usage = r.json()["usage"]
            prompt += usage["prompt_tokens"]
            cached += usage["prompt_tokens_details"]["cached_tokens"]
            per_replica[i] += 1
    finally:
        for e in engines:
            e.__exit__(None, None, None)
    return {
        "hit_rate": round(cached / prompt, 4),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "chats_per_replica": per_replica,
    }


def hit_rates(n: int) -> dict:
    """{workload: {policy: {hit_rate, prompt_tokens, cached_tokens, per_replica}}}."""
    workloads = {"shared-system": shared_system_workload(n), "system-x-image": system_x_image_workload(n)}
    results: dict[str, dict] = {w: {} for w in workloads}
    with tempfile.TemporaryDirectory() as tmp:
        for workload, bodies in workloads.items():
            for policy in POLICIES:
                results[workload][policy] = _run(bodies, policy, Path(tmp) / f"{workload}-{policy}")
                row = results[workload][policy]
                print(
                    f"  {workload:14s} {policy:11s}: {row['prompt_tokens']} prompt tokens, "
                    f"{row['cached_tokens']} cached -> hit rate {row['hit_rate']:.1%} "
                    f"(chats per replica {row['chats_per_replica']})"
                )
    for workload, row in results.items():
        print(
            f"  {workload}: prefix {row['prefix']['hit_rate']:.1%} vs old key {row['old-key']['hit_rate']:.1%} "
            f"vs random {row['random']['hit_rate']:.1%} (one replica, the ceiling: {row['one-replica']['hit_rate']:.1%})"
        )
    return results


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


def _cpu() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--skip-ray", action="store_true", help="only the hit-rate part")
    ap.add_argument("--out", type=Path, default=None, help="save the hit rates as JSON here")
    args = ap.parse_args()
    print(
        f"Prefix-cache hit rate (cached_tokens / prompt_tokens), {args.requests} chats per workload, 2 replicas:"
    )
    rates = hit_rates(args.requests)
    if args.out is not None:
        args.out.write_text(
            json.dumps(
                {
                    "bench": "replicas hit rate",
                    "machine": {
                        "cpu": _cpu(),
                        "cores": os.cpu_count(),
                        "note": "this CPU, 2 cores shared with other users; hit rates do not depend on speed",
                    },
                    "model": MODEL,
                    "requests_per_workload": args.requests,
                    "sent": "one at a time (equal loads: the load bound never acts)",
                    "workloads": rates,
                },
                indent=1,
            )
            + "\n"
        )
        print(f"  saved {args.out}")
    if not args.skip_ray:
        print("Throughput on Ray Serve (tiny Qwen3-VL, greedy, 16 tokens each):")
        throughput(args.requests, args.concurrency)


if __name__ == "__main__":
    main()
