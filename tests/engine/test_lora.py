"""LoRA adapters: per-row application in one batched pass equals peft's merged weights.

Tolerance: the conftest's ATOL (1e-4 on float32 logits). Ours computes
``base(x) + s * (x A^T) B^T`` where peft's merged model computes ``x (W + s B A)^T``: the
same float32 products summed in another order, ~1e-6 at these magnitudes; a missing,
misplaced or wrongly scaled adapter moves logits by 1e-2 or more (asserted below).
"""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch

from engine import AdapterMismatchError, AdapterNotFoundError, Context, Model, SyncContext
from fixtures.tiny_lora import build_adapter
from media import Image
from tests.engine.conftest import TINY_GEMMA, TINY_QWEN, assert_logits_close, reference_logits

NAMES = [TINY_QWEN, TINY_GEMMA]
PROMPTS = ["Tell me about cats.", "Why is the sea blue?", "Count to five please."]


@pytest.fixture(scope="module")
def lora_dirs(tmp_path_factory, tiny_dir):
    root = tmp_path_factory.mktemp("lora")
    return {
        name: [build_adapter(tiny_dir(name), root / f"{name}-{seed}", seed=seed) for seed in (1, 2)]
        for name in NAMES
    }


def _merged(model_dir, adapter_dir):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    base = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()


def _ref_inputs(name: str, ids: list[int]) -> dict[str, torch.Tensor]:
    inputs = {"input_ids": torch.tensor([ids])}
    if name == TINY_QWEN:
        inputs["mm_token_type_ids"] = torch.zeros(1, len(ids), dtype=torch.long)
    return inputs


@pytest.mark.parametrize("name", NAMES)
def test_two_adapters_and_none_in_one_pass(models, refs, lora_dirs, name):
    model = models[name]
    a, b = (model.load_adapter(d) for d in lora_dirs[name])
    ctxs = [Context(model).user(p).cue() for p in PROMPTS]
    ctxs[0].adapters.push(a)
    ctxs[1].adapters.push(b)

    async def flush_all():
        return await asyncio.gather(*(c.flush(return_logits=True) for c in ctxs))

    before = model.scheduler.stats.passes
    ours = asyncio.run(flush_all())
    assert model.scheduler.stats.passes - before == 1  # one batched pass for all three
    for ctx, logits, adapter_dir in zip(ctxs, ours, [*lora_dirs[name], None], strict=True):
        ids = ctx.token_ids
        ref_model = refs[name] if adapter_dir is None else _merged(model.path, adapter_dir)
        ref = reference_logits(ref_model, **_ref_inputs(name, ids))
        assert_logits_close(logits, ref, f"lora {name} {adapter_dir and adapter_dir.name}")
        if adapter_dir is not None:  # the adapter matters: base logits differ clearly
            base = reference_logits(refs[name], **_ref_inputs(name, ids))
            assert (logits - base).abs().max().item() > 1e-2
        ctx.close()


