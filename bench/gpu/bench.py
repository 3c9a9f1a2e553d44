"""GPU benchmark: captions on a random Qwen3-VL-2B-shaped checkpoint, ours vs transformers.

    python bench/gpu/bench.py [--out FILE.json] [--concurrency 1,8,32] [--tokens 32]
    python bench/gpu/bench.py --smoke          # CPU rehearsal: tiny shapes, a few tokens

The checkpoint is built on the device with the public Qwen3-VL-2B-Instruct layer sizes
(text: hidden 2048, 28 layers, 16 heads / 8 KV heads of 128, MLP 6144, vocabulary 151936,
tied embeddings; vision: 24 blocks of 1024, MLP 4096, patch 16, merge 2, DeepStack at
5/11/17) and random weights in bfloat16, and the tokenizer of the tiny fixture (nothing is
downloaded). For each concurrency: that many 448x448 images captioned at once, greedy,
exactly ``--tokens`` new tokens each (random weights rarely say EOS; when they do, tokens
are counted as generated):

* ours (``engine.Model``, continuous batching), per attention backend (flashinfer,
  flashinfer with CUDA-graph decode, and torch on CUDA): tokens/s, images/s, time to
  first token (p50, p90);
* transformers ``generate`` on the same weights, one left-padded batch: tokens/s,
  images/s, and its time to first token (a ``max_new_tokens=1`` batch);
* the vision encoder alone: ours, ms per image;
* the vision tower alone on one pass of 32 images: ms per image with attention once per
  image per layer (transformers' sdpa path) and with each variable-length kernel usable
  there (one attention call per layer for all 32; ``encoders/varlen_attention.py``).

Prints a table and the ratios; writes everything as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
# Run as a script, this file's folder comes first on sys.path and its name would shadow the
# ``bench`` package: the repository root goes first instead.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]

PROMPT = "Describe this image in detail."
TEXT_2B = {
    "hidden_size": 2048,
    "num_hidden_layers": 28,
    "intermediate_size": 6144,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
VISION_2B = {
    "depth": 24,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_heads": 16,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 2048,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [5, 11, 17],
}


def build_checkpoint(out: Path, *, smoke: bool, device: str, dtype: torch.dtype) -> Path:
    """A random checkpoint (2B shapes, or the tiny fixture's for ``smoke``) saved to ``out``
    with the tiny fixture's tokenizer and processor files."""
    from transformers import GenerationConfig, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from fixtures import tiny_qwen3_vl
    from fixtures.tiny_models import ensure_tiny_model

    tiny = ensure_tiny_model("tiny-qwen3-vl")
    for f in tiny.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json":
            shutil.copyfile(f, out / f.name)
    cfg = tiny_qwen3_vl.config_dict()
    if not smoke:
        cfg["text_config"].update(TEXT_2B)
        cfg["text_config"]["rope_parameters"] = {
            **cfg["text_config"]["rope_parameters"],
            "mrope_section": [24, 20, 20],  # head_dim 128 -> 64 rotary frequencies
        }
        cfg["vision_config"].update(VISION_2B)
        cfg["tie_word_embeddings"] = True
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**cfg)).eval()
    finally:
        torch.set_default_dtype(previous)
    model.generation_config = GenerationConfig.from_pretrained(tiny)
    model.save_pretrained(out, safe_serialization=True)
    del model
    return out


@contextlib.contextmanager
def checkpoint_dir(keep: Path | None, *, smoke: bool, device: str, dtype: torch.dtype) -> Iterator[Path]:
    """The random checkpoint: built in a temporary folder, or once into ``keep`` and reused
    from there by later runs (check.sh shares one between the benchmark and the profiles)."""
    if keep is None:
        with tempfile.TemporaryDirectory() as tmp:
            yield build_checkpoint(Path(tmp), smoke=smoke, device=device, dtype=dtype)
        return
    done = keep / f"built-{'smoke' if smoke else '2b'}-{str(dtype).removeprefix('torch.')}.ok"
    if not done.exists():
        if keep.exists():
            shutil.rmtree(keep)
        keep.mkdir(parents=True)
        build_checkpoint(keep, smoke=smoke, device=device, dtype=dtype)
        done.touch()
    yield keep


