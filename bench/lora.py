"""Two contexts on two LoRA adapters: one batched pass vs two separate passes.

Run: ``.venv/bin/python -m bench.lora [--model tiny-qwen3-vl] [--reps 20]``. Each rep
prefills two fresh contexts (every row computed, no prefix-cache reuse) once together
(``asyncio.gather``: one scheduler pass, per-row adapters) and once one after the other
(two passes); prints the median times, their ratio, and the same without adapters.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch

from engine import Context, Model
from fixtures.tiny_lora import build_adapter
from fixtures.tiny_models import ensure_tiny_model

PROMPTS = [
    "Tell me a story about a cat who lives by the sea. " * 2,
    "Why is the sky blue on a clear day? " * 2,
]


def _contexts(model: Model, adapters: list) -> list[Context]:
    ctxs = []
    for prompt, adapter in zip(PROMPTS, adapters, strict=True):
        ctx = Context(model).user(prompt).cue()
        if adapter is not None:
            ctx.adapters.push(adapter)
        ctxs.append(ctx)
    return ctxs


async def _one_rep(model: Model, adapters: list, batched: bool) -> float:
    ctxs = _contexts(model, adapters)
    start = time.perf_counter()
    if batched:
        await asyncio.gather(*(c.flush(return_logits=True) for c in ctxs))
    else:
        for c in ctxs:
            await c.flush(return_logits=True)
    took = time.perf_counter() - start
    for c in ctxs:
        c.close()
    return took


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="tiny-qwen3-vl")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model_dir = ensure_tiny_model(args.model)
    model = Model.load(model_dir, kv_pages=256, device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [model.load_adapter(build_adapter(model_dir, Path(tmp) / f"a{s}", seed=s)) for s in (1, 2)]
    times: dict[bool, list[float]] = {True: [], False: []}
    passes: dict[bool, int] = {True: 0, False: 0}
    for _ in range(args.reps):
        for batched in (True, False):
            before = model.scheduler.stats.passes
            times[batched].append(asyncio.run(_one_rep(model, adapters, batched)))
            passes[batched] += model.scheduler.stats.passes - before
    base = {
        batched: statistics.median(
            asyncio.run(_one_rep(model, [None, None], batched)) for _ in range(args.reps)
        )
        for batched in (True, False)
    }
    one, two = statistics.median(times[True]), statistics.median(times[False])
    print(f"model {args.model}, 2 contexts x 2 adapters, prefill, {args.reps} reps (median)")
    print(f"  one batched pass : {one * 1e3:8.2f} ms  ({passes[True] / args.reps:.1f} passes/rep)")
    print(f"  separate passes  : {two * 1e3:8.2f} ms  ({passes[False] / args.reps:.1f} passes/rep)")
    print(f"  ratio separate/batched: {two / one:.2f}x")
    print(f"  same without adapters: batched {base[True] * 1e3:.2f} ms, separate {base[False] * 1e3:.2f} ms")
    print(f"  LoRA overhead (batched with / without adapters): {one / base[True]:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
