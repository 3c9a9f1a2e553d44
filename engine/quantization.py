"""Quantization of the language model's linear layers at load time (int8/int4 weight-only,
fp8 W8A8).

Decode reads every weight once per token, so on a memory-bound machine tokens/s scale
with the bytes the weights take. ``quantize_language_model(arch, method)`` swaps the
language model's ``nn.Linear`` layers (and the LM head; the vision/audio towers and the
embeddings stay in the load dtype) for:

- ``Int8WeightOnlyLinear``: int8 weights, one scale per output channel (symmetric,
  ``max|w| / 127``: rounding error <= scale/2, i.e. <= 1/254 of the channel's max |w|);
- ``Int4WeightOnlyLinear``: 4-bit weights in groups of ``group_size`` input features
  (asymmetric min/max per group, a bfloat16 scale and offset each; default 32, the
  smallest group the kernels take: same speed as 64/128 here and the smallest error);
- ``Fp8RowwiseLinear`` (``--quantization fp8``): float8 e4m3 weights with one float32
  scale per output channel, activations quantized per row on the fly (W8A8), through
  torch's scaled matmul (``engine.fp8_matmul``: rowwise recipe, sm89+);
- ``Fp8BlockLinear``: float8 e4m3 weights with one scale per 128x128 block, the layout of
  the FP8 checkpoints Qwen publishes (``engine.fp8_checkpoint``), activations in 1x128
  blocks (sm90 and cuBLASLt >= 12.9). fp8 is CUDA-only at load: on the CPU an FP8
  checkpoint is dequantized to the load dtype (torch's CPU fp8 matmul is slower than that).

Kernels, chosen per device when the layer is built (the weight is already placed):
on the CPU torch's own ``_weight_int8pack_mm`` and ``_weight_int4pack_mm_for_cpu`` with
bfloat16 activations (measured at 1x2048 by 2048x6144: 0.16 / 0.18 ms against 2.4 ms for
float32 ``F.linear`` and 4.2 ms for the int8 op fed float32: activations are therefore cast
to bfloat16 and the output back to the input's dtype); on CUDA ``_weight_int8pack_mm`` and
``_weight_int4pack_mm`` (tensor-core tiles, packed by ``_convert_weight_to_int4pack``) and
for fp8 torch's scaled matmul, with the scales laid out as ``engine.fp8_matmul`` says.
int8/int4 are refused on CUDA (``check_method``): on an H100 at the 2B shapes they were
4-9x (int8) and up to 10x (int4) slower than bfloat16, so fp8 is the quantization that
pays there; ``allow_slow=True`` or ``PIE_MEDIA_ALLOW_SLOW_QUANTIZATION=1`` keeps them for
memory's sake. Every CUDA kernel is tried on the layer's first call against its reference
(int8/int4: dequantize + matmul; fp8: the same quantized activations and weights
multiplied in float32, since W8A8 differs from the weight-only product by the activation
rounding, ~2.5% relative) and replaced by dequantize + matmul when it raises or
disagrees; a kernel the device or torch build cannot run is never tried. Either way one
log line per reason says why. torchao was not added: its CPU int8/int4 weight-only layouts
call these same aten ops. int8/int4 passes of many rows (prefill) dequantize the weight to
bfloat16 and run one GEMM, which beats the weight-only kernels at that size on the CPU;
fp8 uses its kernel at every row count.

Each quantized layer keeps ``in_features`` / ``out_features`` and its module path, so
``engine.lora`` wraps it like a plain linear layer (the base output comes from the
quantized forward, the LoRA delta is added in float). Layers a kernel cannot take (int4:
``in_features`` not a multiple of the group, ``out_features`` not a multiple of 16; fp8:
either not a multiple of 16) stay in the load dtype; ``QuantizationReport.kept`` names them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from engine import fp8_matmul
from engine.errors import QuantizationUnavailableError

log = logging.getLogger(__name__)

METHODS = ("int8", "int4", "fp8")
"""Weight quantizations ``Model.load(quantization=...)`` knows."""
SLOW_ON_CUDA = ("int8", "int4")
"""Weight-only methods refused on CUDA unless asked for anyway: bench/quant.py --layers-only
on an H100 (2B layer shapes, issue 33) measured int8 at 1 row 0.064-0.171 ms against
bfloat16's 0.017-0.020 ms, and int4 slower than bfloat16 at 1 row and ~10x slower at 256."""
ALLOW_SLOW_ENV = "PIE_MEDIA_ALLOW_SLOW_QUANTIZATION"
"""Set to 1 to load int8/int4 on CUDA anyway (to fit a model in memory, not for speed)."""

