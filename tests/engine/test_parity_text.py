"""Text prompts: logits at every position and greedy tokens equal transformers'."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine import Context, Sampler, SyncContext, max_tokens
from tests.engine.conftest import (
    TINY_GEMMA,
    TINY_QWEN,
    assert_logits_close,
    reference_greedy,
    reference_logits,
)

NAMES = [TINY_QWEN, TINY_GEMMA]
PROMPT = "Hello there, tell me a long story about a cat who lives in a small village near the sea."


def _ref_inputs(name: str, ids: list[int]) -> dict[str, torch.Tensor]:
    inputs = {"input_ids": torch.tensor([ids])}
    if name == TINY_QWEN:
        inputs["mm_token_type_ids"] = torch.zeros(1, len(ids), dtype=torch.long)
    return inputs


def _chat(model) -> SyncContext:
    return SyncContext(model).system("You are terse.").user(PROMPT).cue()


@pytest.mark.parametrize("name", NAMES)
def test_prompt_ids_equal_the_template(models, name):
    model = models[name]
    ctx = _chat(model)
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
        {"role": "user", "content": [{"type": "text", "text": PROMPT}]},
    ]
    text = model.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ctx.token_ids == model.tokenizer.encode(text, add_special_tokens=False)
    ctx.close()


@pytest.mark.parametrize("name", NAMES)
def test_logits_at_every_position(models, refs, name):
    model = models[name]
    ctx = _chat(model)
    ids = ctx.token_ids
    if name == TINY_GEMMA:
        assert len(ids) > model.hf.config.text_config.sliding_window  # the sliding path is exercised
    ours = ctx.flush(return_logits=True)
    ref = reference_logits(refs[name], **_ref_inputs(name, ids))
    assert_logits_close(ours, ref, f"text prompt, {name}")
    ctx.close()


@pytest.mark.parametrize("name", NAMES)
def test_chunked_prefill_equals_one_pass(models, refs, name):
    model = models[name]
    ids = _chat(model).token_ids
    saved = model.max_prefill_rows
    model.max_prefill_rows = 7
    try:
        ctx = SyncContext(model).fill_tokens(ids)
        ours = ctx.flush(return_logits=True)
    finally:
        model.max_prefill_rows = saved
    ref = reference_logits(refs[name], **_ref_inputs(name, ids))
    assert_logits_close(ours, ref, f"text prompt in 7-row prefill chunks, {name}")
    ctx.close()


@pytest.mark.parametrize("name", NAMES)
def test_greedy_32_tokens(models, refs, name):
    model = models[name]
    ctx = _chat(model)
    ids = ctx.token_ids
    out = ctx.generate(Sampler.greedy(), max_tokens(32))
    assert out.finish_reason == "length" and len(out.tokens) == 32
    assert out.tokens == reference_greedy(refs[name], 32, **_ref_inputs(name, ids))
    assert ctx.token_ids == ids + out.tokens
    assert ctx.pending == 1  # the last sampled token waits for the next pass
    ctx.close()


@pytest.mark.parametrize("name", NAMES)
def test_concurrent_generations_share_passes(models, name):
    """Contexts generating together are batched into shared passes and get the tokens
    they get alone."""
    model = models[name]
    prompts = ["Say one thing.", PROMPT, "Another, somewhat longer, request about the sea and boats."]

    def alone(p):
        ctx = SyncContext(model).user(p).cue()
        toks = ctx.generate(Sampler.greedy(), max_tokens(12)).tokens
        ctx.close()
        return toks

    expected = [alone(p) for p in prompts]

    async def together():
        ctxs = [Context(model).user(p).cue() for p in prompts]
        before = model.scheduler.stats.max_steps_in_pass
        outs = await asyncio.gather(*(c.generate(Sampler.greedy(), max_tokens(12)) for c in ctxs))
        for c in ctxs:
            c.close()
        return [o.tokens for o in outs], before

    got, _ = asyncio.run(together())
    assert got == expected
    assert model.scheduler.stats.max_steps_in_pass >= len(prompts)


def test_stream_yields_every_token_and_the_text(qwen):
    ctx = SyncContext(qwen).user(PROMPT).cue()
    events = list(ctx.stream(Sampler.greedy(), max_tokens(10)))
    assert len(events) == 10 and events[-1].done is not None and events[-1].done.kind == "length"
    assert all(e.done is None for e in events[:-1])
    text = "".join(e.text for e in events)
    assert text == qwen.detokenize([e.token for e in events], skip_special_tokens=True)
    ctx.close()


def test_decode_step_dist_is_the_softmax(gemma, gemma_ref):
    ctx = SyncContext(gemma).user(PROMPT).cue()
    ids = ctx.token_ids
    dist = ctx.decode_step_dist()
    ref = reference_logits(gemma_ref, input_ids=torch.tensor([ids]))[-1].softmax(-1)
    assert dist.ids.shape == dist.probs.shape
    assert torch.all(dist.probs[:-1] >= dist.probs[1:])
    assert torch.allclose(dist.probs, ref[dist.ids], atol=1e-6)
    top = ctx.decode_step_dist(Sampler.top_k(1.0, 5))
    assert len(top.ids) == 5 and abs(float(top.probs.sum()) - 1) < 1e-5
    # sampling what decode_step_dist ranked first and filling it continues like greedy
    ctx.fill_tokens([int(dist.ids[0])])
    g = ctx.generate(Sampler.greedy(), max_tokens(4)).tokens
    ref_tokens = reference_greedy(gemma_ref, 5, input_ids=torch.tensor([ids]))
    assert [int(dist.ids[0]), *g] == ref_tokens
    ctx.close()


def test_seeded_sampling_is_reproducible(gemma):
    def run(seed):
        ctx = SyncContext(gemma, seed=seed).user(PROMPT).cue()
        toks = ctx.generate(Sampler.top_p(1.0, 0.9), max_tokens(16)).tokens
        ctx.close()
        return toks

    assert run(7) == run(7)
    assert run(7) != run(8)
