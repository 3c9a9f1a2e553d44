"""Pie's ``pie:zo``: evolution-strategy training of a LoRA adapter, per-pass seeds.

What Pie does (read from Pie's source): Pie 0.4.0's runtime passes ``initialize`` /
``update`` on to its drivers, and every 0.4.0 driver answers them as no-op stubs; the
algorithm is the ``CmaesAdapter`` of Pie 0.2/0.3's Python driver
(``driver/dev/src/pie_driver_dev/adapter.py`` in 0.3.0), which this module implements:

* **Weights**: LoRA A and B of q/k/v in every decoder layer (``engine.adapter_store``'s
  defaults), A uniform in ``±1/sqrt(3 * rank)``, B zero.
* **Search distribution**: separable (diagonal) CMA-ES, one block per decoder layer: a step
  size ``sigma`` per layer and per weight a variance ``C`` (1 at first), evolution paths
  ``ps`` and ``pc`` (0 at first). A pass under seed ``s`` runs with weights
  ``theta + S * z(s)``, ``S = sigma * sqrt(C)`` elementwise, ``z(s)`` standard normal noise
  drawn from the seed (one draw per weight, no antithetic pairs). Seed 0 is no noise: Pie's
  wire sends an unseeded pass as seed 0 and its noise kernels give zero for it.
* **Selection** (``mu_fraction``): ``mu = max(1, int(population_size * mu_fraction))`` best
  seeds by score (higher is better), recombination weights ``w_i ∝ log(mu + 1/2) - log(i)``
  summing to 1, ``mueff = 1 / sum(w_i^2)``.
* **Update**, per layer with ``d`` its weight count:
  ``theta' = theta + sum_i w_i S z_i``; ``step = (theta' - theta) / sigma``;
  ``ps' = (1 - cs) ps + sqrt(cs (2 - cs) mueff) step / max(sqrt(C), sqrt(min_var))``;
  ``sigma' = clamp(sigma exp(cs / damps (|ps'| / chiN - 1)), min_sigma, max_sigma)`` (no
  upper bound when ``max_sigma <= 0``); ``h = |ps'| < (1.4 + 2 / (d + 1)) chiN``;
  ``pc' = (1 - cc) pc + h sqrt(cc (2 - cc) mueff) step``;
  ``C' = clamp((1 - c1 - cmu) C + c1 pc'^2 + cmu sum_i w_i (S z_i / sigma)^2, min_var, max_var)``;
  with CMA-ES's default constants for dimension ``d`` (``cc``, ``cs``, ``c1``, ``cmu``,
  ``damps``, ``chiN`` below) and Pie's bounds ``min_sigma = 1e-7``, ``min_var = 1e-8``,
  ``max_var = 1e4``.

Where this differs from Pie, on purpose: the noise. Pie draws it with Triton's Philox
``randn(seed as int32, element index)`` keyed by ``seed ± layer (+100, +200 per q/k/v)``, so
seeds ``s`` and ``s + 1`` share noise one layer apart. Here each weight matrix draws from
its own stream, ``numpy`` Philox seeded by ``SeedSequence([seed as u64, hash(module path,
A|B)])``: all 64 bits of the seed count, streams are independent, and the noise is the
same on every device.

``perturbed(adapter, seed)`` builds the perturbed weights once per seed and keeps them
(LRU, at most ``population_size`` entries and ``cache_bytes``) until the adapter's weights
change, so every pass of a population member reuses one ``engine.lora.Adapter``. An
``update`` swaps the weights and the search state at once: a ``perturbed`` running beside it
(another thread) builds from one generation, never a mix.
"""

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

from engine.adapter_store import AdapterArgumentError, NamedAdapter, pie_init, snapshot
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


def _state(adapter: NamedAdapter) -> EvolutionState:
    if not isinstance(adapter, NamedAdapter):
        raise AdapterArgumentError(
            "pie:zo works on an adapter of the adapter store", got=type(adapter).__name__
        )
    adapter._live()
    state = adapter.evolution
    if state is None:
        raise EvolutionError(
            "this adapter has no pie:zo state; call initialize() first", adapter=adapter.name
        )
    return state


def initialize(
    adapter: NamedAdapter,
    rank: int,
    alpha: float,
    population_size: int,
    mu_fraction: float,
    initial_sigma: float,
    *,
    seed: int | None = None,
) -> None:
    """Pie's ``zo.initialize``: fresh weights of rank ``rank`` on the adapter's targets
    (A uniform, B zero) and a fresh search distribution around them (``sigma =
    initial_sigma`` in every layer). ``seed`` fixes the A draw (else torch's global RNG)."""
    if not isinstance(adapter, NamedAdapter):
        raise AdapterArgumentError(
            "pie:zo works on an adapter of the adapter store", got=type(adapter).__name__
        )
    adapter._live()
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise EvolutionError("rank is an integer >= 1", rank=repr(rank))
    alpha = _number("alpha", alpha)
    if isinstance(population_size, bool) or not isinstance(population_size, int) or population_size < 1:
        raise EvolutionError("population_size is an integer >= 1", population_size=repr(population_size))
    mu_fraction = _number("mu_fraction", mu_fraction, lo=0.0, hi=1.0, lo_open=True)
    initial_sigma = _number("initial_sigma", initial_sigma, lo=0.0, lo_open=True)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    weights = pie_init(adapter.model, rank, adapter.targets, gen)
    params = {(p, i): tuple(ab[i].shape) for p, ab in weights.items() for i in (0, 1)}
    device = next(iter(weights.values()))[0].device
    state = EvolutionState(
        params, device, population_size=population_size, mu_fraction=mu_fraction, initial_sigma=initial_sigma
    )
    adapter.set_weights(weights, rank=rank, alpha=alpha)
    adapter.evolution = state


