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

import math

import torch

from engine.adapter_store import AdapterArgumentError, NamedAdapter, pie_init, snapshot
from engine.evolution_state import (
    _EPS,
    EvolutionError,
    EvolutionState,
    _check_seed,
    _number,
    _stdev,
    noise,
)
from engine.lora import Adapter


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
