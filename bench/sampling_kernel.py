"""The CPU sampling kernel (engine.sampling_kernel): ms per row, this tree's beside a baseline.

    python -m bench.sampling_kernel [--rounds 15] [--baseline f310bd1] [--out PATH]

Rows of 151,936 float32 logits (the tiny Qwen3-VL vocabulary): "flat" ones shaped like the
tiny model's (random weights: N(0, 0.16), so top-p 0.9 keeps ~130k tokens, the worst case
for the kernel), "peaked" ones (N(0, 3) with a few tokens 12 above, as a trained model's)
and "masked" ones (peaked, with 1% of the tokens at -100 as a logit bias bans them and 1%
at -inf).
Per sampler kind (temperature only, top-k, top-p, min-p, top-k with top-p) and batch (1 and
32 rows in one call), the best of ``--rounds`` calls of ``sample_rows`` (the whole call: the
float32 view, the extremes, the kernel), this tree's and the baseline's alternated in the
same process, so both see the same load on a shared machine (and, for a batch this tree
splits over two threads, also this tree's on one thread: ``one_thread_*``, its CPU cost).
The baseline is the kernel
file as of a git commit (``git show``), compiled here without numba's cache. Also: numpy's
argmax of the same rows (what a greedy row costs), and whether both kernels drew the same
tokens for the same uniforms (they must).

``--stages`` also times each stage of one flat top-p row in this tree's kernel.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [str(Path(__file__).resolve().parents[1])] + [
    p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent
]

import argparse
import importlib.util
import json
import platform
import subprocess
import tempfile
import time
from types import ModuleType

import numpy as np
import torch

VOCAB = 151_936
ROOT = Path(__file__).resolve().parents[1]
SAMPLERS = {  # temperature, top_k, top_p, min_p
    "temperature": (0.8, 0, 1.0, 0.0),
    "top_k_50": (0.8, 50, 1.0, 0.0),
    "top_p_0.9": (0.8, 0, 0.9, 0.0),
    "min_p_0.05": (1.0, 0, 1.0, 0.05),
    "top_k_5000_top_p_0.5": (0.7, 5000, 0.5, 0.0),
}


def _git_show(commit: str, path: str) -> str | None:
    r = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, text=True)
    return r.stdout if r.returncode == 0 else None


def _load(name: str, source: str, folder: Path) -> ModuleType:
    path = folder / f"{name}.py"
    path.write_text(source.replace("cache=True", "cache=False"))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def baseline(commit: str) -> ModuleType:
    """engine/sampling_kernel.py as of ``commit``, imported from a temporary file, with its
    numba kernels as of the same commit (engine/sampling_kernel_jit.py, where it has one:
    without this the baseline would run this tree's kernels)."""
    source = _git_show(commit, "engine/sampling_kernel.py")
    assert source is not None, f"no engine/sampling_kernel.py at {commit}"
    folder = Path(tempfile.mkdtemp(prefix="pie-bench-kernel-"))
    jit_source = _git_show(commit, "engine/sampling_kernel_jit.py")
    if jit_source is not None:
        jit_name = f"sampling_kernel_jit_{commit}"
        _load(jit_name, jit_source, folder)
        source = source.replace("from engine import sampling_kernel_jit as k", f"import {jit_name} as k")
    module = _load(f"sampling_kernel_{commit}", source, folder)
    assert module.available(), "the baseline kernel did not compile"
    return module


def rows(kind: str, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "flat":
        return torch.randn(n, VOCAB, generator=g) * 0.16
    x = torch.randn(n, VOCAB, generator=g) * 3.0
    top = torch.randint(0, VOCAB, (n, 8), generator=g)
    x = x.scatter_add(1, top, torch.full((n, 8), 12.0))
    if kind == "masked":  # 1% banned by a logit bias of -100, 1% masked to -inf
        pick = torch.rand(n, VOCAB, generator=g)
        x = torch.where(pick < 0.01, x - 100.0, torch.where(pick > 0.99, float("-inf"), x))
    return x


def call(module: ModuleType, x: torch.Tensor, sampler: tuple, u: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    t, k, p, m = sampler
    return module.sample_rows(
        x, np.full(n, t, np.float32), np.full(n, k, np.int64), np.full(n, p), np.full(n, m), u
    )


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def compare(new: ModuleType, old: ModuleType, rounds: int) -> dict:
    out: dict = {}
    same = True
    for kind in ("flat", "peaked", "masked"):
        for batch in (1, 32):
            x = rows(kind, batch, seed=batch)
            xn = x.numpy()
            u = np.random.default_rng(batch).random(batch)
            argmax = min(timed(xn.argmax, 1) for _ in range(rounds))
            out[f"{kind}@{batch}:numpy_argmax_ms_per_row"] = round(argmax / batch * 1e3, 4)
            for name, sampler in SAMPLERS.items():
                same &= bool(np.array_equal(call(new, x, sampler, u), call(old, x, sampler, u)))
                best_new = best_old = best_one = float("inf")
                split = new.SPLIT_ROWS
                for _ in range(rounds):
                    best_old = min(best_old, timed(call, old, x, sampler, u))
                    best_new = min(best_new, timed(call, new, x, sampler, u))
                    if batch >= split:
                        new.SPLIT_ROWS = batch + 1
                        best_one = min(best_one, timed(call, new, x, sampler, u))
                        new.SPLIT_ROWS = split
                key = f"{kind}@{batch}:{name}"
                out[key] = {
                    "baseline_ms_per_row": round(best_old / batch * 1e3, 4),
                    "ms_per_row": round(best_new / batch * 1e3, 4),
                    "speedup": round(best_old / best_new, 2),
                }
                if batch >= split:
                    out[key]["one_thread_ms_per_row"] = round(best_one / batch * 1e3, 4)
                    out[key]["one_thread_speedup"] = round(best_old / best_one, 2)
                print(f"{key:40} {out[key]}", flush=True)
    out["same_tokens_as_baseline"] = same
    return out


def stages(new: ModuleType, old: ModuleType, rounds: int) -> dict:
    """Each stage of one flat 151,936-token top-p row (temperature 0.8, top-p 0.9), hot in
    cache, best of ``rounds`` (ms): this tree's, and f310bd1's (its stages' signatures)."""
    x = rows("flat", 1, seed=1)[0].numpy()
    temp = np.float32(0.8)
    v = x.shape[0]
    e, bins, idx = np.empty(v, np.float32), np.empty(v, np.uint16), np.empty(v, np.int64)
    hits, hm, hc = np.empty(v // 64 + 1, np.uint16), np.empty(4096), np.empty(4096, np.int64)
    mass = np.empty((v + 255) // 256)

    def best(fn) -> float:
        return round(min(timed(fn) for _ in range(rounds)) * 1e3, 4)

    k = new._get()
    bits = x.view(np.int32)
    ours = {"extremes (max, min, NaN)": best(lambda: k["extremes"](bits))}
    mx, mn = (np.float32(v) for v in k["extremes"](bits)[:2])
    ours["prepare (exps, histogram)"] = best(
        lambda: k["prepare"](x, bits, mx, mn, temp, e, bins, hm, hc, hits, True, False)
    )
    inv_w = k["prepare"](x, bits, mx, mn, temp, e, bins, hm, hc, hits, True, False)
    ours["cut (top-p)"] = best(lambda: k["cut"](x, temp, 0, 0.9, 0.0, inv_w, e, bins, hm, hc, idx, hits))
    cb, ct, ci, ids, vals = k["cut"](x, temp, 0, 0.9, 0.0, inv_w, e, bins, hm, hc, idx, hits)
    ours["mark (the cut bin's dropped tokens)"] = best(
        lambda: k["mark"](x, temp, bins, cb, ct, ci, ids, vals, idx, hits)
    )
    ours["draw (block sums, walk)"] = best(lambda: k["draw"](x, temp, e, bins, cb, ct, ci, 0.5, mass))
    out = {"this tree": ours}
    try:  # the baseline's stages, where they have f310bd1's signatures
        k = old._get()
        theirs = {"numpy max + min": best(lambda: (x.max(), x.min()))}
        mx, mn = x.max(), x.min()
        theirs["prepare (exps, histogram)"] = best(
            lambda: k["prepare"](x, mx, mn, temp, e, bins, hm, hc, True, False)
        )
        inv_w = k["prepare"](x, mx, mn, temp, e, bins, hm, hc, True, False)
        theirs["cut (top-p)"] = best(lambda: k["cut"](x, temp, 0, 0.9, 0.0, inv_w, e, bins, hm, hc, idx))
        cb, ct, ci = k["cut"](x, temp, 0, 0.9, 0.0, inv_w, e, bins, hm, hc, idx)
        theirs["draw (block sums, walk)"] = best(lambda: k["draw"](x, temp, e, bins, cb, ct, ci, 0.5, mass))
        out["baseline"] = theirs
    except Exception as error:  # another baseline: its stages differ
        out["baseline"] = f"not timed ({type(error).__name__})"
    for who, figures in out.items():
        print(f"  {who}: {figures}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--baseline", default="f310bd1", help="git commit of the kernel to compare with")
    parser.add_argument("--stages", action="store_true", help="also time each stage of a flat top-p row")
    parser.add_argument("--machine", default=f"{platform.processor() or platform.machine()}")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from engine import sampling_kernel

    assert sampling_kernel.available(), "numba kernel unavailable"
    old = baseline(args.baseline)
    result: dict = {"machine": args.machine, "label": args.label, "baseline": args.baseline, "vocab": VOCAB}
    result["ms_per_row"] = compare(sampling_kernel, old, args.rounds)
    if args.stages:
        result["stages_ms"] = stages(sampling_kernel, old, args.rounds)
    print(json.dumps(result, indent=2))
    if args.out:
        path = Path(args.out)
        saved = json.loads(path.read_text()) if path.exists() else {}
        saved[args.label or "latest"] = result
        path.write_text(json.dumps(saved, indent=2) + "\n")


if __name__ == "__main__":
    main()
