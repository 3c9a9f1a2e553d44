"""Prompts with images, video and audio: the engine's token ids, logits at every
position and greedy tokens equal the transformers reference's.

Images and audio go through the reference processors (PIL image processors and the
Gemma-4 feature extractor work without torchvision). The reference video processors need
torchvision, so video prompts feed the reference model the pixel tensors and ids our
encoder prepared (the encoder's own tests hold those to the reference formulas); what is
checked here is the engine's part: splicing, positions, masks, KV.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch

from engine import Sampler, SyncContext, max_tokens
from media import Audio, Image, Video
from tests.engine.conftest import assert_logits_close, reference_greedy, reference_logits


def _without_video(processor_class):
    class WithoutVideo(processor_class):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument is None and argument_name == "video_processor":
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return WithoutVideo


@pytest.fixture(scope="module")
def qwen_processor(qwen):
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen3VLProcessor

    tok = AutoTokenizer.from_pretrained(qwen.path)
    return _without_video(Qwen3VLProcessor)(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(qwen.path),
        tokenizer=tok,
        video_processor=None,
        chat_template=tok.chat_template,
    )


@pytest.fixture(scope="module")
def gemma_processor(gemma):
    from transformers import (
        AutoTokenizer,
        Gemma4AudioFeatureExtractor,
        Gemma4ImageProcessorPil,
        Gemma4Processor,
    )

    tok = AutoTokenizer.from_pretrained(gemma.path)
    settings = json.loads((gemma.path / "processor_config.json").read_text())
    return _without_video(Gemma4Processor)(
        feature_extractor=Gemma4AudioFeatureExtractor.from_pretrained(gemma.path),
        image_processor=Gemma4ImageProcessorPil.from_pretrained(gemma.path),
        tokenizer=tok,
        video_processor=None,
        chat_template=tok.chat_template,
        image_seq_length=settings["image_seq_length"],
        audio_seq_length=settings["audio_seq_length"],
        audio_ms_per_token=settings["audio_ms_per_token"],
    )


def _png(width: int, height: int, seed: int) -> bytes:
    from PIL import Image as PILImage

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    PILImage.fromarray(pixels, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def _pil(data: bytes):
    from PIL import Image as PILImage

    return PILImage.open(io.BytesIO(data)).convert("RGB")


IMG_A, IMG_B = _png(64, 64, 1), _png(80, 48, 2)


def _compare(ctx: SyncContext, ref, inputs, label: str) -> float:
    assert ctx.token_ids == inputs["input_ids"][0].tolist()
    ours = ctx.flush(return_logits=True)
    theirs = reference_logits(ref, **inputs)
    return assert_logits_close(ours, theirs, label)


def _greedy_matches(model, build, ref, inputs, n: int = 32) -> None:
    ctx = build()
    out = ctx.generate(Sampler.greedy(), max_tokens(n)).tokens
    ctx.close()
    assert out == reference_greedy(ref, n, **inputs)


# ------------------------------------------------------------------------------ Qwen3-VL


def _qwen_image_prompt(qwen, qwen_processor, images: list[bytes], text: str):
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    messages = [{"role": "user", "content": content}]
    prompt = qwen_processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = qwen_processor(text=[prompt], images=[_pil(b) for b in images], return_tensors="pt")

    def build():
        return SyncContext(qwen).user(*[Image.from_bytes(b) for b in images], text).cue()

    return build, dict(inputs)


def test_qwen_image(qwen, qwen_ref, qwen_processor):
    build, inputs = _qwen_image_prompt(qwen, qwen_processor, [IMG_A], "Describe this image.")
    ctx = build()
    _compare(ctx, qwen_ref, inputs, "qwen image")
    ctx.close()
    _greedy_matches(qwen, build, qwen_ref, inputs)


def test_qwen_multi_image_with_text_between(qwen, qwen_ref, qwen_processor):
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "First this one."},
                {"type": "image"},
                {"type": "text", "text": "Then this one. What differs?"},
            ],
        }
    ]
    prompt = qwen_processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = dict(qwen_processor(text=[prompt], images=[_pil(IMG_A), _pil(IMG_B)], return_tensors="pt"))

    def build():
        a, b = Image.from_bytes(IMG_A), Image.from_bytes(IMG_B)
        return SyncContext(qwen).user(a, "First this one.", b, "Then this one. What differs?").cue()

    ctx = build()
    # M-RoPE: text after an image continues at anchor + position_span, not + row count
    assert ctx.position < len(ctx)
    _compare(ctx, qwen_ref, inputs, "qwen multi image with text between")
    ctx.close()
    _greedy_matches(qwen, build, qwen_ref, inputs)


def _video_inputs(model, ctx: SyncContext, prepared) -> dict[str, torch.Tensor]:
    ids = ctx.token_ids
    types = torch.zeros(1, len(ids), dtype=torch.long)
    (span,) = ctx.spans
    types[0, list(span.rows)] = torch.tensor(prepared.mm_token_type, dtype=torch.long)
    return {"input_ids": torch.tensor([ids]), "mm_token_type_ids": types, **prepared.inputs}


def test_qwen_video(qwen, qwen_ref, samples):
    video = Video.from_path(samples / "video" / "animated_160x120_10fps_2s.gif")

    def build():
        return SyncContext(qwen).user(qwen.prepare(video), "What happens?").cue()

    ctx = build()
    prepared = qwen.prepare(video)
    assert prepared.grid[0] >= 2 and prepared.timestamps
    inputs = _video_inputs(qwen, ctx, prepared)
    marker = "<|vision_start|><|video_pad|><|vision_end|>"
    text = qwen.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert marker in text
    expanded = text.replace(marker, qwen.detokenize(prepared.input_ids))
    assert ctx.token_ids == qwen.tokenizer.encode(expanded, add_special_tokens=False)
    _compare(ctx, qwen_ref, inputs, "qwen video")
    ctx.close()
    _greedy_matches(qwen, build, qwen_ref, inputs)


def test_qwen_image_then_video_then_text(qwen, qwen_ref, samples):
    """Images and videos in one prompt: DeepStack rows of both kinds, positions chained."""
    video = Video.from_path(samples / "video" / "animated_160x120_10fps_2s.gif")
    ctx = SyncContext(qwen).user(Image.from_bytes(IMG_A), "and", qwen.prepare(video), "compare").cue()
    img = qwen.prepare(Image.from_bytes(IMG_A))
    vid = qwen.prepare(video)
    types = torch.zeros(1, len(ctx), dtype=torch.long)
    img_span, vid_span = ctx.spans
    assert img_span.prepared.kind == "image" and vid_span.prepared.kind == "video"
    types[0, list(img_span.rows)] = torch.tensor(img.mm_token_type)
    types[0, list(vid_span.rows)] = torch.tensor(vid.mm_token_type)
    inputs = {
        "input_ids": torch.tensor([ctx.token_ids]),
        "mm_token_type_ids": types,
        **img.inputs,
        **vid.inputs,
    }
    _compare(ctx, qwen_ref, inputs, "qwen image then video then text")
    ctx.close()


# ------------------------------------------------------------------------------ Gemma-4


def test_gemma_image(gemma, gemma_ref, gemma_processor):
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}]}
    ]
    prompt = gemma_processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = dict(
        gemma_processor(text=[prompt], images=[_pil(IMG_A)], max_soft_tokens=70, return_tensors="pt")
    )

    def build():
        return (
            SyncContext(gemma)
            .user(gemma.prepare(Image.from_bytes(IMG_A), max_soft_tokens=70), "Describe this image.")
            .cue()
        )

    ctx = build()
    assert len(ctx) > gemma.hf.config.text_config.sliding_window
    _compare(ctx, gemma_ref, inputs, "gemma image")
    ctx.close()
    _greedy_matches(gemma, build, gemma_ref, inputs)


def test_gemma_multi_image(gemma, gemma_ref, gemma_processor):
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "and"},
                {"type": "image"},
                {"type": "text", "text": "Same?"},
            ],
        }
    ]
    prompt = gemma_processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = dict(
        gemma_processor(
            text=[prompt], images=[_pil(IMG_A), _pil(IMG_B)], max_soft_tokens=70, return_tensors="pt"
        )
    )

    def build():
        a = gemma.prepare(Image.from_bytes(IMG_A), max_soft_tokens=70)
        b = gemma.prepare(Image.from_bytes(IMG_B), max_soft_tokens=70)
        return SyncContext(gemma).user(a, "and", b, "Same?").cue()

    ctx = build()
    _compare(ctx, gemma_ref, inputs, "gemma multi image")
    ctx.close()
    _greedy_matches(gemma, build, gemma_ref, inputs)


def test_gemma_audio(gemma, gemma_ref, gemma_processor, samples):
    path = samples / "audio" / "tone_16k_mono.wav"
    audio = Audio.from_path(path)
    messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "Transcribe."}]}]
    prompt = gemma_processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = dict(gemma_processor(text=[prompt], audio=[audio.mono_at(16000)], return_tensors="pt"))

    def build():
        return SyncContext(gemma).user(Audio.from_path(path), "Transcribe.").cue()

    ctx = build()
    _compare(ctx, gemma_ref, inputs, "gemma audio")
    ctx.close()
    _greedy_matches(gemma, build, gemma_ref, inputs)


def test_gemma_video(gemma, gemma_ref, samples):
    video = Video.from_path(samples / "video" / "animated_160x120_10fps_2s.gif")
    prepared = gemma.prepare(video, num_frames=4)

    def build():
        return SyncContext(gemma).user(prepared, "What happens?").cue()

    ctx = build()
    # the ids equal the template text with the processor's expansion of <|video|> ("MM:SS
    # <|image>...<image|>" per frame), tokenized as one string
    text = gemma.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    expanded = text.replace("<|video|>", gemma.detokenize(prepared.input_ids))
    assert ctx.token_ids == gemma.tokenizer.encode(expanded, add_special_tokens=False)
    inputs = _video_inputs(gemma, ctx, prepared)
    inputs.setdefault("num_frames_per_video", torch.tensor([prepared.inputs["pixel_values_videos"].shape[0]]))
    _compare(ctx, gemma_ref, inputs, "gemma video")
    ctx.close()
    _greedy_matches(gemma, build, gemma_ref, inputs)


# ------------------------------------------------------------------------------ pages and media


@pytest.mark.parametrize("which", ["qwen", "gemma"])
def test_different_images_never_share_a_page_identical_ones_do(request, which):
    model = request.getfixturevalue(which)
    ps = model.pool.page_size

    def ctx_with(image: bytes) -> SyncContext:
        ctx = SyncContext(model).fill("A long shared prefix " * 8)
        ctx.append_image(Image.from_bytes(image))
        ctx.fill(" and the same words after the image, long enough to fill a page or two" * 3)
        ctx.flush()
        return ctx

    a1, a2, b = ctx_with(IMG_A), ctx_with(IMG_A), ctx_with(_png(64, 64, 99))
    first_media = a1.spans[0].start
    full = a1.committed // ps
    shared_prefix = first_media // ps  # pages entirely before the image
    assert a1.token_ids == b.token_ids  # same ids: only the pixels differ
    assert a1.pages[:shared_prefix] == b.pages[:shared_prefix]
    assert not set(a1.pages[shared_prefix:]) & set(b.pages)
    assert a2.pages[: full - 1] == a1.pages[: full - 1]
    for c in (a1, a2, b):
        c.close()


def test_media_span_is_prefilled_whole_even_when_chunks_are_small(qwen, qwen_ref, qwen_processor):
    build, inputs = _qwen_image_prompt(qwen, qwen_processor, [IMG_A], "Describe this image.")
    saved = qwen.max_prefill_rows
    qwen.max_prefill_rows = 5
    try:
        ctx = build()
        _compare(ctx, qwen_ref, inputs, "media span is prefilled whole even when chunks are small")
        ctx.close()
    finally:
        qwen.max_prefill_rows = saved


def test_media_turn_then_fork(gemma):
    img = gemma.prepare(Image.from_bytes(IMG_A), max_soft_tokens=70)
    base = SyncContext(gemma).user(img, "Describe this image.")
    base.flush()
    child = base.fork().user("Shorter please.").cue()
    alone = SyncContext(gemma).user(img, "Describe this image.").user("Shorter please.").cue()
    assert child.token_ids == alone.token_ids
    assert (
        child.generate(Sampler.greedy(), max_tokens(8)).tokens
        == alone.generate(Sampler.greedy(), max_tokens(8)).tokens
    )
    for c in (base, child, alone):
        c.close()


def test_concurrent_contexts_with_one_image_encode_it_once(qwen):
    import asyncio

    from engine import Context

    data = _png(64, 64, 1234)  # an image no other test uses: not in the encoder cache yet
    calls = qwen.encoder.tower_calls

    async def go():
        ctxs = [Context(qwen).user(Image.from_bytes(data), f"Question {i}?").cue() for i in range(3)]
        outs = await asyncio.gather(*(c.generate(Sampler.greedy(), max_tokens(4)) for c in ctxs))
        for c in ctxs:
            c.close()
        return [o.tokens for o in outs]

    outs = asyncio.run(go())
    assert qwen.encoder.tower_calls == calls + 1
    alone = SyncContext(qwen).user(Image.from_bytes(data), "Question 1?").cue()
    assert alone.generate(Sampler.greedy(), max_tokens(4)).tokens == outs[1]
    alone.close()


def test_caption(qwen, tmp_path):
    from engine import caption
    from engine.caption import caption_many

    path = tmp_path / "a.png"
    path.write_bytes(IMG_A)
    a = caption(qwen, path, prompt="What is it?", max_tokens=5)
    b = caption(qwen, IMG_A, prompt="What is it?", max_tokens=5)
    ctx = SyncContext(qwen).user(Image.from_bytes(IMG_A), "What is it?").cue()
    expected = ctx.generate(Sampler.greedy(), max_tokens(5)).text
    ctx.close()
    assert a == b == expected
    assert caption_many(qwen, [IMG_A, path], prompt="What is it?", max_tokens=5) == [a, a]