INT4_GROUP_SIZE = 32
PREFILL_DEQUANT_ROWS = 64
"""From this many rows an int8/int4 pass dequantizes the weight and runs one bfloat16 GEMM
(at 256 rows of 2048x6144 on the CPU: 30 ms against 40 ms for the int8 kernel)."""
FP8_BLOCK = (128, 128)
FP8_MAX = fp8_matmul.FP8_MAX

_logged: set[str] = set()


def _log_once(message: str, *args: Any) -> None:
    """One warning per distinct message (a model has hundreds of layers with the same reason)."""
    text = message % args if args else message
    if text not in _logged:
        _logged.add(text)
        log.warning("%s", text)


def allow_slow_default() -> bool:
    """Whether ``PIE_MEDIA_ALLOW_SLOW_QUANTIZATION`` asks for int8/int4 on CUDA anyway."""
    return os.environ.get(ALLOW_SLOW_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def available_methods(device: torch.device, *, allow_slow: bool | None = None) -> tuple[str, ...]:
    """The methods ``device`` runs: int8/int4 on the CPU (fp8 weights need CUDA); fp8 on
    CUDA, plus int8/int4 there only when ``allow_slow`` (default: the environment variable)."""
    if device.type != "cuda":
        return ("int8", "int4")
    slow = allow_slow_default() if allow_slow is None else allow_slow
    return METHODS if slow else ("fp8",)


def check_method(method: str, device: torch.device, *, allow_slow: bool | None = None) -> None:
    """A typed error for an unknown method or one ``device`` cannot run, or (int8/int4 on
    CUDA) one slower there than the bfloat16 weights it replaces."""
    here = available_methods(device, allow_slow=allow_slow)
    if method not in METHODS:
        raise QuantizationUnavailableError(
            f"unknown quantization {method!r}; available on {device.type}: {', '.join(here)}",
            method=method,
            available=list(here),
        )
    if method in here:
        return
    if device.type == "cuda" and method in SLOW_ON_CUDA:
        raise QuantizationUnavailableError(
            f"quantization {method!r} is refused on CUDA: its weight-only kernels are slower than "
            f"bfloat16 there (H100, 2B layer shapes: int8 4-9x slower per decode row, int4 up to 10x "
            f"slower); use quantization 'fp8' (fp8 weights and activations through torch's scaled "
            f"matmul), the one that pays on a GPU. To load {method} anyway for its memory savings: "
            f"Model.load(..., quantization={method!r}) with {ALLOW_SLOW_ENV}=1 in the environment "
            f"(serve reads it too)",
            method=method,
            available=list(here),
            reason="slower_than_bfloat16_on_cuda",
            override=ALLOW_SLOW_ENV,
        )
    raise QuantizationUnavailableError(
        f"quantization {method!r} needs a CUDA device (no fp8 matmul on the CPU); available on "
        f"{device.type}: {', '.join(here)} (an FP8 checkpoint still loads here, dequantized)",
        method=method,
        available=list(here),
    )


class QuantizedLinear(torch.nn.Module):
    """Base of the quantized linear layers: ``y = x W^T + b`` with W stored compressed.

    Subclasses implement ``dequantized_weight`` (the fallback) and ``_kernel_matmul``
    ((rows, in) activations -> (rows, out)); the base handles shapes, dtypes, the bias,
    the many-rows path and the lazy check of CUDA kernels against ``_reference_matmul``."""

    method: str = ""
    dequant_from_rows: int | None = PREFILL_DEQUANT_ROWS
    """Passes of at least this many rows dequantize and run one GEMM (None: never)."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None, device: torch.device):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=True)
        self.kernel = "dequant"
        """"cpu" / "cuda" (the device's kernel) or "dequant" (dequantize + matmul)."""
        self._checked = device.type != "cuda"
        self.compute_dtype = torch.bfloat16

    # -- to implement -----------------------------------------------------------------------
    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def _kernel_matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        return next(b for n, b in self.named_buffers() if n != "bias").device

    def weight_bytes(self) -> int:
        """Bytes the stored weight takes (quantized values plus scales)."""
        return sum(b.numel() * b.element_size() for n, b in self.named_buffers() if n != "bias")

    # -- forward ----------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, self.in_features)
        many = self.dequant_from_rows is not None and flat.shape[0] >= self.dequant_from_rows
        if self.kernel == "dequant" or many:
            y = self._dequant_matmul(flat)
        elif not self._checked:
            y = self._first_cuda_call(flat)
        else:
            y = self._kernel_matmul(flat.to(self.compute_dtype).contiguous())
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def _dequant_matmul(self, flat: torch.Tensor) -> torch.Tensor:
        dt = self.compute_dtype
        return F.linear(flat.to(dt), self.dequantized_weight(dt))

    def _reference_matmul(self, flat: torch.Tensor) -> torch.Tensor:
        """What the kernel must reproduce (weight-only kernels: dequantize + matmul)."""
        return self._dequant_matmul(flat)

    def _first_cuda_call(self, flat: torch.Tensor) -> torch.Tensor:
        """The CUDA kernel's first call, checked against ``_reference_matmul``; on an error
        or a disagreement the layer keeps dequantize + matmul (one log line per reason)."""
        self._checked = True
        ref = self._reference_matmul(flat)
        try:
            y = self._kernel_matmul(flat.to(self.compute_dtype).contiguous())
            err = (y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)
            if not bool(err < 2e-2):
                raise RuntimeError(f"relative error {float(err):.3g} against its reference")
            return y
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
            _log_once(
                "%s: CUDA kernel not usable (%s: %s); dequantize + matmul instead",
                type(self).__name__,
                type(e).__name__,
                str(e).splitlines()[0] if str(e) else "",
            )
            self.kernel = "dequant"
            return self._dequant_matmul(flat)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}"


class Int8WeightOnlyLinear(QuantizedLinear):
    """int8 weights with one scale per output channel; activations in bfloat16 (or the
    model's half dtype on CUDA)."""

    method = "int8"

    def __init__(self, linear: torch.nn.Linear):
        w = linear.weight.detach()
        super().__init__(linear.in_features, linear.out_features, linear.bias, w.device)
        wf = w.float()
        if w.device.type == "cuda" and w.dtype in (torch.float16, torch.bfloat16):
            self.compute_dtype = w.dtype
        # The scales are rounded to the kernel's dtype first and the codes computed from the
        # rounded ones, so the kernel's weight is the nearest int8 multiple of its own scale.
        scales = (wf.abs().amax(dim=1) / 127.0).clamp_min(1e-12).to(self.compute_dtype)
        q = torch.round(wf / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        self.register_buffer("qweight", q.contiguous())
        self.register_buffer("scales", scales)
        self.kernel = w.device.type if w.device.type in ("cpu", "cuda") else "dequant"

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return self.qweight.to(dtype) * self.scales.to(dtype)[:, None]

    def _kernel_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)


class Int4WeightOnlyLinear(QuantizedLinear):
    """4-bit weights in groups of ``group_size`` input features: ``w = (q - 8) * scale +
    zero`` with q in 0..15 (the convention of torch's int4 kernels)."""

    method = "int4"

    def __init__(self, linear: torch.nn.Linear, group_size: int = INT4_GROUP_SIZE):
        w = linear.weight.detach()
        n, k = w.shape
        if not fits_int4(linear, group_size):
            raise ValueError(f"{n}x{k} does not fit int4 groups of {group_size}")
        super().__init__(k, n, linear.bias, w.device)
        self.group_size = group_size
        wg = w.float().reshape(n, k // group_size, group_size)
        lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
        scale = ((hi - lo) / 15.0).clamp_min(1e-12)
        q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8).reshape(n, k)
        zero = lo + 8.0 * scale
        # (k/group, n, 2) bfloat16: the kernels' scales-and-zeros layout, also the reference's.
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        self.register_buffer("scales_and_zeros", sz)
        self.kernel = "dequant"
        packed: torch.Tensor | None = None
        if w.device.type == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            self.kernel = "cpu"
        elif w.device.type == "cuda":
            packed = _cuda_int4_pack(q)
            self.kernel = "cuda" if packed is not None else "dequant"
        self.register_buffer("packed", packed)
        # Nibbles for the reference / fallback: two 4-bit values per byte, low nibble first.
        self.register_buffer(
            "nibbles", None if packed is not None and self.kernel == "cpu" else _pack_nibbles(q)
        )

    def weight_bytes(self) -> int:
        held = self.packed if self.packed is not None else self.nibbles
        assert held is not None
        return held.numel() * held.element_size() + self.scales_and_zeros.numel() * 2

    def codes(self) -> torch.Tensor:
        """(out, in) uint8 codes 0..15."""
        if self.nibbles is not None:
            return _unpack_nibbles(self.nibbles)
        # The CPU kernel's packing is its own; recover codes by multiplying by the identity.
        eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.packed.device)
        ones = torch.zeros_like(self.scales_and_zeros)
        ones[..., 0] = 1.0  # scale 1, zero 0: the kernel returns q - 8 exactly
        got = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group_size, ones)
        return (got.t().float() + 8.0).round().to(torch.uint8)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        n, k, g = self.out_features, self.in_features, self.group_size
        q = self.codes().reshape(n, k // g, g).to(torch.float32)
        sz = self.scales_and_zeros.float().transpose(0, 1)  # (n, k/g, 2)
        w = (q - 8.0) * sz[..., 0:1] + sz[..., 1:2]
        return w.reshape(n, k).to(dtype)

    def _dequant_matmul(self, flat: torch.Tensor) -> torch.Tensor:
        if self.nibbles is None:  # the CPU kernel at every row count (no nibbles kept to dequantize)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                flat.to(torch.bfloat16).contiguous(), self.packed, self.group_size, self.scales_and_zeros
            )
        return super()._dequant_matmul(flat)

    def _kernel_matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "cpu":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, self.packed, self.group_size, self.scales_and_zeros
            )
        return torch.ops.aten._weight_int4pack_mm(
            x.to(torch.bfloat16), self.packed, self.group_size, self.scales_and_zeros
        )


