"""Which attention backend a model's passes use (``Model.load(attention=...)``).

Kept apart from ``engine.attention`` (which ``engine.attention_flashinfer`` builds on), so
that choosing flashinfer does not make the torch backend's file import the flashinfer one.
``engine.attention_flashinfer`` is imported here only to serve a CUDA device.
"""

from __future__ import annotations

import logging

import torch

from engine.attention import TORCH_BACKEND, AttentionBackend
from engine.errors import AttentionBackendUnavailableError, InvalidRequestError
from engine.kv_quant import KVFormat

ATTENTION_CHOICES = ("auto", "torch", "flashinfer")

log = logging.getLogger(__name__)


def check_attention_choice(attention: str) -> None:
    """``InvalidRequestError`` unless ``attention`` names a backend choice."""
    if attention not in ATTENTION_CHOICES:
        raise InvalidRequestError(
            f"unknown attention backend {attention!r}; expected one of {', '.join(ATTENTION_CHOICES)}",
            attention=attention,
        )


def select_backend(
    attention: str, *, device: torch.device, dtype: torch.dtype, kv_format: KVFormat | None = None
) -> AttentionBackend:
    """The backend ``Model.load(attention=...)`` asked for.

    ``"torch"``: the reference backend. ``"flashinfer"``: flashinfer, or
    ``AttentionBackendUnavailableError`` saying why it cannot be used. ``"auto"``:
    flashinfer when the device is CUDA, the dtype is float16/bfloat16 and flashinfer
    imports; else torch (the reason is logged). ``engine.attention_flashinfer`` is imported
    only for a CUDA device, and flashinfer itself only by its ``flashinfer_available``.
    ``kv_format``: the pool's storage (``Model.load(kv_dtype=...)``); flashinfer reads the
    model's own dtype or fp8_e4m3, never int8 (that stays on the torch backend)."""
    check_attention_choice(attention)
    if attention == "torch":
        return TORCH_BACKEND
    why_not = _flashinfer_unusable(device, dtype) or _kv_unusable(dtype, kv_format)
    if why_not is None:
        from engine.attention_flashinfer import FlashInferBackend

        return FlashInferBackend(device)
    if attention == "flashinfer":
        raise AttentionBackendUnavailableError(why_not, backend="flashinfer")
    log.info("attention backend: torch (%s)", why_not)
    return TORCH_BACKEND


def _kv_unusable(dtype: torch.dtype, kv_format: KVFormat | None) -> str | None:
    if kv_format is None or kv_format.storage in (dtype, torch.float8_e4m3fn):
        return None
    return (
        f"flashinfer reads K/V in the model's dtype ({dtype}) or fp8_e4m3, not kv_dtype "
        f"{kv_format.name} (use the torch backend, or kv_dtype fp8_e4m3 / auto)"
    )


def _flashinfer_unusable(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cuda":
        return f"flashinfer needs a CUDA device; this model is on {device}"
    from engine import attention_flashinfer

    if dtype not in attention_flashinfer.FLASHINFER_DTYPES:
        return (
            f"flashinfer's kernels take float16 or bfloat16; this model is {dtype} "
            "(load it with dtype=torch.bfloat16 or torch.float16)"
        )
    ok, why = attention_flashinfer.flashinfer_available()
    return None if ok else why
