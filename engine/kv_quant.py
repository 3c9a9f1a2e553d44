"""How the KV pool stores K/V: a float dtype, or 8 bits with scales (``kv_dtype``).

``Model.load(kv_dtype=...)`` / ``pie-media serve --kv-cache-dtype`` name one of
``KV_DTYPES`` (vLLM's ``--kv-cache-dtype`` words): ``"auto"`` is the model's dtype;
``"float32"`` / ``"bfloat16"`` / ``"float16"`` store K/V in that float dtype; ``"int8"``
and ``"fp8_e4m3"`` store one byte per element with float32 scales beside the pages:

* ``int8``, per (row, kv head): ``scale = max|x| / 127`` over the head's ``head_dim``
  values, ``q = round(x / scale)``. Dequantized ``q * scale`` is within ``scale / 2 =
  max|x| / 254`` of ``x`` in every element (round to nearest; no clipping, since
  ``|x / scale| <= 127``).
* ``fp8_e4m3`` with per (row, kv head) scales (the torch backend): ``scale = max|x| /
  448`` (e4m3's largest finite value), ``q = float8_e4m3fn(x / scale)``: 3 mantissa bits,
  so a relative error of at most 2^-4 per normal element.
* ``fp8_e4m3`` with one scale per layer for K and one for V (``scales="tensor"``): what
  flashinfer's fp8 kernels take (``run(..., k_scale=, v_scale=)`` are scalars: a key's
  scale cannot vary by row inside the kernel). The scale is fixed (1.0, vLLM's default
  without calibration); values past +-448 are clipped. Chosen at load when the
  attention backend is flashinfer.

The torch backend dequantizes to the query's dtype as it gathers (``KVPool.read``), so
attention math is unchanged; only the stored K/V carry the rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from engine.errors import InvalidRequestError

KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3", "int8")
"""The ``kv_dtype`` / ``--kv-cache-dtype`` choices."""

FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
INT8_MAX = 127.0
SCALE_DTYPE = torch.float32
_TINY = 1e-12
"""Floor of a scale (an all-zero head stores zeros with this scale, not a division by 0)."""

_FLOATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NAMES = {v: k for k, v in _FLOATS.items()}

ScaleMode = Literal["row", "tensor"]


@dataclass(frozen=True)
class KVFormat:
    """What a pool stores: ``storage`` dtype, and where the scales live (None: a float
    dtype, no scales; "row": one per (row, kv head); "tensor": one per layer for K and V)."""

    name: str
    storage: torch.dtype
    scales: ScaleMode | None = None
    tensor_scale: float = 1.0
    """The fixed per-layer scale of ``scales="tensor"``."""

    @property
    def quantized(self) -> bool:
        return self.scales is not None

    def describe(self) -> str:
        """The name snapshots record and errors quote ("int8 (per-row scales)")."""
        if self.scales is None:
            return self.name
        return f"{self.name} (per-{self.scales} scales)"

    def element_bytes(self) -> int:
        return torch.empty((), dtype=self.storage).element_size()

    def scale_bytes_per_row_head(self) -> int:
        """Bytes of scales per (row, kv head), for K and V each."""
        return torch.empty((), dtype=SCALE_DTYPE).element_size() if self.scales == "row" else 0


def float_format(dtype: torch.dtype) -> KVFormat:
    """Unquantized storage in ``dtype``."""
    return KVFormat(_NAMES.get(dtype, str(dtype).removeprefix("torch.")), dtype)


def resolve_kv_dtype(
    kv_dtype: str | torch.dtype | KVFormat | None, model_dtype: torch.dtype, *, scales: ScaleMode = "row"
) -> KVFormat:
    """The pool format ``kv_dtype`` names (None / "auto": the model's dtype); ``scales``:
    where an fp8 format keeps its scales ("tensor" for flashinfer). ``InvalidRequestError``
    for an unknown name."""
    if isinstance(kv_dtype, KVFormat):
        return kv_dtype
    if kv_dtype is None or kv_dtype == "auto":
        return float_format(model_dtype)
    if isinstance(kv_dtype, torch.dtype):
        if kv_dtype not in _NAMES:
            raise InvalidRequestError(
                f"unsupported kv_dtype {kv_dtype}; expected one of {', '.join(KV_DTYPES)}",
                kv_dtype=str(kv_dtype),
            )
        return float_format(kv_dtype)
    if kv_dtype in _FLOATS:
        return float_format(_FLOATS[kv_dtype])
    if kv_dtype == "int8":
        return KVFormat("int8", torch.int8, "row")
    if kv_dtype in ("fp8_e4m3", "fp8"):
        return KVFormat("fp8_e4m3", torch.float8_e4m3fn, scales)
    raise InvalidRequestError(
        f"unknown kv_dtype {kv_dtype!r}; expected one of {', '.join(KV_DTYPES)}", kv_dtype=str(kv_dtype)
    )


def quantize_rows(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, kv_heads, head_dim) values -> (stored values, (rows, kv_heads) float32 scales)
    for a per-row format."""
    amax = x.abs().amax(dim=-1).to(SCALE_DTYPE)
    top = INT8_MAX if fmt.storage == torch.int8 else FP8_MAX
    scale = (amax / top).clamp_min(_TINY)
    y = x.to(SCALE_DTYPE) / scale.unsqueeze(-1)
    if fmt.storage == torch.int8:
        return y.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale
    return y.clamp_(-FP8_MAX, FP8_MAX).to(fmt.storage), scale


def quantize_tensor(x: torch.Tensor, scale: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Values -> stored values under one fixed ``scale`` (0-d), clipped to the fp8 range."""
    return (x.to(SCALE_DTYPE) / scale).clamp_(-FP8_MAX, FP8_MAX).to(fmt.storage)


def dequantize(q: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Stored values (rows, kv_heads, head_dim) and their scales ((rows, kv_heads) or 0-d;
    None: a float format) -> values in ``dtype``."""
    if scale is None:
        return q.to(dtype)
    if scale.dim():
        scale = scale.unsqueeze(-1)
    if q.dtype == torch.int8:  # int8 * float32 promotes in the one multiply (no converted copy)
        return (q * scale).to(dtype)
    return (q.to(SCALE_DTYPE) * scale).to(dtype)  # float8 takes no type promotion
