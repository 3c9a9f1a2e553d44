"""fp8 W8A8 matmuls through torch's scaled matmul: the operands in exactly the layout torch
asks for, the check of that layout, and why a device cannot run it.

Two recipes, both with float8_e4m3fn data, float32 scales, activations quantized on the
fly (one scale per row or per 1x128 block: vLLM's "dynamic" activation scheme), ``a`` the
(M, K) activations row-major and ``b`` the weight (N, K) contiguous seen as (K, N)
column-major (``weight.t()``), K and N multiples of 16:

- ``ROWWISE`` (``--quantization fp8``): ``scale_a`` (M, 1) and ``scale_b`` (1, N), both
  contiguous (one scale per activation row, one per output channel). torch >= 2.5 (PR
  #128989, CUTLASS on sm90); on Hopper with cuBLAS >= 12.9 torch calls cuBLASLt's
  outer-vector scaling. Compute capability >= 8.9.
- ``BLOCKWISE`` (Qwen's / DeepSeek's FP8 checkpoints): activations in 1x128 blocks,
  weights in 128x128 blocks. ``scale_a`` (M, ceil(K/128)) "outer-dim-major", strides
  (1, M); ``scale_b`` (L4, ceil(N/128)) with L4 = round_up(ceil(K/128), 4), strides
  (1, L4): the checkpoint's (N/128, K/128) ``weight_scale_inv`` padded along K-blocks to
  a multiple of 4, then transposed. Hopper only (sm90, torch's ``_check_deepseek_support``)
  and cuBLASLt >= 12.9 (PR #158037, torch 2.9); the L4 padding is enforced since PR
  #166752 (torch 2.10: without it cuBLASLt silently computes wrong results when
  ceil(K/128) % 4 != 0). cuBLASLt also wants M a multiple of 4 (the 1x128 scales' leading
  dimension 16-byte aligned; vLLM pads M for the same reason), so M is padded here.

Sources: aten/src/ATen/native/cuda/ScaledBlas.cpp (``_scaled_rowwise_rowwise``,
``_scaled_block1x128_block128x128``, ``_check_deepseek_support``, and the v1 op's
``is_blockwise_1x128_scaling`` / ``is_blockwise_128x128_scaling``), torch/_meta_registrations.py
``_check_scaled_mm_sizes``, test/test_scaled_matmul_cuda.py
``test_scaled_mm_block_wise_numerics`` (its docstring lists the same strides).

The H100 run of issue 33 failed with "scale_a must have strides (1, 1); got [1, 16]": at
M = 1 ``scale.t().contiguous().t()`` is a no-op copy that leaves strides (16, 1) (a size-1
dimension makes the transposed view "contiguous" already), so the scales were
row-major; the message printed ``scale_b``'s strides. ``column_major`` below allocates the
strides it wants instead.

On the CPU torch (2.13) runs ``ROWWISE`` (and tensor-wise) ``_scaled_mm`` for
float8_e4m3fn, slower than dequantize + matmul, so the engine does not serve fp8 there;
the tests use it to check the numerics. ``BLOCKWISE`` is CUDA-only.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

ROWWISE = "rowwise"
BLOCKWISE = "blockwise"
FP8_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK = 128
M_MULTIPLE = {ROWWISE: 16, BLOCKWISE: 4}
"""Rows the CUDA kernel gets padded to: BLOCKWISE, cuBLASLt's alignment of the 1x128
scales; ROWWISE, 16 (cuBLASLt's fp8 heuristics have rejected M % 16 != 0 in some versions,
and padding a decode row to 16 costs one small copy)."""


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def column_major(t: torch.Tensor) -> torch.Tensor:
    """A copy of the 2-D ``t`` with strides (1, rows) whatever its shape (``t.t().contiguous().t()``
    keeps (cols, 1) when a dimension has size 1)."""
    out = torch.empty_strided(tuple(t.shape), (1, t.shape[0]), dtype=t.dtype, device=t.device)
    return out.copy_(t)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) -> (float8 (M, K) row-major, float32 scales (M, 1) contiguous): each row's
    max |x| maps to 448."""
    xf = x.float()
    scale = xf.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    q = (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize_blocks_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) -> (float8 (M, K) row-major, float32 scales (M, ceil(K/128)) with strides
    (1, M)): one scale per row and 128 features (a partial last block is zero-padded)."""
    m, k = x.shape
    kb = -(-k // BLOCK)
    xf = x.float()
    if k != kb * BLOCK:
        xf = F.pad(xf, (0, kb * BLOCK - k))
    blocks = xf.view(m, kb, BLOCK)
    scale = column_major(blocks.abs().amax(dim=-1).clamp_min(1e-12) / FP8_MAX)
    q = (blocks / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).view(m, kb * BLOCK)[:, :k]
    return q.to(torch.float8_e4m3fn).contiguous(), scale


def block_weight_scale(weight_scale_inv: torch.Tensor) -> torch.Tensor:
    """The checkpoint's (ceil(N/128), ceil(K/128)) ``weight_scale_inv`` as scaled-mm's
    128x128 ``scale_b``: (L4, ceil(N/128)), strides (1, L4), the K-blocks padded with ones
    to L4 = round_up(ceil(K/128), 4) (padding no K column reads)."""
    nb, kb = weight_scale_inv.shape
    l4 = _round_up(kb, 4)
    padded = torch.ones(nb, l4, dtype=torch.float32, device=weight_scale_inv.device)
    padded[:, :kb] = weight_scale_inv.float()
    return padded.t()


def check_operands(
    recipe: str, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor
) -> None:
    """ValueError naming the first requirement of torch's scaled matmul (CUDA, the v2
    ``F.scaled_mm`` checks, which are the stricter ones) the operands miss."""

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"{recipe} scaled_mm: {what}")

    m, k = a.shape
    n = b.shape[1]
    need(a.dtype == b.dtype == torch.float8_e4m3fn, f"a, b float8_e4m3fn, got {a.dtype}, {b.dtype}")
    need(b.shape[0] == k, f"a {tuple(a.shape)} and b {tuple(b.shape)} do not multiply")
    need(a.stride() == (k, 1), f"a row-major (strides ({k}, 1)), got {a.stride()}")
    need(b.stride() == (1, k), f"b column-major (strides (1, {k})), got {b.stride()}")
    need(k % 16 == 0 and n % 16 == 0, f"K and N multiples of 16, got K={k}, N={n}")
    need(
        scale_a.dtype == scale_b.dtype == torch.float32,
        f"float32 scales, got {scale_a.dtype}, {scale_b.dtype}",
    )
    if recipe == ROWWISE:
        need(tuple(scale_a.shape) == (m, 1), f"scale_a ({m}, 1), got {tuple(scale_a.shape)}")
        need(tuple(scale_b.shape) == (1, n), f"scale_b (1, {n}), got {tuple(scale_b.shape)}")
        need(scale_a.is_contiguous() and scale_b.is_contiguous(), "contiguous scales")
        need(scale_b.stride(1) == 1, f"scale_b.stride(1) == 1, got {scale_b.stride(1)}")
        return
    need(recipe == BLOCKWISE, f"unknown recipe {recipe!r}")
    kb, nb = -(-k // BLOCK), -(-n // BLOCK)
    l4 = _round_up(kb, 4)
    need(tuple(scale_a.shape) == (m, kb), f"scale_a ({m}, {kb}), got {tuple(scale_a.shape)}")
    need(
        scale_a.stride(0) == 1 and (scale_a.stride(1) == m or (kb == 1 and scale_a.stride(1) == 1)),
        f"scale_a strides (1, {m}) (outer-dim-major), got {scale_a.stride()}",
    )
    need(tuple(scale_b.shape) == (l4, nb), f"scale_b ({l4}, {nb}), got {tuple(scale_b.shape)}")
    need(
        scale_b.stride(0) == 1 and (scale_b.stride(1) == l4 or (nb == 1 and scale_b.stride(1) == 1)),
        f"scale_b strides (1, {l4}) (K-blocks padded to a multiple of 4), got {scale_b.stride()}",
    )


def unavailable(recipe: str, device: torch.device) -> str | None:
    """Why ``device`` (with this torch) cannot run ``recipe``'s kernel, or None when it can."""
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no _scaled_mm"
    if device.type == "cpu":
        if recipe != ROWWISE:
            return "block-scaled fp8 matmul is CUDA-only (torch's CPU kernel: tensor-/row-wise)"
        return _cpu_rowwise_missing()
    if device.type != "cuda":
        return f"no fp8 scaled matmul on {device.type}"
    if torch.version.hip:
        return "ROCm: not tried by this engine"
    major, minor = torch.cuda.get_device_capability(device)
    if recipe == ROWWISE:
        return None if (major, minor) >= (8, 9) else f"compute capability {major}.{minor} < 8.9"
    if major != 9:
        return f"1x128/128x128 block scaling runs on sm90 (Hopper) only; this is sm{major}{minor}"
    cuda = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])
    if cuda < (12, 9):
        return f"block scaling needs CUDA/cuBLASLt >= 12.9, torch was built with {torch.version.cuda}"
    if not hasattr(F, "scaled_mm") and not _torch_at_least(2, 9):
        return f"torch {torch.__version__} < 2.9 has no block-scaled _scaled_mm"
    return None


