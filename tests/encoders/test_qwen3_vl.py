"""Qwen3-VL encoder: preparation, span ids/positions and embeddings against the transformers
reference on the tiny checkpoint (fp32, CPU).

Exactness: every pixel tensor, grid, token id and position is compared with ``torch.equal``
(bit-exact). Embeddings of a batch equal ``get_image_features`` / ``get_video_features`` on
the same batch exactly (same module, same weights, same inputs); an item encoded alone is
compared with the batch within atol 1e-5 (fp32 matmuls of a different row count may block
differently; the vision attention never mixes items: it splits by ``cu_seqlens``).

The reference video processor cannot run here (its module needs torchvision), so its
pipeline is rebuilt in ``reference_video_inputs`` from the reference's own functions
(``load_video`` with PyAV, ``Qwen3VLVideoProcessor.sample_frames`` / ``patchify``, the
video ``smart_resize``) plus what torchvision does on CPU (quoted there).
"""

from __future__ import annotations

import json
import os
from functools import partial
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from PIL import Image as PILImage  # noqa: E402

from encoders import EncoderCache, UnsupportedMediaKindError, UnsupportedModelError, encoder_for  # noqa: E402
from encoders.qwen3_vl import (  # noqa: E402
    AspectRatioError,
    Qwen3VLEncoder,
    TooFewFramesError,
    image_smart_resize,
    sample_frame_indices,
    temporal_group_timestamps,
    video_smart_resize,
)
from fixtures.tiny_models import ensure_tiny_model  # noqa: E402
from media import Audio, Image, InvalidRequestError, Video  # noqa: E402

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    AutoTokenizer,
    Qwen2VLImageProcessorPil,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as ref_image_smart_resize  # noqa: E402
from transformers.models.qwen3_vl.video_processing_qwen3_vl import (  # noqa: E402
    Qwen3VLVideoProcessor,
)
from transformers.models.qwen3_vl.video_processing_qwen3_vl import (  # noqa: E402
    smart_resize as ref_video_smart_resize,
)
from transformers.video_utils import VideoMetadata, load_video  # noqa: E402

EMBED_ATOL = 1e-5


# ----------------------------------------------------------------------------------------------------
# Reference helpers
# ----------------------------------------------------------------------------------------------------


def _without_video(processor_class):
    """The processor class, accepting ``video_processor=None`` (HF video processors need torchvision)."""

    class WithoutVideo(processor_class):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument is None and argument_name == "video_processor":
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return WithoutVideo


def reference_image_processor(model_dir: Path) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil.from_pretrained(model_dir)


def reference_prepare_image(model_dir: Path | Qwen2VLImageProcessorPil, pil: PILImage.Image) -> dict:
    """``pixel_values`` and ``image_grid_thw`` as the reference image processor makes them."""
    processor = (
        model_dir if isinstance(model_dir, Qwen2VLImageProcessorPil) else reference_image_processor(model_dir)
    )
    return dict(processor(pil, return_tensors="pt"))