def images(n: int, size: int, seed: int) -> list:
    from PIL import Image as PILImage

    rng = np.random.default_rng(seed)
    return [PILImage.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(n)]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


async def _caption(
    model, image, tokens: int, t0: float, sampled: bool = False
) -> tuple[float, int, list[int]]:
    """(time to first token, tokens generated, the tokens) for one request; ``sampled``:
    temperature 0.8, top-p 0.9 (seeded) instead of greedy, every token generated."""
    from engine import Context, Sampler, max_tokens

    first = None
    out: list[int] = []
    async with Context(model) as ctx:
        ctx.user(image, PROMPT).cue()
        if sampled:
            ctx.reseed(1234)
        sampler = Sampler.top_p(0.8, 0.9) if sampled else Sampler.greedy()
        async for ev in ctx.stream(sampler, max_tokens(tokens)):
            if first is None:
                first = time.perf_counter() - t0
            out.append(ev.token)
    return first or 0.0, len(out), out


def run_ours(model, pil_images: list, tokens: int, device: str, sampled: bool = False) -> dict:
    from media import Image

    prepared = [model.prepare(Image.from_pil(im)) for im in pil_images]  # decode/resize off the clock

    async def go():
        t0 = time.perf_counter()
        res = await asyncio.gather(*(_caption(model, p, tokens, t0, sampled) for p in prepared))
        _sync(device)
        return time.perf_counter() - t0, res

    wall, res = asyncio.run(go())
    ttft = sorted(r[0] for r in res)
    n_tok = sum(r[1] for r in res)
    return {
        "wall_s": wall,
        "tokens": n_tok,
        "tok_s": n_tok / wall,
        "img_s": len(pil_images) / wall,
        "ttft_p50_ms": 1e3 * statistics.median(ttft),
        "ttft_p90_ms": 1e3 * ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
        "first_tokens": res[0][2],
    }


def decode_only(model, n: int, tokens: int, device: str) -> dict:
    """Text-only decode at ``n`` contexts: a short prompt each, then ``tokens`` greedy tokens
    (no EOS stop); tok/s and ms per step over the decode alone (from the last context's
    first token to the last context's last token)."""
    from engine import Context, Sampler, max_tokens

    firsts: list[float] = []
    lasts: list[float] = []

    async def one(i: int) -> None:
        async with Context(model) as ctx:
            ctx.user(f"Count slowly from {i} upwards, one number per line.").cue()
            count = 0
            async for _ in ctx.stream(Sampler.greedy(), max_tokens(tokens)):
                count += 1
                if count == 1:
                    firsts.append(time.perf_counter())
            _sync(device)
            lasts.append(time.perf_counter())

    async def go() -> None:
        await asyncio.gather(*(one(i) for i in range(n)))

    asyncio.run(go())
    span = max(lasts) - max(firsts)
    steps = tokens - 1
    return {"contexts": n, "tokens": tokens, "tok_s": n * steps / span, "ms_per_step": 1e3 * span / steps}


def run_reference(ref, proc, pil_images: list, tokens: int, device: str) -> dict:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    prompt = proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = proc(text=[prompt] * len(pil_images), images=pil_images, return_tensors="pt", padding=True)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    common = {"do_sample": False, "pad_token_id": proc.tokenizer.pad_token_id, "eos_token_id": None}
    with torch.no_grad():
        _sync(device)
        t0 = time.perf_counter()
        ref.generate(**inputs, max_new_tokens=1, **common)
        _sync(device)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = ref.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, **common)
        _sync(device)
        wall = time.perf_counter() - t0
    n_tok = (out.shape[1] - inputs["input_ids"].shape[1]) * out.shape[0]
    return {
        "wall_s": wall,
        "tokens": n_tok,
        "tok_s": n_tok / wall,
        "img_s": len(pil_images) / wall,
        "ttft_ms": 1e3 * ttft,
        "first_tokens": out[0, inputs["input_ids"].shape[1] :].tolist(),
    }


