"""Beam search equals transformers' ``generate(num_beams=..., do_sample=False)``: the
returned sequences and their scores, on text and image prompts; beams share pages."""

from __future__ import annotations

import pytest
import torch

from engine import SyncContext
from media import Image
from tests.engine.conftest import ATOL
from tests.engine.test_parity_media import IMG_A, _pil, gemma_processor, qwen_processor  # noqa: F401

WIDTH, STEPS = 4, 6


def _reference(ref, inputs: dict, length_penalty: float) -> tuple[list[list[int]], list[float]]:
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=STEPS,
        do_sample=False,
        num_beams=WIDTH,
        num_return_sequences=WIDTH,
        length_penalty=length_penalty,
        eos_token_id=None,
        pad_token_id=0,
    )
    saved = ref.generation_config.eos_token_id
    ref.generation_config.eos_token_id = None
    try:
        with torch.no_grad():
            out = ref.generate(
                **inputs, generation_config=config, output_scores=True, return_dict_in_generate=True
            )
    finally:
        ref.generation_config.eos_token_id = saved
    n = inputs["input_ids"].shape[1]
    return out.sequences[:, n:].tolist(), out.sequences_scores.tolist()


def _check(hyps, sequences, scores) -> None:
    assert [list(h.tokens) for h in hyps] == sequences
    for h, s in zip(hyps, scores, strict=True):
        # Sums of STEPS log-softmax values, each within ~2 ATOL of the reference (conftest).
        assert abs(h.score - s) < 2 * ATOL * STEPS


@pytest.mark.parametrize("family", ["qwen", "gemma"])
@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
def test_text_beams_equal_transformers(request, family: str, length_penalty: float) -> None:
    model, ref = request.getfixturevalue(family), request.getfixturevalue(f"{family}_ref")
    ids = model.tokenize("The old lighthouse keeper said")
    inputs = {"input_ids": torch.tensor([ids])}
    if family == "qwen":
        inputs["mm_token_type_ids"] = torch.zeros(1, len(ids), dtype=torch.long)
    sequences, scores = _reference(ref, inputs, length_penalty)
    ctx = SyncContext(model).fill_tokens(ids)
    hyps = ctx.beam_search(WIDTH, STEPS, length_penalty=length_penalty, eos=(), num_return=WIDTH)
    _check(hyps, sequences, scores)
    assert len(ctx) == len(ids)  # the context itself is left as it was
    ctx.close()


def test_image_beams_equal_transformers(qwen, qwen_ref, qwen_processor) -> None:  # noqa: F811
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    prompt = qwen_processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = dict(qwen_processor(text=[prompt], images=[_pil(IMG_A)], return_tensors="pt"))
    sequences, scores = _reference(qwen_ref, inputs, 1.0)
    ctx = SyncContext(qwen).user(Image.from_bytes(IMG_A), "What is it?").cue()
    before = qwen.pool_stats().in_use
    hyps = ctx.beam_search(WIDTH, STEPS, eos=(), num_return=WIDTH)
    _check(hyps, sequences, scores)
    assert qwen.pool_stats().in_use == before  # every beam closed, its pages returned
    ctx.close()


def test_beam_search_arguments(qwen) -> None:
    from engine import InvalidRequestError

    ctx = SyncContext(qwen).fill("Hi")
    with pytest.raises(InvalidRequestError):
        ctx.beam_search(0, 4)
    with pytest.raises(InvalidRequestError):
        ctx.beam_search(2, 4, num_return=3)
    best = ctx.beam_search(2, 3)
    assert len(best) == 1 and best[0].finish_reason in ("eos", "length")
    ctx.close()


def test_gemma_image_beams_equal_transformers(gemma, gemma_ref, gemma_processor) -> None:  # noqa: F811
    """Gemma-4 with an image: the media block attends bidirectionally and the prompt is
    longer than the sliding window; beams fork after it and still equal the reference."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    prompt = gemma_processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = dict(
        gemma_processor(text=[prompt], images=[_pil(IMG_A)], max_soft_tokens=70, return_tensors="pt")
    )
    sequences, scores = _reference(gemma_ref, inputs, 1.0)
    image = gemma.prepare(Image.from_bytes(IMG_A), max_soft_tokens=70)
    ctx = SyncContext(gemma).user(image, "What is it?").cue()
    hyps = ctx.beam_search(WIDTH, STEPS, eos=(), num_return=WIDTH)
    _check(hyps, sequences, scores)
    ctx.close()
