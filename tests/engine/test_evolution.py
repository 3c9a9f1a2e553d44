"""``pie:zo`` on the engine (engine/evolution.py): perturbed adapters per seed, Pie's
separable CMA-ES update checked against a direct numpy computation, a toy ES loop."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine import evolution as zo
from engine.adapter_store import AdapterArgumentError, AdapterStore
from engine.evolution import EvolutionError
from tests.engine.conftest import pass_logits  # noqa: E402

PROMPT = "The cat sat on the mat and looked at the sea."
POP = 6


def _logits(model, adapter=None, text: str = PROMPT) -> torch.Tensor:
    return pass_logits(model, text, adapter)


@pytest.fixture
def es(qwen):
    """An adapter initialized for ES: rank 4, a population of 6, the best 3 kept."""
    store = AdapterStore()
    a = store.create(qwen, "es", rank=4)
    zo.initialize(a, 4, 8.0, POP, 0.5, 0.2, seed=0)
    return a


def _write_peft(weights, rank: int, alpha: float, out):
    out.mkdir(parents=True)
    tensors = {}
    for path, (a, b) in weights.items():
        tensors[f"base_model.model.{path}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{path}.lora_B.weight"] = b.contiguous()
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": alpha})
    )
    return out


def test_initialize_is_pies_init(es):
    assert es.rank == 4 and es.alpha == 8.0 and es.evolution.mu == 3
    bound = 1 / math.sqrt(3 * 4)  # kaiming_uniform_(a=sqrt(5)) on Pie's (in, 3 * rank) down matrix
    for a, b in es.weights.values():
        assert a.abs().max() <= bound and a.abs().max() > 0.8 * bound
        assert b.abs().max() == 0
    assert set(es.evolution.sigma.values()) == {0.2}


def test_a_perturbed_pass_equals_the_same_weights_loaded_as_a_plain_adapter(qwen, es, tmp_path):
    p = zo.perturbed(es, 7)
    plain = qwen.load_adapter(_write_peft(p.weights, p.rank, p.alpha, tmp_path / "plain"))
    ours = _logits(qwen, p)
    assert torch.equal(ours, _logits(qwen, plain))
    assert (ours - _logits(qwen, es.adapter)).abs().max().item() > 1e-2  # the noise matters
    # and theta + S * z: the perturbation is the noise scale times a standard normal draw
    z = torch.cat(
        [
            ((pw[i] - w[i]) / es.evolution.stdev((path, i))).flatten()
            for path, w in es.weights.items()
            for pw in [p.weights[path]]
            for i in (0, 1)
        ]
    )
    assert abs(z.mean().item()) < 0.05 and abs(z.std().item() - 1) < 0.05


def test_same_seed_same_perturbation_and_cached(qwen, es):
    p = zo.perturbed(es, 42)
    assert zo.perturbed(es, 42) is p  # built once per seed: passes reuse it
    twin = es.fork("twin")
    q = zo.perturbed(twin, 42)
    assert q is not p and q.digest == p.digest
    for path, (a, b) in p.weights.items():
        assert torch.equal(a, q.weights[path][0]) and torch.equal(b, q.weights[path][1])
    other = zo.perturbed(es, 43)
    assert other.digest != p.digest
    assert not torch.equal(other.weights[path][1], p.weights[path][1])
    assert zo.perturbed(es, -(2**63)).digest != zo.perturbed(es, 2**63 - 1).digest  # all 64 bits count
    assert zo.perturbed(es, 0) is es.adapter  # seed 0: no noise, as Pie's unseeded pass
    assert torch.equal(_logits(qwen, p), _logits(qwen, q))
    for s in range(1, 3 * POP):  # the cache keeps at most a population
        zo.perturbed(es, s)
    assert len(es.evolution._cache) == POP
    zo.update(es, [float(i) for i in range(POP)], list(range(1, POP + 1)), 0.0)
    assert not es.evolution._cache and zo.perturbed(es, 42) is not p  # new weights: rebuilt


class _NumpyCMA:
    """Pie's CmaesAdapter.update written out in float64 numpy, one layer block at a time."""

    def __init__(self, blocks, sigma0, pop, mu_fraction):
        self.mu = max(1, int(pop * mu_fraction))
        logw = np.log(self.mu + 0.5) - np.log(np.arange(1, self.mu + 1))
        self.w = logw / logw.sum()
        self.mueff = self.w.sum() ** 2 / (self.w**2).sum()
        self.blocks = blocks  # block -> list of (path, part, shape)
        self.sigma = dict.fromkeys(blocks, sigma0)
        keys = [(p, i) for ks in blocks.values() for p, i, _ in ks]
        shapes = {(p, i): s for ks in blocks.values() for p, i, s in ks}
        self.C = {k: np.ones(shapes[k]) for k in keys}
        self.ps = {k: np.zeros(shapes[k]) for k in keys}
        self.pc = {k: np.zeros(shapes[k]) for k in keys}

    def update(self, mean, noises, scores, seeds, max_sigma):
        order = np.argsort(-np.asarray(scores), kind="stable")[: self.mu]
        top = [seeds[i] for i in order]
        new = {}
        for block, ks in self.blocks.items():
            d = float(sum(np.prod(s) for _, _, s in ks))
            mueff, sigma = self.mueff, self.sigma[block]
            cc = (4 + mueff / d) / (d + 4 + 2 * mueff / d)
            cs = (mueff + 2) / (d + mueff + 5)
            c1 = 2 / ((d + 1.3) ** 2 + mueff)
            cmu = min(1 - c1, 2 * (mueff - 2 + 1 / mueff) / ((d + 2) ** 2 + mueff))
            damps = 1 + 2 * max(0.0, np.sqrt((mueff - 1) / (d + 1)) - 1) + cs
            chin = np.sqrt(d) * (1 - 1 / (4 * d) + 1 / (21 * d**2))
            steps, norm = {}, 0.0
            for p, i, _ in ks:
                k = (p, i)
                n = np.stack([noises[s][k] for s in top])  # (mu, ...) = S * z of each parent
                new[k] = mean[k] + np.tensordot(self.w, n, 1)
                steps[k] = (new[k] - mean[k]) / sigma
                std = np.maximum(np.sqrt(self.C[k]), np.sqrt(1e-8))
                self.ps[k] = (1 - cs) * self.ps[k] + np.sqrt(cs * (2 - cs) * mueff) * steps[k] / std
                norm += (self.ps[k] ** 2).sum()
            norm = np.sqrt(norm)
            s_new = max(sigma * np.exp(cs / damps * (norm / chin - 1)), 1e-7)
            if max_sigma > 0:
                s_new = min(s_new, max_sigma)
            h = float(norm < (1.4 + 2 / (d + 1)) * chin)
            for p, i, _ in ks:
                k = (p, i)
                self.pc[k] = (1 - cc) * self.pc[k] + h * np.sqrt(cc * (2 - cc) * mueff) * steps[k]
                y2 = np.tensordot(self.w, np.stack([(noises[s][k] / sigma) ** 2 for s in top]), 1)
                self.C[k] = np.clip((1 - c1 - cmu) * self.C[k] + c1 * self.pc[k] ** 2 + cmu * y2, 1e-8, 1e4)
            self.sigma[block] = s_new
        return new