def encoder_ms(model, size: int, device: str, n: int = 8) -> float:
    """Our vision encoder alone, ms per image (new images: no encoder-cache hits)."""
    from media import Image

    # Images no other step used (seed 99 is the untimed warm-up's): encoder-cache hits had made
    # this 0.00 ms on the first GPU run.
    prepared = [model.prepare(Image.from_pil(im)) for im in images(n + 1, size, seed=7919)]
    model.encode(prepared[:1])  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    for p in prepared[1:]:
        model.encode([p])
    _sync(device)
    return 1e3 * (time.perf_counter() - t0) / n


def vision_pass_ms(model, size: int, device: str, n: int = 32, reps: int = 3) -> dict:
    """The vision tower alone on one pass of ``n`` images (prepare excluded): ms per image
    with transformers' per-image attention and with each variable-length kernel usable here
    (each warmed up once first: flashinfer's JIT compile, the allocator)."""
    from encoders import varlen_attention as va
    from media import Image

    enc = model.encoder
    tower = enc.tower
    prepared = [enc.prepare(Image.from_pil(im)) for im in images(n, size, seed=4242)]
    pixels = torch.cat([p.inputs["pixel_values"] for p in prepared]).to(device=enc.device, dtype=enc.dtype)
    grid = torch.cat([p.inputs["image_grid_thw"] for p in prepared]).to(enc.device)
    head_dim = tower.config.hidden_size // tower.config.num_heads
    modes = {"per image (sdpa)": "sdpa"}
    out: dict = {"images": n, "rows": int(pixels.shape[0]), "ms_per_image": {}, "unavailable": {}}
    for name in ("torch", "flashinfer"):
        try:
            kernel, _ = va.select_kernel(device, enc.dtype, head_dim, name)
        except va.VarlenUnavailableError as e:
            out["unavailable"][name] = str(e)
            continue
        modes[f"varlen {name}"] = va.register(kernel)
    before = tower.config._attn_implementation
    out["encoder_default"] = before
    try:
        for label, attention in modes.items():
            va.set_attention(tower, attention)
            with torch.no_grad():
                tower(pixels, grid_thw=grid)  # warm-up
                _sync(device)
                t0 = time.perf_counter()
                for _ in range(reps):
                    tower(pixels, grid_thw=grid)
                _sync(device)
            out["ms_per_image"][label] = 1e3 * (time.perf_counter() - t0) / (reps * n)
    finally:
        va.set_attention(tower, before)
    return out