def reference_video_inputs(
    path: Path, video_cfg: dict, *, fps: float | None = None, num_frames: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, VideoMetadata]:
    """What ``Qwen3VLVideoProcessor`` (as configured by ``video_cfg``) makes of a video file."""
    fake = SimpleNamespace(
        fps=video_cfg["fps"], min_frames=video_cfg["min_frames"], max_frames=video_cfg["max_frames"]
    )
    if fps is None and num_frames is None:
        fps = video_cfg["fps"]
    sampler = partial(Qwen3VLVideoProcessor.sample_frames, fake, num_frames=num_frames, fps=fps)
    frames, metadata = load_video(str(path), backend="pyav", sample_indices_fn=sampler)
    # _prepare_input_videos: (T, H, W, C) -> contiguous (T, C, H, W); _preprocess stacks one video.
    video = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()[None]
    _, n, c, h, w = video.shape
    size = video_cfg["size"]
    rh, rw = ref_video_smart_resize(
        num_frames=n,
        height=h,
        width=w,
        temporal_factor=video_cfg["temporal_patch_size"],
        factor=video_cfg["patch_size"] * video_cfg["merge_size"],
        min_pixels=size["shortest_edge"],
        max_pixels=size["longest_edge"],
    )
    if (rh, rw) != (h, w):
        # tvF.resize(video, [rh, rw], BICUBIC, antialias=True): torchvision's resize_image reshapes to
        # (-1, C, H, W) and, for a uint8 CPU tensor and bicubic, calls interpolate on the uint8 tensor
        # directly (torchvision/transforms/v2/functional/_geometry.py: _do_native_uint8_resize_on_cpu).
        flat = torch.nn.functional.interpolate(
            video.reshape(-1, c, h, w), size=[rh, rw], mode="bicubic", align_corners=False, antialias=True
        )
        video = flat.reshape(1, n, c, rh, rw)
    # rescale_and_normalize: mean/std fused with the 1/255 rescale, then tvF.normalize = sub_(mean).div_(std).
    mean = torch.tensor(video_cfg["image_mean"]) * (1.0 / (1 / 255))
    std = torch.tensor(video_cfg["image_std"]) * (1.0 / (1 / 255))
    x = video.to(torch.float32).sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
    patches, gt, gh, gw = Qwen3VLVideoProcessor.patchify(
        None,
        x,
        patch_size=video_cfg["patch_size"],
        merge_size=video_cfg["merge_size"],
        temporal_patch_size=video_cfg["temporal_patch_size"],
    )
    return patches[0], torch.tensor([[gt, gh, gw]]), metadata


# ----------------------------------------------------------------------------------------------------
# Fixtures (built once per module)
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny() -> Path:
    return ensure_tiny_model("tiny-qwen3-vl")


@pytest.fixture(scope="module")
def encoder(tiny) -> Qwen3VLEncoder:
    enc = encoder_for(tiny)
    assert isinstance(enc, Qwen3VLEncoder)
    return enc


@pytest.fixture(scope="module")
def model(tiny):
    return Qwen3VLForConditionalGeneration.from_pretrained(tiny).eval()


@pytest.fixture(scope="module")
def image_processor(tiny) -> Qwen2VLImageProcessorPil:
    return reference_image_processor(tiny)


@pytest.fixture(scope="module")
def processor(tiny, image_processor):
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    proc = _without_video(Qwen3VLProcessor)(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=tokenizer.chat_template,
    )
    video_cfg = json.loads((tiny / "video_preprocessor_config.json").read_text())
    # replace_video_token only reads these two from the video processor.
    proc.video_processor = SimpleNamespace(
        merge_size=video_cfg["merge_size"], temporal_patch_size=video_cfg["temporal_patch_size"]
    )
    return proc


@pytest.fixture(scope="module")
def video_cfg(tiny) -> dict:
    return json.loads((tiny / "video_preprocessor_config.json").read_text())


@pytest.fixture(scope="module")
def images_dir(samples) -> Path:
    return samples / "images"


@pytest.fixture(scope="module")
def videos_dir(samples) -> Path:
    return samples / "video"


