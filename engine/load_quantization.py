"""Model.load's quantization steps: check the method before any weight loads, then turn
the placed weights into what was asked (``engine.quantization`` layers, or an FP8
checkpoint's own fp8 values through ``engine.fp8_checkpoint``). Kept apart from both so
that neither imports the other back: the layers and their arithmetic are below the FP8
file reader, and this file is above both.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from engine.fp8_checkpoint import fp8_config, keep_fp8_layers
from engine.quantization import check_kernels, check_method, quantize_language_model

log = logging.getLogger(__name__)


def check_quantization(
    method: str | None, config: dict[str, Any], device: torch.device, *, allow_slow: bool | None = None
) -> None:
    """Before any weight loads: ``check_method`` (int8/int4 on CUDA refused unless
    ``allow_slow``, default ``PIE_MEDIA_ALLOW_SLOW_QUANTIZATION``), except that "fp8" is what
    an FP8 checkpoint already is (on the CPU it then loads dequantized)."""
    if method is None or (method == "fp8" and fp8_config(config) is not None):
        return
    check_method(method, device, allow_slow=allow_slow)


def quantize_at_load(
    hf: Any,
    language_model: torch.nn.Module,
    path: Any,
    config: dict[str, Any],
    method: str | None,
    *,
    device: torch.device,
    dtype: torch.dtype,
    allow_slow: bool | None = None,
) -> str | None:
    """``Model.load``'s one step after placement: what the model's weights end up as.

    None with a float checkpoint: nothing. A checkpoint carrying an fp8
    ``quantization_config`` (already dequantized by the loader) with no method or "fp8":
    on CUDA its layers go back to the file's fp8 values ("fp8"), on the CPU they stay
    dequantized ("fp8-dequantized"). "int8" / "int4" / "fp8": the language model (and head)
    are quantized from whatever was loaded (fp8: per-row W8A8)."""
    from_fp8 = fp8_config(config) is not None
    if method is None and not from_fp8:
        return None
    if from_fp8 and method in (None, "fp8"):
        if device.type != "cuda":
            log.info("fp8 checkpoint on %s: weights dequantized to %s", device.type, dtype)
            if device.type == "cpu":
                _detach_from_checkpoint_file(hf)
            return "fp8-dequantized"
        half = dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
        n = keep_fp8_layers(hf, path, config, half)
        log.info("fp8 checkpoint: %d layers kept in fp8", n)
        check_kernels(hf)
        return "fp8"
    assert method is not None
    quantize_language_model(hf, language_model, method, device=device, allow_slow=allow_slow)
    if device.type == "cpu":
        _detach_from_checkpoint_file(hf)
    check_kernels(hf)
    return method


@torch.no_grad()
def _detach_from_checkpoint_file(hf: Any) -> None:
    """Copy the weights that stay float out of the checkpoint's memory map.

    On the CPU, ``from_pretrained`` leaves weights whose dtype matches the file as views of
    the safetensors mapping. Quantization drops the float linear layers, but the mapping
    stays alive through the towers and embeddings that remain, and every page of it read
    while loading stays in the process's resident set: measured on the 2B-shaped
    checkpoint, int8 sat at 11.4 GiB RSS (float32: 11.0) although its weights are 4.3 GiB.
    Copying the rest (~3 GB, about a second) lets the mapping go: 5.6-6.0 GiB."""
    for param in hf.parameters():  # deduplicated: a tied weight is copied once
        param.data = param.data.clone()
    seen: dict[int, torch.Tensor] = {}
    for module in hf.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[name] = seen.setdefault(id(buf), buf.clone())
