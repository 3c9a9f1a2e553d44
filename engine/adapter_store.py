"""Named LoRA adapters per model and per namespace: Pie's ``pie:core/adapter`` on the engine.

An ``AdapterStore`` keeps, per (model, namespace), adapters by name. Each ``NamedAdapter``
is the mutable thing Pie's ``adapter`` resource names: its weights can be replaced
(``load``, ``pie:zo``'s ``initialize`` / ``update``), and every replacement publishes a new
immutable ``engine.lora.Adapter`` snapshot (``named.adapter``) for
``ctx.forward().adapter(...)``. A pass that is already running keeps the snapshot it was
given; the snapshot's digest is a hash of its weights, so pages computed under old weights
are never taken for pages computed under new ones.

Pie 0.4.0 (runtime/src/adapter.rs) keeps adapter names per model; a name is unique there,
``create`` of a taken name fails, ``fork`` of a taken name gives nothing. The weights Pie's
drivers keep are LoRA A/B pairs on ``q_proj`` / ``k_proj`` / ``v_proj`` (the CMA-ES adapter
of Pie's dev driver; its portable driver also loads ``o_proj``) in PEFT's tensor names. Here:

* ``create`` makes a rank-``rank`` adapter on the language model's q/k/v projections (by
  default), initialized as Pie initializes one: A uniform in ``±1/sqrt(n_targets * rank)``
  (``kaiming_uniform_(a=sqrt(5))`` on Pie's ``(in, 3 * rank)`` down matrix), B zero, so a
  fresh adapter changes nothing until it is loaded or trained.
* ``save`` writes a PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``,
  plus ``zo_state.safetensors`` when the adapter carries ``pie:zo`` state); ``load`` reads
  any PEFT LoRA directory that fits the model (through ``engine.lora.load_adapter``).
* Paths are confined to a sandbox directory the caller gives: a relative path is taken
  under it, an absolute path must lie inside it (or under ``guest_root``, Pie's ``/scratch``
  preopen, which maps onto the sandbox); anything resolving outside (``..``, a symlink out)
  raises ``AdapterPathError``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from engine import lora
from engine.errors import AdapterNotFoundError, EngineError, InvalidRequestError
from engine.lora import Adapter
from engine.quantization import QuantizedLinear

if TYPE_CHECKING:
    from engine.model import Model

DEFAULT_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
"""Pie's adapter targets: the attention q/k/v projections of every decoder layer."""

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ZO_STATE_FILE = "zo_state.safetensors"
_PEFT_PREFIX = "base_model.model."


class AdapterArgumentError(EngineError, InvalidRequestError):
    """An adapter call's argument is invalid (rank < 1, a bad alpha, an unknown target, an
    empty name, an object that is not this store's adapter)."""

    code = "invalid_adapter_argument"


class AdapterExistsError(EngineError, InvalidRequestError):
    """``create`` / ``fork`` under a name the (model, namespace) already has."""

    code = "adapter_exists"


class AdapterPathError(EngineError, InvalidRequestError):
    """A ``save`` / ``load`` path resolves outside the caller's sandbox directory."""

    code = "adapter_path_outside_sandbox"


