"""Gemma-4 preparation and towers against the transformers reference, on the tiny checkpoint (fp32).

The reference is run in the same process: ``Gemma4ImageProcessorPil``,
``Gemma4AudioFeatureExtractor``, ``Gemma4Processor`` (with ``video_processor=None``: the HF
video processor needs torchvision) and ``Gemma4ForConditionalGeneration``'s own
``get_image_features`` / ``get_audio_features`` / ``get_video_features``.

What is exact and what has a tolerance:

* image pixel values, position ids, token counts: exact (``torch.equal``) -- the same
  Pillow resize on the same uint8 pixels, and float32 values from a table holding exactly
  ``float32(uint8 * rescale_factor)``;
* audio log-mel features and masks: exact -- the same numpy float32 ``rfft``, float64
  matmul and log on the same samples, row for row;
* token spans (ids, mm_token_type, bidirectional blocks): exact;
* embeddings: ``atol 1e-5`` (values are ~0.3). Our vision batches are padded only to the
  longest item instead of to the ``max_soft_tokens * 9`` patches the processor pads to, so
  attention/pooling reduce over fewer (zero) terms and fp32 rounding differs by ~1e-7;
  audio batches pad exactly as the reference and come out bit-identical in practice.
* video: the reference video processor cannot run without torchvision, so the frame
  indices, per-frame token counts and timestamp text are checked against the reference's
  own functions (``default_sample_indices_fn``, ``get_aspect_ratio_preserving_size``,
  ``Gemma4Processor.replace_video_token``), frames against an independent PyAV decode
  (``transformers.video_utils.load_video``) put through torchvision's uint8 resize call
  (``interpolate(..., "bicubic", antialias=True)``) and the reference's patch layout, and
  the embeddings against ``get_video_features`` fed our inputs.
"""

from __future__ import annotations

import json
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from encoders import EncoderCache, UnsupportedMediaKindError, encoder_for  # noqa: E402
from encoders.gemma4 import SUPPORTED_SOFT_TOKENS, Gemma4Encoder  # noqa: E402
from fixtures.tiny_models import TINY_GEMMA4, ensure_tiny_model  # noqa: E402
from media import Audio, Image, Video  # noqa: E402
from media.errors import EmptyMediaError, InvalidRequestError, MediaTooLongError  # noqa: E402

EMBED_ATOL = 1e-5


# ----------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def folder() -> Path:
    return ensure_tiny_model(TINY_GEMMA4)