@pytest.mark.parametrize("name", NAMES)
def test_adapter_with_image_equals_merged_checkpoint(models, lora_dirs, tmp_path, name):
    """With media in the context: ours + adapter equals our engine on peft's merged
    checkpoint (the engine itself matches transformers with images: test_parity_media)."""
    model = models[name]
    merged_dir = tmp_path / "merged"
    shutil.copytree(model.path, merged_dir, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    _merged(model.path, lora_dirs[name][0]).save_pretrained(merged_dir)
    merged = Model.load(merged_dir, kv_pages=128, device="cpu")
    image = Image.from_bytes(_png())
    adapter = model.load_adapter(lora_dirs[name][0])
    ctx = SyncContext(model).user(image, "What is this?").cue()
    ctx.adapters.push(adapter)
    ours = ctx.flush(return_logits=True)
    ref = SyncContext(merged).user(image, "What is this?").cue().flush(return_logits=True)
    assert_logits_close(ours, ref, f"lora image {name}")
    ctx.close()


def _png() -> bytes:
    import io

    import numpy as np
    from PIL import Image as PILImage

    pixels = np.random.default_rng(3).integers(0, 255, (40, 56, 3), dtype=np.uint8)
    buf = io.BytesIO()
    PILImage.fromarray(pixels, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def test_stack_pop_and_clear_return_to_base(qwen, lora_dirs):
    a, b = (qwen.load_adapter(d) for d in lora_dirs[TINY_QWEN])
    base = SyncContext(qwen).user(PROMPTS[0]).cue().flush(return_logits=True)
    ctx = SyncContext(qwen)
    ctx.adapters.push(a, scale=0.5)
    ctx.adapters.push(b, scale=2.0)
    assert len(ctx.adapters) == 2
    assert ctx.adapters.pop() is b
    ctx.adapters.clear()
    out = ctx.user(PROMPTS[0]).cue().flush(return_logits=True)
    assert_logits_close(out, base, "lora cleared")


def test_adapter_that_does_not_fit(qwen, gemma, lora_dirs, tmp_path):
    with pytest.raises(AdapterMismatchError) as e:
        gemma.load_adapter(lora_dirs[TINY_QWEN][0])
    assert e.value.code == "adapter_mismatch"
    with pytest.raises(AdapterNotFoundError):
        qwen.load_adapter(tmp_path / "nothing")
    with pytest.raises(AdapterMismatchError):
        SyncContext(qwen).adapters.pop()


LONG = "Once upon a time a small cat lived by the sea and watched the boats come and go. " * 3


def test_prefix_cache_never_shares_pages_across_adapter_stacks(qwen, refs, lora_dirs):
    """Pages published under an adapter are reused by the same stack only: a context with
    no adapter (or another) recomputes them and gets its own model's logits."""
    a, b = (qwen.load_adapter(d) for d in lora_dirs[TINY_QWEN])
    runner = qwen.runner

    def run(*stack):
        ctx = SyncContext(qwen).user(LONG).cue()
        for adapter in stack:
            ctx.adapters.push(adapter)
        before = runner.rows_computed
        ctx.flush()
        logits = ctx.next_token_logits().clone()
        computed = runner.rows_computed - before
        ids = ctx.token_ids
        ctx.close()
        return logits, computed, ids

    first, n_first, ids = run(a)
    assert n_first == len(ids)  # nothing published yet under this stack
    again, n_again, _ = run(a)
    assert n_again < len(ids) // 2  # same stack: the published pages are reused
    assert_logits_close(again, first, "lora prefix reuse same adapter")
    for stack, ref_model in (((), refs[TINY_QWEN]), ((b,), _merged(qwen.path, lora_dirs[TINY_QWEN][1]))):
        logits, n, _ = run(*stack)
        ref = reference_logits(ref_model, **_ref_inputs(TINY_QWEN, ids))[-1]
        assert_logits_close(logits, ref, f"lora prefix other stack {len(stack)}")
    both, n_both, _ = run(a, b)
    assert n_both == len(ids)  # a stack that starts with a is still another stack


def test_wrapping_keeps_the_checkpoint_layout(tiny_dir, lora_dirs):
    """A model with adapters loaded saves (state_dict) exactly as without them."""
    model = Model.load(tiny_dir(TINY_QWEN), kv_pages=16, device="cpu")
    before = {k: v.data_ptr() for k, v in model.hf.state_dict().items()}
    model.load_adapter(lora_dirs[TINY_QWEN][0])
    after = {k: v.data_ptr() for k, v in model.hf.state_dict().items()}
    assert after == before  # same names, same tensors (nothing copied)


def test_page_straddling_a_push_is_not_taken_for_one_computed_under_the_adapter(qwen, tiny_dir, lora_dirs):
    """A page whose first rows were computed without the adapter and the rest with it is
    published under both stacks, so a context that runs the whole page under the adapter
    never reuses it: it computes the page and gets the logits a cold cache gives."""
    ps = qwen.pool.page_size
    ids = SyncContext(qwen).fill(LONG * 2).token_ids[: 3 * ps + 3]
    assert len(ids) == 3 * ps + 3

    def run(model: Model, push_at: int) -> torch.Tensor:
        """Fill ``ids`` with the adapter pushed after row ``push_at`` (flushed before)."""
        adapter = model.load_adapter(lora_dirs[TINY_QWEN][0])
        ctx = SyncContext(model).fill_tokens(ids[:push_at])
        ctx.flush()
        ctx.adapters.push(adapter)
        ctx.fill_tokens(ids[push_at:]).flush()  # hidden state only: the prefix cache is used
        logits = ctx.next_token_logits().clone()
        ctx.close()
        return logits

    run(qwen, ps + ps // 2)  # publishes page 1 with rows computed under two stacks
    warm = run(qwen, ps)  # page 1 all under the adapter: must not reuse that page
    cold = run(Model.load(tiny_dir(TINY_QWEN), kv_pages=64, device="cpu"), ps)
    assert_logits_close(warm, cold, "lora page straddling a push")
