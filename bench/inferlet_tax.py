"""The programmability tax: a Pie-SDK inferlet's own decode loop against the engine's.

    python -m bench.inferlet_tax [--runs 1,32] [--steps 24] [--rounds 3] [--no-real]
                                 [--staged both] [--out bench/results/inferlet_tax_cpu.json]

Two ways to decode the same greedy tokens after the same prompt ids, side by side in one
process, on one model:

* ``native``: ``engine.Context``: ``ctx.fill_tokens(ids)`` then
  ``await ctx.generate(Sampler.greedy(), stopping.max_tokens(N))``;
* ``inferlet``: the Pie 0.4 project in ``bench/inferlet_tax/`` (Pie's own Python SDK
  ``inferlet`` 0.4.0, built with stock componentize-py), run by ``InferletRuntime``: it
  appends the same ids and iterates ``ctx.generate(Sampler.argmax(), max_tokens=N)`` with
  one ``await step.execute()`` per token, as Pie's python-example does, and returns its
  tokens (which must equal the engine's, token for token: asserted on every run).

Each at 1 and 32 concurrent runs (contexts), on the stand-in forward of
``bench/host_overhead.py`` (fixed hidden states and logits row: what is left is the host's
share of a step) and on the whole tiny Qwen3-VL, with the staged pass on and off (the
scheduler's overlap, ``model.scheduler.overlap``: the engine's generate overlaps its
passes, and an SDK pass, which never calls ``pass-speculation``, follows the same switch,
so with it on each one-token greedy pass stages its successor).

Figures: per generation of ``warm + steps`` tokens minus one of ``warm`` tokens, over
``steps`` (launch, instantiation, prefill and context set-up cancel out), each length's best
of ``--rounds`` interleaved rounds: wall milliseconds per step, the process's CPU
milliseconds per step, tokens/s (all runs together); the aims: at 1 run, the inferlet's
wall time per token above native <= 300 us; at 32 runs, inferlet tokens/s >= 0.8x native.

``--profile``: where an inferlet's time per token goes (1 run, staged off): every host
function of Pie's world timed (``inferlets.host.binding.host_function`` wrapped: calls per
token, wall and thread-CPU microseconds each), the guest thread's CPU besides the host
calls (the wasm guest: Pie's SDK, the guest's asyncio loop, componentize-py's glue), and
the event loop thread's CPU (the engine's pass, the hops host calls make to it).

torch runs on ONE intra-op thread (``torch.set_num_threads(1)``, ``--threads``): on a
2-core machine torch's threads fight the guest's thread for the cores (a pass measured
26 ms instead of 4 ms with 2 torch threads), as the tests set it too.
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
import os
import platform
import threading
import time
from collections import defaultdict
from typing import Any

from bench.host_overhead import PROMPT, load

PROJECT = Path(__file__).resolve().parent / "inferlet_tax"
WARM = 8


def prompt_ids(model) -> list[int]:
    from engine import Context

    ctx = Context(model).user(PROMPT).cue()
    try:
        return list(ctx.token_ids)
    finally:
        ctx.close()


async def native(model, ids: list[int], n: int, tokens: int) -> list[list[int]]:
    from engine import Context, Sampler, stopping

    contexts = [Context(model) for _ in range(n)]

    async def one(ctx) -> list[int]:
        ctx.fill_tokens(ids)
        g = await ctx.generate(Sampler.greedy(), stopping.max_tokens(tokens))
        return list(g.tokens)

    try:
        return list(await asyncio.gather(*(one(c) for c in contexts)))
    finally:
        for c in contexts:
            c.close()


async def inferlet(rt, wasm: Path, ids: list[int], n: int, tokens: int) -> list[list[int]]:
    arg = json.dumps({"prompt_tokens": ids, "max_tokens": tokens})
    # Every run ends before this returns (a failed one raises after): the loop the others'
    # host calls hop to must outlive them.
    outs = await asyncio.gather(*(rt.run_async(wasm, [arg]) for _ in range(n)), return_exceptions=True)
    for o in outs:
        if isinstance(o, BaseException):
            raise o
    return [json.loads(o) for o in outs]


def timed(coro) -> tuple[float, float, list[list[int]]]:
    """(wall s, process CPU s, the runs' tokens)."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = asyncio.run(coro)
    return time.perf_counter() - t0, time.process_time() - c0, out


def check_equal(ways: dict[str, list[list[int]]], tokens: int, where: str) -> None:
    """Every run of every way gave the same ``tokens`` greedy tokens (else: a bug, shown)."""
    ref = ways["native"][0]
    assert len(ref) == tokens, f"{where}: the engine gave {len(ref)} tokens, not {tokens}"
    for way, runs in ways.items():
        for i, got in enumerate(runs):
            if got != ref:
                first = next((k for k, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b), None)
                raise AssertionError(
                    f"{where}: {way} run {i} differs from the engine's greedy tokens "
                    f"(first difference at token {first}): {got} != {ref}"
                )


def measure(model, rt, wasm: Path, ids: list[int], n: int, steps: int, rounds: int, where: str) -> dict:
    ways = {
        "native": lambda k: native(model, ids, n, k),
        "inferlet": lambda k: inferlet(rt, wasm, ids, n, k),
    }
    c = model.counters
    hits0, misses0 = c.staged_hits, c.staged_misses
    for make in ways.values():  # warm-up: compilation caches, first calls
        timed(make(4))
    best: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for length in (WARM, WARM + steps):
            outs = {}
            for way, make in ways.items():
                wall, cpu, outs[way] = timed(make(length))
                b = best.setdefault((way, length), [float("inf"), float("inf")])
                b[0], b[1] = min(b[0], wall), min(b[1], cpu)
            check_equal(outs, length, f"{where}, {length} tokens")
    row: dict[str, Any] = {}
    for way in ways:
        short, long = best[way, WARM], best[way, WARM + steps]
        wall = (long[0] - short[0]) / steps
        row[way] = {
            "wall_ms_per_step": round(wall * 1e3, 3),
            "cpu_ms_per_step": round((long[1] - short[1]) / steps * 1e3, 3),
            "tokens_per_s": round(n / wall, 1) if wall > 0 else None,
        }
    nat, inf = row["native"], row["inferlet"]
    row["inferlet_over_native_tokens_per_s"] = (
        round(inf["tokens_per_s"] / nat["tokens_per_s"], 3)
        if inf["tokens_per_s"] and nat["tokens_per_s"]
        else None
    )
    row["inferlet_wall_us_per_token_above_native"] = round(
        (inf["wall_ms_per_step"] - nat["wall_ms_per_step"]) * 1e3 / n, 1
    )
    row["inferlet_cpu_us_per_token_above_native"] = round(
        (inf["cpu_ms_per_step"] - nat["cpu_ms_per_step"]) * 1e3 / n, 1
    )
    hits, misses = c.staged_hits - hits0, c.staged_misses - misses0
    row["staged_hit_rate"] = round(hits / (hits + misses), 3) if hits + misses else None
    if n == 1:
        row["aim_300us_met"] = row["inferlet_wall_us_per_token_above_native"] <= 300
    else:
        r = row["inferlet_over_native_tokens_per_s"]
        row["aim_0.8x_met"] = r is not None and r >= 0.8
    return row


# -- profile ----------------------------------------------------------------------------------


ENTRIES = "(every entry from wasm: wasmtime-py's trampoline + the host function or drop)"


class HostCallTimer:
    """Wraps ``inferlets.host.pie_world.host_function`` (the factory of every Pie-world host
    function) so each call is timed: wall and the calling thread's CPU, per WIT name; and
    ``InferletRuntime.run`` so the guest thread's own CPU is known."""

    def __init__(self) -> None:
        self.calls: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
        self.guest_cpu = 0.0
        self._lock = threading.Lock()

    def __enter__(self) -> HostCallTimer:
        import inferlets.host.pie_world as pw
        from inferlets.host.runtime import InferletRuntime

        self._pw, self._real_hf = pw, pw.host_function
        self._rt_cls, self._real_run = InferletRuntime, InferletRuntime.run
        real_hf, real_run, calls, lock = self._real_hf, self._real_run, self.calls, self._lock

        def host_function(iface, name, *a, **kw):
            call = real_hf(iface, name, *a, **kw)
            key = f"{iface}.{name}"
            wall, cpu = time.perf_counter, time.thread_time

            def timed_call(store, *args):
                t0, c0 = wall(), cpu()
                try:
                    return call(store, *args)
                finally:
                    dt, dc = wall() - t0, cpu() - c0
                    with lock:
                        rec = calls[key]
                        rec[0] += 1
                        rec[1] += dt
                        rec[2] += dc

            timed_call.__name__ = call.__name__
            return timed_call

        timer = self

        def run(rt, *a, **kw):
            c0 = time.thread_time()
            try:
                return real_run(rt, *a, **kw)
            finally:
                with lock:
                    timer.guest_cpu += time.thread_time() - c0

        # Every entry from wasm into Python is timed around its whole cost, the value
        # conversions (value_codec) included: host functions enter through typed_funcs'
        # callback (``call_entry``, wrapped in a timed callback of its own), resource drops
        # through its ``drop_entry`` (likewise), wasmtime's own resources' drops through
        # wasmtime-py's ``catch_exceptions``.
        import wasmtime.component._linker as wl
        from wasmtime import _ffi as ffi

        import inferlets.host.typed_funcs as tf

        def count(t0: float, c0: float) -> None:
            dt, dc = time.perf_counter() - t0, time.thread_time() - c0
            with lock:
                rec = calls[ENTRIES]
                rec[0] += 1
                rec[1] += dt
                rec[2] += dc

        self._wl, self._tf = wl, tf
        self._real_catch, self._real_call, self._real_drop = wl.catch_exceptions, tf._call, tf._drop
        real_catch, real_entry, real_drop = self._real_catch, tf.call_entry, tf.drop_entry

        def timed(real):
            def entry(*a):
                t0, c0 = time.perf_counter(), time.thread_time()
                try:
                    return real(*a)
                finally:
                    count(t0, c0)

            return entry

        catch_exceptions = timed(real_catch)
        timed_entry, timed_drop = timed(real_entry), timed(real_drop)

        self._timed_call = ffi.wasmtime_component_func_callback_t(timed_entry)  # kept alive
        self._timed_drop = tf._drop_t(timed_drop)
        pw.host_function = host_function
        InferletRuntime.run = run
        wl.catch_exceptions = catch_exceptions
        tf._call = self._timed_call  # runs linked from now on enter through it
        tf._drop = self._timed_drop
        return self

    def __exit__(self, *exc: object) -> None:
        self._pw.host_function = self._real_hf
        self._rt_cls.run = self._real_run
        self._wl.catch_exceptions = self._real_catch
        self._tf._call = self._real_call
        self._tf._drop = self._real_drop

    def snapshot(self) -> tuple[dict[str, tuple[int, float, float]], float]:
        with self._lock:
            return {k: tuple(v) for k, v in self.calls.items()}, self.guest_cpu


def profile(model, rt, wasm: Path, ids: list[int], steps: int, rounds: int) -> dict[str, Any]:
    """Per token at 1 run (a run of ``WARM + steps`` tokens less one of ``WARM``, the
    lower of ``rounds`` pairs by wall time): host calls (count, wall and CPU us each, total
    us), the guest's CPU besides its host calls, the loop thread's CPU, and the wall."""
    best: dict[str, Any] | None = None
    with HostCallTimer() as timer:
        asyncio.run(inferlet(rt, wasm, ids, 1, 4))  # warm-up
        for _ in range(rounds):
            rec = {}
            for length in (WARM, WARM + steps):
                calls0, guest0 = timer.snapshot()
                t0, l0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
                asyncio.run(inferlet(rt, wasm, ids, 1, length))
                t1, l1, p1 = time.perf_counter(), time.thread_time(), time.process_time()
                calls1, guest1 = timer.snapshot()
                diff = {}
                for k, (n1, w1, c1) in calls1.items():
                    n0, w0, c0 = calls0.get(k, (0, 0.0, 0.0))
                    if n1 > n0:
                        diff[k] = (n1 - n0, w1 - w0, c1 - c0)
                rec[length] = (t1 - t0, l1 - l0, p1 - p0, guest1 - guest0, diff)
            wall = (rec[WARM + steps][0] - rec[WARM][0]) / steps
            if best is None or wall < best["wall_us_per_token"] / 1e6:
                short, long = rec[WARM], rec[WARM + steps]
                host_calls = {}
                for k, (n, w, c) in long[4].items():
                    n0, w0, c0 = short[4].get(k, (0, 0.0, 0.0))
                    dn = (n - n0) / steps
                    if dn <= 0:
                        continue
                    host_calls[k] = {
                        "calls_per_token": round(dn, 2),
                        "wall_us_per_token": round((w - w0) / steps * 1e6, 1),
                        "cpu_us_per_token": round((c - c0) / steps * 1e6, 1),
                        "wall_us_per_call": round((w - w0) / (n - n0) * 1e6, 1),
                    }
                entries = host_calls.pop(ENTRIES, None)
                host_calls = dict(sorted(host_calls.items(), key=lambda kv: -kv[1]["wall_us_per_token"]))
                guest_cpu = (long[3] - short[3]) / steps * 1e6
                fn_cpu = sum(v["cpu_us_per_token"] for v in host_calls.values())
                fn_wall = sum(v["wall_us_per_token"] for v in host_calls.values())
                ent_cpu = entries["cpu_us_per_token"] if entries else fn_cpu
                ent_wall = entries["wall_us_per_token"] if entries else fn_wall
                best = {
                    "wall_us_per_token": round(wall * 1e6, 1),
                    "process_cpu_us_per_token": round((long[2] - short[2]) / steps * 1e6, 1),
                    "guest_thread": {
                        "cpu_us_per_token": round(guest_cpu, 1),
                        "in_host_functions_cpu_us": round(fn_cpu, 1),
                        "in_entries_and_value_conversions_cpu_us": round(ent_cpu - fn_cpu, 1),
                        "in_the_wasm_guest_cpu_us": round(guest_cpu - ent_cpu, 1),
                        "in_host_functions_wall_us": round(fn_wall, 1),
                        "in_entries_and_value_conversions_wall_us": round(ent_wall - fn_wall, 1),
                        "in_the_wasm_guest_wall_us": round(wall * 1e6 - ent_wall, 1),
                    },
                    "event_loop_thread_cpu_us_per_token": round((long[1] - short[1]) / steps * 1e6, 1),
                    "host_function_calls_per_token": round(
                        sum(v["calls_per_token"] for v in host_calls.values()), 2
                    ),
                    "host_functions": host_calls,
                }
                if entries is not None:
                    best["wasm_to_python_entries"] = {
                        **entries,
                        "what": "every entry from wasm into Python: the typed callback (arguments "
                        "and result converted by value_codec) around a host function, or a resource drop",
                    }
    assert best is not None
    return best


# -- main -------------------------------------------------------------------------------------


def lock_wasmtime_slabs() -> None:
    """WORKAROUND (a host bug this bench found): wasmtime-py keeps every host function of
    every component linker in one process-wide ``Slab`` (``wasmtime.component._linker.
    FUNCTIONS``) whose ``allocate`` / ``deallocate`` are plain Python, not thread-safe. Runs
    link Pie's world on their own threads (``link_pie_world``, ~hundreds of ``add_func``)
    while finished runs' linkers are freed (``func_finalize`` -> ``deallocate``) on others,
    so concurrent launches now and then corrupt the free list: one run of 32 here died in
    ``Slab.allocate`` (``self.next = cast(int, self.list[idx])``) and the other 31 then
    waited out their deadline; 8 threads allocating and freeing on one ``Slab`` reproduce
    it in seconds (``TypeError: list indices must be integers or slices, not object``).
    It could as well hand two host functions one index. Until the host serialises linking and
    linker release, the bench makes the slabs' two methods atomic under one lock."""
    from wasmtime import _slab

    if getattr(_slab.Slab, "_bench_locked", False):
        return
    lock = threading.Lock()
    allocate, deallocate = _slab.Slab.allocate, _slab.Slab.deallocate

    def locked_allocate(self, val):
        with lock:
            return allocate(self, val)

    def locked_deallocate(self, idx):
        with lock:
            return deallocate(self, idx)

    _slab.Slab.allocate, _slab.Slab.deallocate = locked_allocate, locked_deallocate
    _slab.Slab._bench_locked = True


def machine() -> dict[str, Any]:
    name, flags = platform.processor() or platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = line
    except OSError:
        pass
    return {
        "cpu": name,
        "cores": os.cpu_count(),
        "avx512": "avx512f" in flags,
        "python": platform.python_version(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default="1,32", help="concurrent runs (contexts)")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-real", action="store_true", help="skip the whole tiny model's forward")
    ap.add_argument("--staged", choices=("on", "off", "both"), default="both")
    ap.add_argument("--profile", action="store_true", help="also time every host call (1 run)")
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (see the doc)")
    ap.add_argument(
        "--no-slab-lock",
        action="store_true",
        help="leave wasmtime-py's slabs unlocked (see lock_wasmtime_slabs)",
    )
    ap.add_argument("--label", default="", help="what the figures are (tree, machine), saved with them")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    import torch

    from fixtures.paths import cache_root
    from inferlets import InferletRuntime
    from inferlets.build import build_pie_component
    from inferlets.host.limits import RunLimits

    torch.set_num_threads(args.threads)
    if not args.no_slab_lock:
        lock_wasmtime_slabs()
    counts = [int(c) for c in args.runs.split(",")]
    modes = {"on": (True,), "off": (False,), "both": (False, True)}[args.staged]
    wasm = build_pie_component(PROJECT, cache_root() / "pie-build")
    result: dict[str, Any] = {
        "machine": machine(),
        "torch_threads": args.threads,
        "label": args.label,
        "steps": args.steps,
        "warm": WARM,
        "rounds": args.rounds,
        "prompt": PROMPT,
        "wasmtime_slab_lock": not args.no_slab_lock,
    }
    limits = RunLimits(wall_s=600, fuel=10**12)
    for label, real in [("stand_in", False), *([] if args.no_real else [("tiny_model", True)])]:
        model = load(real, max(counts))
        rt = InferletRuntime(
            {"tiny": model}, cache_root(), limits=limits, max_concurrent_runs=max(64, *counts)
        )
        ids = prompt_ids(model)
        result["prompt_tokens"] = len(ids)
        result[label] = {}
        saved = model.scheduler.overlap
        try:
            for staged in modes:
                model.scheduler.overlap = staged
                key = "staged" if staged else "not_staged"
                for n in counts:
                    where = f"{label}, {key}, {n} runs"
                    row = measure(model, rt, wasm, ids, n, args.steps, args.rounds, where)
                    result[label].setdefault(key, {})[str(n)] = row
                    print(f"{where}: {json.dumps(row)}", flush=True)
            if args.profile:
                model.scheduler.overlap = False
                result[label]["profile_1_run_not_staged"] = prof = profile(
                    model, rt, wasm, ids, args.steps, args.rounds
                )
                print(f"{label}, profile (1 run, not staged): {json.dumps(prof, indent=1)}", flush=True)
        finally:
            model.scheduler.overlap = saved
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"saved in {args.out}")


if __name__ == "__main__":
    main()