def _noise(width: int, height: int, seed: int = 0) -> Image:
    rng = np.random.default_rng(seed)
    return Image.from_array(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _assert_same_image_inputs(prepared, ref: dict) -> None:
    assert prepared.inputs["pixel_values"].dtype == ref["pixel_values"].dtype == torch.float32
    assert torch.equal(prepared.inputs["pixel_values"], ref["pixel_values"])
    assert torch.equal(prepared.inputs["image_grid_thw"], ref["image_grid_thw"])
    assert prepared.inputs["image_grid_thw"].dtype == ref["image_grid_thw"].dtype
    assert prepared.token_count == int(ref["image_grid_thw"].prod()) // 4


# ----------------------------------------------------------------------------------------------------
# Settings and size rules
# ----------------------------------------------------------------------------------------------------


def test_settings_come_from_the_checkpoint(encoder, image_processor, tiny):
    s = encoder.image_settings
    assert (s.patch_size, s.temporal_patch_size, s.merge_size) == (16, 2, 2)
    assert (s.min_pixels, s.max_pixels) == (
        image_processor.size.shortest_edge,
        image_processor.size.longest_edge,
    )
    assert list(s.image_mean) == list(image_processor.image_mean)
    assert s.resample == int(image_processor.resample) == PILImage.Resampling.BICUBIC
    v = encoder.video_settings
    assert (v.fps, v.min_frames, v.max_frames, v.min_pixels, v.max_pixels) == (2, 4, 768, 4096, 25165824)
    t = encoder.tokens
    config = json.loads((tiny / "config.json").read_text())
    assert (t.vision_start, t.vision_end, t.image_pad, t.video_pad) == (
        config["vision_start_token_id"],
        config["vision_end_token_id"],
        config["image_token_id"],
        config["video_token_id"],
    )
    assert encoder.family == "qwen3_vl" and encoder.kinds == {"image", "video"}
    assert encoder.deepstack_layers == (0, 1)


SIZES = [
    (10, 10),
    (1, 1),
    (7, 13),
    (13, 7),
    (333, 517),
    (517, 333),
    (1, 37),
    (37, 1),
    (1, 200),
    (200, 1),
    (1, 201),
    (250, 1),
    (4032, 3024),
    (3024, 4032),
    (8000, 8000),
    (31, 33),
    (48, 48),
    (4096, 4096),
    (4097, 4096),
    (16, 4000),
]


@pytest.mark.parametrize(("h", "w"), SIZES)
def test_smart_resize_matches_reference(h, w):
    factor, lo, hi = 32, 65536, 16777216
    try:
        expected = ref_image_smart_resize(h, w, factor=factor, min_pixels=lo, max_pixels=hi)
    except ValueError:
        with pytest.raises(AspectRatioError):
            image_smart_resize(h, w, factor, lo, hi)
    else:
        assert image_smart_resize(h, w, factor, lo, hi) == expected
    for frames in (1, 2, 3, 4, 7, 768):
        args = dict(num_frames=frames, height=h, width=w, temporal_factor=2, factor=factor)
        bounds = dict(min_pixels=4096, max_pixels=25165824)
        try:
            expected = ref_video_smart_resize(**args, **bounds)
        except ValueError:
            with pytest.raises((AspectRatioError, TooFewFramesError)):
                video_smart_resize(frames, h, w, 2, factor, 4096, 25165824)
        else:
            assert video_smart_resize(frames, h, w, 2, factor, 4096, 25165824) == expected


# ----------------------------------------------------------------------------------------------------
# Image pixels
# ----------------------------------------------------------------------------------------------------

# Where the media layer decodes a file differently from handing the raw PIL image to the
# reference (documented decisions of media.Image, not of this encoder): EXIF orientation is
# applied (transformers' own load_image does that too), 16-bit grey keeps the high byte
# (Pillow's convert("RGB") clips it), float images are scaled to 0..255 (Pillow clips).
MEDIA_DECODES_DIFFERENTLY = {"exif_rotated_6.jpg", "gray16.png", "float.tif"}


def _sample_images() -> list[str]:
    from fixtures.samples import ensure_samples

    return sorted(p.name for p in (ensure_samples() / "images").iterdir() if p.is_file())


@pytest.mark.parametrize("name", _sample_images())
def test_sample_images_match_reference(encoder, image_processor, images_dir, name):
    image = Image.from_path(images_dir / name)
    prepared = encoder.prepare(image)
    _assert_same_image_inputs(prepared, reference_prepare_image(image_processor, image.to_pil()))
    if name not in MEDIA_DECODES_DIFFERENTLY and not name.startswith("photo_4032"):  # (time: once is enough)
        # The raw file through the reference's own convert_to_rgb gives the same numbers.
        with PILImage.open(images_dir / name) as raw:
            _assert_same_image_inputs(prepared, reference_prepare_image(image_processor, raw))
    if name == "exif_rotated_6.jpg":
        from transformers.image_utils import load_image

        _assert_same_image_inputs(
            prepared, reference_prepare_image(image_processor, load_image(str(images_dir / name)))
        )


@pytest.mark.parametrize(("w", "h"), [(w, h) for h, w in SIZES if max(h, w) <= 4096 and h * w < 8_000_000])
def test_image_sizes_match_reference(encoder, image_processor, w, h):
    image = _noise(w, h, seed=w * 7919 + h)
    try:
        ref = reference_prepare_image(image_processor, image.to_pil())
    except ValueError as e:
        assert "aspect ratio" in str(e)
        with pytest.raises(AspectRatioError) as info:
            encoder.prepare(image)
        assert info.value.code == "invalid_request" and info.value.limit == 200
        return
    prepared = encoder.prepare(image)
    _assert_same_image_inputs(prepared, ref)
    assert prepared.meta["resized_size"] == [
        int(ref["image_grid_thw"][0, 2]) * 16,
        int(ref["image_grid_thw"][0, 1]) * 16,
    ]
    # Budgeting without pixels gives the same grid.
    assert encoder.image_grid(w, h) == prepared.grid


def test_image_params_override_bounds(encoder, image_processor):
    image = _noise(640, 480, seed=3)
    small = encoder.prepare(image, max_pixels=128 * 128)
    ref = image_processor(
        image.to_pil(), size={"shortest_edge": 65536, "longest_edge": 128 * 128}, return_tensors="pt"
    )
    big = encoder.prepare(image)
    assert small.token_count < big.token_count and small.cache_key != big.cache_key
    assert torch.equal(small.inputs["image_grid_thw"], ref["image_grid_thw"])
    assert torch.equal(small.inputs["pixel_values"], ref["pixel_values"])
    with pytest.raises(InvalidRequestError):
        encoder.prepare(image, max_pixel=10)
    with pytest.raises(InvalidRequestError):
        encoder.prepare(image, max_pixels=-5)


@pytest.mark.parametrize(
    "settings",
    [
        {
            "image_mean": [0.48145466, 0.4578275, 0.40821073],
            "image_std": [0.26862954, 0.26130258, 0.27577711],
        },
        {"do_normalize": False},
        {"do_rescale": False},
        {"rescale_factor": 1 / 127.0, "image_mean": [0.1, 0.1, 0.1], "image_std": [0.3, 0.3, 0.3]},
        {},
    ],
    ids=["clip-mean-std", "no-normalize", "no-rescale", "odd-rescale", "qwen3-vl"],
)
@pytest.mark.parametrize("use_table", [False, True], ids=["arithmetic", "table"])
def test_pixel_math_for_other_settings(settings, use_table):
    """The fused rescale/normalise is exact for other processor settings too, both through
    the self-checked float32 arithmetic and through the lookup table it falls back to."""
    from encoders.qwen3_vl import ImagePixels, ImageSettings

    base = {"patch_size": 16, "merge_size": 2, "size": {"shortest_edge": 4096, "longest_edge": 1 << 24}}
    cfg = {**base, "image_mean": [0.5] * 3, "image_std": [0.5] * 3, **settings}
    pixels = ImagePixels(ImageSettings.from_dict(cfg))
    assert pixels.arithmetic_exact or settings  # Qwen3-VL's own settings take the fast path
    if use_table:
        pixels.arithmetic_exact = False
    rgb = np.random.default_rng(1).integers(0, 256, (96, 160, 3), dtype=np.uint8)  # no resize needed
    ref = Qwen2VLImageProcessorPil(**cfg)(PILImage.fromarray(rgb), return_tensors="pt")
    assert torch.equal(pixels(rgb), ref["pixel_values"])
    assert torch.equal(pixels(PILImage.fromarray(rgb)), ref["pixel_values"])


# ----------------------------------------------------------------------------------------------------
# Span: input ids, mm token types, positions
# ----------------------------------------------------------------------------------------------------


def _check_span(prepared, input_ids, mm_types, positions, start: int) -> None:
    n = prepared.num_rows
    assert tuple(input_ids[start : start + n].tolist()) == prepared.input_ids
    assert tuple(mm_types[start : start + n].tolist()) == prepared.mm_token_type
    anchor = int(positions[0, start])  # the span's first row (vision_start) follows text
    assert int(positions[0, start - 1]) == anchor - 1
    assert torch.equal(positions[:, start : start + n] - anchor, prepared.positions)
    assert int(prepared.positions.max()) + 1 == prepared.position_span
    if start + n < positions.shape[1]:
        assert torch.equal(positions[:, start + n], torch.full((3,), anchor + prepared.position_span))
    ids = torch.tensor(prepared.input_ids)
    assert int((ids == prepared.placeholder_id).sum()) == prepared.token_count
    assert (
        prepared.placeholder_rows().tolist()
        == torch.nonzero(ids == prepared.placeholder_id).flatten().tolist()
    )


def test_image_span_matches_processor_and_rope_index(encoder, processor, model):
    images = [_noise(640, 480, seed=1), _noise(100, 300, seed=2)]
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare"},
                {"type": "image"},
                {"type": "text", "text": "with"},
                {"type": "image"},
                {"type": "text", "text": "please."},
            ],
        }
    ]
    prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[prompt], images=[im.to_pil() for im in images], return_tensors="pt")
    positions, _ = model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"]
    )
    ids, types, pos = inputs["input_ids"][0], inputs["mm_token_type_ids"][0], positions[:, 0]
    starts = torch.nonzero(ids == encoder.tokens.vision_start).flatten().tolist()
    assert len(starts) == 2
    for image, start in zip(images, starts, strict=True):
        prepared = encoder.prepare(image)
        assert prepared.prefix_tokens == (encoder.tokens.vision_start,)
        assert prepared.suffix_tokens == (encoder.tokens.vision_end,)
        assert prepared.placeholder_id == encoder.tokens.image_pad
        assert prepared.position_span != prepared.num_rows  # M-RoPE: not the row count
        _check_span(prepared, ids, types, pos, start)