class Fp8Linear(QuantizedLinear):
    """Base of the fp8 W8A8 layers: float8 e4m3 weight (out, in), activations quantized per
    call, ``engine.fp8_matmul``'s ``recipe`` on the device's scaled matmul. The kernel's
    reference is the same arithmetic in float32 (quantized activations times the
    dequantized weight); the fallback multiplies unquantized activations (W8A16)."""

    method = "fp8"
    recipe = ""
    dequant_from_rows = None  # fp8 tensor cores beat a bfloat16 GEMM at prefill sizes too

    def _choose_kernel(self, device: torch.device, fits: str | None) -> None:
        """``self.kernel``: the device's when it runs ``recipe`` for this shape, else dequantize +
        matmul with one log line naming why (on CUDA; the CPU kernel is a test rehearsal)."""
        why = fits or fp8_matmul.unavailable(self.recipe, device)
        if why is None:
            self.kernel = device.type
            return
        self.kernel = "dequant"
        if device.type == "cuda":
            _log_once(
                "%s: fp8 scaled matmul unavailable (%s); dequantize + matmul instead",
                type(self).__name__,
                why,
            )

    def _quantize_activations(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _activation_scales_full(self, scale: torch.Tensor) -> torch.Tensor:
        """(rows, in) float32 factors that turn quantized activations back into values."""
        raise NotImplementedError

    def _scale_b(self) -> torch.Tensor:
        raise NotImplementedError

    def kernel_operands(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(a, b, scale_a, scale_b) for ``fp8_matmul.scaled_mm``, for (rows, in) ``x``."""
        xq, xs = self._quantize_activations(x)
        return xq, self.weight.t(), xs, self._scale_b()

    def _kernel_matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.kernel == "cuda":
            x = fp8_matmul.pad_rows(x, fp8_matmul.M_MULTIPLE[self.recipe])
        y = fp8_matmul.scaled_mm(self.recipe, *self.kernel_operands(x), out_dtype=self.compute_dtype)
        return y[:rows]

    def _reference_matmul(self, flat: torch.Tensor) -> torch.Tensor:
        xq, xs = self._quantize_activations(flat.to(self.compute_dtype))
        x = xq.float() * self._activation_scales_full(xs)
        return F.linear(x, self.dequantized_weight(torch.float32)).to(self.compute_dtype)


class Fp8RowwiseLinear(Fp8Linear):
    """float8 e4m3 weights with one float32 scale per output channel (``max|w_row| / 448``),
    activations with one scale per row: torch's row-wise scaled matmul, what
    ``--quantization fp8`` builds from float weights."""

    recipe = fp8_matmul.ROWWISE

    def __init__(self, linear: torch.nn.Linear):
        w = linear.weight.detach()
        n, k = w.shape
        super().__init__(k, n, linear.bias, w.device)
        if w.dtype in (torch.float16, torch.bfloat16):
            self.compute_dtype = w.dtype
        wf = w.float()
        scale = wf.abs().amax(dim=1).clamp_min(1e-12) / FP8_MAX
        q = (wf / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        self.register_buffer("weight", q.contiguous())
        self.register_buffer("weight_scale", scale.contiguous())
        self._choose_kernel(w.device, None if fits_fp8(linear) else f"{n}x{k} not multiples of 16")

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> Fp8RowwiseLinear:
        return cls(linear)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight.float() * self.weight_scale[:, None]).to(dtype)

    def _quantize_activations(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return fp8_matmul.quantize_rows(x)

    def _activation_scales_full(self, scale: torch.Tensor) -> torch.Tensor:
        return scale.expand(-1, self.in_features)

    def _scale_b(self) -> torch.Tensor:
        return self.weight_scale.view(1, -1)


class Fp8BlockLinear(Fp8Linear):
    """float8 e4m3 weights with one float32 scale per (128, 128) block (``weight_scale_inv``
    in the checkpoint's naming: the factor that turns the stored value back into the weight),
    activations in 1x128 blocks: torch's block-scaled matmul (DeepSeek's recipe)."""

    recipe = fp8_matmul.BLOCKWISE

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale_inv: torch.Tensor,
        bias: torch.Tensor | None,
        block: tuple[int, int] = FP8_BLOCK,
        compute_dtype: torch.dtype = torch.bfloat16,
    ):
        n, k = weight.shape
        want = (-(-n // block[0]), -(-k // block[1]))
        if tuple(weight_scale_inv.shape) != want:
            raise ValueError(
                f"weight_scale_inv {tuple(weight_scale_inv.shape)} for a {n}x{k} weight, want {want}"
            )
        super().__init__(k, n, bias, weight.device)
        self.block = block
        self.compute_dtype = compute_dtype
        self.register_buffer("weight", weight.to(torch.float8_e4m3fn).contiguous())
        self.register_buffer("weight_scale_inv", weight_scale_inv.to(torch.float32).contiguous())
        # scaled-mm's 128x128 scale_b, built once: K-blocks padded to 4, strides (1, L4)
        self.register_buffer(
            "mm_scale_b", fp8_matmul.block_weight_scale(self.weight_scale_inv), persistent=False
        )
        fits = None
        if block != FP8_BLOCK or n % block[0] or k % block[1]:
            fits = f"{n}x{k} in {block[0]}x{block[1]} blocks is not whole 128x128 blocks"
        elif not hasattr(F, "scaled_mm") and (k // 128) % 4:
            fits = f"torch._scaled_mm without F.scaled_mm mis-reads K/128 = {k // 128} (not a multiple of 4)"
        self._choose_kernel(weight.device, fits)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, block: tuple[int, int] = FP8_BLOCK) -> Fp8BlockLinear:
        w = linear.weight.detach()
        q, s = quantize_fp8_blocks(w, block)
        dt = w.dtype if w.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
        return cls(q, s, linear.bias, block, compute_dtype=dt)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8_blocks(self.weight, self.weight_scale_inv, self.block, dtype)

    def _quantize_activations(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return fp8_matmul.quantize_blocks_1x128(x)

    def _activation_scales_full(self, scale: torch.Tensor) -> torch.Tensor:
        return scale.repeat_interleave(fp8_matmul.BLOCK, dim=1)[:, : self.in_features]

    def _scale_b(self) -> torch.Tensor:
        return self.mm_scale_b

    def weight_bytes(self) -> int:
        return self.weight.numel() + self.weight_scale_inv.numel() * 4


# -- block-wise fp8 arithmetic (shared with engine.fp8_checkpoint and the fixture) -------------
def quantize_fp8_blocks(
    w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 per-block ``weight_scale_inv``): each block's max |w|
    maps to 448."""
    n, k = w.shape
    bn, bk = block
    rn, rk = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rn * bn, rk * bk, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    blocks = padded.reshape(rn, bn, rk, bk)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12)
    scale_inv = amax / FP8_MAX
    q = (blocks / scale_inv[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(rn * bn, rk * bk)[:n, :k].contiguous(), scale_inv


def dequantize_fp8_blocks(
    q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """The weight ``q * scale_inv[i // bn, j // bk]`` in ``dtype`` (partial edge blocks included)."""
    n, k = q.shape
    s = scale_inv.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return (q.float() * s).to(dtype)


# -- packing helpers ---------------------------------------------------------------------------
def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8).contiguous()


def _unpack_nibbles(p: torch.Tensor) -> torch.Tensor:
    out = torch.empty(p.shape[0], p.shape[1] * 2, dtype=torch.uint8, device=p.device)
    out[:, 0::2] = p & 0x0F
    out[:, 1::2] = p >> 4
    return out


def _cuda_int4_pack(q: torch.Tensor) -> torch.Tensor | None:
    """The tensor-core tile layout of ``_weight_int4pack_mm`` (high nibble first, as the op
    expects), or None when this build/device cannot pack (the layer dequantizes then)."""
    n, k = q.shape
    if n % 8 or k % 128:
        return None
    try:
        hi_first = ((q[:, 0::2] << 4) | q[:, 1::2]).to(torch.uint8).contiguous()
        return torch.ops.aten._convert_weight_to_int4pack(hi_first, 8)
    except (RuntimeError, NotImplementedError) as e:
        log.warning("int4 CUDA packing unavailable (%s); dequantize + matmul instead", e)
        return None


# -- swapping layers ---------------------------------------------------------------------------
def fits_int4(linear: torch.nn.Linear, group_size: int = INT4_GROUP_SIZE) -> bool:
    """Whether the int4 kernels take this layer (in % group == 0, out % 16 == 0)."""
    return (
        linear.in_features % group_size == 0
        and linear.out_features % 16 == 0
        and linear.in_features >= group_size
    )


def fits_fp8(linear: torch.nn.Linear) -> bool:
    """Whether torch's scaled matmul takes this layer (in and out multiples of 16)."""
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0


@dataclass
class QuantizationReport:
    """What ``quantize_language_model`` did: per method the layers swapped and those kept."""

    method: str
    quantized: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    weight_bytes: int = 0
    """Bytes of the swapped layers' stored weights after quantization."""
    float_bytes: int = 0
    """Bytes the same layers took before."""

    def summary(self) -> str:
        return (
            f"{self.method}: {len(self.quantized)} layers ({self.float_bytes / 2**20:.1f} -> "
            f"{self.weight_bytes / 2**20:.1f} MiB), {len(self.kept)} kept in float"
        )


def quantize_modules(
    root: torch.nn.Module,
    method: str,
    *,
    prefix: str = "",
    group_size: int = INT4_GROUP_SIZE,
    report: QuantizationReport | None = None,
) -> QuantizationReport:
    """Swap every ``nn.Linear`` under ``root`` for its ``method`` version (in place)."""
    report = report or QuantizationReport(method)
    for name, mod in list(root.named_modules()):
        if type(mod) is not torch.nn.Linear:
            continue
        path = f"{prefix}.{name}" if prefix and name else (prefix or name)
        new = _quantized(mod, method, group_size)
        if new is None:
            report.kept.append(path)
            continue
        report.float_bytes += mod.weight.numel() * mod.weight.element_size()
        report.weight_bytes += new.weight_bytes()
        parent_name, _, leaf = name.rpartition(".")
        setattr(root.get_submodule(parent_name) if parent_name else root, leaf, new)
        report.quantized.append(path)
    return report


def _quantized(mod: torch.nn.Linear, method: str, group_size: int) -> QuantizedLinear | None:
    if method == "int8":
        return Int8WeightOnlyLinear(mod)
    if method == "int4":
        return Int4WeightOnlyLinear(mod, group_size) if fits_int4(mod, group_size) else None
    if method == "fp8":
        return Fp8RowwiseLinear(mod) if fits_fp8(mod) else None
    raise QuantizationUnavailableError(
        f"unknown quantization {method!r}", method=method, available=list(METHODS)
    )


def quantize_language_model(
    hf: Any,
    language_model: torch.nn.Module,
    method: str,
    *,
    device: torch.device,
    head: bool = True,
    group_size: int = INT4_GROUP_SIZE,
    allow_slow: bool | None = None,
) -> QuantizationReport:
    """Quantize the language model's linear layers of a loaded, placed ``hf`` model, and the
    LM head when ``head`` (a tied head gets its own quantized copy; the embedding stays).
    Module paths stay those of ``hf`` (LoRA adapters name them)."""
    check_method(method, device, allow_slow=allow_slow)
    prefix = next(n for n, m in hf.named_modules() if m is language_model)
    report = quantize_modules(language_model, method, prefix=prefix, group_size=group_size)
    lm_head = getattr(hf, "lm_head", None)
    if head and type(lm_head) is torch.nn.Linear:
        new = _quantized(lm_head, method, group_size)
        if new is None:
            report.kept.append("lm_head")
        else:
            report.float_bytes += lm_head.weight.numel() * lm_head.weight.element_size()
            report.weight_bytes += new.weight_bytes()
            hf.lm_head = new
            report.quantized.append("lm_head")
    log.info("quantized the language model: %s", report.summary())
    return report


def check_kernels(hf: torch.nn.Module) -> None:
    """Run every CUDA layer's first-call kernel check now, on one dummy row, so that no
    check (which reads a result back to the host) happens inside a CUDA-graph capture."""
    for mod in hf.modules():
        if isinstance(mod, QuantizedLinear) and not mod._checked:
            mod(torch.zeros(1, mod.in_features, device=mod.device, dtype=mod.compute_dtype).normal_())
