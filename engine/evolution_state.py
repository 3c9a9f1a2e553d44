"""The search state of Pie's ``pie:zo`` (Pie 0.2/0.3's diagonal CMA-ES over an adapter's
LoRA weights): per-layer step sizes, per-weight variances and paths, the noise a seed
draws, and its file form. Its own file so that ``engine.adapter_store`` can restore a saved
state without importing ``engine.evolution`` (which builds on the store)."""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from engine.errors import AdapterMismatchError, EngineError, InvalidRequestError
from engine.lora import Adapter

MIN_SIGMA = 1e-7
MIN_VAR = 1e-8
MAX_VAR = 1e4
_EPS = 1e-12
_S64 = (-(2**63), 2**63 - 1)

ParamKey = tuple[str, int]  # (module path, 0 for lora_A / 1 for lora_B)


class EvolutionError(EngineError, InvalidRequestError):
    """A ``pie:zo`` call's input is invalid: a bad hyperparameter, scores and seeds that do
    not match the population, a seed outside s64, an adapter never initialized."""

    code = "evolution_invalid"


def _param_name(key: ParamKey) -> str:
    return f"{key[0]}.lora_{'AB'[key[1]]}"


def _stream_key(key: ParamKey) -> int:
    return int.from_bytes(hashlib.blake2b(_param_name(key).encode(), digest_size=8).digest(), "little")


def _block_of(path: str) -> str:
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", path)
    return f"layers.{m.group(1)}" if m else path


def _check_seed(seed: object) -> int:
    if (
        isinstance(seed, bool)
        or not isinstance(seed, int | np.integer)
        or not _S64[0] <= int(seed) <= _S64[1]
    ):
        raise EvolutionError("a seed is an integer in the s64 range", seed=repr(seed))
    return int(seed)


def noise(seed: int, key: ParamKey, shape: tuple[int, ...]) -> torch.Tensor:
    """The standard normal draw ``z(seed)`` for one weight matrix (float32, CPU); zeros for
    seed 0."""
    seed = _check_seed(seed)
    if seed == 0:
        return torch.zeros(shape)
    ss = np.random.SeedSequence([seed & (2**64 - 1), _stream_key(key)])
    z = np.random.Generator(np.random.Philox(ss)).standard_normal(size=shape, dtype=np.float32)
    return torch.from_numpy(z)


def _number(
    name: str, value: object, *, lo: float | None = None, hi: float | None = None, lo_open: bool = False
) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float | np.number)
        or not math.isfinite(float(value))
    ):
        raise EvolutionError(f"{name} is a finite number", **{name: repr(value)})
    v = float(value)
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise EvolutionError(f"{name} must be {'>' if lo_open else '>='} {lo}", **{name: v})
    if hi is not None and v > hi:
        raise EvolutionError(f"{name} must be <= {hi}", **{name: v})
    return v


