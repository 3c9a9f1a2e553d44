"""Host cost of a decode loop driven pass by pass (``ctx.forward()``) against the engine's own.

    python -m bench.forward_pass [--contexts 1,32] [--steps 32] [--rounds 3] [--real] [--out PATH]

Each of N contexts decodes ``steps`` greedy tokens, all at once (their passes batched by
the scheduler), in three ways:

* ``engine``: ``ctx.stream(greedy, max_tokens)``, the engine's decode loop (overlap as the
  device has it: off on the CPU);
* ``forward 1 slot``: a loop of ``ctx.forward().input_tokens([t]).sampler([0], greedy)``
  passes, as Pie's python-example inferlet drives one;
* ``forward 4 slots``: the same with a dist (top 8), an entropy and the logprobs of 4
  candidates on the row beside the token;
* ``forward 1 slot, staged`` / ``not staged``: the one-slot loop with
  ``pass_speculation(True)`` / ``(False)`` (unset, the first way follows the scheduler's
  overlap: off on the CPU): staged, each pass is submitted while the one before runs.

The forward is the stand-in of ``bench/host_overhead.py`` (fixed hidden states and logits
row: what is left is the host's share), and with ``--real`` also the whole tiny Qwen3-VL.
Figures: process CPU milliseconds per step and wall milliseconds per step (each run
length's best of ``--rounds``, interleaved, then the difference over ``steps``), and the
ratios the aims are about: a one-slot pass <= 1.2x the engine's step at 32 contexts; each
extra slot <= 10% of a one-slot pass; a staged hit saves >= 80% of the queueing time.

Queueing time (``queueing_ms_per_pass``, every pass of every round;
``queueing_ms_per_staged_hit``, the hits alone): from a hand-built pass's ``execute`` to
the forward worker beginning the pass that computes it (``engine.step_timing``'s "queue:
..." phases), zero for a pass the worker began before it was asked for (a staged hit
whose pass began in time). A staged way's passes that are not hits are each run's first,
which may wait for the pass staged after the run before (dropped, but already running).
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
import time
from typing import Any

from bench.host_overhead import PROMPT, load


async def _engine(model, n: int, steps: int) -> None:
    from engine import Context, Sampler, max_tokens

    contexts = [Context(model).user(PROMPT).cue() for _ in range(n)]
    for c in contexts:
        await c.flush()

    async def one(ctx) -> None:
        async for _ in ctx.stream(Sampler.greedy(), max_tokens(steps)):
            pass

    try:
        await asyncio.gather(*(one(c) for c in contexts))
    finally:
        for c in contexts:
            c.close()


async def _forward(model, n: int, steps: int, extra: bool, staged: bool | None = None) -> None:
    from engine import Context, Slot

    contexts = [Context(model).user(PROMPT).cue() for _ in range(n)]
    firsts = []
    for c in contexts:
        last = c.token_ids[-1]
        c.truncate(len(c) - 1)
        await c.flush()
        firsts.append(last)
    greedy = Slot.greedy()
    probes = [Slot.dist(1.0, 8), Slot.entropy(), Slot.logprobs([1, 2, 3, 4])]

    async def one(ctx, token: int) -> None:
        for _ in range(steps):
            fp = ctx.forward().input_tokens([token])
            if staged is not None:
                fp.pass_speculation(staged)
            h = fp.sampler([0], greedy)
            if extra:
                for p in probes:
                    fp.sampler([0], p)
            out = await fp.execute()
            token = out[h].token

    try:
        await asyncio.gather(*(one(c, t) for c, t in zip(contexts, firsts, strict=True)))
    finally:
        for c in contexts:
            c.close()


def _timed(model, run) -> tuple[float, float, int]:
    passes = model.scheduler.stats.passes
    t0, c0 = time.perf_counter(), time.process_time()
    asyncio.run(run)
    return time.perf_counter() - t0, time.process_time() - c0, model.scheduler.stats.passes - passes


def measure(model, n: int, steps: int, rounds: int) -> dict[str, Any]:
    """ms per decode step (CPU of the process, wall), each way; steps of ``steps + 8`` minus
    steps of 8 tokens, over ``steps`` (set-up and prefill cancel out)."""
    ways = {
        "engine": lambda k: _engine(model, n, k),
        "forward 1 slot": lambda k: _forward(model, n, k, False),
        "forward 1 slot, staged": lambda k: _forward(model, n, k, False, staged=True),
        "forward 1 slot, not staged": lambda k: _forward(model, n, k, False, staged=False),
        "forward 4 slots": lambda k: _forward(model, n, k, True),
    }
    from engine.step_timing import TIMING

    # each way and length's best (wall, CPU) over the rounds: the best of a difference would
    # take the round whose short run a neighbour on the machine slowed down
    lows: dict[tuple[str, int], list[float]] = {}
    queued: dict[str, list[float]] = {}  # way -> [seconds, passes] of queueing, every round
    hits: dict[str, list[float]] = {}  # the same, of staged hits alone
    for make in ways.values():  # warm-up: first calls, kernels, allocator
        _timed(model, make(4))
    for _ in range(rounds):
        for way, make in ways.items():
            for k in (8, 8 + steps):
                with TIMING.recording():
                    wall, cpu, _ = _timed(model, make(k))
                    q, h = queued.setdefault(way, [0.0, 0]), hits.setdefault(way, [0.0, 0])
                    for name, seconds in TIMING.seconds.items():
                        if name.startswith("queue: a hand-built pass"):
                            for acc in (q, h) if name.endswith("(staged hit)") else (q,):
                                acc[0] += seconds
                                acc[1] += TIMING.counts[name]
                low = lows.setdefault((way, k), [float("inf"), float("inf")])
                low[0], low[1] = min(low[0], cpu), min(low[1], wall)
    best = {
        w: [
            (lows[w, 8 + steps][0] - lows[w, 8][0]) / steps * 1e3,
            (lows[w, 8 + steps][1] - lows[w, 8][1]) / steps * 1e3,
        ]
        for w in ways
    }
    row: dict[str, Any] = {w: {"cpu_ms": round(c, 3), "wall_ms": round(wl, 3)} for w, (c, wl) in best.items()}
    for way, (seconds, passes) in queued.items():
        if passes:
            row[way]["queueing_ms_per_pass"] = round(seconds / passes * 1e3, 4)
        if hits[way][1]:
            row[way]["queueing_ms_per_staged_hit"] = round(hits[way][0] / hits[way][1] * 1e3, 4)
    staged = row["forward 1 slot, staged"].get("queueing_ms_per_staged_hit")
    plain = row["forward 1 slot, not staged"].get("queueing_ms_per_pass")
    if staged is not None and plain:
        row["staged hit's saving of queueing time"] = round(1 - staged / plain, 3)
    row["one slot over engine (cpu)"] = round(best["forward 1 slot"][0] / best["engine"][0], 3)
    row["staged over not staged (wall)"] = round(
        best["forward 1 slot, staged"][1] / best["forward 1 slot, not staged"][1], 3
    )
    row["each extra slot over one slot (cpu)"] = round(
        (best["forward 4 slots"][0] / best["forward 1 slot"][0] - 1) / 3, 3
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1,32")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--real", action="store_true", help="also the real tiny model's forward")
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch.set_num_threads (as bench/host_overhead.py)"
    )
    ap.add_argument("--label", default="", help="what the figures are (machine, tree), saved with them")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    counts = [int(c) for c in args.contexts.split(",")]
    result: dict[str, Any] = {
        "machine": platform.processor() or platform.machine(),
        "cpu": _cpu_name(),
        "steps": args.steps,
        "rounds": args.rounds,
        "threads": args.threads,
        "label": args.label,
    }
    for label, real in [("stand_in", False), *([("tiny_model", True)] if args.real else [])]:
        model = load(real, max(counts))
        result[label] = {}
        for n in counts:
            c = model.counters
            hits, misses = c.staged_hits, c.staged_misses
            result[label][str(n)] = row = measure(model, n, args.steps, args.rounds)
            row["staged hit rate"] = round(
                (c.staged_hits - hits) / max(1, c.staged_hits - hits + c.staged_misses - misses), 3
            )
            print(f"{label}, {n:3d} contexts: {row}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
