"""The Qwen3-VL encoder: preparation of images and videos into spans (see
:mod:`encoders.qwen3_vl`) and the vision tower, transformers' own ``Qwen3VLVisionModel``,
with DeepStack features."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image as PILImage

from encoders.base import Checkpoint, CheckpointEncoder, optional_positive
from encoders.checkpoint_files import load_tokenizer, read_tower_weights
from encoders.errors import UnsupportedModelError
from encoders.frame_resize import resize_frames_like_torchvision
from encoders.prepared import Encoded, MediaKind, Prepared
from encoders.qwen3_vl.pixels import ImagePixels, video_pixels
from encoders.qwen3_vl.reference import (
    TooFewFramesError,
    image_smart_resize,
    sample_frame_indices,
    temporal_group_timestamps,
    video_smart_resize,
)
from encoders.qwen3_vl.settings import (
    ImageSettings,
    SpecialTokens,
    VideoSettings,
    read_settings,
    special_tokens,
)
from encoders.span import Placeholders, Segment, Text, TextIds, TokenType, build_span
from encoders.varlen_attention import VarlenKernel, configure_tower, requested_choice
from media import Image, InvalidRequestError, Video

__all__ = ["FAMILY", "Qwen3VLEncoder"]

FAMILY = "qwen3_vl"


class Qwen3VLEncoder(CheckpointEncoder):
    """Preparation and vision tower of a ``Qwen3VLForConditionalGeneration`` checkpoint.

    ``prepare(Image | Video, **params)`` -> :class:`~encoders.prepared.Prepared`;
    ``encode([Prepared, ...])`` -> :class:`~encoders.prepared.Encoded` with the merged
    embeddings and one DeepStack feature tensor per ``deepstack_visual_indexes`` entry.

    Parameters accepted by ``prepare``: images ``min_pixels``, ``max_pixels``; videos
    ``fps`` or ``num_frames``, ``min_frames``, ``max_frames``, ``min_pixels``,
    ``max_pixels`` (the same names as the reference processor's call arguments; they
    override the processor config for that call and are part of the cache key).

    The tower attends all images (or all videos' frames) of an ``encode`` call with one
    variable-length attention call per layer on CUDA in float16/bfloat16
    (:mod:`encoders.varlen_attention`); ``varlen_attention`` (``"auto"``, ``"torch"``,
    ``"flashinfer"``, ``"off"``; default ``$PIE_MEDIA_VISION_VARLEN`` or ``"auto"``) picks
    the kernel or turns it off. Elsewhere transformers' per-image sdpa stays.
    """

    family = FAMILY
    display_name = "Qwen3-VL"
    kinds = frozenset({"image", "video"})

    def __init__(
        self,
        checkpoint: Checkpoint,
        *,
        tokenizer: Any,
        image: ImageSettings,
        video: VideoSettings,
        tokens: SpecialTokens,
        tower: torch.nn.Module | None,
        varlen_attention: str | None = None,
    ):
        super().__init__(checkpoint, tokenizer=tokenizer)
        self._varlen_choice = requested_choice(varlen_attention)
        self.varlen_kernel: VarlenKernel | None = None
        """The variable-length attention kernel the tower uses (None: once per image)."""
        self.image_settings = image
        self.video_settings = video
        self.tokens = tokens
        self._tower = tower
        self._image_pixels = ImagePixels(image)
        self._timestamp_ids = TextIds(tokenizer)
        vision = self.config.get("vision_config") or {}
        self.deepstack_layers = tuple(vision.get("deepstack_visual_indexes") or ())
        if tower is not None:
            self._configure_attention(tower)

    # -- construction -------------------------------------------------------------------
    @classmethod
    def _from_checkpoint(
        cls,
        checkpoint: Checkpoint,
        *,
        tower: torch.nn.Module | None = None,
        load_weights: bool = True,
        varlen_attention: str | None = None,
    ) -> Qwen3VLEncoder:
        """Read the processor configs and tokenizer from the checkpoint; build the tower.

        ``tower``: the engine's already-loaded ``model.model.visual`` (its device and dtype
        win); otherwise a ``Qwen3VLVisionModel`` is built from ``config["vision_config"]``
        and only the vision weights are read from the checkpoint. ``load_weights=False``
        defers that until the first ``encode`` (prepare-only users never pay for it).
        ``varlen_attention``: see the class doc.
        """
        image, video = read_settings(checkpoint.model_dir, checkpoint.config)
        tokenizer = load_tokenizer(checkpoint.model_dir)
        enc = cls(
            checkpoint.placed_like([tower] if tower is not None else []),
            tokenizer=tokenizer,
            image=image,
            video=video,
            tokens=special_tokens(checkpoint.config, tokenizer),
            tower=tower,
            varlen_attention=varlen_attention,
        )
        if tower is None and load_weights:
            enc.tower  # noqa: B018 - load now
        return enc

    @property
    def tower(self) -> torch.nn.Module:
        """The vision model (built and loaded on first use when deferred)."""
        if self._tower is None:
            with self._tower_lock:
                if self._tower is None:
                    tower = _build_tower(self.model_dir, self.config, self.device, self.dtype)
                    self._configure_attention(tower)
                    self._tower = tower
        return self._tower

    def _configure_attention(self, tower: torch.nn.Module) -> None:
        """One variable-length attention call per layer where a kernel runs (see
        :mod:`encoders.varlen_attention`), else transformers' per-image attention."""
        cfg = tower.config
        self.varlen_kernel = configure_tower(
            tower,
            device=self.device,
            dtype=self.dtype,
            head_dim=cfg.hidden_size // cfg.num_heads,
            choice=self._varlen_choice,
            what=f"{self.display_name} vision tower ({self.name})",
        )

    # -- planning -----------------------------------------------------------------------
    def image_size_for(self, width: int, height: int, **params: Any) -> tuple[int, int]:
        """(resized_width, resized_height) of an image of this size, no pixels needed."""
        s = self.image_settings
        lo, hi = self._pixel_bounds(params, s.min_pixels, s.max_pixels, "image")
        if not s.do_resize:
            return width, height
        h, w = image_smart_resize(height, width, s.patch_size * s.merge_size, lo, hi)
        return w, h

    def image_grid(self, width: int, height: int, **params: Any) -> tuple[int, int, int]:
        """``grid`` (t, h, w in merged tokens) a ``width`` x ``height`` image gets."""
        w, h = self.image_size_for(width, height, **params)
        unit = self.image_settings.patch_size * self.image_settings.merge_size
        return 1, h // unit, w // unit

    # -- prepare ------------------------------------------------------------------------
    def _prepare(self, kind: MediaKind, media: Any, cache_key: str, **params: Any) -> Prepared:
        if kind == "image":
            return self._prepare_image(media, cache_key, params)
        return self._prepare_video(media, cache_key, params)

    @staticmethod
    def _pixel_bounds(params: dict[str, Any], lo: int, hi: int, kind: str) -> tuple[int, int]:
        for key in ("min_pixels", "max_pixels"):
            optional_positive(key, params.get(key), integer=True, kind=kind)
        # No ordering check: with max < min the reference's smart_resize takes the
        # "too large" branch first, and so do we.
        return params.get("min_pixels") or lo, params.get("max_pixels") or hi

    def _prepare_image(self, image: Image, cache_key: str, params: dict[str, Any]) -> Prepared:
        self._check_params(params, {"min_pixels", "max_pixels"}, "image")
        s = self.image_settings
        rw, rh = self.image_size_for(image.width, image.height, **params)
        if (rw, rh) != (image.width, image.height):
            source = image.resized_array((rw, rh), PILImage.Resampling(s.resample))
        else:
            source = image.rgb_view()
        pixel_values = self._image_pixels(source)
        gh, gw = rh // s.patch_size, rw // s.patch_size
        grid_thw = torch.tensor([[1, gh, gw]], dtype=torch.long)
        mh, mw = gh // s.merge_size, gw // s.merge_size
        t = self.tokens
        span = build_span(
            [
                Text((t.vision_start,)),
                Placeholders(t.image_pad, TokenType.IMAGE, mh * mw, grid=(mh, mw)),
                Text((t.vision_end,)),
            ],
            rope="mrope",
        )
        return span.prepared(
            kind="image",
            family=FAMILY,
            grid=(1, mh, mw),
            inputs={"pixel_values": pixel_values, "image_grid_thw": grid_thw},
            content_hash=image.content_hash,
            cache_key=cache_key,
            meta={
                "source_size": [image.width, image.height],
                "resized_size": [rw, rh],
                "patches": gh * gw,
                "params": dict(params),
            },
        )

    def _prepare_video(self, video: Video, cache_key: str, params: dict[str, Any]) -> Prepared:
        allowed = {"fps", "num_frames", "min_frames", "max_frames", "min_pixels", "max_pixels"}
        self._check_params(params, allowed, "video")
        s = self.video_settings
        total = video.info.frame_count
        video_fps = video.info.fps if video.info.fps and video.info.fps > 0 else None
        indices = self._frame_indices(total, video_fps, params)
        sampled = video.sample_indices(indices)
        kept = list(sampled.indices)  # frames a damaged file could not deliver are left out
        # (N, C, H, W) over the decoded (N, H, W, C) array, i.e. channels-last: torch's uint8
        # antialiased resize works in that layout anyway, so no transposing copy is made.
        frames = torch.from_numpy(np.ascontiguousarray(sampled.frames)).permute(0, 3, 1, 2)
        n_frames, _, height, width = frames.shape
        lo, hi = self._pixel_bounds(params, s.min_pixels, s.max_pixels, "video")
        factor = s.patch_size * s.merge_size
        if s.cap_pixels_per_frame:
            frame_cap = s.max_video_tokens * factor * factor
            hi = max(min(frame_cap, hi // n_frames), int(lo * 1.05)) * n_frames
        if n_frames < s.temporal_patch_size:
            raise TooFewFramesError(
                f"video gives {n_frames} frame(s); Qwen3-VL needs at least {s.temporal_patch_size}",
                limit=s.temporal_patch_size,
                actual=n_frames,
                kind="video",
            )
        if s.do_resize:
            rh, rw = video_smart_resize(n_frames, height, width, s.temporal_patch_size, factor, lo, hi)
            frames = resize_frames_like_torchvision(frames, rh, rw, s.resample)
        else:
            rh, rw = height, width
        pixel_values = video_pixels(frames, s)
        gt = -(-n_frames // s.temporal_patch_size)
        gh, gw = rh // s.patch_size, rw // s.patch_size
        mh, mw = gh // s.merge_size, gw // s.merge_size
        stamps = temporal_group_timestamps(kept, video_fps or 24, s.temporal_patch_size)
        t = self.tokens
        # The template's <|vision_start|> ... <|vision_end|> around, per temporal patch:
        # "<t seconds>" <|vision_start|> pads <|vision_end|>.
        segments: list[Segment] = [Text((t.vision_start,))]
        for stamp in stamps:
            segments += [
                Text((*self._timestamp_tokens(stamp), t.vision_start)),
                Placeholders(t.video_pad, TokenType.VIDEO, mh * mw, grid=(mh, mw)),
                Text((t.vision_end,)),
            ]
        segments.append(Text((t.vision_end,)))
        return build_span(segments, rope="mrope").prepared(
            kind="video",
            family=FAMILY,
            grid=(gt, mh, mw),
            inputs={
                "pixel_values_videos": pixel_values,
                "video_grid_thw": torch.tensor([[gt, gh, gw]], dtype=torch.long),
            },
            content_hash=video.content_hash,
            cache_key=cache_key,
            timestamps=tuple(stamps),
            meta={
                "frame_indices": kept,
                "skipped_frames": [f.index for f in sampled.skipped],
                "video_fps": video_fps,
                "total_frames": total,
                "source_size": [width, height],
                "resized_size": [rw, rh],
                "patches": gt * gh * gw,
                "params": dict(params),
            },
        )

    def _frame_indices(self, total: int, video_fps: float | None, params: dict[str, Any]) -> list[int]:
        """The frames to sample, from the call's ``fps`` / ``num_frames`` / ``min_frames`` /
        ``max_frames`` over the configured ones, as the reference's ``sample_frames``."""
        s = self.video_settings
        if not s.do_sample_frames:
            return list(range(total))

        def asked(key: str, integer: bool) -> Any:
            return optional_positive(key, params.get(key), integer=integer, kind="video")

        asked_fps, asked_n = asked("fps", False), asked("num_frames", True)
        if asked_fps is not None and asked_n is not None:
            raise InvalidRequestError("fps and num_frames are mutually exclusive", kind="video")
        if asked_n is not None:
            fps, num_frames = None, asked_n
        else:  # fps=None (or absent) means the configured rate, as in the reference
            fps, num_frames = asked_fps or s.fps, s.num_frames
            if fps is not None and num_frames is not None:
                fps = None  # a configured frame count wins over the default rate
        return sample_frame_indices(
            total,
            video_fps,
            fps=fps,
            num_frames=num_frames,
            min_frames=asked("min_frames", True) or s.min_frames,
            max_frames=asked("max_frames", True) or s.max_frames,
        )

    def _timestamp_tokens(self, seconds: float) -> tuple[int, ...]:
        """Ids of ``"<{seconds:.1f} seconds>"``. In the reference prompt this text always sits
        between two special tokens (a ``<|vision_start|>`` before and after), which the
        tokenizer splits on first, so it tokenizes the same on its own as in context."""
        return self._timestamp_ids(f"<{seconds:.1f} seconds>")

    # -- encode -------------------------------------------------------------------------
    def _encode(self, kind: MediaKind, items: list[Prepared]) -> list[Encoded]:
        if kind == "image":
            key, grid_key = "pixel_values", "image_grid_thw"
        else:
            key, grid_key = "pixel_values_videos", "video_grid_thw"
        tower = self.tower
        if self.device.type == "cpu":
            pixels = torch.cat([p.inputs[key] for p in items]).to(dtype=self.dtype)
        else:  # each item to the device, joined there: no host copy of the whole batch first
            # (32 images at 448x448 are 154 MB of float32 patches, ~70 ms to join on a CPU)
            pixels = torch.cat([p.inputs[key].to(self.device, self.dtype, non_blocking=True) for p in items])
        grid = torch.cat([p.inputs[grid_key] for p in items]).to(self.device)
        out = tower(pixels, grid_thw=grid, return_dict=True)
        sizes = [p.token_count for p in items]
        merged = torch.split(out.pooler_output, sizes)
        deepstack = [torch.split(f, sizes) for f in (out.deepstack_features or ())]
        return [
            Encoded(embeddings=merged[i], deepstack=[layer[i] for layer in deepstack] if deepstack else None)
            for i in range(len(items))
        ]


_VISUAL_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.", "thinker.visual.")


def _build_tower(model_dir: Path, config: dict[str, Any], device: torch.device, dtype: torch.dtype):
    """transformers' ``Qwen3VLVisionModel`` for ``config["vision_config"]`` with only the
    vision weights read from the checkpoint's safetensors (sharded or not)."""
    from transformers import Qwen3VLConfig
    from transformers.initialization import no_init_weights
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    cfg = Qwen3VLConfig.from_dict({k: v for k, v in config.items() if not k.startswith("_")})
    state = read_tower_weights(model_dir, {"visual": _VISUAL_PREFIXES})["visual"]
    if not state:
        raise UnsupportedModelError(f"no vision weights (model.visual.*) in {model_dir}")
    with no_init_weights():
        tower = Qwen3VLVisionModel._from_config(cfg.vision_config, dtype=dtype)
    missing, unexpected = tower.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in dict(tower.named_buffers())]
    if missing or unexpected:
        raise UnsupportedModelError(
            f"vision weights in {model_dir} do not fit Qwen3VLVisionModel: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    return tower.to(device=device, dtype=dtype).eval()
