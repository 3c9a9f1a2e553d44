"""Qwen3-VL: image and video preparation exactly as the transformers reference, and the
vision tower (transformers' own ``Qwen3VLVisionModel``) with DeepStack features.

Modules: :mod:`~encoders.qwen3_vl.reference` (the reference's resize, frame sampling and
timestamp arithmetic), :mod:`~encoders.qwen3_vl.settings` (processor configs and special
tokens from the checkpoint), :mod:`~encoders.qwen3_vl.pixels` (image and video pixel
values), :mod:`~encoders.qwen3_vl.encoder` (:class:`Qwen3VLEncoder`: spans, tower).

Reference (transformers 5.23), read top to bottom:

* images: ``Qwen2VLImageProcessorPil`` configured by ``preprocessor_config.json``:
  RGB uint8 -> ``smart_resize`` to multiples of ``patch * merge`` within
  [min_pixels, max_pixels] -> PIL resize (bicubic) -> rescale (float64 ``x * 1/255``, cast
  to float32) -> normalise (float32 ``(x - mean) / std``) -> patches flattened in the
  merge order ``(h/m, w/m, m, m, C, T, p, p)``, the single frame repeated over the
  temporal patch. ``image_grid_thw`` = (1, h/p, w/p).
* videos: ``Qwen3VLVideoProcessor`` configured by ``video_preprocessor_config.json``
  (it needs torchvision, which is not a dependency, so every step is reproduced from its
  source): ``num_frames = int(total / video_fps * fps)`` clamped to
  [min_frames, max_frames] and the total, indices ``linspace(0, total-1, n).round()``,
  a ``smart_resize`` that also weighs the frame count, torchvision's uint8 bicubic
  antialiased resize (on CPU that is ``torch.nn.functional.interpolate`` on the uint8
  tensor), the fused rescale+normalise ``(x - 255*mean) / (255*std)`` in float32, the
  last frame repeated to fill the last temporal patch, and patches in the order
  ``(t, h/m, w/m, m, m, C, T, p, p)``.
* text: ``Qwen3VLProcessor`` expands the chat template's
  ``<|vision_start|><|image_pad|><|vision_end|>`` to ``token_count`` image pads, and a
  video's ``<|video_pad|>`` to, per temporal patch, ``"<{t:.1f} seconds>"`` +
  ``<|vision_start|>`` + pads + ``<|vision_end|>`` (inside the template's own start/end
  pair), with ``t`` the mean of the group's first and last ``index / video_fps``.
* positions: ``Qwen3VLModel.get_rope_index``: text rows advance by one; a vision group
  (a whole image, or one temporal patch of a video) placed at cursor ``s`` gets
  ``(s, s + row, s + col)`` and advances the cursor by ``max(h, w) / merge``
  (M-RoPE in :mod:`encoders.span`).

Speed: the image path makes the same numbers as the reference in a fraction of its time
(see :class:`~encoders.qwen3_vl.pixels.ImagePixels`): one PIL resize, then patchify +
rescale + normalise fused, in cache-sized bands, straight into the output tensor. Every
float is bit-identical to the reference's (checked over all 256 input levels when the
encoder is built, with a lookup table as fallback).
"""

from encoders.qwen3_vl.encoder import FAMILY, Qwen3VLEncoder
from encoders.qwen3_vl.pixels import ImagePixels
from encoders.qwen3_vl.reference import (
    MAX_ASPECT_RATIO,
    AspectRatioError,
    TooFewFramesError,
    image_smart_resize,
    sample_frame_indices,
    temporal_group_timestamps,
    video_smart_resize,
)
from encoders.qwen3_vl.settings import ImageSettings, SpecialTokens, VideoSettings

"""The class's name before the split into modules (kept for callers that import it)."""

__all__ = [
    "FAMILY",
    "MAX_ASPECT_RATIO",
    "AspectRatioError",
    "ImagePixels",
    "ImageSettings",
    "Qwen3VLEncoder",
    "SpecialTokens",
    "TooFewFramesError",
    "VideoSettings",
    "image_smart_resize",
    "sample_frame_indices",
    "temporal_group_timestamps",
    "video_smart_resize",
]
