"""The example inferlets' programs written directly against the engine (the reference
their guest runs must equal), and tiny media made in-test."""

from __future__ import annotations

import asyncio
import io
import json
import math

import numpy as np

from engine import Context, Sampler, stopping


def png(width: int = 48, height: int = 40, seed: int = 1) -> bytes:
    from PIL import Image as PILImage

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    PILImage.fromarray(pixels, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def mp4(frames: int = 6, size: int = 48, fps: int = 4) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("mpeg4", rate=fps)
        s.width = s.height = size
        s.pix_fmt = "yuv420p"
        for i in range(frames):
            arr = np.zeros((size, size, 3), dtype=np.uint8)
            arr[:, : (i + 1) * size // frames] = (40 * i) % 256
            arr[..., 1] = np.arange(size, dtype=np.uint8)[None, :] * 4
            frame = av.VideoFrame.from_ndarray(arr, format="rgb24")
            frame.pts = i
            c.mux(s.encode(frame))
        c.mux(s.encode())
    return buf.getvalue()


def wav(seconds: float = 1.0, rate: int = 16000) -> bytes:
    import soundfile as sf

    t = np.arange(int(seconds * rate), dtype=np.float64) / rate
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), rate, format="WAV")
    return buf.getvalue()


def facts(p) -> dict:
    return {
        "kind": p.kind,
        "token_count": p.token_count,
        "rows": p.num_rows,
        "grid": list(p.grid),
        "position_span": p.position_span,
        "frame_count": (len(p.meta.get("frame_indices", ())) or p.grid[0]) if p.kind == "video" else 0,
        "timestamps": [round(float(np.float32(t)), 4) for t in p.timestamps or ()],
    }


async def answer(ctx: Context, n: int) -> dict:
    g = await ctx.generate(max_tokens=n)
    ctx.close()
    return {"text": g.text, "tokens": g.tokens, "finish_reason": g.finish_reason}


async def chat(model, prompt: str, n: int) -> str:
    """The chat example on the engine: a user turn, cue, ``n`` greedy tokens -> text."""
    c = Context(model).user(prompt).cue()
    try:
        return (await c.generate(max_tokens=n)).text
    finally:
        c.close()


async def media_qa(model, media, question: str, n: int, **params) -> tuple[dict, dict]:
    prepared = model.prepare(media, **params)
    return facts(prepared), await answer(Context(model).user(prepared, question).cue(), n)


def score(g) -> tuple:
    return (g.finish_reason == "eos", len(set(g.text.split())))


async def best_of(model, prompt: str, n: int, k: int, temperature: float, seed: int) -> tuple[list[str], str]:
    base = Context(model).user(prompt).cue()
    await base.flush()
    branches = [base.fork() for _ in range(k)]
    for i, b in enumerate(branches):
        if temperature > 0:
            b.reseed(seed + i)
    sampler = Sampler(temperature=temperature) if temperature > 0 else Sampler.greedy()
    cond = stopping.max_tokens(n) | stopping.eos(model.eos_token_ids)
    gens = await asyncio.gather(*(b.generate(sampler, cond) for b in branches))
    best = 0
    for i, g in enumerate(gens):
        if score(g) > score(gens[best]):
            best = i
    for c in (*branches, base):
        c.close()
    return [g.text for g in gens], gens[best].text


def _norm(total: float, length: int, penalty: float) -> float:
    return total / (max(length, 1) ** penalty)


async def beam(model, prompt: str, width: int, max_tokens: int, num_return: int = 1, penalty: float = 1.0):
    """The guest's beam search (inferlets/examples/search.py) on the engine: the same rule
    on the same top-2w distributions."""
    eos = set(model.eos_token_ids)
    beams = [(Context(model).user(prompt).cue(), (), 0.0)]
    finished: list[tuple[float, tuple[int, ...]]] = []
    for step in range(max_tokens):
        dists = await asyncio.gather(*(b.decode_step_dist(top_n=2 * width) for b, _, _ in beams))
        cands = []
        for bi, ((_, _, s), d) in enumerate(zip(beams, dists, strict=True)):
            for tok, p in zip(d.ids.tolist(), d.probs.tolist(), strict=True):
                if p > 0:
                    cands.append((s + math.log(p), bi, tok))
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        chosen = []
        for rank, (value, bi, tok) in enumerate(cands[: 2 * width]):
            if tok in eos:
                if rank < width:
                    toks = (*beams[bi][1], tok)
                    finished.append((_norm(value, len(toks), penalty), toks))
                continue
            chosen.append((bi, tok, value))
            if len(chosen) == width:
                break
        finished.sort(key=lambda f: -f[0])
        del finished[width:]
        new = []
        for bi, tok, value in chosen:
            new.append((beams[bi][0].fork().fill_tokens([tok]), (*beams[bi][1], tok), value))
        for b, _, _ in beams:
            b.close()
        beams = new
        if not beams:
            break
        if (
            len(finished) >= width
            and max(_norm(s, step + 1, penalty) for _, _, s in beams) <= finished[-1][0]
        ):
            break
    results = list(finished) + [(_norm(s, len(t), penalty), t) for _, t, s in beams]
    for b, _, _ in beams:
        b.close()
    results.sort(key=lambda r: -r[0])
    return [(score, model.detokenize(toks)) for score, toks in results[:num_return]]


async def tour(model, prompt: str, n: int) -> dict:
    """inferlets/examples/tour.py on the engine."""
    out: dict = {}
    ids = model.tokenize(prompt)
    out["tokenize"] = ids
    out["detokenize"] = model.detokenize(ids)
    ctx = Context(model).system("Be brief.").user(prompt).cue()
    await ctx.flush()
    d = await ctx.decode_step_dist(top_n=5)
    out["dist"] = [d.ids.tolist(), d.probs.tolist()]
    name = "tour-direct:" + prompt
    ctx.save(name, overwrite=True)
    g = await ctx.generate(max_tokens=n)
    out["greedy"] = [g.text, g.tokens, g.finish_reason]
    again = Context.open(model, name)
    g2 = await again.generate(max_tokens=n)
    out["reopened"] = g2.tokens
    again.truncate(len(again) - len(g2.tokens))
    again.reseed(7)
    cond = stopping.max_tokens(n) | stopping.eos(model.eos_token_ids)
    g3 = await again.generate(Sampler(temperature=0.9, topk=20, topp=0.9), cond)
    out["sampled"] = g3.tokens
    raw = Context(model).fill_tokens(ids)
    g4 = await raw.generate(Sampler.greedy(), stopping.max_tokens(n) | stopping.stop_strings("e"))
    out["stopped"] = [g4.text, g4.finish_reason]
    out["length"] = len(raw)
    model.delete_saved(name)
    for c in (ctx, again, raw):
        c.close()
    out["clock_ok"] = True
    return json.loads(json.dumps(out))
