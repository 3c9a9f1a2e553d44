"""Engine benchmark on a small random Qwen3-VL (bigger than the tiny fixture).

    python -m bench.engine [--quick]

Builds, in a temp dir, the tiny fixture's Qwen3-VL with a bigger language model (hidden
512, 8 layers, intermediate 1376, 8 heads / 4 KV heads; the vision tower stays tiny), then
prints, in one run:

1. 16 concurrent captions: ours (``caption_many_async``: decode steps of all 16 share
   forward passes) vs transformers ``generate`` one by one and as one left-padded batch
   (processor-made inputs): tokens/s and images/s, and the ratios.
2. KV pages used by 16 forks of a 1k-token prefix vs one context (pool stats).
3. Time to append + prefill an image already seen (encoder cache hit) vs a new one, and a
   repeat of the same image after the same prefix (prefix cache) beside the encoder-only ratio.
4. A serving-shaped mixed workload: 48 requests arriving over time (seeded Poisson
   arrivals, 1.5/s by default: about twice what either side finishes per second here, so
   both run loaded and a queue builds; ``--rate`` changes it), images of varied sizes or none, prompts of 10-400 tokens, ``max_tokens``
   8-128, some stopping early on a stop string. Ours (each request submitted to the engine
   at its arrival time; continuous batching) vs transformers ``generate`` as a static
   padded batch per arrival window (each batch takes what arrived while the previous one
   ran): requests/s, tokens/s, p50/p99 latency (arrival to finish), and how many greedy
   outputs agree.

``--only serving`` (or ``PIE_BENCH_ONLY=serving``) runs one section; names: captions,
forks, image-cache, serving (comma-separated for several).
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script (python bench/engine.py), this folder comes first on sys.path and its
# engine.py / inferlets.py / speech.py would shadow those packages: the repository root
# goes first instead. (python -m bench.engine works either way.)
sys.path[:] = [str(Path(__file__).resolve().parents[1])] + [
    p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent
]

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch

N_CAPTIONS = 16
PROMPT = "Describe this image."
SECTIONS = ("captions", "forks", "image-cache", "serving")
SERVING_RATE = 1.5


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

    async def append(image: Image, tag: int, prefix: str | None = None, question: str = "") -> float:
        async with Context(model) as ctx:
            # a different text prefix: no KV prefix-cache hit; the same prefix: full pages hit
            ctx.fill(prefix if prefix is not None else f"request {tag}: ")
            t0 = time.perf_counter()
            ctx.append_image(image)
            if question:
                ctx.fill(question)
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
    rows0, passes0 = model.runner.rows_computed, model.runner.passes
    same_s = float(np.median([asyncio.run(append(seen, -3, same)) for _ in range(repeats)]))
    same_rows = (model.runner.rows_computed - rows0) / repeats
    same_passes = (model.runner.passes - passes0) / repeats
    # The common case after it: the same prefix and image, then a question never seen: the
    # full pages come from the prefix cache, the rest of the image's last page and the
    # question are computed (vs a new image with a question).
    q_new, q_rep = [], []
    for i in range(repeats):
        q_new.append(asyncio.run(append(new_image(), 0, same, f" Question {i}: what is in it?")))
        q_rep.append(asyncio.run(append(seen, 0, same, f" Question {i + repeats}: what is in it?")))
    q_new_s, q_rep_s = float(np.median(q_new)), float(np.median(q_rep))

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
    print(
        f"  per repeat: {same_rows:.0f} rows computed in {same_passes:.0f} passes (full pages: prefix cache;"
        " the partial last page and its output: kept by the first flush)"
    )
    print(
        f"+ a new question after it:    {q_rep_s * 1e3:8.1f} ms   vs a new image + question {q_new_s * 1e3:7.1f} ms:"
        f" {q_new_s / q_rep_s:5.2f}x"
    )


SERVING_REQUESTS = 48
SERVING_SIZES = [None, (64, 48), (96, 64), (128, 96), (160, 120), (224, 160)]
SERVING_STOPS = ["a", "e", "o"]
WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but "
    "have an they you were her she there been one all we their has would when if so no what up out "
    "image photo colour light small large river house street tree water people city window table "
    "garden morning evening sky cloud road market animal bird flower stone bridge mountain winter"
).split()


@dataclass
class Request:
    idx: int
    arrival: float
    """Seconds after the start of the run."""
    image: object | None
    """A PIL image or None."""
    text: str
    max_tokens: int
    stop: str | None


def serving_requests(model, n: int, rate: float, seed: int = 7) -> list[Request]:
    """``n`` requests with seeded Poisson arrivals at ``rate`` per second: an image of one of
    several sizes or none, a user text of 10-400 tokens, max_tokens 8-128, a stop string on
    about a third of them."""
    from PIL import Image as PILImage

    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, n)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[1:])])
    # lengths spread evenly over their ranges, in a seeded order
    wants = rng.permutation(np.linspace(10, 400, n).round().astype(int))
    budgets = rng.permutation(np.linspace(8, 128, n).round().astype(int))
    out = []
    for i in range(n):
        size = SERVING_SIZES[int(rng.integers(len(SERVING_SIZES)))]
        image = None
        if size is not None:
            image = PILImage.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
        want = int(wants[i])
        ids = model.tokenize(" ".join(rng.choice(WORDS, size=want + 8)))[:want]
        text = model.detokenize(ids).strip()
        stop = SERVING_STOPS[int(rng.integers(len(SERVING_STOPS)))] if rng.random() < 0.35 else None
        out.append(Request(i, float(arrivals[i]), image, text, int(budgets[i]), stop))
    return out


def request_stop(model, req: Request):
    from engine import eos, max_tokens, stop_strings

    cond = max_tokens(req.max_tokens)
    if model.eos_token_ids:
        cond = cond | eos(model.eos_token_ids)
    if req.stop is not None:
        cond = cond | stop_strings(req.stop)
    return cond


def cut_generation(model, req: Request, tokens: list[int]) -> tuple[list[int], str, str]:
    """A reference row's new tokens cut where the engine's stop rules would stop: (tokens,
    text, finish kind)."""
    tracker = request_stop(model, req).start()
    for i in range(len(tokens)):
        reason = tracker.check(tokens[: i + 1], model.detokenize(tokens[: i + 1], skip_special_tokens=True))
        if reason is not None:
            return tokens[: i + 1], reason.text, reason.kind
    return tokens, model.detokenize(tokens, skip_special_tokens=True), "length"


@dataclass
class ServingResult:
    name: str
    makespan: float
    latencies: list[float]
    tokens: dict[int, list[int]]
    kinds: dict[int, str]
    batches: int = 0

    def row(self, n: int) -> str:
        toks = sum(len(t) for t in self.tokens.values())
        p50, p99 = np.percentile(self.latencies, [50, 99])
        extra = f"  ({self.batches} batches)" if self.batches else ""
        return (
            f"{self.name:34s} {self.makespan:7.2f} s {n / self.makespan:6.2f} req/s {toks / self.makespan:7.1f} tok/s"
            f"  p50 {p50:6.2f} s  p99 {p99:6.2f} s{extra}"
        )


def serve_ours(model, reqs: list[Request]) -> ServingResult:
    from engine import Context, Sampler
    from media import Image

    async def one(req: Request, t0: float) -> tuple[float, list[int], str]:
        await asyncio.sleep(max(0.0, t0 + req.arrival - time.perf_counter()))
        async with Context(model) as ctx:
            if req.image is not None:
                ctx.user(Image.from_pil(req.image), req.text)
            else:
                ctx.user(req.text)
            ctx.cue()
            gen = await ctx.generate(Sampler.greedy(), request_stop(model, req))
        return time.perf_counter() - t0, gen.tokens, gen.reason.kind

    async def run() -> tuple[float, list]:
        t0 = time.perf_counter()
        done = await asyncio.gather(*(one(r, t0) for r in reqs))
        return time.perf_counter() - t0, done

    makespan, done = asyncio.run(run())
    return ServingResult(
        "ours: continuous batching",
        makespan,
        [fin - r.arrival for r, (fin, _, _) in zip(reqs, done, strict=True)],
        {r.idx: toks for r, (_, toks, _) in zip(reqs, done, strict=True)},
        {r.idx: kind for r, (_, _, kind) in zip(reqs, done, strict=True)},
    )


def serve_padded(model, ref, proc, reqs: list[Request]) -> ServingResult:
    """transformers ``generate`` as a static left-padded batch per arrival window: each
    batch is what arrived while the previous one ran; a row that hit its own stop rule
    (max_tokens, EOS, stop string) is done, the batch runs until every row is."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class RowStops(StoppingCriteria):
        def __init__(self, batch: list[Request], prompt_len: int):
            self.trackers = [request_stop(model, r).start() for r in batch]
            self.done = [False] * len(batch)
            self.prompt_len = prompt_len

        def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
            for i, tr in enumerate(self.trackers):
                if not self.done[i]:
                    new = input_ids[i, self.prompt_len :].tolist()
                    text = model.detokenize(new, skip_special_tokens=True)
                    self.done[i] = tr.check(new, text) is not None
            return torch.tensor(self.done, dtype=torch.bool, device=input_ids.device)

    pending = sorted(reqs, key=lambda r: r.arrival)
    latencies: dict[int, float] = {}
    tokens: dict[int, list[int]] = {}
    kinds: dict[int, str] = {}
    batches = 0
    t0 = time.perf_counter()
    with torch.no_grad():
        while pending:
            now = time.perf_counter() - t0
            if pending[0].arrival > now:
                time.sleep(pending[0].arrival - now)
                continue
            batch = [r for r in pending if r.arrival <= now]
            pending = pending[len(batch) :]
            texts = []
            for r in batch:
                content = ([{"type": "image"}] if r.image is not None else []) + [
                    {"type": "text", "text": r.text}
                ]
                messages = [{"role": "user", "content": content}]
                texts.append(proc.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
            imgs = [r.image for r in batch if r.image is not None]
            inputs = proc(text=texts, images=imgs or None, return_tensors="pt", padding=True)
            plen = inputs["input_ids"].shape[1]
            out = ref.generate(
                **inputs,
                max_new_tokens=max(r.max_tokens for r in batch),
                do_sample=False,
                pad_token_id=proc.tokenizer.pad_token_id,
                stopping_criteria=StoppingCriteriaList([RowStops(batch, plen)]),
            )
            end = time.perf_counter() - t0
            batches += 1
            for i, r in enumerate(batch):
                toks, _, kind = cut_generation(model, r, out[i, plen:].tolist())
                tokens[r.idx], kinds[r.idx] = toks, kind
                latencies[r.idx] = end - r.arrival
    makespan = time.perf_counter() - t0
    return ServingResult(
        "transformers generate, padded batch",
        makespan,
        [latencies[r.idx] for r in reqs],
        tokens,
        kinds,
        batches,
    )


def bench_serving(model, path: Path, n: int, rate: float) -> None:
    from transformers import Qwen3VLForConditionalGeneration

    reqs = serving_requests(model, n, rate)
    ref = Qwen3VLForConditionalGeneration.from_pretrained(path).eval()
    proc = hf_processor(path)
    warm = serving_requests(model, 2, 100.0, seed=99)
    for r in warm:
        r.max_tokens = 4
    serve_ours(model, warm)
    serve_padded(model, ref, proc, warm)

    ours = serve_ours(model, reqs)
    padded = serve_padded(model, ref, proc, reqs)

    lens = [len(model.tokenize(r.text)) for r in reqs]
    with_image = sum(r.image is not None for r in reqs)
    print(
        f"\n== serving: {n} requests, Poisson arrivals at {rate:g}/s over {reqs[-1].arrival:.1f} s, "
        f"{with_image} with an image ({len({r.image.size for r in reqs if r.image is not None})} sizes), "
        f"user text {min(lens)}-{max(lens)} tokens, max_tokens {min(r.max_tokens for r in reqs)}-"
        f"{max(r.max_tokens for r in reqs)}, {sum(r.stop is not None for r in reqs)} with a stop string; greedy =="
    )
    print(ours.row(n))
    print(padded.row(n))
    ours_tps = sum(len(t) for t in ours.tokens.values()) / ours.makespan
    pad_tps = sum(len(t) for t in padded.tokens.values()) / padded.makespan
    p99_o, p99_p = np.percentile(ours.latencies, 99), np.percentile(padded.latencies, 99)
    print(
        f"ratio ours / padded batch: requests/s {padded.makespan / ours.makespan:5.2f}x, tokens/s "
        f"{ours_tps / pad_tps:5.2f}x, p99 latency {p99_o / p99_p:5.2f}x (lower is better)"
    )
    agree = [r.idx for r in reqs if ours.tokens[r.idx] == padded.tokens[r.idx]]
    stopped = sum(k == "stop_string" for k in ours.kinds.values())
    print(
        f"finish reasons (ours): {stopped} stop string, {sum(k == 'eos' for k in ours.kinds.values())} eos, "
        f"{sum(k == 'length' for k in ours.kinds.values())} length"
    )
    diverged = []
    for r in reqs:
        a, b = ours.tokens[r.idx], padded.tokens[r.idx]
        if a != b:
            first = next(
                (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
            )
            diverged.append(f"#{r.idx} at token {first}")
    print(
        f"greedy outputs equal to the padded batch's: {len(agree)}/{n}"
        + (
            f" (diverged: {', '.join(diverged)}; a padded batch changes float rounding, so near-ties can flip)"
            if diverged
            else ""
        )
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer tokens, finishes in a couple of minutes")
    p.add_argument(
        "--only",
        default=os.environ.get("PIE_BENCH_ONLY", ""),
        help=f"comma-separated sections to run ({', '.join(SECTIONS)}); default all (env PIE_BENCH_ONLY)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--rate", type=float, default=SERVING_RATE, help="serving: arrivals per second")
    args = p.parse_args(argv)
    only = {x.strip() for x in args.only.split(",") if x.strip()} or set(SECTIONS)
    unknown = only - set(SECTIONS)
    if unknown:
        p.error(f"unknown section(s): {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    threads_note = ""
    if args.threads:
        torch.set_num_threads(args.threads)
    elif (os.cpu_count() or 1) <= 2 or os.getloadavg()[0] >= (os.cpu_count() or 1):
        # On a small or loaded machine OpenMP's spinning workers make every small op wait for
        # a core (the tests measured 0.01 ms -> 16 ms) and figures swing 10x between runs;
        # one thread gives figures that mean something.
        threads_note = (
            f" ({os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}: 1 thread; --threads N to choose)"
        )
        torch.set_num_threads(1)
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
            f"(built+loaded in {time.perf_counter() - t0:.1f}s), torch threads {torch.get_num_threads()}{threads_note}"
        )
        if "captions" in only:
            bench_captions(model, path, N_CAPTIONS, max_tokens, 3)
        if "forks" in only:
            bench_forks(model, prefix)
        if "image-cache" in only:
            bench_image_cache(model, 3 if args.quick else 7)
        if "serving" in only:
            bench_serving(model, path, SERVING_REQUESTS, args.rate)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