@pytest.fixture(scope="module")
def ref(folder):
    """The reference: processor (with its image processor, feature extractor, tokenizer) and model."""
    from transformers import (
        AutoTokenizer,
        Gemma4AudioFeatureExtractor,
        Gemma4ForConditionalGeneration,
        Gemma4ImageProcessorPil,
        Gemma4Processor,
    )

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # "channel dimension is ambiguous" for 1-px images

    class WithoutVideo(Gemma4Processor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument is None and argument_name == "video_processor":
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    settings = json.loads((folder / "processor_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    processor = WithoutVideo(
        feature_extractor=Gemma4AudioFeatureExtractor.from_pretrained(folder),
        image_processor=Gemma4ImageProcessorPil.from_pretrained(folder),
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=tokenizer.chat_template,
        image_seq_length=settings["image_seq_length"],
        audio_seq_length=settings["audio_seq_length"],
        audio_ms_per_token=settings["audio_ms_per_token"],
    )
    model = Gemma4ForConditionalGeneration.from_pretrained(folder).eval()
    yield processor, model
    transformers.logging.set_verbosity(verbosity)


@pytest.fixture(scope="module")
def enc(folder) -> Gemma4Encoder:
    return encoder_for(folder, cache=EncoderCache())


def _fresh(enc: Gemma4Encoder, folder: Path) -> Gemma4Encoder:
    """A new encoder (own cache and counters) sharing the already-loaded towers."""
    return encoder_for(folder, cache=EncoderCache(), towers=enc.towers)


def _image(samples: Path, name: str) -> Image:
    return Image.from_path(samples / "images" / name)


def _random_image(width: int, height: int, seed: int = 0) -> Image:
    rng = np.random.default_rng(seed)
    return Image.from_array(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _speechlike(seconds_or_samples: float | int, rate: int = 16_000, seed: int = 1) -> np.ndarray:
    n = seconds_or_samples if isinstance(seconds_or_samples, int) else int(round(seconds_or_samples * rate))
    rng = np.random.default_rng(seed)
    t = np.arange(n) / rate
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 3.0 * t)
    voice = sum(np.sin(2 * np.pi * f * t) / k for k, f in enumerate((180.0, 360.0, 720.0, 1440.0), start=1))
    return (0.2 * envelope * voice + 0.01 * rng.standard_normal(n)).astype(np.float32)


def _check_image(enc, processor, image: Image, budget: int | None) -> None:
    kw = {} if budget is None else {"max_soft_tokens": budget}
    ours = enc.prepare(image, **kw)
    theirs = processor.image_processor(image.to_pil(), return_tensors="pt", **kw)
    assert torch.equal(ours.inputs["pixel_values"], theirs["pixel_values"])
    assert torch.equal(ours.inputs["image_position_ids"], theirs["image_position_ids"])
    assert ours.inputs["pixel_values"].dtype == theirs["pixel_values"].dtype == torch.float32
    assert ours.inputs["image_position_ids"].dtype == theirs["image_position_ids"].dtype == torch.long
    assert ours.token_count == int(theirs["num_soft_tokens_per_image"][0])
    _, gh, gw = ours.grid
    assert gh * gw == ours.token_count
    # planning without pixels agrees with the processor's own count formula
    assert enc.image_token_count(image.width, image.height, budget) == ours.token_count
    if budget is None:
        counts = processor._get_num_multimodal_tokens(image_sizes=[[image.height, image.width]])
        assert counts.num_image_tokens == [ours.token_count]


def _runs(ids: list[int], start_id: int, end_id: int) -> list[list[int]]:
    """Every ``start_id ... end_id`` run in ``ids`` (inclusive)."""
    out, i = [], 0
    while i < len(ids):
        if ids[i] == start_id:
            j = ids.index(end_id, i)
            out.append(ids[i : j + 1])
            i = j + 1
        else:
            i += 1
    return out


# ----------------------------------------------------------------------------------------- construction


def test_kinds_tokens_and_settings(enc, ref):
    processor, model = ref
    assert enc.family == "gemma4" and enc.kinds == {"image", "video", "audio"}
    t = enc.tokens
    tok = processor.tokenizer
    assert t.image == processor.image_token_id == model.config.image_token_id
    assert t.boi == tok.convert_tokens_to_ids(processor.boi_token) == model.config.boi_token_id
    assert t.eoi == tok.convert_tokens_to_ids(processor.eoi_token) == model.config.eoi_token_id
    assert t.video == processor.video_token_id == model.config.video_token_id
    assert t.audio == processor.audio_token_id == model.config.audio_token_id
    assert t.boa == tok.convert_tokens_to_ids(processor.boa_token)
    assert t.eoa == tok.convert_tokens_to_ids(processor.eoa_token)
    ip, fe = processor.image_processor, processor.feature_extractor
    s, a = enc.image_settings, enc.audio_settings
    assert (s.patch_size, s.pooling_kernel_size, s.max_soft_tokens) == (
        ip.patch_size,
        ip.pooling_kernel_size,
        ip.max_soft_tokens,
    )
    assert (a.frame_length, a.hop_length, a.fft_length, a.feature_size) == (
        fe.frame_length,
        fe.hop_length,
        fe.fft_length,
        fe.feature_size,
    )
    assert enc.video_settings.max_soft_tokens == 70 and enc.video_settings.num_frames == 32
    # only the towers and their embedders were built, from the checkpoint
    assert set(enc.towers) == {"vision_tower", "embed_vision", "audio_tower", "embed_audio"}
    for name, module in enc.towers.items():
        reference = getattr(model.model, name).state_dict()
        for key, value in module.state_dict().items():
            assert torch.equal(value, reference[key]), f"{name}.{key}"


def test_checkpoint_without_audio_refuses_audio(folder, tmp_path, enc):
    config = json.loads((folder / "config.json").read_text())
    config.pop("audio_config")
    target = tmp_path / "gemma4-no-audio"
    target.mkdir()
    for f in folder.iterdir():
        if f.is_file() and f.name != "config.json":
            shutil.copy(f, target / f.name)
    (target / "config.json").write_text(json.dumps(config))
    no_audio = encoder_for(target)
    assert no_audio.kinds == {"image", "video"}
    assert set(no_audio.towers) == {"vision_tower", "embed_vision"}
    clip = Audio.from_array(_speechlike(1.0), 16_000)
    with pytest.raises(UnsupportedMediaKindError) as err:
        no_audio.prepare(clip)
    assert "gemma4-no-audio" in str(err.value) and err.value.kind == "audio"
    # images still work, with the same result as the full checkpoint
    img = _random_image(64, 48)
    a, b = no_audio.prepare(img), enc.prepare(img)
    assert a.input_ids == b.input_ids and torch.equal(a.inputs["pixel_values"], b.inputs["pixel_values"])


# ----------------------------------------------------------------------------------------- images


def test_image_every_sample_file(enc, ref, samples):
    """Every image in the samples (all formats and modes, decoded to RGB by media.Image) at the
    checkpoint's default budget. The reference gets the same decoded RGB pixels: turning
    RGBA/CMYK/16-bit/EXIF-rotated files into RGB is media's policy (tests/media), the
    preparation under test starts from RGB."""
    processor, _ = ref
    names = sorted(p.name for p in (samples / "images").iterdir() if p.is_file())
    assert len(names) >= 20
    for name in names:
        _check_image(enc, processor, _image(samples, name), None)


# Source modes where media.Image's RGB conversion is deliberately not ``load_image``'s
# ``convert("RGB")``: alpha is composited over white (as transformers' own ``convert_to_rgb``
# does, where load_image drops it), 16-bit keeps the high byte, float images are scaled.
_MEDIA_POLICY_MODES = {"RGBA", "LA", "I;16", "F"}


def test_image_files_end_to_end(enc, ref, samples):
    """Files given to the reference the way HF users do (``load_image``: Pillow decode, EXIF
    transpose, RGB) prepare to the same tensors as media.Image's decode + ours: RGB, grey,
    bilevel, palette, CMYK, GIF, WebP, AVIF, BMP, TIFF, ICO ..."""
    from transformers.image_utils import load_image

    processor, _ = ref
    checked = set()
    for path in sorted((samples / "images").iterdir()):
        image = Image.from_path(path)
        if image.source_mode in _MEDIA_POLICY_MODES:
            continue
        ours = enc.prepare(image, max_soft_tokens=70)
        theirs = processor.image_processor(load_image(str(path)), max_soft_tokens=70, return_tensors="pt")
        assert torch.equal(ours.inputs["pixel_values"], theirs["pixel_values"]), path.name
        checked.add(image.source_mode)
    assert {"RGB", "L", "1", "P", "CMYK"} <= checked


@pytest.mark.parametrize("budget", SUPPORTED_SOFT_TOKENS)
@pytest.mark.parametrize(
    "size",
    [(10, 10), (1, 500), (500, 1), (1, 37), (37, 1), (7, 13), (641, 479), (1000, 3), (48, 48), (1296, 960)],
    ids=lambda s: f"{s[0]}x{s[1]}",
)
def test_image_sizes_and_budgets(enc, ref, size, budget):
    processor, _ = ref
    _check_image(enc, processor, _random_image(*size, seed=size[0] * 7 + size[1]), budget)


@pytest.mark.parametrize("budget", SUPPORTED_SOFT_TOKENS)
def test_large_photo_every_budget(enc, ref, samples, budget):
    processor, _ = ref
    photo = _image(samples, "photo_4032x3024.jpg")
    _check_image(enc, processor, photo, budget)
    enc.cache.clear()


def test_image_parameters_are_validated(enc):
    img = _random_image(32, 32)
    for bad in (100, 0, 280.0, True, "280", None):
        with pytest.raises(InvalidRequestError) as err:
            enc.prepare(img, max_soft_tokens=bad)
        assert err.value.limit == list(SUPPORTED_SOFT_TOKENS)
    with pytest.raises(InvalidRequestError, match="unknown image parameter"):
        enc.prepare(img, max_pixels=1000)


def test_image_span_matches_processor_prompt(enc, ref, samples):
    """Two images in one chat prompt: each boi..eoi run the processor writes is our input_ids,
    its mm_token_type_ids rows are ours, and the bidirectional blocks are the runs the model's
    get_block_sequence_ids_for_mask would build."""
    from transformers.models.gemma4.modeling_gemma4 import get_block_sequence_ids_for_mask

    processor, _ = ref
    images = [_image(samples, "photo_640x480.jpg"), _image(samples, "odd_7x13.png")]
    messages = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}],
        }
    ]
    prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = processor(text=[prompt], images=[[i.to_pil() for i in images]], return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    types = out["mm_token_type_ids"][0].tolist()
    blocks = get_block_sequence_ids_for_mask(out["mm_token_type_ids"], device="cpu")[0].tolist()
    t = enc.tokens
    spans = _runs(ids, t.boi, t.eoi)
    assert len(spans) == 2
    cursor = 0
    for block_id, (image, span) in enumerate(zip(images, spans, strict=True)):
        p = enc.prepare(image)
        assert list(p.input_ids) == span
        start = ids.index(t.boi, cursor)
        cursor = start + len(span)
        assert list(p.mm_token_type) == types[start:cursor]
        assert p.prefix_tokens == (t.boi,) and p.suffix_tokens == (t.eoi,)
        assert p.placeholder_id == t.image and p.token_count == span.count(t.image)
        assert p.positions.shape == (1, p.num_rows) and p.positions[0].tolist() == list(range(p.num_rows))
        assert p.position_span == p.num_rows
        assert p.placeholder_rows().tolist() == list(range(1, 1 + p.token_count))
        (b0, b1), *rest = p.meta["bidirectional_blocks"]
        assert not rest and blocks[start + b0 : start + b1] == [block_id] * (b1 - b0)
        assert blocks[start + b0 - 1] == -1 and blocks[start + b1] == -1
        assert p.meta["bidirectional_attention"] is False  # the tiny text config says None


def test_image_embeddings_match_reference_batch(enc, ref, samples, folder):
    processor, model = ref
    e = _fresh(enc, folder)
    images = [_image(samples, "photo_640x480.jpg"), _image(samples, "odd_37x1.png")]
    prepared = [e.prepare(i, max_soft_tokens=140) for i in images]  # 140: a quicker test than 280
    encoded = e.encode(prepared)
    assert e.tower_calls == 1  # both images in one tower call
    assert prepared[0].token_count != prepared[1].token_count
    theirs = processor.image_processor([i.to_pil() for i in images], max_soft_tokens=140, return_tensors="pt")
    with torch.no_grad():
        reference = model.model.get_image_features(
            theirs["pixel_values"], theirs["image_position_ids"]
        ).pooler_output
    for p, enc_out, r in zip(prepared, encoded, reference, strict=True):
        assert enc_out.embeddings.shape == r.shape == (p.token_count, model.config.text_config.hidden_size)
        torch.testing.assert_close(enc_out.embeddings, r, rtol=0, atol=EMBED_ATOL)


def test_towers_passed_by_the_engine_are_used(folder, ref, samples):
    _, model = ref
    towers = {name: getattr(model.model, name) for name in ("vision_tower", "embed_vision")}
    e = encoder_for(folder, cache=EncoderCache(), towers=towers, load_weights=False)
    assert e.towers["vision_tower"] is model.model.vision_tower
    assert "audio_tower" in e.towers  # the missing ones were loaded from the checkpoint
    p = e.prepare(_image(samples, "photo_640x480.jpg"), max_soft_tokens=70)
    with torch.no_grad():
        reference = model.model.get_image_features(
            p.inputs["pixel_values"], p.inputs["image_position_ids"]
        ).pooler_output[0]
    torch.testing.assert_close(e.encode([p])[0].embeddings, reference, rtol=0, atol=EMBED_ATOL)


def test_image_settings_other_than_the_checkpoints(ref):
    """Per-channel normalisation and other filters (not used by released checkpoints) follow the
    reference too: settings parsed from the processor's own dict, pixels from the lower-level
    functions the encoder uses."""
    from PIL import Image as PILImage
    from transformers import Gemma4ImageProcessorPil

    from encoders.gemma4.vision import VisionSettings, aspect_ratio_preserving_size, patchify

    img = _random_image(200, 120, seed=9)
    for kwargs in (
        {"do_normalize": True, "image_mean": [0.5, 0.4, 0.3], "image_std": [0.2, 0.3, 0.4]},
        {"resample": PILImage.Resampling.BILINEAR, "rescale_factor": 1 / 127.5},
        {"resample": PILImage.Resampling.LANCZOS, "max_soft_tokens": 140},
    ):
        reference = Gemma4ImageProcessorPil(**kwargs)
        s = VisionSettings.from_dict(reference.to_dict(), video=False)
        h, w = aspect_ratio_preserving_size(
            img.height, img.width, s.patch_size, s.max_patches(s.max_soft_tokens), s.pooling_kernel_size
        )
        pixels = np.asarray(img.to_pil().resize((w, h), resample=s.resample))[None]
        values, positions, _ = patchify(
            pixels, s.patch_size, s.pixel_table(video=False), s.max_patches(s.max_soft_tokens)
        )
        theirs = reference(img.to_pil(), return_tensors="pt")
        assert torch.equal(values, theirs["pixel_values"]), kwargs
        assert torch.equal(positions, theirs["image_position_ids"]), kwargs


# ----------------------------------------------------------------------------------------- audio


def _clips(samples: Path) -> dict[str, Audio]:
    return {
        "1s_16k": Audio.from_array(_speechlike(1.0), 16_000),
        "7.3s_odd_16k": Audio.from_array(_speechlike(116_803, seed=2), 16_000),
        "30s_16k": Audio.from_path(samples / "audio" / "speechlike_30s_16k.wav"),
        "2s_44k1_stereo": Audio.from_path(samples / "audio" / "chirp_44k1_stereo.wav"),
        "2s_48k_stereo_flac": Audio.from_path(samples / "audio" / "chirp_48k_stereo_24.flac"),
        "161_samples": Audio.from_array(_speechlike(161, seed=3), 16_000),
    }


def test_audio_features_match_reference(enc, ref, samples):
    """Features and masks bit-identical to Gemma4AudioFeatureExtractor on the same mono 16 kHz
    samples (media's soxr resampling equals librosa's, tested in tests/media); token counts
    equal what Gemma4Processor writes into the prompt."""
    processor, _ = ref
    fe = processor.feature_extractor
    for name, clip in _clips(samples).items():
        wave = np.array(clip.mono_at(16_000))
        p = enc.prepare(clip)
        theirs = fe([wave], return_tensors="pt")
        assert torch.equal(p.inputs["input_features"], theirs["input_features"]), name
        assert torch.equal(p.inputs["input_features_mask"], theirs["input_features_mask"]), name
        assert p.inputs["input_features"].dtype == torch.float32
        assert p.inputs["input_features_mask"].dtype == torch.bool
        prompt = processor(text=["<|audio|>"], audio=[wave], return_tensors="pt")
        assert list(p.input_ids) == prompt["input_ids"][0].tolist(), name
        assert p.token_count == processor._compute_audio_num_tokens(wave, 16_000), name
        assert enc.audio_token_count(clip.frames, clip.sample_rate) == p.token_count, name
        assert p.grid == (1, 1, p.token_count) and p.meta["truncated"] is False
    assert enc.prepare(_clips(samples)["30s_16k"]).token_count == 750
    assert enc.prepare(_clips(samples)["1s_16k"]).token_count == 25


def test_audio_float32_mel_option(enc, ref, samples, folder):
    """``exact_audio=False``: filter bank and log in float32, within float32 rounding of the
    reference (values span about -7..3; observed max deviation ~5e-7), same masks and tokens,
    and another cache fingerprint."""
    processor, _ = ref
    fast = encoder_for(folder, cache=EncoderCache(), towers=enc.towers, exact_audio=False)
    assert fast.fingerprint != enc.fingerprint
    for name, clip in _clips(samples).items():
        p = fast.prepare(clip)
        theirs = processor.feature_extractor([np.array(clip.mono_at(16_000))], return_tensors="pt")
        torch.testing.assert_close(p.inputs["input_features"], theirs["input_features"], rtol=0, atol=2e-6)
        assert torch.equal(p.inputs["input_features_mask"], theirs["input_features_mask"]), name
        assert p.input_ids == enc.prepare(clip).input_ids


def test_audio_over_30s_is_truncated_like_the_reference(enc, ref, samples):
    processor, _ = ref
    clip = Audio.from_path(samples / "audio" / "speechlike_35s_16k.wav")
    assert clip.duration == pytest.approx(35.0)
    wave = np.array(clip.mono_at(16_000))
    p = enc.prepare(clip)
    theirs = processor.feature_extractor([wave], return_tensors="pt")  # truncates to 480000 samples
    assert torch.equal(p.inputs["input_features"], theirs["input_features"])
    assert torch.equal(p.inputs["input_features_mask"], theirs["input_features_mask"])
    assert p.token_count == 750 and p.meta["truncated"] is True and p.meta["samples"] == 480_000
    prompt = processor(text=["<|audio|>"], audio=[wave], return_tensors="pt")
    assert list(p.input_ids) == prompt["input_ids"][0].tolist()
    with pytest.raises(MediaTooLongError) as err:
        enc.prepare(clip, truncate=False)
    assert err.value.limit == 30.0 and err.value.actual == pytest.approx(35.0) and err.value.kind == "audio"
    with pytest.raises(InvalidRequestError):
        enc.prepare(clip, truncate="no")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"preemphasis": 0.97, "preemphasis_htk_flavor": True},
        {"preemphasis": 0.97, "preemphasis_htk_flavor": False},
        {"per_bin_mean": list(np.linspace(-2, 2, 128)), "per_bin_stddev": list(np.linspace(0.5, 2, 128))},
        {"input_scale_factor": 0.5, "mel_floor": 1e-5, "fft_overdrive": True},
        {"frame_length_ms": 25.0, "hop_length_ms": 12.5, "feature_size": 80, "max_frequency": 7600.0},
    ],
)
def test_audio_settings_other_than_the_checkpoints(kwargs):
    """Options the released config leaves off follow the reference too (settings parsed from the
    feature extractor's own saved dict, as a checkpoint would carry it)."""
    from transformers import Gemma4AudioFeatureExtractor

    from encoders.gemma4.audio import AudioSettings, LogMel

    reference = Gemma4AudioFeatureExtractor(**kwargs)
    saved = json.loads(reference.to_json_string())  # per-bin arrays come back nested (1, 1, F)
    settings = AudioSettings.from_dict({**saved, **{k: v for k, v in kwargs.items() if "per_bin" not in k}})
    wave = _speechlike(40_017, seed=5)
    features, mask = LogMel(settings)(wave)
    theirs = reference([wave], return_tensors="np")
    np.testing.assert_array_equal(features, theirs["input_features"][0])
    np.testing.assert_array_equal(mask, theirs["input_features_mask"][0])