# ----------------------------------------------------------------------------------------------------
# Image embeddings
# ----------------------------------------------------------------------------------------------------


def test_image_embeddings_match_reference(encoder, model, images_dir):
    items = [
        encoder.prepare(Image.from_path(images_dir / "photo_640x480.jpg")),
        encoder.prepare(Image.from_path(images_dir / "odd_7x13.png")),
        encoder.prepare(_noise(333, 517, seed=9)),
    ]
    encoder.cache.clear()
    calls = encoder.tower_calls
    encoded = encoder.encode(items)
    assert encoder.tower_calls == calls + 1  # one batch, one tower call
    with torch.no_grad():
        ref = model.model.get_image_features(
            torch.cat([p.inputs["pixel_values"] for p in items]),
            torch.cat([p.inputs["image_grid_thw"] for p in items]),
        )
    assert len(ref.deepstack_features) == 2
    for i, (p, enc) in enumerate(zip(items, encoded, strict=True)):
        assert enc.embeddings.shape == (p.token_count, model.config.text_config.hidden_size)
        assert enc.embeddings.dtype == torch.float32
        assert torch.equal(enc.embeddings, ref.pooler_output[i])
        assert enc.deepstack is not None and len(enc.deepstack) == 2
        for layer in range(2):
            assert torch.equal(enc.deepstack[layer], ref.deepstack_features[layer][i])
        with torch.no_grad():  # alone, not in a batch: same within fp32 tolerance
            alone = model.model.get_image_features(p.inputs["pixel_values"], p.inputs["image_grid_thw"])
        torch.testing.assert_close(enc.embeddings, alone.pooler_output[0], atol=EMBED_ATOL, rtol=0)
        for layer in range(2):
            torch.testing.assert_close(
                enc.deepstack[layer], alone.deepstack_features[layer][0], atol=EMBED_ATOL, rtol=0
            )


