"""The Gemma-4 encoder: preparation of images, videos and audio into spans (see
:mod:`encoders.gemma4`) and the vision and audio towers with their embedders."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from encoders.base import Checkpoint, CheckpointEncoder, optional_positive
from encoders.checkpoint_files import load_tokenizer, read_tower_weights
from encoders.errors import UnsupportedMediaKindError, UnsupportedModelError
from encoders.frame_resize import resize_frames_like_torchvision
from encoders.gemma4.audio import AudioSettings, LogMel, audio_token_count, valid_frame_count
from encoders.gemma4.settings import Settings, SpecialTokens, read_settings, special_tokens
from encoders.gemma4.vision import (
    aspect_ratio_preserving_size,
    check_budget,
    patchify,
    sample_frame_indices,
    timestamp_text,
)
from encoders.prepared import Encoded, MediaKind, Prepared
from encoders.span import Placeholders, Segment, Span, Text, TextIds, TokenType, build_span
from media import Audio, Image, Video
from media.errors import EmptyMediaError, InvalidRequestError, MediaTooLongError

__all__ = ["FAMILY", "TOWER_NAMES", "Gemma4Encoder"]

FAMILY = "gemma4"

_IMAGE_PARAMS = frozenset({"max_soft_tokens"})
_VIDEO_PARAMS = frozenset({"max_soft_tokens", "num_frames", "fps"})
_AUDIO_PARAMS = frozenset({"truncate"})

# Vision batches are split so that sum(frames * patches^2) stays under this many attention
# scores (the CPU SDPA path materialises them); one item always goes through whole.
_VISION_BATCH_SCORES = 8 * 2520 * 2520
# Audio batches: at most this many mel frames (batch x longest).
_AUDIO_BATCH_FRAMES = 16 * 3000

TOWER_NAMES = ("vision_tower", "embed_vision", "audio_tower", "embed_audio")
"""Keys of ``towers``: the ``Gemma4Model`` attributes of the same names."""


class Gemma4Encoder(CheckpointEncoder):
    """Preparation and encoder towers of a ``Gemma4ForConditionalGeneration`` checkpoint.

    ``prepare(Image | Video | Audio, **params)`` -> :class:`~encoders.prepared.Prepared`;
    ``encode([Prepared, ...])`` -> :class:`~encoders.prepared.Encoded` whose embeddings
    are already in the language model's embedding space (``token_count`` x text hidden).

    Parameters accepted by ``prepare`` (same names as the reference processor's call
    arguments; part of the cache key):

    * image: ``max_soft_tokens`` (70, 140, 280, 560 or 1120; default from the checkpoint);
    * video: ``max_soft_tokens`` per frame (default 70), ``num_frames`` (default 32) or
      ``fps`` (mutually exclusive);
    * audio: ``truncate`` (default True: clips over 30 s are cut to 30 s as the reference
      does; False raises ``MediaTooLongError``).

    ``kinds`` is per instance: audio only when the checkpoint has an audio tower.
    """

    family = FAMILY
    display_name = "Gemma-4"

    def __init__(
        self,
        checkpoint: Checkpoint,
        *,
        tokenizer: Any,
        settings: Settings,
        tokens: SpecialTokens,
        towers: dict[str, torch.nn.Module],
        exact_audio: bool = True,
    ):
        super().__init__(checkpoint, tokenizer=tokenizer, fingerprint_suffix="" if exact_audio else "+f32mel")
        image, video, audio = settings.image, settings.video, settings.audio
        self.image_settings = image
        self.video_settings = video
        self.audio_settings = audio
        self.processor_settings = settings.processor
        self.tokens = tokens
        self._towers = dict(towers)
        kinds: set[MediaKind] = set()
        if self.config.get("vision_config") is not None:
            kinds.add("image")
            if tokenizer is not None:
                kinds.add("video")
        if audio is not None:
            kinds.add("audio")
        self.kinds = frozenset(kinds)
        text = self.config.get("text_config") or {}
        self.bidirectional_vision = text.get("use_bidirectional_attention") == "vision"
        self._image_table = image.pixel_table(video=False)
        self._video_table = video.pixel_table(video=True)
        self._logmel = LogMel(audio, exact=exact_audio) if audio is not None else None
        self._text_ids = TextIds(tokenizer)

    # -- construction -------------------------------------------------------------------
    @classmethod
    def _from_checkpoint(
        cls,
        checkpoint: Checkpoint,
        *,
        towers: dict[str, torch.nn.Module] | None = None,
        load_weights: bool = True,
        exact_audio: bool = True,
    ) -> Gemma4Encoder:
        """Read the processor configs and tokenizer from the checkpoint; build the towers.

        ``towers``: modules the engine already holds, keyed like the ``Gemma4Model``
        attributes (``vision_tower``, ``embed_vision``, ``audio_tower``, ``embed_audio``);
        their device and dtype win. The rest are built from ``config`` with transformers'
        ``Gemma4VisionModel`` / ``Gemma4AudioModel`` / ``Gemma4MultimodalEmbedder`` and only
        their weights are read from the checkpoint's safetensors. ``load_weights=False``
        defers that until the first ``encode`` (prepare-only users never pay for it).
        ``exact_audio=False`` computes the log-mel filter bank and log in float32 (see
        :class:`~encoders.gemma4.audio.LogMel`): faster, within float32 rounding of the
        reference instead of bit-identical; it is part of the cache fingerprint.
        """
        model_dir, config = checkpoint.model_dir, checkpoint.config
        if config.get("vision_config") is None and config.get("audio_config") is None:
            raise UnsupportedModelError(
                f"{model_dir.name}: config.json has neither a vision_config nor an audio_config"
            )
        settings = read_settings(model_dir, config)
        tokenizer = load_tokenizer(model_dir, required=False)
        tokens = special_tokens(config, tokenizer)
        if settings.audio is not None and None in (tokens.boa, tokens.eoa, tokens.audio):
            raise UnsupportedModelError(f"{model_dir.name} has an audio tower but no audio token ids")
        given = {k: v for k, v in (towers or {}).items() if v is not None}
        unknown = set(given) - set(TOWER_NAMES)
        if unknown:
            raise ValueError(f"unknown tower names {sorted(unknown)}; expected some of {TOWER_NAMES}")
        enc = cls(
            checkpoint.placed_like(given.values()),
            tokenizer=tokenizer,
            settings=settings,
            tokens=tokens,
            towers=given,
            exact_audio=exact_audio,
        )
        if load_weights:
            enc.towers  # noqa: B018 - load now
        return enc

    @property
    def towers(self) -> dict[str, torch.nn.Module]:
        """The vision/audio towers and their embedders (built and loaded on first use)."""
        wanted = []
        if self.config.get("vision_config") is not None:
            wanted += ["vision_tower", "embed_vision"]
        if self.config.get("audio_config") is not None:
            wanted += ["audio_tower", "embed_audio"]
        if any(name not in self._towers for name in wanted):
            with self._tower_lock:
                missing = [name for name in wanted if name not in self._towers]
                if missing:
                    self._towers.update(
                        _build_towers(self.model_dir, self.config, missing, self.device, self.dtype)
                    )
        return self._towers

    # -- planning (no pixels needed) -----------------------------------------------------
    def image_size_for(self, width: int, height: int, max_soft_tokens: int | None = None) -> tuple[int, int]:
        """(resized_width, resized_height) of a ``width`` x ``height`` image."""
        s = self.image_settings
        budget = check_budget(max_soft_tokens if max_soft_tokens is not None else s.max_soft_tokens, "image")
        if not s.do_resize:
            return width, height
        h, w = aspect_ratio_preserving_size(
            height, width, s.patch_size, s.max_patches(budget), s.pooling_kernel_size
        )
        return w, h

    def image_token_count(self, width: int, height: int, max_soft_tokens: int | None = None) -> int:
        """Soft tokens a ``width`` x ``height`` image gets (``_get_num_multimodal_tokens``)."""
        w, h = self.image_size_for(width, height, max_soft_tokens)
        unit = self.image_settings.side_multiple
        return (h // unit) * (w // unit)

    def audio_token_count(self, num_samples: int, sample_rate: int | None = None) -> int:
        """Soft tokens for a clip of ``num_samples`` at ``sample_rate`` (default 16 kHz),
        after the 30 s truncation."""
        s = self._audio()
        rate = sample_rate or s.sampling_rate
        n = (
            int(np.ceil(num_samples * (s.sampling_rate / rate)))
            if rate != s.sampling_rate
            else int(num_samples)
        )
        return audio_token_count(valid_frame_count(min(n, s.max_length), s))

    # -- prepare ------------------------------------------------------------------------
    def _prepare(self, kind: MediaKind, media: Any, cache_key: str, **params: Any) -> Prepared:
        if kind == "image":
            return self._prepare_image(media, cache_key, params)
        if kind == "video":
            return self._prepare_video(media, cache_key, params)
        return self._prepare_audio(media, cache_key, params)

    def _vision_meta(self, span: Span, meta: dict[str, Any]) -> dict[str, Any]:
        """``meta`` plus the runs of vision tokens (the blocks
        ``get_block_sequence_ids_for_mask`` builds) and whether the model attends
        bidirectionally within them."""
        return {
            **meta,
            "bidirectional_blocks": [[a, b] for a, b in span.placeholder_runs],
            "bidirectional_attention": self.bidirectional_vision,
        }

    def _prepare_image(self, image: Image, cache_key: str, params: dict[str, Any]) -> Prepared:
        self._check_params(params, _IMAGE_PARAMS, "image")
        s = self.image_settings
        budget = check_budget(params.get("max_soft_tokens", s.max_soft_tokens), "image")
        width, height = image.width, image.height
        tw, th = self.image_size_for(width, height, budget)
        unit = s.side_multiple
        if th % unit or tw % unit:
            raise InvalidRequestError(
                f"with resizing off the image must have sides divisible by {unit}, got {width}x{height}",
                kind="image",
            )
        if (tw, th) == (width, height):
            pixels = image.rgb_view()
        else:
            pixels = image.resized_array((tw, th), s.resample)
        values, positions, real = patchify(
            pixels[None], s.patch_size, self._image_table, s.max_patches(budget)
        )
        tokens = real // s.pooling_kernel_size**2
        t = self.tokens
        span = build_span(
            [Text((t.boi,)), Placeholders(t.image, TokenType.IMAGE, tokens), Text((t.eoi,))], rope="1d"
        )
        meta = {
            "source_size": [width, height],
            "resized_size": [tw, th],
            "patch_grid": [th // s.patch_size, tw // s.patch_size],
            "max_soft_tokens": budget,
            "params": dict(params),
        }
        return span.prepared(
            kind="image",
            family=FAMILY,
            grid=(1, th // unit, tw // unit),
            inputs={"pixel_values": values, "image_position_ids": positions},
            content_hash=image.content_hash,
            cache_key=cache_key,
            meta=self._vision_meta(span, meta),
        )

    def _prepare_video(self, video: Video, cache_key: str, params: dict[str, Any]) -> Prepared:
        self._check_params(params, _VIDEO_PARAMS, "video")
        s = self.video_settings
        budget = check_budget(params.get("max_soft_tokens", s.max_soft_tokens), "video")
        num_frames, fps = s.num_frames, s.fps
        if "num_frames" in params or "fps" in params:
            num_frames, fps = params.get("num_frames"), params.get("fps")
        if num_frames is not None and fps is not None:
            raise InvalidRequestError("`num_frames` and `fps` are mutually exclusive, give one", kind="video")
        num_frames = optional_positive("num_frames", num_frames, integer=True, kind="video")
        fps = optional_positive("fps", fps, integer=False, kind="video")
        total = video.info.frame_count
        if total < 1:
            raise EmptyMediaError("the video has no frames", actual=0, kind="video")
        video_fps = (
            float(video.info.fps) if video.info.fps and video.info.fps > 0 else 24.0
        )  # the reference's fallback
        if s.do_sample_frames:
            indices = sample_frame_indices(total, num_frames, fps, video_fps)
        else:
            indices = list(range(total))
        sampled = video.sample_indices(indices)
        frames = np.ascontiguousarray(sampled.frames)
        n, height, width = frames.shape[:3]
        max_patches = s.max_patches(budget)
        th, tw = aspect_ratio_preserving_size(height, width, s.patch_size, max_patches, s.pooling_kernel_size)
        if not s.do_resize:
            th, tw = height, width
        # A channels-last (N, C, H, W) view of the decoded frames: no transposing copy.
        resized = resize_frames_like_torchvision(
            torch.from_numpy(frames).permute(0, 3, 1, 2), th, tw, s.resample
        )
        pixels = resized.permute(0, 2, 3, 1).numpy()
        values, positions, real = patchify(pixels, s.patch_size, self._video_table, max_patches)
        per_frame = real // s.pooling_kernel_size**2
        seconds = [i / video_fps for i in sampled.indices]
        stamps = [timestamp_text(x) for x in seconds]
        t = self.tokens
        # Per frame "mm:ss " <|image> pads <image|>, frames joined by a space.
        segments: list[Segment] = []
        for k, stamp in enumerate(stamps):
            segments += [
                Text((*self._text(f"{stamp} " if k == 0 else f" {stamp} "), t.boi)),
                Placeholders(t.video, TokenType.VIDEO, per_frame),
                Text((t.eoi,)),
            ]
        span = build_span(segments, rope="1d")
        meta = {
            "source_size": [width, height],
            "resized_size": [tw, th],
            "patch_grid": [th // s.patch_size, tw // s.patch_size],
            "max_soft_tokens": budget,
            "tokens_per_frame": per_frame,
            "frame_indices": list(sampled.indices),
            "frame_times": [float(x) for x in sampled.timestamps],
            "timestamp_text": stamps,
            "video_fps": video_fps,
            "skipped_frames": [f.to_dict() for f in sampled.skipped],
            "params": dict(params),
        }
        unit = s.side_multiple
        return span.prepared(
            kind="video",
            family=FAMILY,
            grid=(n, th // unit, tw // unit),
            inputs={
                "pixel_values_videos": values,
                "video_position_ids": positions,
                "num_frames_per_video": torch.tensor([n], dtype=torch.long),
            },
            content_hash=video.content_hash,
            cache_key=cache_key,
            timestamps=tuple(seconds),
            meta=self._vision_meta(span, meta),
        )

    def _prepare_audio(self, audio: Audio, cache_key: str, params: dict[str, Any]) -> Prepared:
        self._check_params(params, _AUDIO_PARAMS, "audio")
        truncate = params.get("truncate", True)
        if not isinstance(truncate, bool):
            raise InvalidRequestError(f"truncate must be true or false, got {truncate!r}", kind="audio")
        s = self._audio()
        assert self._logmel is not None
        samples = audio.mono_at(s.sampling_rate)
        n = int(samples.shape[0])
        truncated = n > s.max_length
        if truncated:
            if not truncate:
                raise MediaTooLongError(
                    f"audio is {n / s.sampling_rate:.2f} s; Gemma-4 takes at most {s.max_seconds:g} s "
                    f"({audio_token_count(valid_frame_count(s.max_length, s))} audio tokens) per clip",
                    limit=s.max_seconds,
                    actual=round(n / s.sampling_rate, 3),
                    kind="audio",
                )
            samples = samples[: s.max_length]
        features, mask = self._logmel(samples)
        tokens = audio_token_count(int(mask.sum()))
        if tokens == 0:
            shortest = s.frame_length + 1 - s.frame_length // 2
            raise EmptyMediaError(
                f"audio is {n} samples at {s.sampling_rate} Hz, shorter than one analysis frame "
                f"({shortest} samples): Gemma-4 makes no audio tokens from it",
                limit=shortest,
                actual=n,
                kind="audio",
            )
        t = self.tokens
        assert t.boa is not None and t.eoa is not None and t.audio is not None
        span = build_span(
            [Text((t.boa,)), Placeholders(t.audio, TokenType.AUDIO, tokens), Text((t.eoa,))], rope="1d"
        )
        return span.prepared(
            kind="audio",
            family=FAMILY,
            grid=(1, 1, tokens),
            inputs={
                "input_features": torch.from_numpy(features).unsqueeze(0),
                "input_features_mask": torch.from_numpy(mask).unsqueeze(0),
            },
            content_hash=audio.content_hash,
            cache_key=cache_key,
            meta={
                "seconds": round(audio.duration, 6),
                "samples": min(n, s.max_length),
                "sample_rate": s.sampling_rate,
                "truncated": truncated,
                "mel_frames": int(features.shape[0]),
                "valid_mel_frames": int(mask.sum()),
                "params": dict(params),
            },
        )

    @property
    def max_audio_seconds(self) -> float | None:
        return self.audio_settings.max_seconds if self.audio_settings is not None else None

    def _audio(self) -> AudioSettings:
        if self.audio_settings is None:
            raise UnsupportedMediaKindError(f"model {self.name!r} has no audio tower", kind="audio")
        return self.audio_settings

    def _text(self, text: str) -> tuple[int, ...]:
        """Token ids of a timestamp segment. Every segment after the first sits between two
        special tokens (``<image|>`` and ``<|image>``), which the tokenizer splits out first,
        so it tokenizes alone exactly as in the reference prompt. The first one is preceded
        by whatever text precedes the video in the prompt; the engine appends the span as
        its own run, which equals the reference whenever that text ends in a special token
        or in text the tokenizer does not merge with the digits (as the chat template's
        ``"<|turn>user\n"``: checked in the tests)."""
        return self._text_ids(text)

    # -- encode -------------------------------------------------------------------------
    def _encode(self, kind: MediaKind, items: list[Prepared]) -> list[Encoded]:
        if kind == "audio":
            return self._encode_audio(items)
        return self._encode_vision(kind, items)

    def _encode_vision(self, kind: MediaKind, items: list[Prepared]) -> list[Encoded]:
        towers = self.towers
        tower, embed = towers["vision_tower"], towers["embed_vision"]
        key_px, key_pos = (
            ("pixel_values", "image_position_ids")
            if kind == "image"
            else (
                "pixel_values_videos",
                "video_position_ids",
            )
        )
        k2 = self.image_settings.pooling_kernel_size**2
        # Every frame (an image is one frame) with its soft-token count.
        frames: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        owner: list[int] = []
        for i, p in enumerate(items):
            px, pos = p.inputs[key_px], p.inputs[key_pos]
            per_frame = p.token_count // px.shape[0]
            for f in range(px.shape[0]):
                frames.append((px[f], pos[f], per_frame))
                owner.append(i)
        outputs: list[torch.Tensor] = []
        for batch in _vision_batches([f[2] for f in frames], k2):
            length = max(frames[j][2] for j in batch) * k2  # output_length * k^2 = patches
            pv = torch.zeros((len(batch), length, frames[batch[0]][0].shape[-1]), dtype=torch.float32)
            pos = torch.full((len(batch), length, 2), -1, dtype=torch.long)
            for row, j in enumerate(batch):
                src_px, src_pos, tokens = frames[j]
                real = tokens * k2  # real patches come first; the rest is padding
                pv[row, :real] = src_px[:real]
                pos[row, :real] = src_pos[:real]
            hidden = tower(
                pixel_values=pv.to(device=self.device, dtype=self.dtype),
                pixel_position_ids=pos.to(self.device),
            ).last_hidden_state
            emb = embed(inputs_embeds=hidden)
            outputs.extend(torch.split(emb, [frames[j][2] for j in batch]))
        per_item: list[list[torch.Tensor]] = [[] for _ in items]
        for i, emb in zip(owner, outputs, strict=True):
            per_item[i].append(emb)
        result = []
        for p, parts in zip(items, per_item, strict=True):
            # Own storage per item: a view would keep the whole batch alive in the cache.
            emb = parts[0].clone() if len(parts) == 1 else torch.cat(parts)
            if emb.shape[0] != p.token_count:
                raise RuntimeError(f"vision tower gave {emb.shape[0]} rows for {p.token_count} tokens")
            result.append(Encoded(embeddings=emb))
        return result

    def _encode_audio(self, items: list[Prepared]) -> list[Encoded]:
        towers = self.towers
        tower, embed = towers["audio_tower"], towers["embed_audio"]
        result: list[Encoded | None] = [None] * len(items)
        order = sorted(range(len(items)), key=lambda i: items[i].inputs["input_features"].shape[1])
        start = 0
        while start < len(order):
            stop = start + 1
            while stop < len(order):
                longest = items[order[stop]].inputs["input_features"].shape[1]
                if (stop - start + 1) * longest > _AUDIO_BATCH_FRAMES:
                    break
                stop += 1
            batch = order[start:stop]
            start = stop
            longest = max(items[i].inputs["input_features"].shape[1] for i in batch)
            bins = items[batch[0]].inputs["input_features"].shape[2]
            feats = torch.zeros((len(batch), longest, bins), dtype=torch.float32)
            mask = torch.zeros((len(batch), longest), dtype=torch.bool)
            for row, i in enumerate(batch):
                f = items[i].inputs["input_features"][0]
                feats[row, : f.shape[0]] = f
                mask[row, : f.shape[0]] = items[i].inputs["input_features_mask"][0]
            out = tower(
                feats.to(device=self.device, dtype=self.dtype), mask.to(self.device), return_dict=True
            )
            emb = embed(inputs_embeds=out.last_hidden_state)
            for row, i in enumerate(batch):
                rows = emb[row][out.attention_mask[row]]
                if rows.shape[0] != items[i].token_count:
                    raise RuntimeError(
                        f"audio tower gave {rows.shape[0]} rows for {items[i].token_count} tokens"
                    )
                result[i] = Encoded(embeddings=rows)
        return result  # type: ignore[return-value]


def _vision_batches(tokens: list[int], k2: int) -> list[list[int]]:
    """Consecutive frame groups whose padded attention (frames x patches^2) fits the budget."""
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for j, t in enumerate(tokens):
        cand = max(longest, t)
        if current and (len(current) + 1) * (cand * k2) ** 2 > _VISION_BATCH_SCORES:
            batches.append(current)
            current, cand = [], t
        current.append(j)
        longest = cand
    if current:
        batches.append(current)
    return batches


_PREFIXES = {name: (f"model.{name}.", f"{name}.") for name in TOWER_NAMES}


def _build_towers(
    model_dir: Path, config: dict[str, Any], names: list[str], device: torch.device, dtype: torch.dtype
) -> dict[str, torch.nn.Module]:
    """transformers' Gemma-4 tower modules for ``names``, with only their weights read from
    the checkpoint's safetensors (sharded or not)."""
    from transformers import Gemma4Config
    from transformers.initialization import no_init_weights
    from transformers.models.gemma4.modeling_gemma4 import (
        Gemma4AudioModel,
        Gemma4MultimodalEmbedder,
        Gemma4VisionModel,
    )

    cfg = Gemma4Config.from_dict({k: v for k, v in config.items() if not k.startswith("_")})
    state = read_tower_weights(model_dir, {n: _PREFIXES[n] for n in names})
    modules: dict[str, torch.nn.Module] = {}
    with no_init_weights():
        for n in names:
            if n == "vision_tower":
                modules[n] = Gemma4VisionModel._from_config(cfg.vision_config, dtype=dtype)
            elif n == "audio_tower":
                modules[n] = Gemma4AudioModel._from_config(cfg.audio_config, dtype=dtype)
            elif n == "embed_vision":
                modules[n] = Gemma4MultimodalEmbedder(cfg.vision_config, cfg.text_config)
            else:
                modules[n] = Gemma4MultimodalEmbedder(cfg.audio_config, cfg.text_config)
    for n, module in modules.items():
        if not state[n]:
            raise UnsupportedModelError(f"no {n} weights (model.{n}.*) in {model_dir}")
        missing, unexpected = module.load_state_dict(state[n], strict=False)
        if missing or unexpected:
            raise UnsupportedModelError(
                f"{n} weights in {model_dir} do not fit transformers' module: "
                f"missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        modules[n] = module.to(device=device, dtype=dtype).eval()
    return modules