def perturbed(adapter: NamedAdapter, seed: int) -> Adapter:
    """The adapter with weights ``theta + S * z(seed)`` (``theta`` itself for seed 0), for
    ``ctx.forward().adapter(...)``: Pie's ``adapter-seed`` on a pass under ``adapter``.
    Built once per seed while the adapter's weights stay the same."""
    state = _state(adapter)
    seed = _check_seed(seed)
    if seed == 0:
        return adapter.adapter
    with state._lock:  # weights and S of one generation (update swaps them under this lock)
        base, sigma, diag_c = adapter.adapter, state.sigma, state.diag_c
        if state._cache_base is not base:
            state._cache.clear()
            state._cache_base = base
        hit = state._cache.get(seed)
        if hit is not None:
            state._cache.move_to_end(seed)
            return hit
    weights = {}
    for path, (a, b) in base.weights.items():
        pa = a + _stdev(sigma, diag_c, (path, 0)) * noise(seed, (path, 0), tuple(a.shape)).to(a.device)
        pb = b + _stdev(sigma, diag_c, (path, 1)) * noise(seed, (path, 1), tuple(b.shape)).to(b.device)
        weights[path] = (pa, pb)
    out = snapshot(adapter.model, f"{adapter.name}@{seed}", base.rank, base.alpha, weights)
    size = sum(a.numel() + b.numel() for a, b in weights.values()) * 4
    with state._lock:
        if state._cache_base is base:
            state._cache[seed] = out
            while len(state._cache) > 1 and (
                len(state._cache) > state.population_size or len(state._cache) * size > state.cache_bytes
            ):
                state._cache.popitem(last=False)
    return out


def update(adapter: NamedAdapter, scores: list[float], seeds: list[int], max_sigma: float) -> None:
    """Pie's ``zo.update``: one CMA-ES generation from the population's ``scores`` (higher
    is better) and the ``seeds`` their passes ran under (one each, in the same order)."""
    state = _state(adapter)
    scores, seeds = list(scores), list(seeds)
    if len(scores) != len(seeds):
        raise EvolutionError("scores and seeds differ in length", scores=len(scores), seeds=len(seeds))
    if len(scores) != state.population_size:
        raise EvolutionError(
            f"expected {state.population_size} scores and seeds (the population size)", got=len(scores)
        )
    scores = [_number("score", s) for s in scores]
    seeds = [_check_seed(s) for s in seeds]
    max_sigma = _number("max_sigma", max_sigma)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable: ties keep input order
    top = [seeds[i] for i in order[: state.mu]]
    w = state.weights
    with state._update_lock:  # one update at a time; perturbed() reads the old state meanwhile
        with state._lock:
            base = adapter.adapter
            old_sigma, old_c, old_ps, old_pc = state.sigma, state.diag_c, state.ps, state.pc
        new_weights = {p: list(ab) for p, ab in base.weights.items()}
        sigma_new, c_new, ps_new, pc_new = dict(old_sigma), dict(old_c), dict(old_ps), dict(old_pc)
        for block, keys in state.blocks.items():
            c = state.consts[block]
            sigma = old_sigma[block]
            steps, ymu = {}, {}
            for key in keys:
                mean = base.weights[key[0]][key[1]].float()
                s = _stdev(old_sigma, old_c, key)
                shift = torch.zeros_like(mean)
                sq = torch.zeros_like(mean)
                for wi, seed in zip(w, top, strict=True):
                    n = s * noise(seed, key, tuple(mean.shape)).to(mean.device)
                    shift += float(wi) * n
                    sq += float(wi) * (n / (sigma + _EPS)) ** 2
                new_weights[key[0]][key[1]] = mean + shift
                steps[key] = shift / (sigma + _EPS)
                ymu[key] = sq
            c_ps = math.sqrt(c["cs"] * (2.0 - c["cs"]) * state.mueff)
            norm_sq = 0.0
            for key in keys:
                std = torch.sqrt(old_c[key]).clamp_min(state.min_var**0.5)
                ps_new[key] = (1.0 - c["cs"]) * old_ps[key] + c_ps * (steps[key] / (std + _EPS))
                norm_sq += float(ps_new[key].double().pow(2).sum())
            norm_ps = math.sqrt(norm_sq)
            sig = sigma * math.exp((c["cs"] / c["damps"]) * (norm_ps / c["chiN"] - 1.0))
            sig = max(sig, state.min_sigma)
            if max_sigma > 0:
                sig = min(sig, max_sigma)
            h = 1.0 if norm_ps < (1.4 + 2.0 / (c["d"] + 1.0)) * c["chiN"] else 0.0
            c_pc = math.sqrt(c["cc"] * (2.0 - c["cc"]) * state.mueff)
            for key in keys:
                pc_new[key] = (1.0 - c["cc"]) * old_pc[key] + h * c_pc * steps[key]
                c_new[key] = (
                    (1.0 - c["c1"] - c["cmu"]) * old_c[key]
                    + c["c1"] * pc_new[key].pow(2)
                    + c["cmu"] * ymu[key]
                ).clamp(state.min_var, state.max_var)
            sigma_new[block] = sig
        with state._lock:
            adapter.set_weights({p: (a, b) for p, (a, b) in new_weights.items()})
            state.sigma, state.diag_c, state.ps, state.pc = sigma_new, c_new, ps_new, pc_new
            state.generation += 1
            state._cache.clear()
            state._cache_base = adapter.adapter
