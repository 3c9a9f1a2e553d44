"""Inferlets: what running application logic inside the server as WebAssembly costs.

    python -m bench.inferlets [--requests 16] [--branches 4] [--tokens 16] [--repeats 3]

On the tiny Qwen3-VL, one process, side by side:

* launch: compiling the example component cold (a fresh cache folder), loading it from
  the on-disk cache (a second runtime), from memory, and a whole cached launch (a fresh
  Store, instantiate, run ``ping 0``, close). Aim: a cached launch under 50 ms.
* host-call round trip: ``ping N`` (N calls of ``now``) minus ``ping 0``, per call.
* throughput: ``--requests`` concurrent best-of-``--branches`` inferlets (one prefill,
  forks, ``generate-all``, score, best) vs the same logic written in Python on
  ``engine.Context`` directly, interleaved medians; outputs must be equal. Aim: the
  inferlet path within 1.25x of the direct one.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script (python bench/inferlets.py), this folder comes first on sys.path and its
# engine.py / inferlets.py / speech.py would shadow those packages: the repository root
# goes first instead. (python -m bench.inferlets works either way.)
sys.path[:] = [str(Path(__file__).resolve().parents[1])] + [
    p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent
]

import argparse
import asyncio
import tempfile
import time

import torch

from bench.timing import interleaved, median_ms

EXAMPLES = Path(__file__).resolve().parents[1] / "inferlets" / "examples"
PROMPTS = [
    "Name a fruit.",
    "Tell me about the sea.",
    "What is a good name for a cat?",
    "Describe a rainy morning.",
    "Why do birds sing?",
    "Suggest a board game.",
    "What is bread made of?",
    "Say something kind.",
]


def _score(finish_eos: bool, text: str) -> tuple:
    """The example's scoring rule (inferlets/examples/best_of.py)."""
    return (finish_eos, len(set(text.split())))


async def direct_best_of(model, prompt: str, n: int, k: int, temperature: float, seed: int) -> list[str]:
    """The best-of example, written on the engine: (each branch's text..., best)."""
    from engine import Context, Sampler, stopping

    base = Context(model).user(prompt).cue()
    await base.flush()
    branches = [base.fork() for _ in range(k)]
    for i, b in enumerate(branches):
        b.reseed(seed + i)
    cond = stopping.max_tokens(n) | stopping.eos(model.eos_token_ids)
    gens = await asyncio.gather(*(b.generate(Sampler(temperature=temperature), cond) for b in branches))
    scores = [_score(g.finish_reason == "eos", g.text) for g in gens]
    best = max(range(k), key=lambda i: (scores[i], -i))
    for c in (*branches, base):
        c.close()
    return [g.text for g in gens] + [gens[best].text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--branches", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pings", type=int, default=2000)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from api.model_ref import load_model
    from fixtures.paths import cache_root
    from inferlets import InferletRuntime, build_component

    model = load_model("tiny", device="cpu")
    wasm = build_component(EXAMPLES, cache_root() / "inferlets-build")
    data = wasm.read_bytes()

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        InferletRuntime({}, Path(tmp)).component(data)
        cold = time.perf_counter() - t0
        disk = median_ms(lambda: InferletRuntime({}, Path(tmp)).component(data), 3, warmup=False)
    rt = InferletRuntime({"tiny": model}, cache_root())
    rt.component(data)
    memory = median_ms(lambda: rt.component(data), 20, warmup=False)

    async def launch(a: list[str]) -> str:
        return await rt.run_async(wasm, a)

    def run(a: list[str]) -> str:
        return asyncio.run(launch(a))

    run(["ping", "0"])
    cached_launch = median_ms(lambda: run(["ping", "0"]), 10, warmup=False)
    pings = median_ms(lambda: run(["ping", str(args.pings)]), 3, warmup=False)
    round_trip_us = (pings - cached_launch) / args.pings * 1e3

    def inferlet_side() -> list[list[str]]:
        async def go():
            outs = []

            async def one(i: int) -> list[str]:
                sends: list[str] = []
                prompt = PROMPTS[i % len(PROMPTS)]
                a = ["best-of", "tiny", prompt, str(args.tokens), str(args.branches), "0.8", str(100 * i)]
                best = await rt.run_async(wasm, a, on_send=sends.append)
                return sends + [best]

            outs = await asyncio.gather(*(one(i) for i in range(args.requests)))
            return list(outs)

        return asyncio.run(go())

    def direct_side() -> list[list[str]]:
        async def go():
            return list(
                await asyncio.gather(
                    *(
                        direct_best_of(
                            model, PROMPTS[i % len(PROMPTS)], args.tokens, args.branches, 0.8, 100 * i
                        )
                        for i in range(args.requests)
                    )
                )
            )

        return asyncio.run(go())

    passes_before = model.scheduler.stats.passes
    r = interleaved({"inferlet": inferlet_side, "direct": direct_side}, args.repeats)
    passes = model.scheduler.stats.passes - passes_before
    same = r["inferlet"][1] == r["direct"][1]
    tokens = args.requests * args.branches * args.tokens

    print(f"tiny Qwen3-VL, CPU, 1 torch thread; component {len(data) / 2**20:.1f} MiB")
    print(f"launch: cold compile {cold:.2f} s, from disk cache {disk:.1f} ms, from memory {memory:.3f} ms")
    print(f"  cached launch (new Store + instantiate + run + close): {cached_launch:.1f} ms (aim < 50 ms)")
    print(f"host-call round trip (now): {round_trip_us:.1f} us")
    print(
        f"{args.requests} concurrent best-of-{args.branches}, {args.tokens} tokens per branch "
        f"(up to {tokens} tokens a round), outputs equal: {same}"
    )
    t_inf, t_dir = r["inferlet"][0], r["direct"][0]
    print(f"  inferlets: {t_inf:.2f} s   direct Python on the engine: {t_dir:.2f} s")
    print(
        f"  inferlet / direct wall time: {t_inf / t_dir:.2f}x (aim <= 1.25x); passes over all rounds: {passes}"
    )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
