"""Weight-only quantization of the language model's linear layers at load time.

Decode reads every weight once per token, so on a memory-bound machine tokens/s scale
with the bytes the weights take. ``quantize_language_model(arch, method)`` swaps the
language model's ``nn.Linear`` layers (and the LM head; the vision/audio towers and the
embeddings stay in the load dtype) for:

- ``Int8WeightOnlyLinear``: int8 weights, one scale per output channel (symmetric,
  ``max|w| / 127``: rounding error <= scale/2, i.e. <= 1/254 of the channel's max |w|);
- ``Int4WeightOnlyLinear``: 4-bit weights in groups of ``group_size`` input features
  (asymmetric min/max per group, a bfloat16 scale and offset each; default 32, the
  smallest group the kernels take: same speed as 64/128 here and the smallest error);
- ``Fp8BlockLinear``: float8 e4m3 weights with one scale per 128x128 block, the layout of
  the FP8 checkpoints Qwen publishes (``engine.fp8_checkpoint``); CUDA only, since the CPU
  has no fp8 kernel (there an FP8 checkpoint is dequantized to the load dtype at load).

Kernels, chosen per device when the layer is built (the weight is already placed):
on the CPU torch's own ``_weight_int8pack_mm`` and ``_weight_int4pack_mm_for_cpu`` with
bfloat16 activations (measured at 1x2048 by 2048x6144: 0.16 / 0.18 ms against 2.4 ms for
float32 ``F.linear`` and 4.2 ms for the int8 op fed float32: activations are therefore cast
to bfloat16 and the output back to the input's dtype); on CUDA ``_weight_int8pack_mm`` and
``_weight_int4pack_mm`` (tensor-core tiles, packed by ``_convert_weight_to_int4pack``) and
for fp8 ``torch.nn.functional.scaled_mm`` with 1x128 activation / 128x128 weight blocks.
Every CUDA kernel is tried on the layer's first call against the dequantize-then-matmul
reference and replaced by it (logged) when it raises or disagrees, so a CUDA build without
one of them still runs. torchao was not added: its CPU int8/int4 weight-only layouts call
these same aten ops. Passes of many rows (prefill) dequantize the weight to bfloat16 and
run one GEMM, which beats the weight-only kernels at that size on the CPU.

Each quantized layer keeps ``in_features`` / ``out_features`` and its module path, so
``engine.lora`` wraps it like a plain linear layer (the base output comes from the
quantized forward, the LoRA delta is added in float). Layers a kernel cannot take (int4:
``in_features`` not a multiple of the group, ``out_features`` not a multiple of 16) stay
in the load dtype; ``QuantizationReport.kept`` names them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from engine.errors import QuantizationUnavailableError

log = logging.getLogger(__name__)

METHODS = ("int8", "int4", "fp8")
"""Weight quantizations ``Model.load(quantization=...)`` knows."""

INT4_GROUP_SIZE = 32
PREFILL_DEQUANT_ROWS = 64
"""From this many rows a pass dequantizes the weight and runs one bfloat16 GEMM (at 256
rows of 2048x6144 on the CPU: 30 ms against 40 ms for the int8 kernel)."""
FP8_BLOCK = (128, 128)
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def available_methods(device: torch.device) -> tuple[str, ...]:
    """The methods that can run on ``device`` (fp8 weights need CUDA)."""
    return METHODS if device.type == "cuda" else ("int8", "int4")


def check_method(method: str, device: torch.device) -> None:
    """A typed error for an unknown method or one ``device`` cannot run."""
    here = available_methods(device)
    if method not in METHODS:
        raise QuantizationUnavailableError(
            f"unknown quantization {method!r}; available on {device.type}: {', '.join(here)}",
            method=method,
            available=list(here),
        )
    if method not in here:
        raise QuantizationUnavailableError(
            f"quantization {method!r} needs a CUDA device (no fp8 matmul on the CPU); available on "
            f"{device.type}: {', '.join(here)} (an FP8 checkpoint still loads here, dequantized)",
            method=method,
            available=list(here),
        )


class QuantizedLinear(torch.nn.Module):
    """Base of the quantized linear layers: ``y = x W^T + b`` with W stored compressed.

    Subclasses implement ``dequantized_weight`` (the reference) and ``_kernel_matmul``
    ((rows, in) activations -> (rows, out)); the base handles shapes, dtypes, the bias,
    the many-rows path and the lazy check of CUDA kernels."""

    method: str = ""

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
        if self.kernel == "dequant" or flat.shape[0] >= PREFILL_DEQUANT_ROWS:
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

    def _first_cuda_call(self, flat: torch.Tensor) -> torch.Tensor:
        """The CUDA kernel's first call, checked against dequantize + matmul; on an error or a
        disagreement the layer keeps the dequantize path (logged once per layer)."""
        self._checked = True
        ref = self._dequant_matmul(flat)
        try:
            y = self._kernel_matmul(flat.to(self.compute_dtype).contiguous())
            err = (y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)
            if not bool(err < 2e-2):
                raise RuntimeError(f"relative error {float(err):.3g} against dequantize + matmul")
            return y
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
            log.warning(
                "%s: CUDA kernel not usable (%s); dequantize + matmul instead", type(self).__name__, e
            )
            self.kernel = "dequant"
            return ref

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


class Fp8BlockLinear(QuantizedLinear):
    """float8 e4m3 weights with one float32 scale per (128, 128) block (``weight_scale_inv``
    in the checkpoint's naming: the factor that turns the stored value back into the weight)."""

    method = "fp8"

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
        fits = block == FP8_BLOCK and n % block[0] == 0 and k % block[1] == 0
        self.kernel = "cuda" if weight.device.type == "cuda" and fits else "dequant"
        self._mm_scale: torch.Tensor | None = None

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, block: tuple[int, int] = FP8_BLOCK) -> Fp8BlockLinear:
        w = linear.weight.detach()
        q, s = quantize_fp8_blocks(w, block)
        dt = w.dtype if w.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
        return cls(q, s, linear.bias, block, compute_dtype=dt)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8_blocks(self.weight, self.weight_scale_inv, self.block, dtype)

    def scaled_mm_args(self, x: torch.Tensor) -> tuple[Any, ...]:
        """``F.scaled_mm``'s operands for 1x128 activation blocks by 128x128 weight blocks:
        activation scales (rows, k/128) column-major; weight scales (round_up(k/128, 4),
        n/128) with stride (1, that padded count), as torch's blockwise recipe asks."""
        if self._mm_scale is None or self._mm_scale.device != self.weight.device:
            kb, nb = self.in_features // 128, self.out_features // 128
            l4 = -(-kb // 4) * 4
            padded = torch.ones(nb, l4, dtype=torch.float32, device=self.weight.device)
            padded[:, :kb] = self.weight_scale_inv
            self._mm_scale = padded.t()
        xq, xs = quantize_fp8_rows(x, self.block[1])
        return (
            xq,
            self.weight.t(),
            xs,
            F.ScalingType.BlockWise1x128,
            self._mm_scale,
            F.ScalingType.BlockWise128x128,
        )

    def _kernel_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.scaled_mm(*self.scaled_mm_args(x), output_dtype=self.compute_dtype)


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


def quantize_fp8_rows(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations as float8 with one scale per row and ``block`` features (dynamic, as the
    checkpoints' ``activation_scheme: dynamic`` says); scales (rows, ceil(k/block)) stored
    column-major, the layout scaled-mm's 1x128 recipe reads."""
    m, k = x.shape
    nb = -(-k // block)
    padded = torch.zeros(m, nb * block, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    amax = padded.reshape(m, nb, block).abs().amax(dim=-1).clamp_min(1e-12)
    scale = amax / FP8_MAX
    q = (
        (padded.reshape(m, nb, block) / scale[..., None])
        .reshape(m, nb * block)[:, :k]
        .to(torch.float8_e4m3fn)
    )
    return q.contiguous(), scale.t().contiguous().t()


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
        return Fp8BlockLinear.from_linear(mod)
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
) -> QuantizationReport:
    """Quantize the language model's linear layers of a loaded, placed ``hf`` model, and the
    LM head when ``head`` (a tied head gets its own quantized copy; the embedding stays).
    Module paths stay those of ``hf`` (LoRA adapters name them)."""
    check_method(method, device)
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