def test_audio_too_short_for_one_token(enc):
    with pytest.raises(EmptyMediaError) as err:
        enc.prepare(Audio.from_array(_speechlike(160), 16_000))
    assert err.value.limit == 161 and err.value.actual == 160


def test_audio_span_matches_processor_prompt(enc, ref, samples):
    processor, _ = ref
    clips = [_clips(samples)["7.3s_odd_16k"], _clips(samples)["2s_44k1_stereo"]]
    waves = [np.array(c.mono_at(16_000)) for c in clips]
    messages = [
        {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "then"}, {"type": "audio"}]}
    ]
    prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = processor(text=[prompt], audio=waves, return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    types = out["mm_token_type_ids"][0].tolist()
    t = enc.tokens
    spans = _runs(ids, t.boa, t.eoa)
    cursor = 0
    for clip, span in zip(clips, spans, strict=True):
        p = enc.prepare(clip)
        assert list(p.input_ids) == span
        start = ids.index(t.boa, cursor)
        cursor = start + len(span)
        assert list(p.mm_token_type) == types[start:cursor]
        assert set(p.mm_token_type) == {0, 3}
        assert p.prefix_tokens == (t.boa,) and p.suffix_tokens == (t.eoa,)
        assert p.position_span == p.num_rows == p.token_count + 2


def test_audio_embeddings_match_reference_batch(enc, ref, samples, folder):
    processor, model = ref
    e = _fresh(enc, folder)
    clips = [_clips(samples)["7.3s_odd_16k"], _clips(samples)["2s_44k1_stereo"]]
    prepared = [e.prepare(c) for c in clips]
    encoded = e.encode(prepared)
    assert e.tower_calls == 1
    theirs = processor.feature_extractor([np.array(c.mono_at(16_000)) for c in clips], return_tensors="pt")
    with torch.no_grad():
        out = model.model.get_audio_features(theirs["input_features"], theirs["input_features_mask"])
    for i, (p, enc_out) in enumerate(zip(prepared, encoded, strict=True)):
        reference = out.pooler_output[i][out.attention_mask[i]]
        assert (
            enc_out.embeddings.shape
            == reference.shape
            == (p.token_count, model.config.text_config.hidden_size)
        )
        torch.testing.assert_close(enc_out.embeddings, reference, rtol=0, atol=EMBED_ATOL)


# ----------------------------------------------------------------------------------------- video


def _reference_video_inputs(path: Path, indices: list[int], budget: int, settings) -> dict[str, torch.Tensor]:
    """Gemma4VideoProcessor's tensors, computed from its source without torchvision: frames by
    transformers' PyAV loader, torchvision's uint8 antialiased bicubic resize (what
    ``tvF.resize`` runs on CPU), fused ``/ 255``, ``convert_video_to_patches`` +
    ``pad_to_max_patches``."""
    from transformers.models.gemma4.processing_gemma4 import get_aspect_ratio_preserving_size
    from transformers.video_utils import load_video

    frames, _ = load_video(
        str(path), backend="pyav", sample_indices_fn=lambda metadata, **kw: np.array(indices)
    )
    video = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()
    patch, pool = settings.patch_size, settings.pooling_kernel_size
    max_patches = budget * pool**2
    th, tw = get_aspect_ratio_preserving_size(
        height=video.shape[-2],
        width=video.shape[-1],
        patch_size=patch,
        max_patches=max_patches,
        pooling_kernel_size=pool,
    )
    video = torch.nn.functional.interpolate(
        video, size=[th, tw], mode="bicubic", align_corners=False, antialias=True
    )
    mean = torch.tensor([0.0, 0.0, 0.0]) * (1.0 / settings.rescale_factor)
    std = torch.tensor([1.0, 1.0, 1.0]) * (1.0 / settings.rescale_factor)
    video = (video.to(torch.float32) - mean.view(1, 3, 1, 1)) / std.view(1, 3, 1, 1)
    n, c, h, w = video.shape
    ph, pw = h // patch, w // patch
    patches = video.reshape(n, c, ph, patch, pw, patch).permute(0, 2, 4, 3, 5, 1).reshape(n, ph * pw, -1)
    grid = torch.stack(torch.meshgrid(torch.arange(pw), torch.arange(ph), indexing="xy"), dim=-1)
    positions = grid.reshape(ph * pw, 2)[None].repeat(n, 1, 1)
    pad = max_patches - ph * pw
    patches = torch.nn.functional.pad(patches, [0, 0, 0, pad, 0, 0], value=0)
    positions = torch.nn.functional.pad(positions, (0, 0, 0, pad, 0, 0), value=-1)
    return {"pixel_values_videos": patches, "video_position_ids": positions}


@pytest.mark.parametrize(
    ("name", "params", "embed"),
    [
        ("h264_320x240_30fps_3s.mp4", {}, False),  # defaults: 32 frames at 70 tokens (embeddings: below)
        ("vp9_320x240_25fps_2s.webm", {"num_frames": 8, "max_soft_tokens": 140}, True),
        ("mpeg4_320x240_25fps_2s.avi", {"fps": 2}, True),
    ],
)
def test_video_against_reference_formulas(enc, ref, samples, name, params, embed):
    from transformers.models.gemma4.processing_gemma4 import get_aspect_ratio_preserving_size
    from transformers.video_utils import VideoMetadata, default_sample_indices_fn

    processor, model = ref
    path = samples / "video" / name
    video = Video.from_path(path)
    p = enc.prepare(video, **params)
    s = enc.video_settings
    budget = params.get("max_soft_tokens", s.max_soft_tokens)

    # frame choice: the reference's default sampler on the same metadata
    metadata = VideoMetadata(total_num_frames=video.info.frame_count, fps=video.info.fps)
    sampler_kw = (
        {"fps": params["fps"]} if "fps" in params else {"num_frames": params.get("num_frames", s.num_frames)}
    )
    indices = default_sample_indices_fn(metadata, **sampler_kw).tolist()
    assert p.meta["frame_indices"] == indices

    # per-frame tokens: the reference's size rule for the video budget
    th, tw = get_aspect_ratio_preserving_size(
        height=video.info.height,
        width=video.info.width,
        patch_size=16,
        max_patches=budget * 9,
        pooling_kernel_size=3,
    )
    per_frame = (th // 16) * (tw // 16) // 9
    assert p.meta["tokens_per_frame"] == per_frame and p.token_count == per_frame * len(indices)
    assert p.grid == (len(indices), th // 48, tw // 48)

    # the text: Gemma4Processor.replace_video_token on the same numbers, tokenized by the reference
    # tokenizer (in a prompt the span follows a special token, so it tokenizes the same)
    metadata.frames_indices = indices
    text = processor.replace_video_token(
        {"num_soft_tokens_per_video": [per_frame], "video_metadata": [metadata]}, video_idx=0
    )
    expected = processor.tokenizer("<|turn>" + text, add_special_tokens=False)["input_ids"][1:]
    assert list(p.input_ids) == expected
    assert list(p.mm_token_type) == processor.create_mm_token_type_ids([expected])[0]
    # ... and in context: the chat prompt with the placeholder expanded as the processor would
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]
    prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    full = processor.tokenizer(prompt.replace(processor.video_token, text), add_special_tokens=False)[
        "input_ids"
    ]
    start = full.index(enc.tokens.boi) - (expected.index(enc.tokens.boi))
    assert full[start : start + len(expected)] == expected
    assert p.timestamps == tuple(metadata.timestamps)
    assert len(p.meta["bidirectional_blocks"]) == len(indices)
    assert all(b - a == per_frame for a, b in p.meta["bidirectional_blocks"])

    # pixels: an independent decode through the reference's video pipeline
    theirs = _reference_video_inputs(path, indices, budget, s)
    assert torch.equal(p.inputs["pixel_values_videos"], theirs["pixel_values_videos"])
    assert torch.equal(p.inputs["video_position_ids"], theirs["video_position_ids"])
    assert p.inputs["num_frames_per_video"].tolist() == [len(indices)]

    if not embed:  # 32 frames through two towers is slow on 2 cores; the tower math is per frame
        return
    # embeddings: the reference model's get_video_features on our inputs
    out = enc.encode([p])[0]
    with torch.no_grad():
        reference = model.model.get_video_features(
            p.inputs["pixel_values_videos"], p.inputs["video_position_ids"], p.inputs["num_frames_per_video"]
        ).pooler_output[0]
    assert out.embeddings.shape == reference.shape == (p.token_count, model.config.text_config.hidden_size)
    torch.testing.assert_close(out.embeddings, reference, rtol=0, atol=EMBED_ATOL)


def test_video_shorter_than_num_frames_takes_every_frame(enc, samples):
    """The reference raises when asked for more frames than the clip has (32 of 20); we take all."""
    video = Video.from_path(samples / "video" / "animated_160x120_10fps_2s.gif")
    assert video.info.frame_count < 32
    p = enc.prepare(video)
    assert p.meta["frame_indices"] == list(range(video.info.frame_count))
    assert p.inputs["pixel_values_videos"].shape[0] == video.info.frame_count


def test_video_parameters_are_validated(enc, samples):
    video = Video.from_path(samples / "video" / "h264_256x192_24fps_2s.mkv")
    with pytest.raises(InvalidRequestError, match="mutually exclusive"):
        enc.prepare(video, num_frames=4, fps=1)
    for bad in (
        {"num_frames": 0},
        {"num_frames": True},
        {"fps": -1},
        {"fps": float("inf")},
        {"max_soft_tokens": 71},
        {"frames": 3},
    ):
        with pytest.raises(InvalidRequestError):
            enc.prepare(video, **bad)


# ----------------------------------------------------------------------------------------- cache


def test_cache_skips_prepare_and_tower(enc, folder, samples):
    e = _fresh(enc, folder)
    raw = (samples / "images" / "photo_640x480.jpg").read_bytes()
    clip_bytes = (samples / "audio" / "tone_16k_mono.wav").read_bytes()
    first = [e.prepare(Image.from_bytes(raw), max_soft_tokens=70), e.prepare(Audio.from_bytes(clip_bytes))]
    out1 = e.encode(first)
    assert (e.prepare_calls, e.tower_calls) == (2, 2)  # one tower call per kind
    # same bytes, new objects
    again = [e.prepare(Image.from_bytes(raw), max_soft_tokens=70), e.prepare(Audio.from_bytes(clip_bytes))]
    assert again[0] is first[0] and again[1] is first[1]
    out2 = e.encode(again)
    assert (e.prepare_calls, e.tower_calls) == (2, 2)
    for a, b in zip(out1, out2, strict=True):
        assert torch.equal(a.embeddings, b.embeddings)
    # other parameters are another preparation (and another tower call)
    bigger = e.prepare(Image.from_bytes(raw), max_soft_tokens=140)
    assert bigger.cache_key != first[0].cache_key and bigger.token_count > first[0].token_count
    e.encode([bigger, first[0]])
    assert (e.prepare_calls, e.tower_calls) == (3, 3)
    # a mixed batch keeps its order and groups per kind
    e2 = _fresh(enc, folder)
    img2 = _random_image(100, 60)
    mixed = [
        e2.prepare(img2, max_soft_tokens=70),
        e2.prepare(Audio.from_bytes(clip_bytes)),
        e2.prepare(_random_image(60, 100, seed=4), max_soft_tokens=70),
    ]
    outs = e2.encode(mixed)
    assert e2.tower_calls == 2 and [o.embeddings.shape[0] for o in outs] == [p.token_count for p in mixed]