class EvolutionState:
    """The separable CMA-ES state of one adapter (``NamedAdapter.evolution``)."""

    def __init__(
        self,
        params: dict[ParamKey, tuple[int, ...]],
        device: torch.device | str,
        *,
        population_size: int,
        mu_fraction: float,
        initial_sigma: float,
        min_sigma: float = MIN_SIGMA,
        min_var: float = MIN_VAR,
        max_var: float = MAX_VAR,
        cache_bytes: int = 2 << 30,
    ):
        self.population_size = population_size
        self.mu_fraction = mu_fraction
        self.initial_sigma = initial_sigma
        self.min_sigma, self.min_var, self.max_var = min_sigma, min_var, max_var
        self.cache_bytes = cache_bytes
        self.generation = 0
        self.shapes = dict(sorted(params.items()))
        self.blocks: dict[str, list[ParamKey]] = {}
        for key in self.shapes:
            self.blocks.setdefault(_block_of(key[0]), []).append(key)
        f32 = dict(dtype=torch.float32, device=device)
        self.diag_c = {k: torch.ones(s, **f32) for k, s in self.shapes.items()}
        self.ps = {k: torch.zeros(s, **f32) for k, s in self.shapes.items()}
        self.pc = {k: torch.zeros(s, **f32) for k, s in self.shapes.items()}
        self.sigma = dict.fromkeys(self.blocks, float(initial_sigma))
        self._cache: OrderedDict[int, Adapter] = OrderedDict()
        self._cache_base: Adapter | None = None
        self._lock = threading.Lock()
        self._update_lock = threading.Lock()
        self._derive()

    # -- strategy constants ---------------------------------------------------------------
    def _derive(self) -> None:
        self.mu = max(1, int(self.population_size * self.mu_fraction))
        logw = math.log(self.mu + 0.5) - np.log(np.arange(1, self.mu + 1, dtype=np.float64))
        self.weights = logw / logw.sum()
        self.mueff = float(self.weights.sum() ** 2 / (self.weights**2).sum())
        self.consts = {}
        for block, keys in self.blocks.items():
            d = float(sum(math.prod(self.shapes[k]) for k in keys))
            mueff = self.mueff
            c1 = 2.0 / ((d + 1.3) ** 2 + mueff)
            cs = (mueff + 2.0) / (d + mueff + 5.0)
            self.consts[block] = {
                "d": d,
                "cc": (4.0 + mueff / d) / (d + 4.0 + 2.0 * mueff / d),
                "cs": cs,
                "c1": c1,
                "cmu": min(1.0 - c1, 2.0 * (mueff - 2.0 + 1.0 / mueff) / ((d + 2.0) ** 2 + mueff)),
                "damps": 1.0 + 2.0 * max(0.0, math.sqrt((mueff - 1.0) / (d + 1.0)) - 1.0) + cs,
                "chiN": math.sqrt(d) * (1.0 - 1.0 / (4.0 * d) + 1.0 / (21.0 * d**2)),
            }

    def stdev(self, key: ParamKey) -> torch.Tensor:
        """``S = sigma * sqrt(C)`` for one weight matrix: the noise scale of its entries."""
        return _stdev(self.sigma, self.diag_c, key)

    def fork(self) -> EvolutionState:
        twin = object.__new__(EvolutionState)
        twin.__dict__.update(self.__dict__)
        twin.diag_c = {k: t.clone() for k, t in self.diag_c.items()}
        twin.ps = {k: t.clone() for k, t in self.ps.items()}
        twin.pc = {k: t.clone() for k, t in self.pc.items()}
        twin.sigma = dict(self.sigma)
        twin._cache, twin._cache_base = OrderedDict(), None
        twin._lock, twin._update_lock = threading.Lock(), threading.Lock()
        return twin

    # -- persistence (zo_state.safetensors beside the PEFT files) --------------------------
    def state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        tensors: dict[str, torch.Tensor] = {}
        for k in self.shapes:
            n = _param_name(k)
            tensors[f"{n}.diag_c"] = self.diag_c[k].detach().cpu().contiguous()
            tensors[f"{n}.ps"] = self.ps[k].detach().cpu().contiguous()
            tensors[f"{n}.pc"] = self.pc[k].detach().cpu().contiguous()
        meta = {
            "population_size": self.population_size,
            "mu_fraction": self.mu_fraction,
            "initial_sigma": self.initial_sigma,
            "min_sigma": self.min_sigma,
            "min_var": self.min_var,
            "max_var": self.max_var,
            "generation": self.generation,
            "sigma": self.sigma,
        }
        return tensors, {"pie_zo": json.dumps(meta)}

    @classmethod
    def from_file(cls, path: Path, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> EvolutionState:
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                meta = json.loads((f.metadata() or {})["pie_zo"])
            tensors = load_file(str(path))
        except (OSError, ValueError, KeyError) as e:
            raise AdapterMismatchError(f"unreadable pie:zo state: {e}", path=str(path)) from e
        params = {(p, i): tuple(ab[i].shape) for p, ab in weights.items() for i in (0, 1)}
        device = next(iter(weights.values()))[0].device
        state = cls(
            params,
            device,
            population_size=int(meta["population_size"]),
            mu_fraction=float(meta["mu_fraction"]),
            initial_sigma=float(meta["initial_sigma"]),
            min_sigma=float(meta["min_sigma"]),
            min_var=float(meta["min_var"]),
            max_var=float(meta["max_var"]),
        )
        state.generation = int(meta["generation"])
        if set(meta["sigma"]) != set(state.sigma):
            raise AdapterMismatchError("the pie:zo state does not fit the adapter's layers", path=str(path))
        state.sigma = {b: float(s) for b, s in meta["sigma"].items()}
        for k, shape in state.shapes.items():
            n = _param_name(k)
            for part, table in (("diag_c", state.diag_c), ("ps", state.ps), ("pc", state.pc)):
                t = tensors.get(f"{n}.{part}")
                if t is None or tuple(t.shape) != shape:
                    raise AdapterMismatchError(
                        "the pie:zo state does not fit the adapter's weights", tensor=f"{n}.{part}"
                    )
                table[k] = t.to(device, torch.float32)
        return state


def _stdev(sigma: dict[str, float], diag_c: dict[ParamKey, torch.Tensor], key: ParamKey) -> torch.Tensor:
    return sigma[_block_of(key[0])] * torch.sqrt(diag_c[key])
