"""Block-wise FP8 checkpoints (the ``*-FP8`` layout Qwen publishes for Qwen3-VL).

Such a checkpoint's config.json carries ``quantization_config`` with ``quant_method:
"fp8"``, ``weight_block_size: [128, 128]`` (``activation_scheme: "dynamic"``,
``modules_to_not_convert``, ``fmt: "e4m3"``); every quantized linear layer stores
``<name>.weight`` as float8_e4m3fn and ``<name>.weight_scale_inv`` with one scale per
128x128 block (the weight is ``weight * weight_scale_inv[i // 128, j // 128]``); the rest
(towers, norms, embeddings, LM head) is in a float dtype.

transformers' own loader needs accelerate and, without a GPU, dequantizes to bfloat16
whatever dtype was asked, and on a GPU uses kernels fetched from its hub: we read the
tensors ourselves instead. ``load_fp8_pretrained`` builds the model from a dequantized
state dict in the load dtype (the CPU path: no CPU fp8 matmul is faster than the load
dtype's). ``keep_fp8_layers`` then (on CUDA) swaps those layers for
``engine.quantization.Fp8BlockLinear`` holding the file's fp8 values and scales, so
weights stay 1 byte per value on the device and multiply through torch's block-scaled
matmul (1x128 activation blocks by these 128x128 weight blocks; the scale layouts torch
wants are built in ``engine.fp8_matmul``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from engine.errors import ModelLoadError

SCALE_SUFFIX = ".weight_scale_inv"


def fp8_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """The checkpoint's fp8 ``quantization_config`` (None when it has none or another method)."""
    q = config.get("quantization_config")
    if not isinstance(q, dict) or str(q.get("quant_method", "")).lower() != "fp8":
        return None
    block = q.get("weight_block_size")
    if block is not None and (not isinstance(block, list | tuple) or len(block) != 2):
        raise ModelLoadError(
            f"fp8 quantization_config: weight_block_size must be two integers, got {block!r}"
        )
    fmt = str(q.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise ModelLoadError(f"fp8 quantization_config: only fmt e4m3 is supported, got {fmt!r}")
    return q


def is_fp8_checkpoint(path: Path) -> bool:
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and fp8_config(config) is not None


def block_size(config: dict[str, Any]) -> tuple[int, int]:
    q = fp8_config(config) or {}
    b = q.get("weight_block_size") or (128, 128)
    return int(b[0]), int(b[1])


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / s for s in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return sorted(path.glob("*.safetensors"))


def iter_fp8_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """(name, tensor, weight_scale_inv or None) for every tensor except the scales."""
    from safetensors import safe_open

    handles = [safe_open(str(f), framework="pt") for f in _weight_files(path)]
    where = {k: h for h in handles for k in h.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    for name, h in where.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        t = h.get_tensor(name)
        scale_name = name.removesuffix(".weight") + SCALE_SUFFIX if name.endswith(".weight") else None
        scale = where[scale_name].get_tensor(scale_name) if scale_name in where else None
        if t.dtype == torch.float8_e4m3fn and scale is None:
            raise ModelLoadError(f"{path}: fp8 tensor {name} has no {SCALE_SUFFIX}")
        yield name, t, scale


def dequantize(
    q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """``q * scale_inv`` per block, in ``dtype``; a typed error when the scale grid does not fit."""
    from engine.quantization import dequantize_fp8_blocks

    n, k = q.shape
    want = (-(-n // block[0]), -(-k // block[1]))
    if tuple(scale_inv.shape) != want:
        raise ModelLoadError(
            f"weight_scale_inv of shape {tuple(scale_inv.shape)} does not fit a {n}x{k} weight in "
            f"{block[0]}x{block[1]} blocks (want {want})"
        )
    return dequantize_fp8_blocks(q, scale_inv, block, dtype)


def load_fp8_pretrained(path: Path, model_cls: Any, *, dtype: torch.dtype) -> tuple[Any, dict[str, Any]]:
    """(model, loading info): ``model_cls`` built from the checkpoint's dequantized weights."""
    import transformers

    raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    block = block_size(raw)
    state: dict[str, torch.Tensor] = {}
    for name, t, scale in iter_fp8_tensors(path):
        state[name] = dequantize(t, scale, block, dtype) if scale is not None else t.to(dtype)
    config = transformers.AutoConfig.from_pretrained(path)
    for holder in (config, getattr(config, "text_config", None)):
        if holder is not None and hasattr(holder, "quantization_config"):
            delattr(holder, "quantization_config")
    return model_cls.from_pretrained(
        None,
        config=config,
        state_dict=state,
        dtype=dtype,
        output_loading_info=True,
        ignore_mismatched_sizes=True,
    )


def keep_fp8_layers(
    hf: torch.nn.Module, path: Path, config: dict[str, Any], compute_dtype: torch.dtype
) -> int:
    """Swap every linear layer whose weight the checkpoint stores in fp8 for an
    ``Fp8BlockLinear`` with the file's values and scales, on the layer's device; returns
    how many were swapped. (CUDA: the CPU keeps the dequantized layers.)"""
    from engine.quantization import Fp8BlockLinear

    block = block_size(config)
    modules = dict(hf.named_modules())
    swapped = 0
    for name, t, scale in iter_fp8_tensors(path):
        if scale is None or not name.endswith(".weight"):
            continue
        mod_path = name.removesuffix(".weight")
        mod = modules.get(mod_path)
        if type(mod) is not torch.nn.Linear:
            continue
        dev = mod.weight.device
        new = Fp8BlockLinear(
            t.to(dev), scale.to(dev, torch.float32), mod.bias, block, compute_dtype=compute_dtype
        )
        parent, _, leaf = mod_path.rpartition(".")
        setattr(hf.get_submodule(parent) if parent else hf, leaf, new)
        swapped += 1
    return swapped
