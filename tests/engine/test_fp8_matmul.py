"""fp8 W8A8 layers (``engine.fp8_matmul``, ``Fp8RowwiseLinear``, ``Fp8BlockLinear``): the
operands handed to torch's scaled matmul have the layout torch documents, checked three
ways (explicit shapes/strides/dtypes, ``fp8_matmul.check_operands``, and torch's own meta
kernel for ``F.scaled_mm``, which carries the CUDA op's checks); the numerics of the row-wise
kernel on torch's CPU ``_scaled_mm``; the block recipe's numerics against an independent
reading of the strided scale tensors (torch has no CPU block-scaled kernel); and the
fallback's one log line per reason.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from engine import fp8_matmul
from engine.quantization import Fp8BlockLinear, Fp8RowwiseLinear, _logged, check_kernels


def _linear(n: int, k: int, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(k, n, bias=True)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _meta(t: torch.Tensor) -> torch.Tensor:
    out = t.to("meta")
    assert out.stride() == t.stride()  # the meta copy keeps the layout under test
    return out


ROWS = [1, 3, 4, 17]
SHAPES = [(256, 384), (384, 1280)]  # K/128 = 3 and 10: the 128x128 scales need L4 padding


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_rowwise_operands_have_the_documented_layout(rows, n, k):
    layer = Fp8RowwiseLinear(_linear(n, k))
    a, b, sa, sb = layer.kernel_operands(torch.randn(rows, k))
    assert a.dtype == b.dtype == torch.float8_e4m3fn and sa.dtype == sb.dtype == torch.float32
    assert a.shape == (rows, k) and a.stride() == (k, 1)  # row-major
    assert b.shape == (k, n) and b.stride() == (1, k)  # column-major: the (n, k) weight transposed
    assert sa.shape == (rows, 1) and sa.is_contiguous()
    assert sb.shape == (1, n) and sb.is_contiguous() and sb.stride(1) == 1
    fp8_matmul.check_operands(fp8_matmul.ROWWISE, a, b, sa, sb)
    out = F.scaled_mm(_meta(a), _meta(b), _meta(sa), F.ScalingType.RowWise, _meta(sb), F.ScalingType.RowWise)
    assert out.shape == (rows, n)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_block_operands_have_the_documented_layout(rows, n, k):
    """1x128 activation scales (M, K/128) with strides (1, M) at every M (the H100 run got
    (16, 1) at M = 1); 128x128 weight scales (L4, N/128) with strides (1, L4)."""
    layer = Fp8BlockLinear.from_linear(_linear(n, k))
    kb, nb, l4 = k // 128, n // 128, -(-(k // 128) // 4) * 4
    a, b, sa, sb = layer.kernel_operands(torch.randn(rows, k))
    assert a.dtype == b.dtype == torch.float8_e4m3fn and sa.dtype == sb.dtype == torch.float32
    assert a.stride() == (k, 1) and b.shape == (k, n) and b.stride() == (1, k)
    assert sa.shape == (rows, kb) and sa.stride() == (1, rows)
    assert sb.shape == (l4, nb) and sb.stride() == (1, l4)
    assert torch.equal(sb[:kb].t(), layer.weight_scale_inv)  # the checkpoint's scales, in order
    fp8_matmul.check_operands(fp8_matmul.BLOCKWISE, a, b, sa, sb)
    out = F.scaled_mm(
        _meta(a),
        _meta(b),
        _meta(sa),
        F.ScalingType.BlockWise1x128,
        _meta(sb),
        F.ScalingType.BlockWise128x128,
        output_dtype=torch.bfloat16,
    )
    assert out.shape == (rows, n)


def test_the_layout_that_failed_on_the_h100_is_rejected():
    """``scale.t().contiguous().t()`` at one row keeps strides (kb, 1): both our check and
    torch's meta kernel refuse it, as CUDA did; the unpadded 128x128 scales too."""
    layer = Fp8BlockLinear.from_linear(_linear(256, 384))
    a, b, sa, sb = layer.kernel_operands(torch.randn(1, 384))
    row_major = torch.empty(1, 3).copy_(sa)  # as the old code computed them
    old = row_major.t().contiguous().t()
    assert old.stride() == (3, 1)
    with pytest.raises(ValueError, match="scale_a strides"):
        fp8_matmul.check_operands(fp8_matmul.BLOCKWISE, a, b, old, sb)
    with pytest.raises(RuntimeError):
        F.scaled_mm(
            _meta(a),
            _meta(b),
            _meta(old),
            F.ScalingType.BlockWise1x128,
            _meta(sb),
            F.ScalingType.BlockWise128x128,
            output_dtype=torch.bfloat16,
        )
    unpadded = layer.weight_scale_inv.t()  # (3, 2): K-blocks not padded to 4
    with pytest.raises(ValueError, match="scale_b"):
        fp8_matmul.check_operands(fp8_matmul.BLOCKWISE, a, b, sa, unpadded)


