"""Gemma-4: image, video and audio preparation exactly as the transformers reference, and the
vision and audio towers (transformers' own modules) projected into the LM embedding space.

Modules: :mod:`~encoders.gemma4.vision` (image and video pixels, frame sampling, the
resize rule), :mod:`~encoders.gemma4.audio` (log-mel features),
:mod:`~encoders.gemma4.settings` (processor configs and special tokens from the
checkpoint), :mod:`~encoders.gemma4.encoder` (:class:`Gemma4Encoder`: spans, towers).

Reference (transformers 5.23, ``models/gemma4``), read top to bottom:

* images: ``Gemma4ImageProcessorPil`` -- see :mod:`encoders.gemma4.vision`. The span the
  processor writes is ``<|image>`` + ``<|image|>`` x N + ``<image|>`` with N the soft
  tokens (``num_soft_tokens_per_image``: patches / 9 after the 3x3 pooling);
* videos: ``Gemma4VideoProcessor`` (torchvision, reproduced) -- per sampled frame
  ``"mm:ss "`` + ``<|image>`` + ``<|video|>`` x N + ``<image|>``, frames joined by a
  space (``Gemma4Processor.replace_video_token``), ``mm:ss`` from ``index / fps``;
* audio: ``Gemma4AudioFeatureExtractor`` -- see :mod:`encoders.gemma4.audio`; the span is
  ``<|audio>`` + ``<|audio|>`` x N + ``<audio|>``, N from the mel mask as the processor
  counts it (one token per 40 ms). Clips over 30 s are truncated to 30 s by the reference
  (the feature extractor's ``max_length=480000, truncation=True``); so are ours, recorded
  in ``meta["truncated"]``; ``prepare(audio, truncate=False)`` raises
  ``MediaTooLongError`` instead;
* positions: Gemma-4 uses 1-D RoPE (``"1d"`` in :mod:`encoders.span`) over ``arange`` of the whole sequence (the model builds
  ``position_ids`` that way; media rows are ordinary rows), so a span's positions are
  ``0..len-1`` and ``position_span == num_rows``;
* ``mm_token_type`` as ``Gemma4Processor.create_mm_token_type_ids``: 1 on image tokens, 2
  on video tokens, 3 on audio tokens, 0 elsewhere (delimiters and timestamps included).
  Checkpoints whose text config says ``use_bidirectional_attention == "vision"`` let each
  run of image/video tokens attend bidirectionally on the sliding-attention layers
  (``get_block_sequence_ids_for_mask`` + ``create_masks_for_vision_model``; full-attention
  layers stay causal): ``meta["bidirectional_blocks"]`` lists those runs as half-open row
  ranges of the span, ``meta["bidirectional_attention"]`` says whether the model uses them;
* embeddings: ``Gemma4Model.get_image_features`` / ``get_video_features`` /
  ``get_audio_features``: the tower, then ``embed_vision`` / ``embed_audio`` (RMS norm +
  projection to the text hidden size), padding rows dropped -- exactly ``token_count``
  rows per item, in the LM embedding space, ready to scatter at the placeholder rows.
"""

from encoders.gemma4.encoder import FAMILY, TOWER_NAMES, Gemma4Encoder
from encoders.gemma4.settings import SpecialTokens
from encoders.gemma4.vision import SUPPORTED_SOFT_TOKENS

__all__ = ["FAMILY", "SUPPORTED_SOFT_TOKENS", "TOWER_NAMES", "Gemma4Encoder", "SpecialTokens"]
