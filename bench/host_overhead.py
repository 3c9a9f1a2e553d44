"""Host time per decode step: the real engine with a forward pass that costs nothing.

    python -m bench.host_overhead [--contexts 1,32,128] [--steps 16] [--real] [--out PATH]

Everything a decode step does on the host runs for real: the tiny Qwen3-VL checkpoint
loaded by ``Model.load``, its scheduler (one pass for every context that is ready),
contexts building their steps (page tables, positions), the runner's index building,
sampling, stop checks (a token budget, a stop string), detokenization and the async
streams. Only the
model is replaced (``StandInModel``): its hidden states are a fixed tensor and its LM head
hands back a fixed row of logits, taken once from the real model, for every row. What is
left is the host's share of a step, the part a GPU cannot make faster.

Per concurrency, sampler (greedy; temperature 0.8 with top-p 0.9, each context seeded)
and the scheduler's overlap (on and off, alternated in the same process; ``--overlap``)
it reports milliseconds per decode pass: the wall time of a generation of ``warm + steps``
tokens minus that of ``warm`` tokens, over ``steps`` (prompt, prefill and context setup
cancel out), each length's best of ``--rounds`` interleaved rounds; and the process's CPU
time per pass the same way (steadier than the wall time on a shared machine), with the
part of it spent sampling inside passes (a GPU's work, where the logits live there) and
the rest, the host's own share. ``--real`` also runs the real
forward (the whole tiny model), which is how a top-p pass compares with a greedy one.

The logits row is the tiny model's own: almost flat (random weights), so top-p 0.9 keeps
~130k of its 151,936 tokens, the hardest case for a sampler that would sort.
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
import threading
import time
from typing import Any

import torch

PROMPT = "Describe a cat in one long sentence."
WARM = 4


class StandInModel:
    """What ``ForwardRunner`` calls on its architecture, at (almost) no cost: fixed hidden
    states and a fixed logits row for every row asked for. Everything else is the real
    architecture's."""

    def __init__(self, arch: Any, logits_row: torch.Tensor, max_rows: int):
        self._arch = arch
        self._hidden = torch.zeros(max_rows, arch.hidden_size)
        self._logits = logits_row.float().reshape(1, -1).expand(max_rows, -1).contiguous()

    def hidden_states(self, inp: Any, pie_batch: Any = None) -> torch.Tensor:
        rows = inp.ids.shape[0]
        if rows > self._hidden.shape[0]:
            self._hidden = torch.zeros(rows, self._hidden.shape[1])
        return self._hidden[:rows]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.shape[0]
        if rows > self._logits.shape[0]:
            self._logits = self._logits[:1].expand(rows, -1).contiguous()
        return self._logits[:rows]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._arch, name)


def load(real: bool, max_contexts: int):
    from engine import Model, SyncContext
    from fixtures.tiny_models import ensure_tiny_model

    model = Model.load(ensure_tiny_model("tiny-qwen3-vl"), kv_pages=max_contexts * 8 + 64, device="cpu")
    ctx = SyncContext(model).user(PROMPT).cue()
    row = ctx.next_token_logits().clone()
    ctx.close()
    if not real:
        model.runner.arch = StandInModel(model.runner.arch, row, max_contexts)
    # As `pie-media serve` does after start-up (engine.startup_heap): without it the oldest
    # generation's collections walk torch's and transformers' ~500k objects now and then,
    # a pause that lands on whichever step allocates at that moment.
    from engine.startup_heap import freeze_startup_heap

    freeze_startup_heap()
    # The sampling kernel compiles (or loads from numba's cache) on a thread of its own at
    # start-up: let it finish, else its CPU time lands in the first figures measured.
    for thread in threading.enumerate():
        if thread.name == "pie-sampling-kernel-warm":
            thread.join()
    return model


async def generate(model, n: int, tokens: int, sampled: bool) -> int:
    from engine import Context, Sampler, max_tokens, stop_strings

    # Stop checks run every step (a token budget, a stop string that never matches); EOS
    # is no stop here, so every stream runs the same number of steps whatever it draws.
    stop = max_tokens(tokens) | stop_strings("<never-in-this-output>")
    sampler = Sampler.top_p(0.8, 0.9) if sampled else Sampler.greedy()
    contexts = [Context(model, seed=i if sampled else None).user(PROMPT).cue() for i in range(n)]

    async def one(ctx) -> int:
        count = 0
        async for _ in ctx.stream(sampler, stop):
            count += 1
        return count

    try:
        counts = await asyncio.gather(*(one(c) for c in contexts))
    finally:
        for c in contexts:
            c.close()
    assert all(c == tokens for c in counts), counts
    return sum(counts)


SAMPLING = [0.0]
"""CPU seconds spent sampling in passes (``engine.pass_sampling``, the forward worker's and
the sampling kernel's second thread's): on a GPU that work is the device's, so the host's
own share is the rest."""


