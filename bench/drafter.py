"""Speculative decoding and grammar jump-forward: acceptance and tok/s with and without.

    python bench/drafter.py [--out bench/results/drafter.json]

On the tiny random checkpoints (CPU, float32, one thread), same process, median of 3:

* (a) ``json``: greedy generation under a JSON schema. Baseline: step by step (the
  grammar's forced tokens switched off for the run); ours: jump-forward (forced tokens
  checked in the pass of the token before them).
* (b) ``copy``: prompt lookup (``PromptLookupDrafter``) on a copy-heavy prompt, greedy
  and seeded sampling, against plain decoding.

Every row also says whether the tokens were identical to the baseline's.

What random weights can and cannot show. A random model's next token has nothing to do
with the text, so an n-gram drafter is right only where the model itself loops: the tiny
Qwen3-VL's greedy output on this prompt repeats one token (the drafter's overlapping
copy guesses it, acceptance near 1: the best case), the tiny Gemma-4's does not (the
drafter has nothing to copy, acceptance near 0: the pure cost of drafting, which is the
rows of rejected drafts plus the bookkeeping). A trained model copying from its prompt
sits between the two; these numbers bound it, they do not predict it. Jump-forward does
not depend on the weights: forced tokens (keys, quotes, separators) are always accepted,
so (a) is representative of the pass count a real model saves on the same schema. On
these tiny models a pass costs about as much per row as per pass, so fewer passes save
less time than they would on a large model, whose decode pass is memory-bound (k+1 rows
cost about one row's weight reads).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [str(Path(__file__).resolve().parents[1])] + [
    p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent
]

import argparse
import asyncio
import json
import platform
import statistics
import time
from typing import Any

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "zip": {"type": "string", "pattern": "[0-9]{5}"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "ok": {"type": "boolean"},
    },
    "required": ["name", "colour", "count", "address", "ok"],
    "additionalProperties": False,
}
COPY = "Repeat exactly: a b c d e f g h a b c d e f g h a b c d e f g h a b c d"


async def _once(model: Any, prompt: str, **kw: Any) -> tuple[list[int], float, int]:
    from engine import Context

    ctx = Context(model, seed=kw.pop("seed", None))
    ctx.user(prompt).cue()
    await ctx.flush()
    await ctx.next_token_logits()  # the prefill is not what is measured
    passes = model.scheduler.stats.passes
    t = time.perf_counter()
    g = await ctx.generate(**kw)
    dt = time.perf_counter() - t
    used = model.scheduler.stats.passes - passes
    ctx.close()
    return g.tokens, dt, used


def _measure(model: Any, prompt: str, reps: int, **kw: Any) -> dict[str, Any]:
    c = model.counters
    drafted, accepted = c.drafted_tokens, c.accepted_draft_tokens
    runs = []
    for _ in range(reps):
        args = dict(kw)
        if "drafter_factory" in args:
            args["drafter"] = args.pop("drafter_factory")()
        runs.append(asyncio.run(_once(model, prompt, **args)))
    tokens = runs[0][0]
    dt = statistics.median(r[1] for r in runs)
    d, a = c.drafted_tokens - drafted, c.accepted_draft_tokens - accepted
    return {
        "tokens": len(tokens),
        "passes": runs[0][2],
        "tok_s": round(len(tokens) / dt, 1),
        "drafted": d // reps,
        "accepted": a // reps,
        "acceptance": round(a / d, 3) if d else None,
        "_ids": tokens,
        "_same_runs": all(r[0] == tokens for r in runs),
    }


def _row(name: str, base: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    row = {
        "case": name,
        "baseline": {k: v for k, v in base.items() if not k.startswith("_")},
        "ours": {k: v for k, v in ours.items() if not k.startswith("_")},
        "identical_tokens": base["_ids"] == ours["_ids"] and base["_same_runs"] and ours["_same_runs"],
        "speedup": round(ours["tok_s"] / base["tok_s"], 2),
        "passes_ratio": round(base["passes"] / max(1, ours["passes"]), 2),
    }
    print(
        f"{name:34s} tok/s {base['tok_s']:7.1f} -> {ours['tok_s']:7.1f} ({row['speedup']:.2f}x)  "
        f"passes {base['passes']:3d} -> {ours['passes']:3d}  acceptance {ours['acceptance']}  "
        f"identical {row['identical_tokens']}"
    )
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "drafter.json"))
    ap.add_argument("--reps", type=int, default=3)
    opts = ap.parse_args()
    torch.set_num_threads(1)
    from engine import Grammar, GrammarMatcher, Model, PromptLookupDrafter, Sampler
    from fixtures.tiny_models import ensure_tiny_model

    rows = []
    for name in ("tiny-qwen3-vl", "tiny-gemma4"):
        model = Model.load(ensure_tiny_model(name), kv_pages=512, device="cpu")
        grammar = Grammar.json_schema(SCHEMA)
        GrammarMatcher(grammar, model)  # the vocabulary index, built once, not measured
        json_kw = dict(max_tokens=120, grammar=grammar)
        forced = GrammarMatcher.forced
        GrammarMatcher.forced = lambda self: []  # type: ignore[method-assign]  # step by step
        try:
            base = _measure(model, "A record as JSON.", opts.reps, **json_kw)
        finally:
            GrammarMatcher.forced = forced  # type: ignore[method-assign]
        ours = _measure(model, "A record as JSON.", opts.reps, **json_kw)
        rows.append(_row(f"{name} json jump-forward", base, ours))
        for label, sampler, seed in (
            ("greedy", None, None),
            ("top-p 0.9 seed 3", Sampler.top_p(1.0, 0.9), 3),
        ):
            kw = dict(max_tokens=64, sampler=sampler, seed=seed)
            base = _measure(model, COPY, opts.reps, **kw)
            for k in (4, 8):
                ours = _measure(
                    model, COPY, opts.reps, drafter_factory=lambda k=k: PromptLookupDrafter(num_draft=k), **kw
                )
                rows.append(_row(f"{name} copy {label} k={k}", base, ours))
    out = {
        "bench": "drafter",
        "machine": {"cpu": platform.processor() or platform.machine(), "torch_threads": 1},
        "note": "tiny random checkpoints; see the module doc for what they can and cannot show",
        "rows": rows,
    }
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
