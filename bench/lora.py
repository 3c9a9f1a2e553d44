"""Contexts on different LoRA adapters: one batched pass vs one pass per adapter.

Run: ``.venv/bin/python -m bench.lora [--reps 3] [--contexts 4] [--steps 8]``. Uses ``bench.engine``'s
bigger random Qwen3-VL (hidden 512, 8 layers; the tiny fixture is so small that the
151k-row LM head hides everything else) with one random PEFT adapter per context.

Two phases, each timed both ways, interleaved medians:

* prefill: every context's prompt (fresh contexts, every row computed, hidden states only:
  no LM head over every row) together (``asyncio.gather``: one scheduler pass, per-row
  adapters) vs one context after another;
* decode: ``--steps`` greedy tokens per context, all at once (each step one pass for all
  contexts) vs one context after another (each step one pass per context): the case that
  matters when many users run their own adapters.

Prints the ratios (separate / batched: > 1 means the batched pass wins) and the LoRA
overhead (batched with adapters / batched without).
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script (python bench/lora.py), this folder comes first on sys.path and its
# engine.py / inferlets.py / speech.py would shadow those packages: the repository root
# goes first instead. (python -m bench.lora works either way.)
sys.path[:] = [str(Path(__file__).resolve().parents[1])] + [
    p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent
]

import argparse
import asyncio
import itertools
import tempfile

import torch

from bench.engine import build_checkpoint
from bench.timing import interleaved
from engine import Context, Model, max_tokens
from fixtures.tiny_lora import build_adapter

PROMPTS = [
    "Tell me a story about a cat who lives by the sea.",
    "Why is the sky blue on a clear day?",
    "Name three rivers and the seas they flow into.",
    "How does a lighthouse keeper spend the winter?",
    "What should I pack for a week in the mountains?",
    "Explain how bread rises in the oven.",
    "Which birds migrate the farthest every year?",
    "Describe the smell of rain on a hot road.",
]


_RUN = itertools.count()


def _contexts(model: Model, adapters: list, fresh: bool = False) -> list[Context]:
    """``fresh``: a run number first, so the prefix cache never answers."""
    head = f"Run {next(_RUN)}. " if fresh else ""
    ctxs = []
    for i, adapter in enumerate(adapters):
        ctx = Context(model).user(head + PROMPTS[i % len(PROMPTS)] * 3).cue()
        if adapter is not None:
            ctx.adapters.push(adapter)
        ctxs.append(ctx)
    return ctxs


async def _prefill(model: Model, adapters: list, batched: bool) -> int:
    ctxs = _contexts(model, adapters, fresh=True)
    before = model.scheduler.stats.passes
    if batched:
        await asyncio.gather(*(c.flush() for c in ctxs))
    else:
        for c in ctxs:
            await c.flush()
    for c in ctxs:
        c.close()
    return model.scheduler.stats.passes - before


async def _decode(model: Model, adapters: list, batched: bool, steps: int) -> list[list[int]]:
    ctxs = _contexts(model, adapters)
    await asyncio.gather(*(c.flush() for c in ctxs))  # not timed apart: same on both sides

    async def gen(c: Context) -> list[int]:
        return (await c.generate(stop=max_tokens(steps))).tokens

    if batched:
        out = await asyncio.gather(*(gen(c) for c in ctxs))
    else:
        out = [await gen(c) for c in ctxs]
    for c in ctxs:
        c.close()
    return list(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--contexts", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(Path(tmp))
        model = Model.load(path, kv_pages=1024, device="cpu")
        adapters = [
            model.load_adapter(build_adapter(path, Path(tmp) / f"a{s}", seed=s)) for s in range(args.contexts)
        ]
    none = [None] * args.contexts
    n = args.contexts

    pre = interleaved(
        {
            "batched": lambda: asyncio.run(_prefill(model, adapters, True)),
            "separate": lambda: asyncio.run(_prefill(model, adapters, False)),
            "base": lambda: asyncio.run(_prefill(model, none, True)),
        },
        args.reps,
    )
    dec = interleaved(
        {
            "batched": lambda: asyncio.run(_decode(model, adapters, True, args.steps)),
            "separate": lambda: asyncio.run(_decode(model, adapters, False, args.steps)),
            "base": lambda: asyncio.run(_decode(model, none, True, args.steps)),
        },
        args.reps,
    )
    same = dec["batched"][1] == dec["separate"][1]
    differ = dec["batched"][1] != dec["base"][1]
    print(f"{n} contexts, each on its own LoRA adapter (rank 4, all attention+MLP projections), CPU")
    print(f"  tokens equal batched vs separate: {same}; adapters change the tokens: {differ}")
    for name, r in (("prefill", pre), (f"decode {args.steps} steps", dec)):
        one, two, base = r["batched"][0], r["separate"][0], r["base"][0]
        print(
            f"  {name:16}: batched {one * 1e3:8.1f} ms, separate {two * 1e3:8.1f} ms, "
            f"ratio separate/batched {two / one:.2f}x; LoRA overhead {one / base:.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