def count_sampling() -> None:
    import engine.forward

    real = engine.forward.sample_pass

    def timed(steps, out) -> None:
        t0 = time.thread_time() + _kernel_threads_cpu()
        try:
            real(steps, out)
        finally:
            SAMPLING[0] += time.thread_time() + _kernel_threads_cpu() - t0

    engine.forward.sample_pass = timed


def _kernel_threads_cpu() -> float:
    """CPU seconds of the sampling kernel's own threads (it samples half of a batch's rows
    on a second thread): sampling too, though not on the thread that called it."""
    total = 0.0
    for thread in threading.enumerate():
        if thread.name.startswith("pie-sampling-kernel_") and thread.ident is not None:
            total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    return total


def wall(model, n: int, tokens: int, sampled: bool) -> tuple[float, float, float, int]:
    """(wall seconds, CPU seconds of the whole process, of which sampling in passes,
    passes) of one generation."""
    passes = model.scheduler.stats.passes
    t0, c0, s0 = time.perf_counter(), time.process_time(), SAMPLING[0]
    asyncio.run(generate(model, n, tokens, sampled))
    return (
        time.perf_counter() - t0,
        time.process_time() - c0,
        SAMPLING[0] - s0,
        model.scheduler.stats.passes - passes,
    )


def measure(model, n: int, steps: int, rounds: int, modes: tuple[bool, ...] = (True,)) -> dict[str, Any]:
    """Per sampler (and overlap mode): ms per decode pass, wall and CPU, each from the best
    of ``rounds`` generations of ``WARM`` and of ``WARM + steps`` tokens (the best: what
    other load on a shared machine adds is never negative). ``modes``: the scheduler's
    overlap on (True) and/or off (False), alternated within each round so both meet the
    same load; keys of the off mode end in ``_no_overlap``."""
    out: dict[str, Any] = {}
    kinds = ("greedy", "top_p")
    runs: dict[tuple[str, bool, str], list[tuple[float, float, float, int]]] = {}
    saved = getattr(model.scheduler, "overlap", None)
    try:
        for kind in kinds:  # warm-up: first calls pay lazy set-up (kernel compilation, caches)
            for mode in modes:
                _set_overlap(model, mode)
                wall(model, n, WARM + 1, kind == "top_p")
        for _ in range(rounds):
            for kind in kinds:
                for mode in modes:
                    _set_overlap(model, mode)
                    for length in ("short", "long"):
                        tokens = WARM if length == "short" else WARM + steps
                        runs.setdefault((kind, mode, length), []).append(
                            wall(model, n, tokens, kind == "top_p")
                        )
    finally:
        if saved is not None:
            model.scheduler.overlap = saved
    for mode in modes:
        tail = "" if mode else "_no_overlap"
        for kind in kinds:
            short, long = runs[kind, mode, "short"], runs[kind, mode, "long"]
            key = f"{kind}{tail}"
            out[f"{key}_ms_per_step"] = round(
                (min(r[0] for r in long) - min(r[0] for r in short)) / steps * 1e3, 3
            )
            out[f"{key}_cpu_ms_per_step"] = round(
                (min(r[1] for r in long) - min(r[1] for r in short)) / steps * 1e3, 3
            )
            sampling = (min(r[2] for r in long) - min(r[2] for r in short)) / steps * 1e3
            out[f"{key}_sampling_cpu_ms_per_step"] = round(sampling, 3)
            out[f"{key}_cpu_ms_per_step_besides_sampling"] = round(
                out[f"{key}_cpu_ms_per_step"] - sampling, 3
            )
            out[f"{key}_passes_per_step"] = round((long[0][3] - short[0][3]) / steps, 3)
        for clock in ("", "cpu_"):
            greedy = out[f"greedy{tail}_{clock}ms_per_step"]
            out[f"top_p_over_greedy{tail}{'_cpu' if clock else ''}"] = (
                round(out[f"top_p{tail}_{clock}ms_per_step"] / greedy, 2) if greedy > 0 else None
            )
    if len(modes) == 2:
        for kind in kinds:
            on, off = out[f"{kind}_ms_per_step"], out[f"{kind}_no_overlap_ms_per_step"]
            out[f"{kind}_overlap_speedup"] = round(off / on, 2) if on > 0 else None
    return out


def late(model, n: int, after: int, steps: int, rounds: int) -> dict[str, float]:
    """Greedy ms per decode pass (wall, and CPU besides sampling) between token ``after``
    and ``after + steps`` of each context's answer: what a step costs deep into a long
    answer (a per-token cost that grows with the text so far shows here, not in the
    first tokens)."""
    runs: dict[int, list[tuple[float, float, float, int]]] = {}
    for _ in range(rounds):
        for tokens in (after, after + steps):
            runs.setdefault(tokens, []).append(wall(model, n, tokens, False))
    short, long = runs[after], runs[after + steps]
    wall_ms = (min(r[0] for r in long) - min(r[0] for r in short)) / steps * 1e3
    cpu_ms = (min(r[1] - r[2] for r in long) - min(r[1] - r[2] for r in short)) / steps * 1e3
    return {
        "after_tokens": after,
        "greedy_ms_per_step": round(wall_ms, 3),
        "greedy_cpu_ms_per_step_besides_sampling": round(cpu_ms, 3),
    }


