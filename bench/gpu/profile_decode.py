"""Where one decode pass's time goes, at concurrency 32 (issue: CUDA graphs and the decode step).

    python bench/gpu/profile_decode.py [--backend flashinfer] [--concurrency 32] [--cuda-graphs 64] [--out DIR]
    python bench/gpu/profile_decode.py --smoke     # CPU rehearsal: tiny shapes

``--concurrency`` contexts (random Qwen3-VL-2B shapes in bf16 on CUDA, the same checkpoint
as ``bench/gpu/bench.py``) are prefilled with a short prompt each, warmed up for a few
decode passes, then ``--steps`` decode passes (every context one token per pass, the
scheduler batching them) run under ``torch.profiler``. Printed and written as JSON:

* wall ms per pass, and the GPU's busy time per pass (the sum of kernel times): their
  ratio says whether the pass is GPU-bound or host-bound (Python per layer, launches);
* kernel launches and host<->device synchronisations per pass (a sync stalls the host
  until the GPU drains: it removes the overlap that hides launch overhead);
* flashinfer ``plan`` calls per pass (re-planning belongs once per pass and layer kind);
* the top operators by host time and by device time.

The verdict line says whether capturing the decode step in CUDA graphs is worth doing:
launch overhead dominates when the GPU is busy for under half of the pass. With
``--cuda-graphs N`` the same passes replay from graphs (``engine.decode_graphs``): the
before/after pair is ``decode_profile.json`` and ``decode_profile_graphs64.json``. A Chrome trace
(``decode_trace.json``) goes beside the JSON for a closer look.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]

_LAUNCH = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
_SYNC = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",  # the synchronous one; cudaMemcpyAsync is counted below when device->host
)


def _prompt(i: int) -> str:
    return f"Request {i}: describe a picture of a harbour at dusk, with boats and gulls."


async def _decode(model, contexts, steps: int) -> None:
    from engine import Sampler, max_tokens

    async def one(ctx) -> None:
        async for _ in ctx.stream(Sampler.greedy(), max_tokens(steps)):
            pass

    await asyncio.gather(*(one(c) for c in contexts))


async def _ready_contexts(model, concurrency: int, warmup: int, device: str) -> list:
    """``concurrency`` contexts, each prompted, prefilled and ``warmup`` tokens into a
    decode (JIT, allocator, plans: off the record)."""
    from engine import Context

    contexts = [Context(model) for _ in range(concurrency)]
    for i, ctx in enumerate(contexts):
        ctx.user(_prompt(i)).cue()
    await asyncio.gather(*(c.flush() for c in contexts))
    await _decode(model, contexts, warmup)
    if device == "cuda":
        torch.cuda.synchronize()
    return contexts


def profile(model, concurrency: int, steps: int, warmup: int, device: str, trace: Path | None) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    async def go() -> dict:
        contexts = await _ready_contexts(model, concurrency, warmup, device)
        try:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
            # The passes run on the model's forward worker thread, and the profiler records
            # host ops on the thread that starts it: make, start and stop it there.
            worker = model.scheduler._executor
            loop = asyncio.get_running_loop()

            def start():
                p = torch_profile(activities=activities, record_shapes=False)
                p.start()
                return p

            prof = await loop.run_in_executor(worker, start)
            passes0 = model.runner.passes
            plans0 = getattr(model.runner.backend, "plans", 0)
            t0 = time.perf_counter()
            await _decode(model, contexts, steps)
            if device == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            passes = model.runner.passes - passes0
            plans = getattr(model.runner.backend, "plans", 0) - plans0
            await loop.run_in_executor(worker, prof.stop)
        finally:
            for c in contexts:
                c.close()
        return _summarise(prof, wall, passes, plans, concurrency, device, trace)

    return asyncio.run(go())


def _summarise(
    prof, wall: float, passes: int, plans: int, concurrency: int, device: str, trace: Path | None
) -> dict:
    events = prof.events()
    per = max(passes, 1)
    launches = sum(1 for e in events if e.name in _LAUNCH)
    syncs = sum(1 for e in events if e.name in _SYNC)
    d2h = sum(1 for e in events if e.name == "cudaMemcpyAsync")  # D2H among these syncs the host
    kernel_us = 0.0
    if device == "cuda":
        for e in events:
            if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
                kernel_us += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    averages = prof.key_averages()
    host_top = sorted(averages, key=lambda a: a.self_cpu_time_total, reverse=True)[:15]
    dev_attr = (
        "self_device_time_total" if hasattr(averages[0], "self_device_time_total") else "self_cuda_time_total"
    )
    dev_top = (
        sorted(averages, key=lambda a: getattr(a, dev_attr, 0.0), reverse=True)[:15]
        if device == "cuda"
        else []
    )
    wall_ms = 1e3 * wall / per
    busy_ms = kernel_us / 1e3 / per
    result = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "concurrency": concurrency,
        "passes": passes,
        "wall_ms_per_pass": wall_ms,
        "gpu_busy_ms_per_pass": busy_ms if device == "cuda" else None,
        "gpu_busy_fraction": (busy_ms / wall_ms) if device == "cuda" and wall_ms else None,
        "kernel_launches_per_pass": launches / per,
        "syncs_per_pass": syncs / per,
        "memcpy_async_per_pass": d2h / per,
        "flashinfer_plans_per_pass": plans / per,
        "tokens_per_s": concurrency * passes / wall if wall else 0.0,
        "top_host_ops": [
            {"op": a.key, "calls": a.count, "self_host_ms": a.self_cpu_time_total / 1e3} for a in host_top
        ],
        "top_device_ops": [
            {"op": a.key, "calls": a.count, "self_device_ms": getattr(a, dev_attr, 0.0) / 1e3}
            for a in dev_top
        ],
    }
    if device == "cuda":
        frac = result["gpu_busy_fraction"] or 0.0
        result["verdict"] = (
            f"host-bound: the GPU is busy {frac:.0%} of a pass; launch/Python overhead dominates, "
            "capturing the decode step in CUDA graphs should pay"
            if frac < 0.5
            else f"GPU-bound: the GPU is busy {frac:.0%} of a pass; CUDA graphs would save little"
        )
    else:
        result["verdict"] = "CPU rehearsal: no device time to compare (run on a GPU for the verdict)"
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    return result


def print_table(r: dict) -> None:
    print(
        f"\ndecode at concurrency {r['concurrency']} on {r['device']}: {r['passes']} passes, "
        f"{r['wall_ms_per_pass']:.2f} ms per pass, {r['tokens_per_s']:.0f} tokens/s"
    )
    if r["gpu_busy_ms_per_pass"] is not None:
        print(
            f"  GPU busy {r['gpu_busy_ms_per_pass']:.2f} ms per pass ({r['gpu_busy_fraction']:.0%} of the wall)"
        )
    print(
        f"  per pass: {r['kernel_launches_per_pass']:.0f} kernel launches, {r['syncs_per_pass']:.1f} host syncs, "
        f"{r['memcpy_async_per_pass']:.1f} async copies, {r['flashinfer_plans_per_pass']:.1f} flashinfer plans"
    )
    print("  top host ops (self ms over the run):")
    for a in r["top_host_ops"][:10]:
        print(f"    {a['self_host_ms']:9.2f}  x{a['calls']:<6} {a['op'][:70]}")
    if r["top_device_ops"]:
        print("  top device ops (self ms over the run):")
        for a in r["top_device_ops"][:10]:
            print(f"    {a['self_device_ms']:9.2f}  x{a['calls']:<6} {a['op'][:70]}")
    print(f"  verdict: {r['verdict']}")


def breakdown(model, concurrency: int, steps: int, device: str) -> dict:
    """Without the profiler: milliseconds per decode pass in each host phase that
    ``engine.step_timing`` names (both threads), and the wall time per pass, at this
    concurrency (prefill and a warm-up first, off the record)."""
    from engine.step_timing import TIMING

    async def go() -> dict:
        contexts = await _ready_contexts(model, concurrency, 3, device)
        try:
            passes0 = model.scheduler.stats.passes
            with TIMING.recording():
                t0 = time.perf_counter()
                await _decode(model, contexts, steps)
                if device == "cuda":
                    torch.cuda.synchronize()
                wall = time.perf_counter() - t0
            passes = model.scheduler.stats.passes - passes0
        finally:
            for c in contexts:
                c.close()
        out = {"wall_ms_per_pass": round(1e3 * wall / max(1, passes), 4), "passes": passes}
        out.update(TIMING.per_pass(passes))
        return out

    return asyncio.run(go())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU rehearsal: tiny shapes, few steps")
    ap.add_argument(
        "--backend", default=None, help="attention backend (default flashinfer on CUDA, torch else)"
    )
    ap.add_argument(
        "--concurrency", type=int, default=None, help="contexts decoding at once (default 32; smoke 4)"
    )
    ap.add_argument("--steps", type=int, default=None, help="decode passes profiled (default 16; smoke 3)")
    ap.add_argument(
        "--cuda-graphs", type=int, default=0, help="replay decode passes from CUDA graphs (max batch; 0 off)"
    )
    ap.add_argument(
        "--checkpoint-dir", type=Path, default=None, help="build the checkpoint here once and reuse it"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args(argv)

    from bench.gpu.bench import checkpoint_dir
    from engine import Model

    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    backend = args.backend or ("flashinfer" if cuda else "torch")
    concurrency = args.concurrency or (32 if cuda else 4)
    steps = args.steps or (16 if cuda else 3)
    args.out.mkdir(parents=True, exist_ok=True)
    with checkpoint_dir(args.checkpoint_dir, smoke=not cuda, device=device, dtype=dtype) as path:
        graphs = args.cuda_graphs if cuda else 0
        model = Model.load(
            path,
            device=device,
            dtype=dtype,
            attention=backend,
            kv_pages=256 if cuda else 64,
            cuda_graphs=graphs,
        )
        tag = f"_graphs{graphs}" if graphs else ""
        result = profile(
            model, concurrency, steps, warmup=3, device=device, trace=args.out / f"decode_trace{tag}.json"
        )
        result["breakdown_ms_per_pass"] = {}
        default_overlap = model.scheduler.overlap
        for c in sorted({1, concurrency}):  # issue 33 part 1: where a step goes, at 1 and 32
            for overlap in (True, False):
                model.scheduler.overlap = overlap
                key = f"{c}" if overlap else f"{c} no-overlap"
                result["breakdown_ms_per_pass"][key] = breakdown(model, c, steps * 2, device)
        model.scheduler.overlap = default_overlap
    result.update(
        backend=backend,
        cuda_graphs=graphs,
        dtype=str(dtype),
        shapes="Qwen3-VL-2B" if cuda else "tiny (smoke)",
    )
    print_table(result)
    for key, rows in result["breakdown_ms_per_pass"].items():
        print(f"\nwhere a pass goes (ms per pass), concurrency {key}:")
        for name, ms in rows.items():
            print(f"    {name:60} {ms}")
    out = args.out / (f"decode_profile{tag}.json" if cuda else "decode_profile_smoke.json")
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    code = main()
    # The profiler (kineto), started on the forward worker's thread, can leave a joinable
    # std::thread behind, and at interpreter teardown libstdc++ then aborts the process
    # ("terminate called without an active exception", seen in the dry run on a busy 2-core
    # machine) after everything is written. Everything is written: leave without teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
