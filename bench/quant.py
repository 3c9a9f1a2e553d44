"""Weight quantization on the CPU: decode tok/s, prefill s, RSS, weight bytes and logits
agreement for float32, int8, int4 and an FP8 checkpoint (dequantized), one run; and the
same checkpoint run in bfloat16 (weights identical: the checkpoint is stored in bfloat16,
so only the activations' rounding differs) as the yardstick for how far this random
28-layer stack carries a rounding as small as the dtype Qwen serves in.

The checkpoint is the random Qwen3-VL-2B-shaped one of ``bench/gpu/bench.py`` (text:
hidden 2048, 28 layers, MLP 6144, vocabulary 151936 tied; the 24-block vision tower),
built once in bfloat16 into ``.cache/bench-quant/`` (``--hidden/--layers/--intermediate``
for a smaller shape), and its FP8 copy written by ``fixtures.fp8_checkpoint``. Each
variant runs in its own child process (so RSS is that variant's own), one after the
other: load, prefill of a 448x448 image plus prompt, greedy decode of ``--tokens``
tokens, and the all-row logits of a text prompt, compared with float32's (cosine, max
|error| / max |logit|, top-1 agreement) plus whether the greedy tokens after the image
match. Prints ratios against float32 and the issue's aims (int8 >= 3x, int4 >= 5x decode;
cosine >= 0.999 / 0.99), and the bytes-per-token arithmetic: the weights one decode step
reads and the tok/s they allow at float32's measured bytes/s. ``--json`` writes it all.

    python bench/quant.py [--tokens 16] [--json bench/results/quant_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(ROOT)] + [
    p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent
]

import engine  # noqa: F401, I001 - first: its OpenMP wait settings precede torch (engine/openmp_wait.py)
import torch

VARIANTS = ("float32", "bfloat16", "int8", "int4", "fp8-checkpoint")
PROMPT = "Describe this image in detail."
TEXT = "The quick brown fox jumps over the lazy dog while the cat watches from the window sill. " * 2
AIMS = {"int8": (3.0, 0.999), "int4": (5.0, 0.99)}


def build(keep: Path, shape: dict[str, int] | None) -> tuple[Path, Path]:
    """(float checkpoint, FP8 checkpoint), built once into ``keep``."""
    import bench.gpu.bench as gpu_bench
    from fixtures.build_step import build_once
    from fixtures.fp8_checkpoint import write_fp8_checkpoint

    text = dict(gpu_bench.TEXT_2B)
    if shape:
        text.update(shape)
    tag = "2b" if not shape else "-".join(f"{k[0]}{v}" for k, v in sorted(shape.items()))

    def write_float(out: Path) -> None:
        saved, saved_vision = dict(gpu_bench.TEXT_2B), dict(gpu_bench.VISION_2B)
        gpu_bench.TEXT_2B.update(text)
        gpu_bench.VISION_2B["out_hidden_size"] = text["hidden_size"]
        try:
            gpu_bench.build_checkpoint(out, smoke=False, device="cpu", dtype=torch.bfloat16)
        finally:
            gpu_bench.TEXT_2B.clear()
            gpu_bench.TEXT_2B.update(saved)
            gpu_bench.VISION_2B.update(saved_vision)

    float_dir = build_once(keep / f"qwen3vl-{tag}-bf16", "1", write_float)
    fp8_dir = build_once(keep / f"qwen3vl-{tag}-fp8", "1", lambda out: write_fp8_checkpoint(float_dir, out))
    return float_dir, fp8_dir


def image_bytes(seed: int) -> bytes:
    import io

    import numpy as np
    from PIL import Image as PILImage

    pixels = np.random.default_rng(seed).integers(0, 256, (448, 448, 3), dtype=np.uint8)
    buf = io.BytesIO()
    PILImage.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def weight_bytes(model) -> dict[str, int]:
    """Bytes of every parameter and buffer, and of what one decode step reads (the language
    model's layers and the LM head; not the embedding table, which is indexed)."""
    hf = model.hf
    seen: set[int] = set()

    def total(mod, skip_embed: bool = False) -> int:
        n = 0
        for name, t in list(mod.named_parameters()) + list(mod.named_buffers()):
            if t is None or id(t) in seen or (skip_embed and "embed" in name):
                continue
            seen.add(id(t))
            n += t.numel() * t.element_size()
        return n

    decode = total(model.arch.language_model, skip_embed=True) + total(hf.lm_head)
    seen.clear()
    return {"all": total(hf), "decode_step": decode}


def run_variant(variant: str, path: Path, tokens: int, out: Path) -> None:
    """One variant in this (child) process: figures to ``out``.json, logits to ``out``.pt."""
    import psutil

    from engine import Model, Sampler, SyncContext, max_tokens
    from media import Image

    proc = psutil.Process()
    t0 = time.perf_counter()
    quant = variant if variant in ("int8", "int4") else None
    dtype = torch.bfloat16 if variant == "bfloat16" else torch.float32
    model = Model.load(path, device="cpu", dtype=dtype, quantization=quant, kv_pages=64)
    load_s = time.perf_counter() - t0
    rss_loaded = proc.memory_info().rss

    def prefill(seed: int) -> tuple[SyncContext, float]:
        # A new image each time: the vision tower runs (as in a real request) and no KV page
        # or encoder-cache entry of an earlier prefill is reused.
        ctx = SyncContext(model).user(Image.from_bytes(image_bytes(seed)), PROMPT).cue()
        t = time.perf_counter()
        ctx.flush()
        return ctx, time.perf_counter() - t

    warm, _ = prefill(0)  # kernels and allocator warm
    warm.generate(Sampler.greedy(), max_tokens(2))
    warm.close()
    prefill_s = []
    for seed in (1, 2):
        c, s = prefill(seed)
        prefill_s.append(s)
        c.close()
    decode_s = []
    for seed in (3, 3):
        ctx, _ = prefill(seed)
        ctx.generate(Sampler.greedy(), max_tokens(1))  # the first token: head over the kept state
        t = time.perf_counter()
        generated = ctx.generate(Sampler.greedy(), max_tokens(tokens)).tokens
        decode_s.append(time.perf_counter() - t)
        ctx.close()
    decode_s = [min(decode_s)]
    text = SyncContext(model).user(TEXT).cue()
    logits = text.flush(return_logits=True)
    text.close()
    torch.save({"logits": logits, "tokens": generated}, out.with_suffix(".pt"))
    figures = {
        "variant": variant,
        "quantization": model.quantization,
        "load_s": load_s,
        "prefill_s": min(prefill_s),
        "decode_tok_s": len(generated) / decode_s[0],
        "decode_tokens": len(generated),
        "rss_bytes": max(rss_loaded, proc.memory_info().rss),
        "weight_bytes": weight_bytes(model),
        "threads": torch.get_num_threads(),
    }
    out.with_suffix(".json").write_text(json.dumps(figures))


def layer_rows(device: str, iters: int) -> dict[str, dict]:
    """Per 2B layer shape (q_proj 2048x2048, gate/up 6144x2048, down 2048x6144) and method:
    the kernel the layer picked on ``device`` after its first call (a CUDA kernel that raises
    or disagrees falls back to dequantize + matmul; an unavailable one is never tried),
    ms per call at 1 row (decode) and 256 rows (prefill), and the relative error against the
    float layer. "fp8" is ``--quantization fp8`` (per-row W8A8, torch's row-wise scaled
    matmul), "fp8-block" the FP8 checkpoints' layers (1x128 x 128x128 blocks). Runs on CUDA in
    bench/gpu/check.sh (beside bfloat16: the figures behind refusing int8/int4 there and the
    fp8 aims of bench/gpu/aims.py); on the CPU as a rehearsal."""
    from engine.quantization import (
        Fp8BlockLinear,
        Fp8RowwiseLinear,
        Int4WeightOnlyLinear,
        Int8WeightOnlyLinear,
    )

    dev = torch.device(device)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    builders = {
        "int8": Int8WeightOnlyLinear,
        "int4": Int4WeightOnlyLinear,
        "fp8": Fp8RowwiseLinear,
        "fp8-block": Fp8BlockLinear.from_linear,
    }

    def timed(fn, x) -> float:
        for _ in range(2):
            fn(x)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            fn(x)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t) / iters * 1e3

    out: dict[str, dict] = {}
    torch.manual_seed(0)
    for n, k in ((2048, 2048), (6144, 2048), (2048, 6144)):
        lin = torch.nn.Linear(k, n, bias=False).to(dev, dt).eval()
        x1, x256 = torch.randn(1, k, device=dev, dtype=dt), torch.randn(256, k, device=dev, dtype=dt)
        with torch.no_grad():
            row = {"float": {"ms_1": timed(lin, x1), "ms_256": timed(lin, x256)}}
            ref = lin(x1).float()
            for method, build_layer in builders.items():
                layer = build_layer(lin)  # fp8-block off CUDA: dequantize + matmul
                got = layer(x1).float()
                row[method] = {
                    "kernel": layer.kernel,
                    "ms_1": timed(layer, x1),
                    "ms_256": timed(layer, x256),
                    "rel_err": ((got - ref).norm() / ref.norm()).item(),
                }
        out[f"{n}x{k}"] = row
        print(f"{n}x{k} on {device} ({str(dt).removeprefix('torch.')} float):", flush=True)
        for method, r in row.items():
            extra = f"  kernel {r['kernel']:8s} rel err {r['rel_err']:.4f}" if "kernel" in r else ""
            print(
                f"  {method:9s} 1 row {r['ms_1']:7.3f} ms  256 rows {r['ms_256']:7.3f} ms{extra}", flush=True
            )
    return out


