"""Gemma-4 features the tiny fixture leaves off, on a variant built here: KV sharing
(``num_kv_shared_layers``: the last layers read the K/V pages of earlier ones) and
bidirectional attention inside image blocks (``use_bidirectional_attention="vision"``)."""

from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pytest
import torch

from engine import Model, Sampler, SyncContext, max_tokens
from media import Image
from tests.engine.conftest import assert_logits_close, reference_greedy, reference_logits
from tests.engine.test_parity_media import _pil, _without_video

PROMPT = "Hello there, tell me a long story about a cat who lives in a small village near the sea."


@pytest.fixture(scope="module")
def variant(tmp_path_factory, gemma):
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from fixtures import tiny_gemma4

    cfg = tiny_gemma4.config_dict()
    text = dict(cfg["text_config"])
    text.update(
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        num_kv_shared_layers=2,
        use_bidirectional_attention="vision",
    )
    cfg["text_config"] = text
    torch.manual_seed(7)
    ref = Gemma4ForConditionalGeneration(Gemma4Config(**cfg)).eval()
    assert ref.config.text_config.kv_sharing_modes == ["store", "store", "reuse", "reuse"]
    folder = tmp_path_factory.mktemp("gemma4-variant")
    ref.save_pretrained(folder)
    for f in gemma.path.iterdir():
        if (
            f.is_file()
            and f.suffix != ".safetensors"
            and f.name not in ("config.json", "generation_config.json")
        ):
            shutil.copy(f, folder / f.name)
    model = Model.load(folder, kv_pages=128, device="cpu")
    return model, ref


def test_shared_layers_own_no_pages(variant):
    model, _ = variant
    layers = model.pool.layers
    assert [lay.shares_with for lay in layers] == [None, None, 0, 1]
    assert model.pool.k[2] is None and model.pool.k[3] is None


def test_kv_sharing_text_parity(variant):
    model, ref = variant
    ctx = SyncContext(model).user(PROMPT).cue()
    ids = ctx.token_ids
    assert len(ids) > 16
    ours = ctx.flush(return_logits=True)
    theirs = reference_logits(ref, input_ids=torch.tensor([ids]))
    assert_logits_close(ours, theirs, "gemma4 variant with KV sharing, text")
    out = ctx.generate(Sampler.greedy(), max_tokens(16)).tokens
    assert out == reference_greedy(ref, 16, input_ids=torch.tensor([ids]))
    ctx.close()


def test_bidirectional_image_blocks(variant):
    from PIL import Image as PILImage
    from transformers import (
        AutoTokenizer,
        Gemma4AudioFeatureExtractor,
        Gemma4ImageProcessorPil,
        Gemma4Processor,
    )

    model, ref = variant
    assert model.runner.block_overlay_layers == {0, 2}
    tok = AutoTokenizer.from_pretrained(model.path)
    settings = json.loads((model.path / "processor_config.json").read_text())
    processor = _without_video(Gemma4Processor)(
        feature_extractor=Gemma4AudioFeatureExtractor.from_pretrained(model.path),
        image_processor=Gemma4ImageProcessorPil.from_pretrained(model.path),
        tokenizer=tok,
        video_processor=None,
        chat_template=tok.chat_template,
        image_seq_length=settings["image_seq_length"],
        audio_seq_length=settings["audio_seq_length"],
        audio_ms_per_token=settings["audio_ms_per_token"],
    )
    pixels = np.random.default_rng(5).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    PILImage.fromarray(pixels, "RGB").save(buf, format="PNG")
    data = buf.getvalue()
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
    prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = dict(processor(text=[prompt], images=[_pil(data)], max_soft_tokens=70, return_tensors="pt"))

    def build():
        img = model.prepare(Image.from_bytes(data), max_soft_tokens=70)
        return SyncContext(model).user(img, "Describe.").cue()

    ctx = build()
    assert ctx.token_ids == inputs["input_ids"][0].tolist()
    ours = ctx.flush(return_logits=True)
    theirs = reference_logits(ref, **inputs)
    assert_logits_close(ours, theirs, "gemma4 variant, bidirectional image blocks + KV sharing")
    # the block mask matters: a causal-only pass would differ
    causal = reference_logits(ref, **{k: v for k, v in inputs.items() if k != "mm_token_type_ids"})
    assert (causal - theirs).abs().max().item() > 1e-3
    ctx.close()
    ctx = build()
    assert ctx.generate(Sampler.greedy(), max_tokens(16)).tokens == reference_greedy(ref, 16, **inputs)
    ctx.close()