def test_update_moves_the_weights_as_pies_rule_says(es):
    blocks = {}
    for path, (a, b) in es.weights.items():
        layer = path.split(".layers.")[1].split(".")[0]
        blocks.setdefault(f"layers.{layer}", []).extend(
            [(path, 0, tuple(a.shape)), (path, 1, tuple(b.shape))]
        )
    ref = _NumpyCMA(blocks, 0.2, POP, 0.5)
    rng = np.random.default_rng(0)
    for gen, max_sigma in enumerate([0.0, 0.19, 0.5]):  # the second clamps sigma below its value
        seeds = [int(s) for s in rng.integers(-(2**63), 2**63 - 1, size=POP)]
        scores = [float(x) for x in rng.normal(size=POP)]
        scores[1] = scores[4]  # a tie: the earlier one ranks first
        mean = {(p, i): w[i].double().numpy() for p, w in es.weights.items() for i in (0, 1)}
        noises = {}
        for s in seeds:  # the perturbation each pass ran under, as the engine built it
            pw = zo.perturbed(es, s).weights
            noises[s] = {(p, i): pw[p][i].double().numpy() - mean[(p, i)] for p in pw for i in (0, 1)}
        want = ref.update(mean, noises, scores, seeds, max_sigma)
        zo.update(es, scores, seeds, max_sigma)
        for (p, i), w in want.items():
            np.testing.assert_allclose(es.weights[p][i].double().numpy(), w, atol=1e-6, rtol=1e-5)
            np.testing.assert_allclose(es.evolution.diag_c[(p, i)].double().numpy(), ref.C[(p, i)], rtol=1e-4)
            np.testing.assert_allclose(
                es.evolution.pc[(p, i)].double().numpy(), ref.pc[(p, i)], atol=1e-6, rtol=1e-4
            )
        for block, s in ref.sigma.items():
            assert es.evolution.sigma[block] == pytest.approx(s, rel=1e-5)
        assert es.evolution.generation == gen + 1
    assert set(es.evolution.sigma.values()) != {0.2}
    assert max(es.evolution.sigma.values()) <= 0.5