# ----------------------------------------------------------------------------------------------------
# Video
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("total", [1, 2, 3, 7, 20, 40, 90, 301, 5000])
@pytest.mark.parametrize("video_fps", [None, 10.0, 25.316, 30.0, 59.94])
@pytest.mark.parametrize("target", [0.5, 2, 2.5])
def test_frame_sampling_matches_reference(total, video_fps, target):
    fake = SimpleNamespace(fps=2, min_frames=4, max_frames=768)
    metadata = VideoMetadata(total_num_frames=total, fps=video_fps)
    expected = Qwen3VLVideoProcessor.sample_frames(fake, metadata, fps=target)
    ours = sample_frame_indices(total, video_fps, fps=target, min_frames=4, max_frames=768)
    assert ours == [int(i) for i in expected]
    rate = metadata.fps  # the reference sets 24 when it was missing
    for temporal in (2,):
        assert temporal_group_timestamps(ours, rate, temporal) == Qwen3VLProcessor._calculate_timestamps(
            None, list(ours), rate, temporal
        )
    fixed = Qwen3VLVideoProcessor.sample_frames(
        fake, VideoMetadata(total_num_frames=total, fps=video_fps), num_frames=min(total, 5), fps=None
    )
    assert sample_frame_indices(total, video_fps, fps=None, num_frames=min(total, 5)) == [
        int(i) for i in fixed
    ]