needs_cpu_rowwise = pytest.mark.skipif(
    fp8_matmul.unavailable(fp8_matmul.ROWWISE, torch.device("cpu")) is not None,
    reason=str(fp8_matmul.unavailable(fp8_matmul.ROWWISE, torch.device("cpu"))),
)
"""torch 2.11 (the GPU machine's) has ``_scaled_mm`` but no CPU kernel for it."""


@needs_cpu_rowwise
def test_rowwise_numerics_on_torchs_cpu_kernel():
    """torch's CPU ``_scaled_mm`` (row-wise, float8_e4m3fn) equals the same arithmetic in
    float32 to bfloat16 output rounding, and differs from dequantize + matmul (weights only)
    by the activations' e4m3 rounding: ~2.5% relative, which is why the CUDA first-call
    check compares with the former."""
    assert fp8_matmul.unavailable(fp8_matmul.ROWWISE, torch.device("cpu")) is None
    lin = _linear(384, 256)
    layer = Fp8RowwiseLinear(lin)
    assert layer.kernel == "cpu"
    x = torch.randn(7, 256)
    got = layer._kernel_matmul(x.bfloat16())
    emulated = layer._reference_matmul(x)
    weight_only = layer._dequant_matmul(x)
    exact = F.linear(x, lin.weight)
    assert _rel(got, emulated) < 5e-3
    assert 5e-3 < _rel(got, weight_only) < 6e-2  # e4m3 activations: 3 mantissa bits
    assert _rel(got, exact) < 8e-2
    # The layer's forward (bias included) is that kernel; rows are quantized independently.
    y = layer(x)
    assert _rel(y, got.float() + lin.bias) < 1e-2
    assert _rel(torch.cat([layer(x[i : i + 1]) for i in range(7)]), y) < 1e-6
    # The weight rounding bound: |w - w_q| <= max|w_row| / 16 (e4m3: 3 mantissa bits).
    w = layer.dequantized_weight(torch.float32)
    assert bool(((w - lin.weight).abs() <= lin.weight.abs().amax(1, keepdim=True) / 16).all())