def _digest(rank: int, alpha: float, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> str:
    h = hashlib.blake2b(f"lora|{rank}|{alpha!r}".encode(), digest_size=16)
    for path in sorted(weights):
        a, b = weights[path]
        h.update(path.encode())
        for t in (a, b):
            h.update(str(tuple(t.shape)).encode())
            h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def _lm_prefix(model: Model) -> str:
    lm = model.arch.language_model
    return next(n for n, m in model.arch.hf.named_modules() if m is lm)


def register(model: Model, adapter: Adapter) -> Adapter:
    """Make ``adapter`` usable on ``model``'s passes: wrap its target layers (idempotent) and
    record it as the model's, as ``Model.load_adapter`` does for a loaded directory."""
    for path in adapter.weights:
        lora._wrap(model.arch.hf, path)
    model._adapters.add(adapter)
    return adapter


def snapshot(
    model: Model, name: str, rank: int, alpha: float, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
) -> Adapter:
    """An immutable, registered ``engine.lora.Adapter`` of these weights (float32, on the
    target layers' device), its digest a hash of them."""
    adapter = Adapter(
        name=name, rank=rank, alpha=float(alpha), weights=dict(weights), digest=_digest(rank, alpha, weights)
    )
    return register(model, adapter)


def target_layers(model: Model, targets: tuple[str, ...] | list[str]) -> dict[str, torch.nn.Module]:
    """The language model's linear layers whose leaf name is in ``targets``, by module path."""
    prefix = _lm_prefix(model)
    found: dict[str, torch.nn.Module] = {}
    for path, mod in model.arch.hf.named_modules():
        if not path.startswith(prefix + ".") or path.rpartition(".")[2] not in targets:
            continue
        base = mod.base if isinstance(mod, lora.LoRALinear) else mod
        if isinstance(base, torch.nn.Linear | QuantizedLinear):
            found[path] = base
    return found


def _layer_device(layer: torch.nn.Module) -> torch.device:
    return layer.device if isinstance(layer, QuantizedLinear) else layer.weight.device


def pie_init(
    model: Model, rank: int, targets: tuple[str, ...] | list[str], generator: torch.Generator | None = None
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Fresh LoRA weights as Pie initializes them: A ~ U(±1/sqrt(len(targets) * rank)), B = 0."""
    layers = target_layers(model, targets)
    if not layers:
        raise AdapterArgumentError(
            "the model's language model has none of these target modules", targets=list(targets)
        )
    bound = 1.0 / math.sqrt(len(tuple(targets)) * rank)
    weights = {}
    for path in sorted(layers):
        layer = layers[path]
        a = (torch.rand((rank, layer.in_features), generator=generator) * 2 - 1) * bound
        b = torch.zeros((layer.out_features, rank))
        dev = _layer_device(layer)
        weights[path] = (a.to(dev, torch.float32), b.to(dev, torch.float32))
    return weights


def resolve_path(sandbox: str | Path, path: str, *, guest_root: str | None = "/scratch") -> Path:
    """``path`` as a host path inside ``sandbox`` (symlinks followed), else ``AdapterPathError``.

    A relative path is taken under the sandbox; an absolute one must be inside it, or start
    with ``guest_root`` (the guest's view of the sandbox, Pie's ``/scratch``)."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise AdapterPathError("an adapter path is a non-empty string", path=repr(path))
    root = Path(os.path.realpath(sandbox))
    p = Path(path)
    if p.is_absolute():
        g = Path(guest_root) if guest_root else None
        if g is not None and (p == g or g in p.parents):
            p = root / p.relative_to(g)
    else:
        p = root / p
    resolved = Path(os.path.realpath(p))
    if resolved != root and root not in resolved.parents:
        raise AdapterPathError("the adapter path is outside the run's sandbox", path=path)
    return resolved


@dataclass(eq=False)
class NamedAdapter:
    """A named, mutable adapter of one model in one namespace (Pie's ``adapter`` resource).

    ``adapter`` is the current immutable snapshot to hand to ``ctx.forward().adapter()``;
    ``evolution`` is the ``pie:zo`` state (``engine.evolution``) or None."""

    store: AdapterStore = field(repr=False)
    model: Model = field(repr=False)
    namespace: str
    name: str
    rank: int
    alpha: float
    targets: tuple[str, ...]
    _adapter: Adapter = field(repr=False)
    evolution: Any = field(default=None, repr=False)
    destroyed: bool = False

    @property
    def adapter(self) -> Adapter:
        self._live()
        return self._adapter

    @property
    def weights(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Module path -> (lora_A (r, in), lora_B (out, r)), float32: the current weights."""
        return self.adapter.weights

    def _live(self) -> None:
        if self.destroyed:
            raise AdapterNotFoundError("this adapter was destroyed", adapter=self.name)

    def set_weights(
        self,
        weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
        *,
        rank: int | None = None,
        alpha: float | None = None,
    ) -> Adapter:
        """Replace the weights (a new snapshot; passes running keep the old one)."""
        self._live()
        rank = self.rank if rank is None else rank
        alpha = self.alpha if alpha is None else alpha
        self._adapter = snapshot(self.model, self.name, rank, alpha, weights)
        self.rank, self.alpha = rank, float(alpha)
        self.targets = tuple(sorted({p.rpartition(".")[2] for p in weights}))
        return self._adapter

    # -- Pie's adapter methods ----------------------------------------------------------------
    def fork(self, new_name: str) -> NamedAdapter:
        return self.store.fork(self, new_name)

    def save(self, path: str, *, sandbox: str | Path, guest_root: str | None = "/scratch") -> Path:
        return self.store.save(self, path, sandbox=sandbox, guest_root=guest_root)

    def load(self, path: str, *, sandbox: str | Path, guest_root: str | None = "/scratch") -> None:
        self.store.load(self, path, sandbox=sandbox, guest_root=guest_root)

    def destroy(self) -> None:
        self.store.destroy(self)

    def __repr__(self) -> str:
        return f"NamedAdapter({self.namespace!r}/{self.name!r}, r={self.rank}, alpha={self.alpha}, targets={self.targets})"


class AdapterStore:
    """Adapters by (model, namespace, name). One store per engine process; a namespace is a
    tenant: names never collide, and ``open`` never sees, across namespaces or models."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_model: weakref.WeakKeyDictionary[Model, dict[tuple[str, str], NamedAdapter]] = (
            weakref.WeakKeyDictionary()
        )

    @staticmethod
    def _model(model: Model) -> Model:
        from engine.model import Model

        if not isinstance(model, Model):
            raise AdapterArgumentError(f"an adapter belongs to an engine Model, got {type(model).__name__}")
        return model

    def _table(self, model: Model) -> dict[tuple[str, str], NamedAdapter]:
        return self._by_model.setdefault(self._model(model), {})

    def _check(self, adapter: NamedAdapter) -> None:
        if not isinstance(adapter, NamedAdapter) or adapter.store is not self:
            raise AdapterArgumentError("not an adapter of this store", got=type(adapter).__name__)
        adapter._live()

    @staticmethod
    def _name(name: str) -> str:
        if not isinstance(name, str) or not name:
            raise AdapterArgumentError("an adapter name is a non-empty string", name=repr(name))
        return name

    def create(
        self,
        model: Model,
        name: str,
        *,
        namespace: str = "",
        rank: int = 8,
        alpha: float | None = None,
        targets: tuple[str, ...] | list[str] = DEFAULT_TARGETS,
        seed: int | None = None,
    ) -> NamedAdapter:
        """A new adapter (Pie's initialization: B = 0, so it changes nothing yet);
        ``AdapterExistsError`` if the name is taken. ``alpha`` defaults to ``2 * rank``."""
        self._model(model)
        self._name(name)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise AdapterArgumentError("an adapter's rank is an integer >= 1", rank=rank)
        alpha = float(2 * rank if alpha is None else alpha)
        if not math.isfinite(alpha):
            raise AdapterArgumentError("an adapter's alpha is a finite number", alpha=alpha)
        targets = tuple(targets)
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise AdapterArgumentError(
                "targets are module leaf names such as 'q_proj'", targets=list(targets)
            )
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        weights = pie_init(model, rank, targets, gen)
        with self._lock:
            table = self._table(model)
            if (namespace, name) in table:
                raise AdapterExistsError(
                    f"adapter {name!r} already exists", adapter=name, namespace=namespace
                )
            named = NamedAdapter(
                store=self,
                model=model,
                namespace=namespace,
                name=name,
                rank=rank,
                alpha=alpha,
                targets=tuple(sorted({p.rpartition(".")[2] for p in weights})),
                _adapter=snapshot(model, name, rank, alpha, weights),
            )
            table[(namespace, name)] = named
            return named

    def open(self, model: Model, name: str, *, namespace: str = "") -> NamedAdapter | None:
        """The adapter of that name in this model and namespace, or None."""
        self._name(name)
        with self._lock:
            return self._table(model).get((namespace, name))

    def names(self, model: Model, *, namespace: str = "") -> list[str]:
        with self._lock:
            return sorted(n for ns, n in self._table(model) if ns == namespace)

    def fork(self, adapter: NamedAdapter, new_name: str) -> NamedAdapter:
        """A copy under ``new_name`` (same model and namespace): the weights (snapshots are
        immutable, so shared until either side changes) and a copy of any ``pie:zo`` state."""
        self._check(adapter)
        self._name(new_name)
        with self._lock:
            table = self._table(adapter.model)
            if (adapter.namespace, new_name) in table:
                raise AdapterExistsError(
                    f"adapter {new_name!r} already exists", adapter=new_name, namespace=adapter.namespace
                )
            src = adapter._adapter
            child = NamedAdapter(
                store=self,
                model=adapter.model,
                namespace=adapter.namespace,
                name=new_name,
                rank=adapter.rank,
                alpha=adapter.alpha,
                targets=adapter.targets,
                _adapter=register(
                    adapter.model, Adapter(new_name, src.rank, src.alpha, dict(src.weights), src.digest)
                ),
                evolution=None if adapter.evolution is None else adapter.evolution.fork(),
            )
            table[(adapter.namespace, new_name)] = child
            return child

    def destroy(self, adapter: NamedAdapter) -> None:
        """Forget the adapter (its name is free again); passes already given its snapshot
        still run under it."""
        self._check(adapter)
        with self._lock:
            table = self._table(adapter.model)
            if table.get((adapter.namespace, adapter.name)) is adapter:
                del table[(adapter.namespace, adapter.name)]
            adapter.destroyed = True
            adapter.evolution = None

    # -- files ----------------------------------------------------------------------------
    def save(
        self, adapter: NamedAdapter, path: str, *, sandbox: str | Path, guest_root: str | None = "/scratch"
    ) -> Path:
        """Write the adapter as a PEFT directory at ``path`` (inside ``sandbox``); returns the
        host directory."""
        self._check(adapter)
        out = resolve_path(sandbox, path, guest_root=guest_root)
        snap = adapter._adapter
        prefix = _lm_prefix(adapter.model)
        tensors: dict[str, torch.Tensor] = {}
        for mod_path, (a, b) in snap.weights.items():
            tensors[f"{_PEFT_PREFIX}{mod_path}.lora_A.weight"] = (
                a.detach().to("cpu", torch.float32).contiguous()
            )
            tensors[f"{_PEFT_PREFIX}{mod_path}.lora_B.weight"] = (
                b.detach().to("cpu", torch.float32).contiguous()
            )
        leaves = sorted({p.rpartition(".")[2] for p in snap.weights})
        config = {
            "peft_type": "LORA",
            "base_model_name_or_path": str(getattr(adapter.model, "path", "") or ""),
            "r": snap.rank,
            "lora_alpha": snap.alpha,
            # A regex (PEFT full-matches it on module names): the language model's layers only.
            "target_modules": rf"{re.escape(prefix)}\..*\.({'|'.join(map(re.escape, leaves))})",
            "lora_dropout": 0.0,
            "bias": "none",
            "fan_in_fan_out": False,
            "use_rslora": False,
            "use_dora": False,
            "init_lora_weights": True,
            "inference_mode": True,
            "modules_to_save": None,
            "task_type": None,
        }
        try:
            out.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
            (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
            zo = out / ZO_STATE_FILE
            if adapter.evolution is not None:
                state, meta = adapter.evolution.state_dict()
                save_file(state, str(zo), metadata=meta)
            elif zo.exists():
                zo.unlink()
        except OSError as e:
            raise AdapterPathError(f"cannot write the adapter: {e.strerror or e}", path=path) from e
        return out

    def load(
        self, adapter: NamedAdapter, path: str, *, sandbox: str | Path, guest_root: str | None = "/scratch"
    ) -> None:
        """Replace the adapter's weights with the PEFT directory at ``path`` (inside
        ``sandbox``); it must fit the adapter's model (``AdapterMismatchError`` otherwise).
        ``pie:zo`` state saved with it comes back; without it the adapter has none."""
        self._check(adapter)
        src = resolve_path(sandbox, path, guest_root=guest_root)
        model = adapter.model
        loaded = lora.load_adapter(model.arch.hf, _lm_prefix(model), src, adapter.name)
        evolution = None
        if (src / ZO_STATE_FILE).is_file():
            from engine.evolution_state import EvolutionState

            evolution = EvolutionState.from_file(src / ZO_STATE_FILE, loaded.weights)
        adapter.set_weights(dict(loaded.weights), rank=loaded.rank, alpha=loaded.alpha)
        adapter.evolution = evolution