def _equal_lead(a: list[int], b: list[int]) -> int:
    """How many leading tokens two captions share (bfloat16 kernels may part after a while)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _save_partial(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**result, "partial": True}, indent=1, default=str))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="CPU rehearsal: tiny shapes, few tokens")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "gpu_bench.json")
    parser.add_argument("--concurrency", default=None, help="comma-separated (default 1,8,32; smoke 1,2)")
    parser.add_argument(
        "--tokens", type=int, default=None, help="new tokens per caption (default 32; smoke 3)"
    )
    parser.add_argument("--size", type=int, default=None, help="image side (default 448; smoke 64)")
    parser.add_argument(
        "--checkpoint-dir", type=Path, default=None, help="build the checkpoint here once and reuse it"
    )
    args = parser.parse_args(argv)

    from transformers import Qwen3VLForConditionalGeneration

    from bench.engine import hf_processor
    from engine import Model

    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    levels = [int(c) for c in (args.concurrency or ("2,1" if args.smoke else "1,8,32")).split(",")]
    tokens = args.tokens or (3 if args.smoke else 32)
    size = args.size or (64 if args.smoke else 448)
    # "flashinfer+graphs": decode passes of up to 64 contexts replayed from CUDA graphs.
    backends = ["flashinfer", "flashinfer+graphs", "torch"] if cuda else ["torch"]
    if not cuda and not args.smoke:
        print("no CUDA device: running the smoke configuration", file=sys.stderr)
        args.smoke = True

    result: dict = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "dtype": str(dtype),
        "shapes": "tiny (smoke)" if args.smoke else "Qwen3-VL-2B",
        "tokens_per_caption": tokens,
        "image_size": size,
        "ours": {},
        "transformers": {},
        "errors": {},
    }
    t0 = time.perf_counter()
    with checkpoint_dir(args.checkpoint_dir, smoke=args.smoke, device=device, dtype=dtype) as path:
        result["build_s"] = time.perf_counter() - t0
        proc = hf_processor(path)
        ref = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=dtype).to(device).eval()
        for backend in backends:
            try:
                # 1024 pages of 32 rows: 32k rows (~3.7 GB of bf16 K/V at 2B shapes), enough
                # for 32 captions of ~300 rows without taking the whole GPU.
                model = Model.load(
                    path,
                    device=device,
                    dtype=dtype,
                    attention=backend.split("+")[0],
                    kv_pages=1024,
                    cuda_graphs=64 if backend.endswith("+graphs") else 0,
                )
            except Exception as e:  # noqa: BLE001 - recorded; the other backend still runs
                result["errors"][backend] = f"{type(e).__name__}: {e}"
                continue
            rows = {}
            run_ours(model, images(2, size, seed=1), 2, device)  # warm-up (JIT, allocator)
            for c in levels:
                try:
                    # Untimed, at this concurrency: batch shapes seen once (allocator, plans,
                    # and with graphs the capture of this batch size's bucket).
                    run_ours(model, images(c, size, seed=99), 3, device)
                    rows[c] = run_ours(model, images(c, size, seed=10 + c), tokens, device)
                except Exception as e:  # noqa: BLE001
                    result["errors"][f"{backend}@{c}"] = f"{type(e).__name__}: {e}"
            result["ours"][backend] = rows
            if backend == backends[0]:  # the sampled row (issue 33): temperature 0.8, top-p 0.9
                sampled = {}
                for c in levels:
                    try:
                        sampled[c] = run_ours(
                            model, images(c, size, seed=10 + c), tokens, device, sampled=True
                        )
                    except Exception as e:  # noqa: BLE001
                        result["errors"][f"{backend} sampled@{c}"] = f"{type(e).__name__}: {e}"
                result["ours"][backend + " top-p"] = sampled
            if backend.endswith("+graphs") or len(backends) == 1:
                # Decode alone (the decode-only row): overlap on (with the device
                # feed, its CUDA default), on without the feed, and off.
                steps = 8 if args.smoke else 128
                default_overlap = model.scheduler.overlap
                default_feed = model.scheduler.device_feed
                for overlap, feed, key in (
                    (True, default_feed, "decode_only"),
                    (True, False, "decode_only_no_feed"),
                    (False, default_feed, "decode_only_no_overlap"),
                ):
                    model.scheduler.overlap = overlap
                    model.scheduler.device_feed = feed
                    for c in sorted({1, levels[-1], 32 if cuda else levels[-1]}):
                        try:
                            decode_only(model, c, 4, device)  # warm-up: this batch size's bucket
                            result.setdefault(key, {})[str(c)] = decode_only(model, c, steps, device)
                        except Exception as e:  # noqa: BLE001
                            result["errors"][f"{backend} {key}@{c}"] = f"{type(e).__name__}: {e}"
                model.scheduler.overlap = default_overlap
                model.scheduler.device_feed = default_feed
                result["device_fed_passes"] = model.scheduler.stats.fed_passes
                result["decode_only_tok_s"] = {
                    c: r["tok_s"] for c, r in result.get("decode_only", {}).items()
                }
                # The scheduler's overlap off (issue 33 part 2): how much of a step the host's
                # work beside the pass saves, at the lowest and highest concurrency.
                plain = {}
                model.scheduler.overlap = False
                for c in sorted({levels[0], levels[-1]}):
                    try:
                        plain[c] = run_ours(model, images(c, size, seed=10 + c), tokens, device)
                    except Exception as e:  # noqa: BLE001
                        result["errors"][f"{backend} no-overlap@{c}"] = f"{type(e).__name__}: {e}"
                model.scheduler.overlap = default_overlap
                result["ours"][backend + " no-overlap"] = plain
            _save_partial(result, args.out)  # a run cut off by its time limit keeps what it measured
            result.setdefault("encoder_ms_per_image", {})[backend] = encoder_ms(model, size, device)
            if backend == backends[0]:  # the tower does not depend on the text attention backend
                try:
                    result["vision_pass"] = vision_pass_ms(
                        model, size, device, n=4 if args.smoke else 32, reps=1 if args.smoke else 3
                    )
                except Exception as e:  # noqa: BLE001
                    result["errors"]["vision pass"] = f"{type(e).__name__}: {e}"
            del model
            gc.collect()  # the pool goes before the next backend's model loads
            if cuda:
                torch.cuda.empty_cache()
        run_reference(ref, proc, images(2, size, seed=1), 2, device)  # warm-up
        for c in levels:
            result["transformers"][c] = run_reference(ref, proc, images(c, size, seed=10 + c), tokens, device)

    print(
        f"\n{result['device']} {result['dtype']} {result['shapes']}: {size}x{size} captions, "
        f"{tokens} greedy tokens each (checkpoint built in {result['build_s']:.1f} s)"
    )
    print(f"{'side':28} {'conc':>5} {'tok/s':>9} {'img/s':>8} {'TTFT p50 ms':>12} {'vs transformers':>16}")
    ratios = {}
    for c in levels:
        hf = result["transformers"][c]
        print(
            f"{'transformers padded batch':28} {c:5d} {hf['tok_s']:9.1f} {hf['img_s']:8.2f} {hf['ttft_ms']:12.1f}"
        )
        for backend, rows in result["ours"].items():
            if c not in rows:
                continue
            r = rows[c]
            ratio = r["tok_s"] / hf["tok_s"]
            ratios[f"{backend}@{c}"] = ratio
            lead = _equal_lead(r["first_tokens"], hf["first_tokens"])
            r["equal_leading_tokens"] = lead
            print(
                f"{'ours ' + backend:28} {c:5d} {r['tok_s']:9.1f} {r['img_s']:8.2f} {r['ttft_p50_ms']:12.1f} "
                f"{ratio:15.2f}x  (first caption: {lead}/{len(hf['first_tokens'])} leading tokens equal)"
            )
    for key in ("decode_only", "decode_only_no_feed", "decode_only_no_overlap"):
        for c, r in result.get(key, {}).items():
            print(
                f"{key + ' (text, greedy)':28} {int(c):5d} {r['tok_s']:9.1f}  {r['ms_per_step']:.2f} ms per step"
            )
    for backend, ms in result.get("encoder_ms_per_image", {}).items():
        print(f"vision encoder ({backend} model): {ms:.2f} ms per image")
    vp = result.get("vision_pass")
    if vp:
        base = vp["ms_per_image"].get("per image (sdpa)")
        print(
            f"vision tower, one pass of {vp['images']} images ({vp['rows']} patch rows; encoder uses {vp['encoder_default']}):"
        )
        for label, ms in vp["ms_per_image"].items():
            ratio = f"  ({base / ms:.2f}x per image)" if base and label != "per image (sdpa)" else ""
            print(f"  {label:20} {ms:8.3f} ms per image{ratio}")
        for name, why in vp["unavailable"].items():
            print(f"  varlen {name}: not run ({why})")
    for k, v in result["errors"].items():
        print(f"ERROR {k}: {v}")
    result["ratios_tok_s"] = ratios
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {args.out}")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