@functools.cache
def _cpu_rowwise_missing() -> str | None:
    """Why this torch's CPU row-wise ``_scaled_mm`` cannot run, or None: tried once on 16x16
    operands (torch 2.11 has the function but no CPU kernel for it; 2.13 has one)."""
    a, sa = quantize_rows(torch.ones(16, 16))
    try:  # the weight side as Fp8RowwiseLinear passes it: (in, out) column-major, (1, out) scales
        scaled_mm(ROWWISE, a, a.t(), sa, sa.t(), torch.bfloat16)
    except (NotImplementedError, RuntimeError) as e:
        return f"torch {torch.__version__} has no CPU row-wise _scaled_mm kernel ({type(e).__name__})"
    return None


def _torch_at_least(major: int, minor: int) -> bool:
    parts = torch.__version__.split("+")[0].split(".")
    return (int(parts[0]), int(parts[1])) >= (major, minor)


def scaled_mm(
    recipe: str,
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b)`` in ``out_dtype``: ``F.scaled_mm`` (torch >= 2.10,
    the recipe named explicitly) when present, else ``torch._scaled_mm`` (the recipe read
    from the scale shapes; BLOCKWISE then needs ceil(K/128) % 4 == 0, which the caller checks)."""
    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
        kind: Any = F.ScalingType
        ra, rb = (
            (kind.RowWise, kind.RowWise)
            if recipe == ROWWISE
            else (kind.BlockWise1x128, kind.BlockWise128x128)
        )
        return F.scaled_mm(a, b, scale_a, ra, scale_b, rb, output_dtype=out_dtype)
    out = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    return out[0] if isinstance(out, tuple) else out


def pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """``x`` (M, K) with zero rows appended up to a multiple of ``multiple`` (itself when it is one)."""
    extra = (-x.shape[0]) % multiple
    return F.pad(x, (0, 0, 0, extra)) if extra else x
