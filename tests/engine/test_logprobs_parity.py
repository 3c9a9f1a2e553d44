"""Streamed logprobs equal transformers' (``generate(output_logits=True)`` + log-softmax)
for text and image prompts: the chosen token's and the top alternatives, every step."""

from __future__ import annotations

import pytest
import torch

from engine import Context, Sampler, max_tokens, run_sync
from media import Image
from tests.engine.conftest import ATOL
from tests.engine.test_parity_media import IMG_A, _pil, gemma_processor, qwen_processor  # noqa: F401

STEPS, TOP = 6, 5


def _reference(ref, inputs: dict) -> tuple[list[int], torch.Tensor]:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0)
    saved = ref.generation_config.eos_token_id
    ref.generation_config.eos_token_id = None
    try:
        with torch.no_grad():
            out = ref.generate(
                **inputs, generation_config=config, output_logits=True, return_dict_in_generate=True
            )
    finally:
        ref.generation_config.eos_token_id = saved
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    return tokens, torch.log_softmax(torch.stack(out.logits)[:, 0].float(), dim=-1)


def _ours(model, build) -> list:
    async def run():
        async with Context(model) as ctx:
            build(ctx)
            return [ev async for ev in ctx.stream(Sampler.greedy(), max_tokens(STEPS), logprobs=TOP)]

    return run_sync(run())


def _check(events, tokens, ref_lp) -> None:
    assert [e.token for e in events] == tokens
    for step, ev in enumerate(events):
        lp = ref_lp[step]
        # log-softmax of logits that agree within ATOL (conftest) moves by at most ~2 ATOL.
        assert abs(ev.logprob - float(lp[ev.token])) < 2 * ATOL
        ids = [t for t, _ in ev.top_logprobs]
        assert ids == lp.topk(TOP).indices.tolist()
        for t, v in ev.top_logprobs:
            assert abs(v - float(lp[t])) < 2 * ATOL


@pytest.mark.parametrize("family", ["qwen", "gemma"])
def test_text_logprobs(request, family: str) -> None:
    model, ref = request.getfixturevalue(family), request.getfixturevalue(f"{family}_ref")
    ids = model.tokenize("Once upon a time, in a quiet town,")
    inputs = {"input_ids": torch.tensor([ids])}
    if family == "qwen":
        inputs["mm_token_type_ids"] = torch.zeros(1, len(ids), dtype=torch.long)
    tokens, lp = _reference(ref, inputs)
    _check(_ours(model, lambda ctx: ctx.fill_tokens(ids)), tokens, lp)


def test_image_logprobs(qwen, qwen_ref, qwen_processor) -> None:  # noqa: F811
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    prompt = qwen_processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = dict(qwen_processor(text=[prompt], images=[_pil(IMG_A)], return_tensors="pt"))
    tokens, lp = _reference(qwen_ref, inputs)
    _check(_ours(qwen, lambda ctx: ctx.user(Image.from_bytes(IMG_A), "What is it?").cue()), tokens, lp)


def test_gemma_image_logprobs(gemma, gemma_ref, gemma_processor) -> None:  # noqa: F811
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    prompt = gemma_processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = dict(
        gemma_processor(text=[prompt], images=[_pil(IMG_A)], max_soft_tokens=70, return_tensors="pt")
    )
    tokens, lp = _reference(gemma_ref, inputs)
    image = gemma.prepare(Image.from_bytes(IMG_A), max_soft_tokens=70)
    _check(_ours(gemma, lambda ctx: ctx.user(image, "What is it?").cue()), tokens, lp)