VIDEOS = [
    ("h264_320x240_30fps_3s.mp4", {}),
    ("mjpeg_240x160_20fps_2s.mov", {}),
    ("animated_160x120_10fps_2s.gif", {}),
    ("h264_320x240_30fps_3s.mp4", {"fps": 2.5}),  # 7 frames: the last temporal patch is padded
    ("mpeg4_320x240_25fps_2s.avi", {"num_frames": 5}),
]


@pytest.mark.parametrize(("name", "params"), VIDEOS, ids=[f"{n}-{p}" for n, p in VIDEOS])
def test_video_inputs_match_reference_pipeline(encoder, video_cfg, videos_dir, name, params):
    path = videos_dir / name
    prepared = encoder.prepare(Video.from_path(path), **params)
    pixels, grid, metadata = reference_video_inputs(path, video_cfg, **params)
    assert prepared.meta["frame_indices"] == [int(i) for i in metadata.frames_indices]
    assert torch.equal(prepared.inputs["video_grid_thw"], grid)
    assert prepared.inputs["pixel_values_videos"].dtype == torch.float32
    assert torch.equal(prepared.inputs["pixel_values_videos"], pixels)
    gt, gh, gw = grid[0].tolist()
    assert prepared.grid == (gt, gh // 2, gw // 2)
    assert prepared.token_count == gt * gh * gw // 4
    expected_stamps = Qwen3VLProcessor._calculate_timestamps(
        None, list(metadata.frames_indices), metadata.fps, 2
    )
    assert list(prepared.timestamps) == expected_stamps
    n = len(metadata.frames_indices)
    assert gt == (n + 1) // 2
    if n % 2:  # the last frame fills the last temporal patch: both temporal slots hold the same pixels
        last = prepared.inputs["pixel_values_videos"][-gh * gw :].view(-1, 3, 2, 16 * 16)
        assert torch.equal(last[:, :, 0], last[:, :, 1])
        assert expected_stamps[-1] == metadata.frames_indices[-1] / metadata.fps


def test_video_span_matches_processor_and_rope_index(encoder, processor, model, videos_dir):
    """A prompt with an image, a video and another image: the reference's own replacement
    text (Qwen3VLProcessor.replace_video_token with our grid and frame indices), its
    tokenizer, mm_token_type_ids and get_rope_index, against our spans."""
    video = Video.from_path(videos_dir / "h264_320x240_30fps_3s.mp4")
    pv = encoder.prepare(video, fps=2.5)
    images = [_noise(320, 200, seed=4), _noise(64, 700, seed=5)]
    pis = [encoder.prepare(im) for im in images]
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image"},
                {"type": "text", "text": "then"},
                {"type": "video"},
                {"type": "text", "text": "and"},
                {"type": "image"},
                {"type": "text", "text": "What happens?"},
            ],
        }
    ]
    prompt = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    image_inputs = processor.image_processor([im.to_pil() for im in images], return_tensors="pt")
    image_repl = [processor.replace_image_token(image_inputs, i) for i in range(2)]
    metadata = VideoMetadata(
        total_num_frames=video.info.frame_count, fps=video.info.fps, frames_indices=pv.meta["frame_indices"]
    )
    video_inputs = {"video_grid_thw": pv.inputs["video_grid_thw"], "video_metadata": [metadata]}
    video_repl = [processor.replace_video_token(video_inputs, 0)]
    text, _ = processor.get_text_with_replacements([prompt], image_repl, video_repl)
    assert f"<{pv.timestamps[0]:.1f} seconds><|vision_start|>" in text[0]
    input_ids = torch.tensor(processor.tokenizer(text)["input_ids"])
    mm_types = torch.tensor(processor.create_mm_token_type_ids(input_ids))
    positions, _ = model.model.get_rope_index(
        input_ids,
        mm_types,
        image_grid_thw=image_inputs["image_grid_thw"],
        video_grid_thw=pv.inputs["video_grid_thw"],
    )
    ids, types, pos = input_ids[0], mm_types[0], positions[:, 0]
    # Spans start at the template's <|vision_start|>: image, video (which nests one start per
    # frame group), image.
    vs = encoder.tokens.vision_start
    starts = [
        i for i in range(1, len(ids)) if int(ids[i]) == vs and int(ids[i - 1]) != encoder.tokens.vision_end
    ]
    first = starts[0]
    video_start = (
        first + pis[0].num_rows + len(processor.tokenizer("then", add_special_tokens=False)["input_ids"])
    )
    second = (
        video_start + pv.num_rows + len(processor.tokenizer("and", add_special_tokens=False)["input_ids"])
    )
    _check_span(pis[0], ids, types, pos, first)
    _check_span(pv, ids, types, pos, video_start)
    _check_span(pis[1], ids, types, pos, second)
    assert pv.placeholder_id == encoder.tokens.video_pad
    assert set(pv.mm_token_type) == {0, 2}
    assert pv.input_ids.count(vs) == 1 + pv.grid[0]  # the template's own, plus one per temporal patch


