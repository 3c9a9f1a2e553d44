"""The speculative-decoding example inferlet: a guest drafter (the SDK's ``NgramDrafter``
or the example's own ``RepeatDrafter``) drives ``verify-draft``; its output equals plain
generation on the engine, in fewer passes when the drafts are right."""

from __future__ import annotations

import asyncio
import json

import pytest

from engine import Context

COPY = "a b c d e f g a b c d e f g a b c d"


def _run(rt, wasm, args):
    async def main():
        return await rt.run_async(wasm, args)

    return json.loads(asyncio.run(main()))


async def _plain(model, prompt: str, n: int, seed: int | None = None, temperature: float = 0.0) -> dict:
    from engine import Sampler

    ctx = Context(model).user(prompt).cue()
    if seed is not None:
        ctx.reseed(seed)
    sampler = Sampler(temperature=temperature) if temperature > 0 else None
    g = await ctx.generate(sampler, max_tokens=n)
    rows = len(ctx)
    ctx.close()
    return {"text": g.text, "tokens": g.tokens, "finish_reason": g.finish_reason, "rows": rows}


@pytest.mark.parametrize("drafter", ["ngram", "repeat"])
def test_guest_drafter_output_equals_plain_generation(rt, wasm, model, drafter: str) -> None:
    want = asyncio.run(_plain(model, COPY, 20))
    passes = model.scheduler.stats.passes
    got = _run(rt, wasm, ["speculative", "tiny", COPY, "20", drafter])
    assert got == want
    # The tiny Qwen's greedy output repeats a token on this prompt: drafts are accepted.
    assert model.scheduler.stats.passes - passes < 20


def test_seeded_sampling_and_other_prompts_equal_plain(rt, wasm, model) -> None:
    want = asyncio.run(_plain(model, COPY, 12, seed=9, temperature=1.0))
    assert _run(rt, wasm, ["speculative", "tiny", COPY, "12", "ngram", "1.0", "9"]) == want
    want = asyncio.run(_plain(model, "Describe a cat.", 10))
    assert _run(rt, wasm, ["speculative", "tiny", "Describe a cat.", "10", "repeat"]) == want
