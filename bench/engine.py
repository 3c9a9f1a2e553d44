"""Engine benchmark on a small random Qwen3-VL (bigger than the tiny fixture).

    python -m bench.engine [--quick]

Builds, in a temp dir, the tiny fixture's Qwen3-VL with a bigger language model (hidden
512, 8 layers, intermediate 1376, 8 heads / 4 KV heads; the vision tower stays tiny), then
prints, in one run:

1. 16 concurrent captions: ours (``caption_many_async``: decode steps of all 16 share
   forward passes) vs transformers ``generate`` one by one and as one left-padded batch
   (processor-made inputs): tokens/s and images/s, and the ratios.
2. KV pages used by 16 forks of a 1k-token prefix vs one context (pool stats).
3. Time to append + prefill an image already seen (encoder cache hit) vs a new one.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

N_CAPTIONS = 16
PROMPT = "Describe this image."


def build_checkpoint(out: Path) -> Path:
    from transformers import GenerationConfig, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from fixtures import tiny_qwen3_vl
    from fixtures.tiny_models import ensure_tiny_model

    tiny = ensure_tiny_model("tiny-qwen3-vl")
    for f in tiny.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json":
            shutil.copyfile(f, out / f.name)
    cfg = tiny_qwen3_vl.config_dict()
    cfg["text_config"].update(
        hidden_size=512,
        num_hidden_layers=8,
        intermediate_size=1376,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
    )
    cfg["text_config"]["rope_parameters"] = {
        **cfg["text_config"]["rope_parameters"],
        "mrope_section": [12, 10, 10],  # head_dim 64 -> 32 rotary frequencies
    }
    cfg["vision_config"]["out_hidden_size"] = 512
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**cfg)).eval()
    model.generation_config = GenerationConfig.from_pretrained(tiny)
    model.save_pretrained(out, safe_serialization=True)
    return out


def images(n: int, seed: int = 0) -> list:
    """PIL images, two sizes alternating (so the padded batch really pads)."""
    from PIL import Image as PILImage

    rng = np.random.default_rng(seed)
    sizes = [(64, 48), (96, 64)]
    return [
        PILImage.fromarray(rng.integers(0, 256, (sizes[i % 2][1], sizes[i % 2][0], 3), dtype=np.uint8))
        for i in range(n)
    ]


def hf_processor(path: Path):
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen3VLProcessor

    class WithoutVideo(Qwen3VLProcessor):  # HF video processors need torchvision
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument is None and argument_name == "video_processor":
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    return WithoutVideo(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(path),
        tokenizer=tok,
        video_processor=None,
        chat_template=tok.chat_template,
    )


def hf_generated(out: torch.Tensor, prompt_len: int, eos: set[int]) -> int:
    """New tokens per row up to and including the first EOS."""
    total = 0
    for row in out[:, prompt_len:].tolist():
        n = len(row)
        for i, t in enumerate(row):
            if t in eos:
                n = i + 1
                break
        total += n
    return total


def bench_captions(model, path: Path, n: int, max_tokens: int, rounds: int) -> None:
    """Ours and the padded batch run round-robin for ``rounds`` rounds, each round on new
    images (so neither our encoder cache nor our KV prefix cache can help); medians are
    compared. One-by-one generate is slow and runs once."""
    from transformers import Qwen3VLForConditionalGeneration

    from engine import caption_many_async
    from media import Image

    warm = [Image.from_array(np.full((48, 64, 3), i, dtype=np.uint8)) for i in range(2)]
    asyncio.run(caption_many_async(model, warm, prompt=PROMPT, max_tokens=2))  # warm-up, other images

    ref = Qwen3VLForConditionalGeneration.from_pretrained(path).eval()
    proc = hf_processor(path)
    eos = set(model.eos_token_ids)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    prompt = proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    gen = {"max_new_tokens": max_tokens, "do_sample": False, "pad_token_id": proc.tokenizer.pad_token_id}

    ours_times, batch_times = [], []
    ours_tokens = batch_tokens = 0
    with torch.no_grad():
        for r in range(rounds):
            pil_images = images(n, seed=1 + r)
            ours_in = [Image.from_pil(im) for im in pil_images]
            t0 = time.perf_counter()
            texts = asyncio.run(caption_many_async(model, ours_in, prompt=PROMPT, max_tokens=max_tokens))
            ours_times.append(time.perf_counter() - t0)
            ours_tokens = sum(min(max_tokens, max(1, len(model.tokenize(t)))) for t in texts)

            t0 = time.perf_counter()
            inputs = proc(text=[prompt] * n, images=pil_images, return_tensors="pt", padding=True)
            out = ref.generate(**inputs, **gen)
            batch_times.append(time.perf_counter() - t0)
            batch_tokens = hf_generated(out, inputs["input_ids"].shape[1], eos)

        t0 = time.perf_counter()
        one_tokens = 0
        for im in images(n, seed=1000):
            inputs = proc(text=[prompt], images=[im], return_tensors="pt")
            out = ref.generate(**inputs, **gen)
            one_tokens += hf_generated(out, inputs["input_ids"].shape[1], eos)
        one_s = time.perf_counter() - t0

    ours_s, batch_s = statistics.median(ours_times), statistics.median(batch_times)
    print(f"\n== {n} captions, max {max_tokens} new tokens, greedy; median of {rounds} interleaved rounds ==")
    rows = [
        ("ours: caption_many_async", ours_s, ours_tokens),
        ("transformers generate, one by one", one_s, one_tokens),
        ("transformers generate, padded batch", batch_s, batch_tokens),
    ]
    for name, s_, toks in rows:
        print(f"{name:38s} {s_:7.2f} s  {toks / s_:8.1f} tok/s  {n / s_:6.2f} img/s  ({toks} tokens)")
    print(f"ratio ours / one-by-one (img/s):  {one_s / ours_s:5.2f}x")
    print(f"ratio ours / padded batch (img/s): {batch_s / ours_s:5.2f}x")


def bench_forks(model, prefix_tokens: int) -> None:
    from engine import Context

    async def main():
        base_stats = model.pool_stats().in_use
        root = Context(model)
        root.fill_tokens([(i * 37) % 5000 + 100 for i in range(prefix_tokens)])
        await root.flush()
        one = model.pool_stats().in_use - base_stats
        forks = [root.fork() for _ in range(N_CAPTIONS)]
        for i, f in enumerate(forks):
            f.fill(f" fork {i} says hello")
        await asyncio.gather(*(f.flush() for f in forks))
        many = model.pool_stats().in_use - base_stats
        for f in forks:
            f.close()
        root.close()
        return one, many

    one, many = asyncio.run(main())
    ps = model.pool.page_size
    print(f"\n== KV pages: {prefix_tokens}-token prefix, page size {ps} ==")
    print(f"one context:                 {one:5d} pages")
    print(f"root + {N_CAPTIONS} forks (+ a few tokens each): {many:5d} pages")
    print(f"{N_CAPTIONS + 1} unshared copies would use:  {one * (N_CAPTIONS + 1):5d} pages")
    print(f"ratio pages(root + forks) / pages(one): {many / one:5.2f}x (vs {N_CAPTIONS + 1}x unshared)")


def bench_image_cache(model, repeats: int) -> None:
    from engine import Context
    from media import Image

    rng = np.random.default_rng(1)

    def new_image() -> Image:
        return Image.from_array(rng.integers(0, 256, (224, 224, 3), dtype=np.uint8))

    seen = new_image()

    async def append(image: Image, tag: int, prefix: str | None = None) -> float:
        async with Context(model) as ctx:
            # a different text prefix: no KV prefix-cache hit; the same prefix: full pages hit
            ctx.fill(prefix if prefix is not None else f"request {tag}: ")
            t0 = time.perf_counter()
            ctx.append_image(image)
            await ctx.flush()
            return time.perf_counter() - t0

    asyncio.run(append(seen, -1))  # encodes ``seen`` once (and warms up)
    new_t, hit_t = [], []
    for i in range(repeats):
        new_t.append(asyncio.run(append(new_image(), 2 * i)))
        hit_t.append(asyncio.run(append(seen, 2 * i + 1)))
    new_s, hit_s = float(np.median(new_t)), float(np.median(hit_t))
    same = "Same question prefix for every request: "
    asyncio.run(append(seen, -2, same))  # publishes the prefix + image pages
    same_s = float(np.median([asyncio.run(append(seen, -3, same)) for _ in range(repeats)]))

    def encode_time(im: Image) -> float:
        t0 = time.perf_counter()
        model.encode([model.prepare(im)])
        return time.perf_counter() - t0

    enc_new = float(np.median([encode_time(new_image()) for _ in range(repeats)]))
    enc_hit = float(np.median([encode_time(seen) for _ in range(repeats)]))
    rows = model.prepare(seen).num_rows
    print(f"\n== append_image + flush, 224x224 ({rows} rows), median of {repeats} ==")
    print(f"new image:         {new_s * 1e3:8.1f} ms   (prepare+encode alone {enc_new * 1e3:7.2f} ms)")
    print(f"repeated (cached): {hit_s * 1e3:8.1f} ms   (prepare+encode alone {enc_hit * 1e3:7.2f} ms)")
    print(f"ratio new / cached: {new_s / hit_s:5.2f}x  (encode alone {enc_new / max(enc_hit, 1e-9):6.1f}x)")
    print(
        f"repeat after the same prefix: {same_s * 1e3:8.1f} ms   ratio new / repeat: {new_s / same_s:6.1f}x"
        f"  (encode alone {enc_new / max(enc_hit, 1e-9):6.1f}x)"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer tokens, finishes in a couple of minutes")
    args = p.parse_args(argv)
    max_tokens = 16 if args.quick else 64
    prefix = 1024

    from engine import Model

    with tempfile.TemporaryDirectory(prefix="pie-bench-") as tmp:
        t0 = time.perf_counter()
        path = build_checkpoint(Path(tmp))
        model = Model.load(path, device="cpu", kv_pages=2048, page_size=32)
        n_params = sum(p.numel() for p in model.hf.parameters()) / 1e6
        print(
            f"checkpoint: Qwen3-VL random, LM hidden 512 x 8 layers, {n_params:.0f}M params "
            f"(built+loaded in {time.perf_counter() - t0:.1f}s), torch threads {torch.get_num_threads()}"
        )
        bench_captions(model, path, N_CAPTIONS, max_tokens, 3)
        bench_forks(model, prefix)
        bench_image_cache(model, 3 if args.quick else 7)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
