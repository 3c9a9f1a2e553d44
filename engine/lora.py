"""LoRA adapters applied per row inside one batched forward pass (no weight merging).

``load_adapter`` reads a PEFT directory (``adapter_config.json`` +
``adapter_model.safetensors``), checks every tensor against the language model's linear
layers and wraps those layers with ``LoRALinear``. A pass publishes which rows run under
which (adapter, scale) via ``pass_adapters``; each wrapped layer adds
``scale * alpha/r * x A^T B^T`` to those rows only, so contexts on different adapters (and
on none) share one forward pass.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.errors import AdapterMismatchError, AdapterNotFoundError
from engine.quantization import QuantizedLinear

_PREFIX = "base_model.model."


@dataclass(frozen=True, eq=False)
class Adapter:
    """One loaded PEFT LoRA adapter: per target module path, its (A, B) pair."""

    name: str
    rank: int
    alpha: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    digest: str = ""

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def __repr__(self) -> str:
        return f"Adapter({self.name!r}, r={self.rank}, alpha={self.alpha}, modules={len(self.weights)})"


class AdapterStack:
    """The adapters a context runs under, each with its own scale (push/pop/clear)."""

    def __init__(self) -> None:
        self._items: list[tuple[Adapter, float]] = []

    def push(self, adapter: Adapter, scale: float = 1.0) -> None:
        if not isinstance(adapter, Adapter):
            raise AdapterMismatchError(
                "push() takes an Adapter from model.load_adapter()", got=type(adapter).__name__
            )
        self._items.append((adapter, float(scale)))

    def pop(self) -> Adapter:
        if not self._items:
            raise AdapterMismatchError("pop() on an empty adapter stack")
        return self._items.pop()[0]

    def clear(self) -> None:
        self._items.clear()

    @property
    def items(self) -> tuple[tuple[Adapter, float], ...]:
        return tuple(self._items)

    def identity(self) -> bytes:
        """Bytes naming the stack (adapter digests and scales): part of the page key."""
        if not self._items:
            return b""
        return "|".join(f"{a.digest}:{s!r}" for a, s in self._items).encode()

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"AdapterStack({[(a.name, s) for a, s in self._items]})"


_PASS: contextvars.ContextVar[list[tuple[torch.Tensor, Adapter, float]] | None] = contextvars.ContextVar(
    "pie_lora_pass", default=None
)


@contextmanager
def pass_adapters(table: list[tuple[torch.Tensor, Adapter, float]]) -> Iterator[None]:
    """Publish (rows, adapter, scale) entries for the layers of the pass being run."""
    token = _PASS.set(table or None)
    try:
        yield
    finally:
        _PASS.reset(token)


class LoRALinear(torch.nn.Module):
    """A base ``nn.Linear`` plus the LoRA deltas of the rows this pass assigns to adapters."""

    def __init__(self, base: torch.nn.Linear | QuantizedLinear, path: str):
        super().__init__()
        # The base layer's own parameters, registered under the same names: a wrapped model's
        # state_dict (and save_pretrained) is the unwrapped one's. The layer itself is kept
        # unregistered, for shape checks only. A quantized base (engine.quantization) is
        # registered as ``base_layer`` and computes the base output itself.
        object.__setattr__(self, "_base", base)
        if isinstance(base, QuantizedLinear):
            self.base_layer = base
        else:
            self.weight = base.weight
            self.bias = base.bias
        self.in_features, self.out_features = base.in_features, base.out_features
        self.path = path

    @property
    def base(self) -> torch.nn.Linear:
        return self._base

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self._base, QuantizedLinear):
            y = self._base(x)
        else:
            y = torch.nn.functional.linear(x, self.weight, self.bias)
        table = _PASS.get()
        if not table:
            return y
        flat_x = x.reshape(-1, x.shape[-1])
        flat_y = y.reshape(-1, y.shape[-1]).clone()
        for rows, adapter, scale in table:
            ab = adapter.weights.get(self.path)
            if ab is None:
                continue
            a, b = ab
            xr = flat_x.index_select(0, rows).to(a.dtype)
            delta = (xr @ a.t()) @ b.t() * (scale * adapter.scaling)
            flat_y.index_add_(0, rows, delta.to(flat_y.dtype))
        return flat_y.reshape(y.shape)

    def __repr__(self) -> str:
        return f"LoRALinear({self.path!r}, {self.base.in_features}->{self.base.out_features})"


def load_adapter(hf: torch.nn.Module, lm_prefix: str, path: str | Path, name: str | None = None) -> Adapter:
    """Load a PEFT LoRA adapter for ``hf`` and wrap its target linear layers (idempotent)."""
    root = Path(path)
    cfg_path, w_path = root / "adapter_config.json", root / "adapter_model.safetensors"
    if not cfg_path.is_file() or not w_path.is_file():
        raise AdapterNotFoundError(
            "an adapter directory needs adapter_config.json and adapter_model.safetensors", path=str(root)
        )
    try:
        cfg = json.loads(cfg_path.read_text())
        tensors = load_file(str(w_path))
    except (ValueError, OSError) as e:
        raise AdapterMismatchError(f"unreadable adapter files: {e}", path=str(root)) from e
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterMismatchError("only LoRA adapters are supported", peft_type=cfg.get("peft_type"))
    if cfg.get("use_dora") or cfg.get("use_rslora"):
        raise AdapterMismatchError("DoRA / rsLoRA adapters are not supported", path=str(root))
    rank, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    modules = dict(hf.named_modules())
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        k = key[len(_PREFIX) :] if key.startswith(_PREFIX) else key
        for part in ("lora_A", "lora_B"):
            tag = f".{part}."
            if tag in k:
                pairs.setdefault(k.split(tag)[0], {})[part] = t
                break
        else:
            raise AdapterMismatchError("unexpected tensor in adapter (only lora_A/lora_B)", tensor=key)
    if not pairs:
        raise AdapterMismatchError("adapter holds no LoRA tensors", path=str(root))
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for mod_path, ab in pairs.items():
        target = modules.get(mod_path)
        if isinstance(target, LoRALinear):
            target = target.base
        if target is None or not mod_path.startswith(lm_prefix + "."):
            raise AdapterMismatchError(
                "adapter targets a module the model's language model does not have", module=mod_path
            )
        if not isinstance(target, torch.nn.Linear | QuantizedLinear):
            raise AdapterMismatchError("adapter targets a module that is not a linear layer", module=mod_path)
        if set(ab) != {"lora_A", "lora_B"}:
            raise AdapterMismatchError("adapter module lacks lora_A or lora_B", module=mod_path)
        a, b = ab["lora_A"], ab["lora_B"]
        want_a, want_b = (rank, target.in_features), (target.out_features, rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise AdapterMismatchError(
                "adapter shapes do not fit the model",
                module=mod_path,
                got=[list(a.shape), list(b.shape)],
                want=[list(want_a), list(want_b)],
            )
        dev = target.device if isinstance(target, QuantizedLinear) else target.weight.device
        dt = torch.float32
        weights[mod_path] = (a.to(dev, dt), b.to(dev, dt))
    for mod_path in weights:
        _wrap(hf, mod_path)
    digest = hashlib.sha256(cfg_path.read_bytes() + w_path.read_bytes()).hexdigest()[:32]
    return Adapter(name=name or root.name, rank=rank, alpha=alpha, weights=weights, digest=digest)


def _wrap(hf: torch.nn.Module, mod_path: str) -> None:
    parent_path, _, leaf = mod_path.rpartition(".")
    parent = hf.get_submodule(parent_path)
    current = getattr(parent, leaf)
    if not isinstance(current, LoRALinear):
        setattr(parent, leaf, LoRALinear(current, mod_path))