def test_video_embeddings_match_reference(encoder, model, videos_dir):
    items = [
        encoder.prepare(Video.from_path(videos_dir / "mjpeg_240x160_20fps_2s.mov")),
        encoder.prepare(Video.from_path(videos_dir / "h264_320x240_30fps_3s.mp4"), fps=2.5),
    ]
    encoder.cache.clear()
    encoded = encoder.encode(items)
    with torch.no_grad():
        ref = model.model.get_video_features(
            torch.cat([p.inputs["pixel_values_videos"] for p in items]),
            torch.cat([p.inputs["video_grid_thw"] for p in items]),
        )
    for i, enc in enumerate(encoded):
        assert torch.equal(enc.embeddings, ref.pooler_output[i])
        for layer in range(2):
            assert torch.equal(enc.deepstack[layer], ref.deepstack_features[layer][i])


def test_video_params(encoder, videos_dir):
    video = Video.from_path(videos_dir / "h264_320x240_30fps_3s.mp4")
    assert encoder.prepare(video, fps=None).cache_key != encoder.prepare(video).cache_key
    assert (
        encoder.prepare(video, fps=None).meta["frame_indices"] == encoder.prepare(video).meta["frame_indices"]
    )
    assert len(encoder.prepare(video, num_frames=8).meta["frame_indices"]) == 8
    assert encoder.prepare(video, max_pixels=64 * 64 * 8).grid[1:] < encoder.prepare(video).grid[1:]
    for bad in (
        {"fps": 2, "num_frames": 4},
        {"fps": -1},
        {"fps": float("nan")},
        {"fps": float("inf")},
        {"num_frames": 2.5},
        {"min_frames": 0},
        {"max_pixels": True},
        {"frames": 3},
    ):
        with pytest.raises(InvalidRequestError):
            encoder.prepare(video, **bad)