def test_a_toy_es_loop_improves_its_objective(qwen):
    """Raise the logit of one token at the prompt's last row (q/k/v LoRA only, so it moves
    slowly): 10 generations of 16, the best half kept. Deterministic (fixed seeds); measured
    here: -0.22 -> 0.66, rising through the run."""
    store = AdapterStore()
    a = store.create(qwen, "toy", rank=2)
    zo.initialize(a, 2, 4.0, 16, 0.5, 1.0, seed=0)
    target = 1234

    def objective(adapter) -> float:
        return _logits(qwen, adapter)[-1, target].item()

    trajectory = [objective(a.adapter)]
    for gen in range(10):
        seeds = [gen * 1000 + i + 1 for i in range(16)]
        scores = [objective(zo.perturbed(a, s)) for s in seeds]
        zo.update(a, scores, seeds, 0.0)
        trajectory.append(objective(a.adapter))
    assert trajectory[-1] > trajectory[0] + 0.6, trajectory
    assert np.mean(trajectory[-3:]) > np.mean(trajectory[:3]) + 0.4, trajectory


def test_bad_input_gives_typed_errors(qwen, es):
    store = AdapterStore()
    fresh = store.create(qwen, "fresh")
    with pytest.raises(EvolutionError, match="initialize"):
        zo.update(fresh, [1.0] * POP, list(range(POP)), 0.0)
    with pytest.raises(EvolutionError, match="initialize"):
        zo.perturbed(fresh, 1)
    for bad in (
        dict(rank=0),
        dict(rank=2.5),
        dict(population_size=0),
        dict(mu_fraction=0.0),
        dict(mu_fraction=1.5),
        dict(initial_sigma=0.0),
        dict(initial_sigma=float("nan")),
        dict(alpha=float("inf")),
    ):
        args = dict(rank=4, alpha=8.0, population_size=4, mu_fraction=0.5, initial_sigma=0.1) | bad
        with pytest.raises(EvolutionError):
            zo.initialize(fresh, **args)
    assert fresh.evolution is None  # a refused initialize changed nothing
    with pytest.raises(EvolutionError, match="differ in length"):
        zo.update(es, [1.0] * POP, list(range(POP - 1)), 0.0)
    with pytest.raises(EvolutionError, match="population size"):
        zo.update(es, [1.0] * (POP + 1), list(range(POP + 1)), 0.0)
    with pytest.raises(EvolutionError):
        zo.update(es, [float("nan")] + [1.0] * (POP - 1), list(range(POP)), 0.0)
    with pytest.raises(EvolutionError):
        zo.update(es, [1.0] * POP, [2**63] + list(range(POP - 1)), 0.0)
    with pytest.raises(EvolutionError):
        zo.perturbed(es, "7")
    assert es.evolution.generation == 0  # nothing moved
    with pytest.raises(AdapterArgumentError):
        zo.perturbed(es.adapter, 1)  # an engine Adapter, not the store's named adapter
    es.destroy()
    from engine import AdapterNotFoundError

    with pytest.raises(AdapterNotFoundError):
        zo.update(es, [1.0] * POP, list(range(POP)), 0.0)