def _block_product(a, b, sa, sb) -> torch.Tensor:
    """The block recipe's definition, read straight from the strided operands:
    out[m, n] = sum over K-blocks j of sa[m, j] * sb[j, n // 128] * (a[m, block j] . b[block j, n])."""
    m, k = a.shape
    n = b.shape[1]
    out = torch.zeros(m, n, dtype=torch.float64)
    af, bf = a.double(), b.double()
    for j in range(-(-k // 128)):
        part = af[:, j * 128 : (j + 1) * 128] @ bf[j * 128 : (j + 1) * 128]
        col_scale = sb[j].double().repeat_interleave(128)[:n]
        out += part * sa[:, j : j + 1].double() * col_scale
    return out


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_block_recipe_numerics_from_the_strided_scales(n, k):
    lin = _linear(n, k, seed=1)
    layer = Fp8BlockLinear.from_linear(lin)
    assert fp8_matmul.unavailable(fp8_matmul.BLOCKWISE, torch.device("cpu")) is not None
    assert layer.kernel == "dequant"  # no CPU block kernel: the layer falls back
    x = torch.randn(5, k)
    got = _block_product(*layer.kernel_operands(x.bfloat16()))
    assert _rel(got, layer._reference_matmul(x)) < 5e-3
    assert _rel(got, F.linear(x, lin.weight)) < 8e-2


@needs_cpu_rowwise
def test_a_correct_w8a8_kernel_passes_the_first_call_check():
    """The first-call check keeps a kernel that matches its W8A8 reference, although it is
    ~2.5% away from the weight-only product (the old check rejected exactly that)."""
    layer = Fp8RowwiseLinear(_linear(256, 256))
    layer._checked = False  # rehearse the CUDA path's check with the CPU kernel
    check_kernels(torch.nn.Sequential(layer))
    assert layer.kernel == "cpu" and layer._checked


def test_fallback_logs_once_per_reason(caplog):
    _logged.clear()
    layers = [Fp8RowwiseLinear(_linear(64, 64, seed=i)) for i in range(3)]
    for layer in layers:
        layer._checked = False
        layer._kernel_matmul = lambda x: (_ for _ in ()).throw(RuntimeError("no kernel here"))  # type: ignore[method-assign]
    x = torch.randn(2, 64)
    with caplog.at_level(logging.WARNING, logger="engine.quantization"):
        outs = [layer(x) for layer in layers]
    for layer, y in zip(layers, outs, strict=True):
        assert layer.kernel == "dequant"
        want = F.linear(x, layer.dequantized_weight(torch.float32), layer.bias)
        assert _rel(y, want) < 1e-2
    lines = [r.getMessage() for r in caplog.records if "not usable" in r.getMessage()]
    assert lines == [
        "Fp8RowwiseLinear: CUDA kernel not usable (RuntimeError: no kernel here); dequantize + matmul instead"
    ]


def test_unavailable_reasons():
    assert "CUDA-only" in (fp8_matmul.unavailable(fp8_matmul.BLOCKWISE, torch.device("cpu")) or "")
    assert fp8_matmul.unavailable(fp8_matmul.ROWWISE, torch.device("meta")) is not None
    # Shapes the block kernel cannot take fall back with the reason, whatever the device.
    assert Fp8BlockLinear.from_linear(_linear(64, 64)).kernel == "dequant"
    assert Fp8RowwiseLinear(_linear(24, 40)).kernel == "dequant"  # not multiples of 16


# -- on a GPU (bench/gpu/check.sh runs this file with the CUDA tests) ------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("rows", [1, 3, 32, 256])
def test_cuda_fp8_kernels_run_where_available_and_agree(rows):
    """On CUDA each fp8 layer keeps its scaled-matmul kernel after the first-call check
    wherever ``fp8_matmul.unavailable`` says the device runs the recipe (row-wise: sm89+;
    block: sm90 with cuBLASLt >= 12.9), at decode and prefill row counts (M padded inside),
    and matches its float32 W8A8 reference."""
    dev = torch.device("cuda")
    lin = _linear(2048, 2048).to(dev, torch.bfloat16)
    x = torch.randn(rows, 2048, device=dev, dtype=torch.bfloat16)
    for layer in (Fp8RowwiseLinear(lin), Fp8BlockLinear.from_linear(lin)):
        why = fp8_matmul.unavailable(layer.recipe, dev)
        check_kernels(torch.nn.Sequential(layer))
        assert layer.kernel == ("dequant" if why else "cuda"), (type(layer).__name__, why)
        got = layer(x) - lin.bias
        assert _rel(got, layer._reference_matmul(x)) < 1e-2, type(layer).__name__
        assert _rel(got, F.linear(x.float(), lin.weight.float())) < 8e-2
    if torch.cuda.get_device_capability(dev) >= (8, 9):
        assert fp8_matmul.unavailable(fp8_matmul.ROWWISE, dev) is None