def test_small_and_short_videos(encoder, video_cfg, tmp_path):
    """Frames smaller than one merged patch are scaled up first (the video smart_resize
    branch); a clip with one frame cannot fill a temporal patch (the reference raises too)."""
    import av

    def write(path: Path, n: int, size: tuple[int, int]) -> None:
        rng = np.random.default_rng(n)
        with av.open(str(path), "w") as c:
            s = c.add_stream("mpeg4", rate=4)
            s.width, s.height, s.pix_fmt = size[0], size[1], "yuv420p"
            for i in range(n):
                frame = av.VideoFrame.from_ndarray(
                    rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), format="rgb24"
                )
                frame.pts = i
                c.mux(s.encode(frame))
            c.mux(s.encode())

    small = tmp_path / "small.avi"
    write(small, 9, (24, 16))
    prepared = encoder.prepare(Video.from_path(small))
    pixels, grid, metadata = reference_video_inputs(small, video_cfg)
    assert torch.equal(prepared.inputs["video_grid_thw"], grid)
    assert torch.equal(prepared.inputs["pixel_values_videos"], pixels)
    assert prepared.meta["frame_indices"] == [int(i) for i in metadata.frames_indices]

    single = tmp_path / "single.avi"
    write(single, 1, (64, 64))
    with pytest.raises(ValueError):
        reference_video_inputs(single, video_cfg)
    with pytest.raises(TooFewFramesError):
        encoder.prepare(Video.from_path(single))


# ----------------------------------------------------------------------------------------------------
# Cache, errors, construction
# ----------------------------------------------------------------------------------------------------


def test_cache_skips_prepare_and_tower(tiny, images_dir):
    enc = encoder_for(tiny, cache=EncoderCache())
    data = (images_dir / "photo_640x480.jpg").read_bytes()
    first = enc.prepare(Image.from_bytes(data))
    assert enc.prepare_calls == 1
    enc.encode([first])
    assert enc.tower_calls == 1 and enc.cache.stats.misses == 1

    again = enc.prepare(Image.from_bytes(data))  # same bytes, new object
    assert again is first and enc.prepare_calls == 1
    (out,) = enc.encode([again])
    assert enc.tower_calls == 1 and enc.cache.stats.hits == 1

    other = enc.prepare(Image.from_bytes((images_dir / "lossy.webp").read_bytes()))
    assert enc.prepare_calls == 2
    enc.encode([other, again])  # one hit, one miss: one more tower call for the miss only
    assert enc.tower_calls == 2 and enc.cache.stats.hits == 2 and enc.cache.stats.misses == 2

    smaller = enc.prepare(Image.from_bytes(data), max_pixels=100_000)  # parameters are part of the key
    assert enc.prepare_calls == 3 and smaller.cache_key != first.cache_key
    assert out.embeddings.shape[0] == first.token_count


def test_audio_is_refused(encoder):
    audio = Audio.from_array(np.zeros(1600, dtype=np.float32), 16000)
    with pytest.raises(UnsupportedMediaKindError) as info:
        encoder.prepare(audio)
    assert "tiny-qwen3-vl" in str(info.value) and "audio" in str(info.value)


def test_text_only_qwen3_is_not_a_media_model():
    with pytest.raises(UnsupportedModelError):
        encoder_for({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"})


def test_engine_tower_and_deferred_weights(tiny, model, images_dir):
    item = Image.from_path(images_dir / "photo_640x480.jpg")
    shared = encoder_for(tiny, tower=model.model.visual)
    assert shared.tower is model.model.visual  # no second copy of the weights
    deferred = encoder_for(tiny, load_weights=False)
    assert deferred._tower is None  # prepare-only use never reads the weights
    p = deferred.prepare(item)
    assert deferred._tower is None
    a = shared.encode([shared.prepare(item)])[0]
    b = deferred.encode([p])[0]
    assert deferred._tower is not None
    assert torch.equal(a.embeddings, b.embeddings)
    info = deferred.describe(p)
    assert info["token_count"] == p.token_count and info["grid"] == list(p.grid)
    assert info["position_span"] == p.position_span and json.dumps(info)


def test_missing_processor_config(tmp_path, tiny):
    config = json.loads((tiny / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError):
        encoder_for(tmp_path, load_weights=False)
