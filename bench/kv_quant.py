"""KV-cache dtypes (``Model.load(kv_dtype=...)``): decode tok/s at a long context, bytes
per KV row, rows a fixed budget holds, and logits agreement with the float KV, one run.

Per kv dtype (float32 / bfloat16 / int8 / fp8_e4m3 on the CPU; bfloat16 and fp8_e4m3 on
CUDA, where fp8 runs through flashinfer): ``--batch`` contexts of ``--context`` random
token ids are prefilled, then decoded together greedily for ``--tokens`` steps (timed:
tok/s over all contexts). Agreement: the last decode step's logits of context 0 against
the first kv dtype's (cosine, max |err| / max |logit|) and whether the greedy tokens are
the same. Ratios are printed against the first kv dtype listed. ``bench/gpu/check.sh`` runs
bfloat16 against fp8_e4m3 at 8 contexts x 8192 rows on the 2B checkpoint (issue 33's fp8-KV
row; ``bench/gpu/aims.py`` reads its JSON), and in ``--dry-run`` the same comparison on the
tiny model at 8 x 512 rows on the CPU.

Checkpoint: the random Qwen3-VL-shaped ones of ``bench/quant.py`` (8 kv heads x 128,
so 8 KiB of float32 K+V per row and layer): by default the small one (hidden 256, 2
layers, MLP 512) where, at 8k rows, K/V reads are as large as the weight reads;
``--checkpoint-dir``: the random 2B one of ``bench/gpu/bench.py`` (built there once if
absent; ``bench/gpu/check.sh`` passes its shared folder on CUDA);
``--smoke``: the tiny fixture model.

    python bench/kv_quant.py [--context 8192] [--batch 2] [--json bench/results/kv_quant_cpu.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(ROOT)] + [
    p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent
]

import torch

SMALL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2}
BUDGET = 1 << 30


def checkpoint(args: argparse.Namespace, stack: contextlib.ExitStack) -> Path:
    if args.checkpoint_dir is not None:  # the 2B one of bench/gpu/bench.py, built there once
        from bench.gpu.bench import checkpoint_dir

        dtype = getattr(torch, args.dtype)
        return stack.enter_context(
            checkpoint_dir(args.checkpoint_dir, smoke=False, device=args.device, dtype=dtype)
        )
    if args.smoke:
        from fixtures.tiny_models import ensure_tiny_model

        return ensure_tiny_model("tiny-qwen3-vl")
    from bench.quant import build

    return build(ROOT / ".cache" / "bench-quant", SMALL)[0]


def run_one(path: Path, kv: str, args: argparse.Namespace) -> dict:
    from engine import Model, Sampler, SyncContext, max_tokens

    dtype = getattr(torch, args.dtype)
    rows = args.batch * (args.context + args.tokens + 2)
    model = Model.load(
        path,
        device=args.device,
        dtype=dtype,
        kv_dtype=kv,
        attention=args.attention,
        page_size=16,
        kv_pages=-(-rows // 16) + 8 * args.batch,
        max_prefill_rows=4096,
    )
    pool = model.pool_stats()
    vocab = model.arch.vocab_size
    gen = torch.Generator().manual_seed(0)
    ctxs = []
    for _ in range(args.batch):
        ids = torch.randint(100, min(vocab, 100_000), (args.context,), generator=gen).tolist()
        ctxs.append(SyncContext(model).fill_tokens(ids))
    t = time.perf_counter()
    for c in ctxs:
        c.flush()
    prefill_s = time.perf_counter() - t
    import asyncio

    async def decode(n: int) -> list[list[int]]:
        gens = [c.ctx.generate(Sampler.greedy(), max_tokens(n)) for c in ctxs]
        return [g.tokens for g in await asyncio.gather(*gens)]

    asyncio.run(decode(1))  # warm: the first token of each, from the prefill's state
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    t = time.perf_counter()
    tokens = asyncio.run(decode(args.tokens))
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    decode_s = time.perf_counter() - t
    logits = ctxs[0].next_token_logits().float().cpu()
    for c in ctxs:
        c.close()
    out = {
        "kv_dtype": pool.kv_dtype,
        "attention": model.attention_backend,
        "bytes_per_row": pool.bytes_per_page / pool.page_size,
        "rows_per_GiB": BUDGET // pool.bytes_per_page * pool.page_size,
        "prefill_s": prefill_s,
        "decode_tok_s": sum(len(t) for t in tokens) / decode_s,
        "tokens": tokens[0],
        "_logits": logits,
    }
    del model
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--kv-dtypes", default=None, help="comma-separated (default CPU: float32,bfloat16,int8,fp8_e4m3)"
    )
    ap.add_argument("--context", type=int, default=None, help="rows per context (default 8192; smoke 256)")
    ap.add_argument("--batch", type=int, default=2, help="contexts decoded together")
    ap.add_argument("--tokens", type=int, default=None, help="decode steps timed (default 16; smoke 4)")
    ap.add_argument("--device", default=None, help="default: CUDA when available")
    ap.add_argument("--dtype", default=None, help="model dtype (default: float32 on CPU, bfloat16 on CUDA)")
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--checkpoint-dir", type=Path, default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny model, short context")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() if args.device is None else args.device.startswith("cuda")
    args.device = args.device or ("cuda" if cuda else "cpu")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.context = args.context or (256 if args.smoke else 8192)
    args.tokens = args.tokens or (4 if args.smoke else 16)
    kvs = (args.kv_dtypes or ("auto,fp8_e4m3" if cuda else "float32,bfloat16,int8,fp8_e4m3")).split(",")
    with contextlib.ExitStack() as stack:
        return report(args, kvs, checkpoint(args, stack))


def report(args: argparse.Namespace, kvs: list[str], path: Path) -> int:
    run_one(path, kvs[0], args)  # warm-up (first-use costs of the process), not reported
    rows = {}
    for kv in kvs:
        rows[kv] = run_one(path, kv, args)
    base = rows[kvs[0]]
    print(f"{path.name}: {args.batch} x {args.context} rows, {args.tokens} steps, {args.device} {args.dtype}")
    print(
        f"{'kv dtype':26} {'attn':10} {'B/row':>8} {'rows/GiB':>10} {'tok/s':>8} {'x':>6} {'cosine':>9} {'rel err':>8} same"
    )
    for r in rows.values():
        got, ref = r["_logits"].double(), base["_logits"].double()
        r["cosine_vs_first"] = torch.nn.functional.cosine_similarity(got, ref, dim=0).item()
        r["max_rel_err_vs_first"] = ((got - ref).abs().max() / ref.abs().max()).item()
        r["greedy_same_as_first"] = r["tokens"] == base["tokens"]
        r["decode_x_first"] = r["decode_tok_s"] / base["decode_tok_s"]
        r["rows_x_first"] = r["rows_per_GiB"] / base["rows_per_GiB"]
        print(
            f"{r['kv_dtype']:26} {r['attention']:10} {r['bytes_per_row']:8.0f} {r['rows_per_GiB']:10d} "
            f"{r['decode_tok_s']:8.2f} {r['decode_x_first']:6.2f} {r['cosine_vs_first']:9.6f} "
            f"{r['max_rel_err_vs_first']:8.4f} {r['greedy_same_as_first']}"
        )
    if args.json:
        report = {
            "checkpoint": path.name,
            "device": args.device,
            "device_name": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
            "torch": torch.__version__,
            "dtype": args.dtype,
            "context": args.context,
            "batch": args.batch,
            "tokens": args.tokens,
            "threads": torch.get_num_threads(),
            "rows": {kv: {k: v for k, v in r.items() if not k.startswith("_")} for kv, r in rows.items()},
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