def breakdown(model, n: int, steps: int, sampled: bool) -> dict[str, Any]:
    """Milliseconds per decode pass in each phase ``engine.step_timing`` names, and the
    event loop's CPU time per pass besides those phases (asyncio, the streams' consumers):
    a generation of ``WARM + steps`` tokens per context less one of ``WARM`` (prompt,
    prefill and set-up cancel out), as the other figures are taken."""
    from engine.step_timing import TIMING

    def record(tokens: int) -> tuple[dict[str, float], float, int]:
        passes = model.scheduler.stats.passes
        with TIMING.recording():
            t0 = time.thread_time()
            asyncio.run(generate(model, n, tokens, sampled))
            loop_cpu = time.thread_time() - t0
        return dict(TIMING.seconds), loop_cpu, model.scheduler.stats.passes - passes

    short, short_cpu, short_passes = record(WARM)
    long, long_cpu, long_passes = record(WARM + steps)
    passes = max(1, long_passes - short_passes)
    out = {
        name: round(1e3 * (long.get(name, 0.0) - short.get(name, 0.0)) / passes, 4)
        for name in sorted(long, key=lambda k: short.get(k, 0.0) - long[k])
    }
    # The hop is waiting (for the GIL, the loop's wake-up, or the loop busy with the pass
    # before), not the loop's CPU: the rest is its CPU time less the phases it runs.
    loop_phases = sum(v for k, v in out.items() if k.startswith("loop:") and "hop" not in k)
    out["loop: the rest of its CPU time (asyncio, consumers)"] = round(
        1e3 * (long_cpu - short_cpu) / passes - loop_phases, 4
    )
    out["passes"] = passes
    return out


def _set_overlap(model, on: bool) -> None:
    if hasattr(model.scheduler, "overlap"):  # an engine from before the overlap: always off
        model.scheduler.overlap = on


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="1,32,128")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    parser.add_argument("--real", action="store_true", help="also time the real forward")
    parser.add_argument("--machine", default=f"{platform.processor() or platform.machine()}")
    parser.add_argument("--label", default="", help="what this run measures (e.g. before/after)")
    parser.add_argument("--out", default="")
    parser.add_argument(
        "--late",
        type=int,
        default=256,
        help="also time greedy steps after this many tokens (the middle concurrency; 0: skip)",
    )
    parser.add_argument(
        "--overlap",
        choices=("on", "off", "both"),
        default="both",
        help="the scheduler's overlap (both: compared)",
    )
    args = parser.parse_args()
    modes = {"on": (True,), "off": (False,), "both": (True, False)}[args.overlap]
    torch.set_num_threads(args.threads)
    try:
        count_sampling()
    except AttributeError:  # an engine without sampling in passes: every sample is the context's
        pass
    counts = [int(c) for c in args.contexts.split(",")]

    result: dict[str, Any] = {
        "machine": args.machine,
        "threads": args.threads,
        "label": args.label,
        "sampled": "temperature 0.8, top-p 0.9, seeded per context",
        "steps": args.steps,
        "stand_in": {},
    }
    model = load(real=False, max_contexts=max(counts))
    for n in counts:
        result["stand_in"][str(n)] = row = measure(model, n, args.steps, args.rounds, modes)
        print(f"stand-in forward, {n:4d} contexts: {row}", flush=True)
    if args.late:
        n = counts[len(counts) // 2]
        # 64+ steps and 3+ rounds: the generations are long, their noise is the steps' size
        result["late"] = {str(n): late(model, n, args.late, max(64, args.steps), max(3, args.rounds))}
        print(
            f"stand-in forward, {n} contexts, after {args.late} tokens: {result['late'][str(n)]}", flush=True
        )
    if hasattr(model.scheduler, "overlap"):  # an engine with engine.step_timing
        result["breakdown_ms_per_pass"] = {}
        for n in counts:
            for kind in ("greedy", "top_p"):
                rows = breakdown(model, n, args.steps, kind == "top_p")
                result["breakdown_ms_per_pass"][f"{kind}@{n}"] = rows
                print(f"where a pass goes, stand-in forward, {kind}, {n} contexts:")
                for name, ms in rows.items():
                    print(f"    {name:60} {ms}")
    if args.real:
        result["real"] = {}
        model = load(real=True, max_contexts=max(counts))
        for n in counts:
            result["real"][str(n)] = row = measure(model, n, max(4, args.steps // 3), args.rounds, modes)
            print(f"real forward,     {n:4d} contexts: {row}", flush=True)
    if args.out:
        path = Path(args.out)
        runs = json.loads(path.read_text()) if path.exists() else {}
        runs[args.label or "run"] = result
        path.write_text(json.dumps(runs, indent=2) + "\n")
        print(f"saved under {args.label or 'run'!r} in {path}")


if __name__ == "__main__":
    main()