def agreement(got: dict, ref: dict) -> dict[str, float]:
    a, b = got["logits"].double(), ref["logits"].double()
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()
    return {
        "cosine": cos,
        "max_rel_err": ((a - b).abs().max() / b.abs().max()).item(),
        "top1": (a.argmax(-1) == b.argmax(-1)).double().mean().item(),
        "greedy_prefix_match": next(
            (i for i, (x, y) in enumerate(zip(got["tokens"], ref["tokens"], strict=False)) if x != y),
            min(len(got["tokens"]), len(ref["tokens"])),
        ),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16, help="greedy tokens timed per variant")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--hidden", type=int, default=None, help="smaller text hidden size (default: 2B's 2048)")
    ap.add_argument("--layers", type=int, default=None, help="fewer text layers (default: 2B's 28)")
    ap.add_argument("--intermediate", type=int, default=None, help="MLP width (default: 2B's 6144)")
    ap.add_argument("--cache", type=Path, default=ROOT / ".cache" / "bench-quant")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    ap.add_argument(
        "--layers-only", action="store_true", help="only the per-layer kernel rows (check.sh on CUDA)"
    )
    ap.add_argument("--device", default=None, help="for --layers-only (default: CUDA when available)")
    ap.add_argument("--child", nargs=3, metavar=("VARIANT", "PATH", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        run_variant(args.child[0], Path(args.child[1]), args.tokens, Path(args.child[2]))
        return 0
    if args.layers_only:
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        rows = layer_rows(device, iters=50 if device.startswith("cuda") else 3)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            name = torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu"
            report = {"device": device, "device_name": name, "torch": torch.__version__, "layers": rows}
            args.json.write_text(json.dumps(report, indent=2) + "\n")
        return 0

    shape = {
        k: v
        for k, v in (
            ("hidden_size", args.hidden),
            ("num_hidden_layers", args.layers),
            ("intermediate_size", args.intermediate),
        )
        if v is not None
    }
    t = time.perf_counter()
    float_dir, fp8_dir = build(args.cache, shape or None)
    print(f"checkpoints ready in {time.perf_counter() - t:.0f} s: {float_dir.name}, {fp8_dir.name}")
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants.split(","):
            path = fp8_dir if variant == "fp8-checkpoint" else float_dir
            out = Path(tmp) / variant
            cmd = [
                sys.executable,
                __file__,
                "--tokens",
                str(args.tokens),
                "--child",
                variant,
                str(path),
                str(out),
            ]
            subprocess.run(cmd, check=True, env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"})
            results[variant] = json.loads(out.with_suffix(".json").read_text())
            results[variant]["_data"] = torch.load(out.with_suffix(".pt"))
            r = results[variant]
            print(
                f"{variant:15s} decode {r['decode_tok_s']:6.2f} tok/s  prefill {r['prefill_s']:6.2f} s  "
                f"RSS {r['rss_bytes'] / 2**30:5.2f} GiB  weights {r['weight_bytes']['all'] / 2**30:5.2f} GiB "
                f"(decode step reads {r['weight_bytes']['decode_step'] / 2**30:5.2f} GiB)",
                flush=True,
            )
    ref = results.get("float32")
    report = {"shape": shape or "2B", "tokens": args.tokens, "variants": {}}
    print()
    data = {variant: r.pop("_data") for variant, r in results.items()}
    for variant, r in results.items():
        if ref is not None and variant != "float32":
            r["agreement"] = agreement(data[variant], data["float32"])
        report["variants"][variant] = r
    if ref is not None:
        f_tps, f_bytes = ref["decode_tok_s"], ref["weight_bytes"]["decode_step"]
        bandwidth = f_tps * f_bytes
        print(
            f"float32 decode reads {f_bytes / 1e9:.2f} GB/token at {f_tps:.2f} tok/s: {bandwidth / 1e9:.1f} GB/s"
        )
        for variant, r in report["variants"].items():
            if variant == "float32":
                continue
            ratio = r["decode_tok_s"] / f_tps
            ceiling = bandwidth / r["weight_bytes"]["decode_step"]
            agr = r.get("agreement", {})
            aim = AIMS.get(variant)
            aim_txt = f"  aims {aim[0]:.0f}x / cosine {aim[1]}" if aim else ""
            r["decode_ratio_vs_float32"] = ratio
            r["bandwidth_ceiling_tok_s"] = ceiling
            print(
                f"{variant:15s} decode {ratio:5.2f}x float32 (bytes/token ceiling at float32's GB/s: "
                f"{ceiling:6.2f} tok/s = {ceiling / f_tps:4.1f}x), prefill {r['prefill_s'] / ref['prefill_s']:4.2f}x "
                f"the time; cosine {agr.get('cosine', float('nan')):.5f}, max rel err "
                f"{agr.get('max_rel_err', float('nan')):.4f}, top-1 {agr.get('top1', float('nan')):.3f}, greedy "
                f"tokens equal for {agr.get('greedy_prefix_match')}/{args.tokens}{aim_txt}"
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
