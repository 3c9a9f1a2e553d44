"""Samplers: statistical checks of every distribution, parity with transformers' warpers, seeding.

Statistical tolerances (N = 20 000 draws from one seeded, batched call):
- chi-square goodness of fit over the allowed tokens, p-value from torch's regularised upper
  incomplete gamma; we require p > 1e-6, so a correct sampler fails for at most one seed in a
  million, while a wrong filter (a token kept or dropped, a wrong temperature) gives p ~ 0;
- total variation: by the Bretagnolle-Huber-Carol inequality P(TV >= eps) <= 2^k exp(-2 N eps^2)
  for k categories, so eps = sqrt((k ln 2 + ln(1/delta)) / (2N)) with delta = 1e-6 (about 0.025
  for k = 16) bounds the sampling error of a correct sampler;
- tokens outside the allowed set must never appear (exact count 0).
The expected distributions are computed here from the definitions in float64, not with the code
under test; `test_statistics_have_power` shows the same checks reject a wrong distribution.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine.sampling import Sampler, argmax, candidates, dist, generator, probs, sample

N = 20_000
DELTA = 1e-6
# Distinct logits in a shuffled order, so that token id order is not probability order.
BASE = torch.tensor([2.0, 1.7, 1.5, 1.2, 1.0, 0.8, 0.5, 0.3, 0.0, -0.3, -0.7, -1.0, -1.5, -2.0, -3.0, -4.0])
PERM = torch.randperm(16, generator=torch.Generator().manual_seed(7))
LOGITS = BASE[PERM]


def expected(logits: torch.Tensor, t: float, k: int | None = None, p: float = 1.0, m: float = 0.0):
    """Reference post-processing distribution from the definitions (float64, descending order)."""
    q = torch.softmax(logits.double() / t, dim=-1)
    order = torch.argsort(q, descending=True)
    keep = torch.zeros_like(q, dtype=torch.bool)
    keep[order[: k or len(q)]] = True
    if p < 1:  # smallest most-probable prefix whose mass reaches p (boundary token included)
        q2 = torch.where(keep, q, 0.0)
        q2 = q2 / q2.sum()
        mass = torch.cumsum(q2[order], 0)
        n = int((mass < p).sum()) + 1
        keep = torch.zeros_like(keep)
        keep[order[:n]] = True
    q2 = torch.where(keep, q, 0.0)
    q2 = q2 / q2.sum()
    keep &= q2 >= m * q2.max()
    q3 = torch.where(keep, q, 0.0)
    return q3 / q3.sum()


def chi2_pvalue(counts: torch.Tensor, p: torch.Tensor) -> float:
    allowed = p > 0
    e = N * p[allowed]
    stat = (((counts[allowed] - e) ** 2) / e).sum()
    df = int(allowed.sum()) - 1
    if df == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def tv_bound(k: int) -> float:
    return math.sqrt((k * math.log(2) + math.log(1 / DELTA)) / (2 * N))


def draw(sampler: Sampler, seed: int = 0) -> torch.Tensor:
    toks = sample(LOGITS.expand(N, -1), sampler, generator(seed))
    return torch.bincount(toks, minlength=len(LOGITS)).double()


CASES = [
    (Sampler.multinomial(1.0), dict(t=1.0)),
    (Sampler.multinomial(0.8), dict(t=0.8)),
    (Sampler.top_k(0.7, 5), dict(t=0.7, k=5)),
    (Sampler.top_p(1.2, 0.8), dict(t=1.2, p=0.8)),
    (Sampler.min_p(1.0, 0.1), dict(t=1.0, m=0.1)),
    (Sampler.top_k_top_p(0.9, 8, 0.7), dict(t=0.9, k=8, p=0.7)),
    (Sampler.reasoning(), dict(t=0.6, k=20, p=0.95)),
]


@pytest.mark.parametrize(("sampler", "params"), CASES, ids=[repr(c[0]) for c in CASES])
def test_empirical_distribution(sampler: Sampler, params: dict) -> None:
    p = expected(LOGITS, **params)
    assert torch.allclose(probs(LOGITS, sampler)[0].double(), p, atol=1e-6)
    counts = draw(sampler)
    assert counts.sum() == N
    assert counts[p == 0].sum() == 0, "a filtered-out token was sampled"
    assert chi2_pvalue(counts, p) > DELTA
    tv = 0.5 * (counts / N - p).abs().sum()
    assert tv < tv_bound(len(p)), f"TV {tv:.4f} >= {tv_bound(len(p)):.4f}"


def test_filters_keep_the_intended_sets() -> None:
    # Guards the fixtures above: each filter really removes something.
    assert int((expected(LOGITS, 0.7, k=5) > 0).sum()) == 5
    assert 2 < int((expected(LOGITS, 1.2, p=0.8) > 0).sum()) < 16
    assert 2 < int((expected(LOGITS, 1.0, m=0.1) > 0).sum()) < 16


def test_statistics_have_power() -> None:
    counts = draw(Sampler.top_k(1.0, 8))
    assert chi2_pvalue(counts, expected(LOGITS, 1.0)) < DELTA  # unfiltered: rejected
    assert chi2_pvalue(counts, expected(LOGITS, 1.25, k=8)) < DELTA  # wrong temperature: rejected
    assert chi2_pvalue(counts, expected(LOGITS, 1.0, k=8)) > DELTA


def test_greedy_is_argmax() -> None:
    logits = torch.randn(64, 100, generator=torch.Generator().manual_seed(1))
    want = logits.argmax(dim=-1)
    for s in (Sampler.greedy(), Sampler.top_p(0.0, 0.5), Sampler.top_k(0, 3), Sampler.min_p(0, 0.2)):
        assert s.is_greedy
        assert torch.equal(sample(logits, s), want)
    tie = torch.tensor([[0.0, 3.0, 1.0, 3.0]])
    assert sample(tie, Sampler.greedy()).tolist() == [1]  # first maximum, like torch.argmax
    assert torch.equal(probs(tie, Sampler.greedy()), torch.tensor([[0.0, 1.0, 0.0, 0.0]]))


def test_a_vanishing_temperature_is_greedy_not_nan() -> None:
    """Below ``GREEDY_BELOW`` (vLLM's 1e-5) a temperature samples as greedy: a float32
    ``1e-40`` is 0, and the division made a row of NaNs (a sampling error, an HTTP 500)."""
    from engine.sampling import GREEDY_BELOW

    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(2))
    for t in (5e-324, 1e-40, 1e-30, GREEDY_BELOW / 2):
        s = Sampler.top_p(t, 0.9)
        assert s.is_greedy and s.temperature == 0
        assert torch.equal(sample(logits, s, generator(0)), logits.argmax(dim=-1))
    assert not Sampler.multinomial(GREEDY_BELOW).is_greedy
    custom = Sampler.custom(lambda ids, ps: ids[0], temperature=1e-300)  # keeps the floor
    assert custom.temperature == GREEDY_BELOW
    ids, ps = candidates(logits[0], custom)
    assert ids[0] == int(logits[0].argmax()) and all(math.isfinite(p) for p in ps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_argmax_follows_torch_rules(dtype) -> None:
    """The CPU fast path (numpy) gives torch.argmax's answer: ties, infinities, NaN (the
    first NaN wins), all -inf, views, 1-D and 2-D, a real vocabulary size."""
    nan, inf = float("nan"), float("inf")
    rows = [
        [0.0, 3.0, 1.0, 3.0],
        [1.0, nan, 3.0, nan],
        [-inf, -inf, -inf, -inf],
        [inf, 1.0, inf, 2.0],
        [1.0, inf, nan, 0.0],
        [nan, nan, nan, nan],
        [-0.0, 0.0, -1.0, -0.0],
    ]
    t = torch.tensor(rows, dtype=dtype)
    assert torch.equal(argmax(t), t.argmax(dim=-1))
    assert argmax(t).dtype == torch.int64
    for r in t:
        assert int(argmax(r)) == int(r.argmax())
    big = torch.randn(16, 151936, generator=torch.Generator().manual_seed(3)).to(dtype)
    big[5, 100] = big[5, 7] = big[5].max() + 1  # a tie far apart
    assert torch.equal(argmax(big), big.argmax(dim=-1))
    assert torch.equal(argmax(big[::3, 1:]), big[::3, 1:].argmax(dim=-1))  # strided view
    assert torch.equal(argmax(big.t().contiguous().t()), big.argmax(dim=-1))  # column-major


def _hf(logits: torch.Tensor, t: float, k: int | None, p: float, m: float) -> torch.Tensor:
    """transformers' generate(do_sample=True) warper chain, in its order."""
    s = TemperatureLogitsWarper(float(t))(None, logits)
    if k is not None:
        s = TopKLogitsWarper(k)(None, s)
    if p < 1:
        s = TopPLogitsWarper(p)(None, s)
    if m > 0:
        s = MinPLogitsWarper(m)(None, s)
    return s.softmax(dim=-1)


HF_PARAMS = [
    (1.0, None, 1.0, 0.0),
    (0.7, None, 1.0, 0.0),
    (1.3, 10, 1.0, 0.0),
    (1.0, 1, 1.0, 0.0),
    (0.8, None, 0.9, 0.0),
    (1.0, None, 0.3, 0.0),
    (1.0, None, 1.0, 0.05),
    (0.6, None, 1.0, 0.3),
    (0.6, 20, 0.95, 0.0),
    (1.1, 50, 0.8, 0.1),
    (2.0, 600, 0.5, 1.0),
]


@pytest.mark.parametrize(("t", "k", "p", "m"), HF_PARAMS)
def test_matches_transformers_warpers(t: float, k: int | None, p: float, m: float) -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 500, generator=g) * 3
    logits[4:] = (logits[4:] * 2).round() / 2  # many exact ties: exercises the tie rules
    s = Sampler(temperature=t, topk=k, topp=p, minp=m)
    want = _hf(logits, t, k, p, m)
    got = probs(logits, s)
    assert torch.allclose(got, want, atol=1e-6, rtol=0)
    assert torch.equal(got > 0, want > 0)  # the same kept set, exactly
    for i in range(len(logits)):  # alone, tie-free rows take the top-k fast path
        alone = probs(logits[i], s)[0]
        assert torch.allclose(alone, want[i], atol=1e-6, rtol=0)
        assert torch.equal(alone > 0, want[i] > 0)


def test_mixed_batch_matches_rows_alone() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(4)) * 2
    samplers = [
        Sampler.top_k(0.7, 5),
        Sampler.greedy(),
        Sampler.top_p(1.0, 0.6),
        Sampler.min_p(0.9, 0.2),
        Sampler.custom(lambda ids, ps: ids[-1], candidates=3),
    ]
    batch = probs(logits, samplers)
    for i, s in enumerate(samplers):
        assert torch.allclose(batch[i], probs(logits[i], s)[0], atol=1e-7)
    gens = [generator(100 + i) for i in range(5)]
    together = sample(logits, samplers, gens)
    alone = [int(sample(logits[i], s, generator(100 + i))[0]) for i, s in enumerate(samplers)]
    assert together.tolist() == alone


def test_draws_do_not_depend_on_batch_company() -> None:
    # Alone, top-k rows take the compact path; next to a row without top-k, the full one.
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(6)).expand(300, -1)
    s = Sampler.top_k_top_p(1.0, 40, 0.9)
    alone = sample(logits, s, [generator(i) for i in range(300)])
    mixed = sample(
        torch.cat([logits, logits[:1]]),
        [s] * 300 + [Sampler.multinomial()],
        [generator(i) for i in range(300)] + [None],
    )
    assert torch.equal(alone, mixed[:300])
    assert len(set(alone.tolist())) > 10


def test_top_p_boundary_token_is_included() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()[[2, 0, 3, 1]]  # ids: 1 -> .5, 3 -> .3, 0 -> .15
    kept = {0.45: {1}, 0.7: {1, 3}, 0.85: {0, 1, 3}, 0.97: {0, 1, 2, 3}, 1.0: {0, 1, 2, 3}}
    for top_p, ids in kept.items():
        ps = probs(logits, Sampler.top_p(1.0, top_p))[0]
        assert set(torch.nonzero(ps).flatten().tolist()) == ids, top_p
        toks = sample(logits.expand(2000, -1), Sampler.top_p(1.0, top_p), generator(0))
        assert set(toks.tolist()) == ids


def test_top_k_keeps_ties_and_min_p_threshold() -> None:
    logits = torch.tensor([1.0, 1.0, 1.0, 0.0])
    assert (probs(logits, Sampler.top_k(1.0, 2))[0] > 0).tolist() == [True, True, True, False]
    assert (probs(logits, Sampler.top_k(1.0, 99))[0] > 0).all()
    p = torch.tensor([0.4, 0.21, 0.1, 0.29])  # min_p 0.5 -> keep probabilities >= 0.2
    assert (probs(p.log(), Sampler.min_p(1.0, 0.5))[0] > 0).tolist() == [True, True, False, True]
    assert (probs(p.log(), Sampler.min_p(1.0, 1.0))[0] > 0).tolist() == [True, False, False, False]


def test_seeded_reproducibility() -> None:
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(5))
    s = Sampler.top_p(1.0, 0.95)
    a = sample(logits, s, generator(42))
    b = sample(logits, s, generator(42))
    c = sample(logits, s, generator(43))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    g1, g2 = generator(9), generator(9)  # a generator advances: a sequence of steps reproduces too
    steps1 = [sample(logits, s, g1) for _ in range(3)]
    steps2 = [sample(logits, s, g2) for _ in range(3)]
    assert all(torch.equal(x, y) for x, y in zip(steps1, steps2, strict=True))
    assert not torch.equal(steps1[0], steps1[1])


def test_never_samples_zero_probability_tokens() -> None:
    logits = torch.full((1, 1000), float("-inf"))
    logits[0, [3, 500, 999]] = torch.tensor([80.0, 80.0, -20.0])  # 999 underflows to probability 0
    toks = sample(logits.expand(5000, -1), Sampler.multinomial(1.0), generator(0))
    assert set(toks.tolist()) == {3, 500}
    half = torch.tensor([[0.0, 0.0]], dtype=torch.bfloat16)  # low-precision logits are accepted
    assert set(sample(half.expand(500, -1), Sampler.multinomial(), generator(1)).tolist()) == {0, 1}


def test_custom_sampler_gets_candidates_and_choice_is_used() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0, float("-inf"), 2.0])
    seen: list[tuple[list[int], list[float]]] = []

    def least_likely(ids: list[int], ps: list[float]) -> int:
        seen.append((ids, ps))
        return ids[-1]

    s = Sampler.custom(least_likely, temperature=0.5, candidates=4)
    assert sample(torch.stack([logits, logits]), s).tolist() == [2, 2]
    ids, ps = seen[0]
    assert ids == [1, 3, 5, 2]  # most probable first, ties (3, 5) by lower id
    full = torch.softmax(logits / 0.5, dim=-1)
    assert ps == pytest.approx(full[ids].tolist(), abs=1e-7)  # not renormalised
    # All nonzero tokens when candidates=None; the -inf token is never a candidate.
    ids, ps = candidates(logits, Sampler.custom(least_likely, candidates=None))
    assert ids == [1, 3, 5, 2, 0]
    assert sum(ps) == pytest.approx(1.0)
    # Temperature 0: the unscaled softmax.
    ids, ps = candidates(logits, Sampler.custom(least_likely, temperature=0.0))
    assert ps == pytest.approx(torch.softmax(logits, -1)[ids].tolist(), abs=1e-7)


@pytest.mark.parametrize("bad", [-1, 6, 1.5, "3", None])
def test_custom_sampler_bad_choice(bad: object) -> None:
    with pytest.raises(ValueError, match="custom sampler returned"):
        sample(torch.zeros(1, 6), Sampler.custom(lambda ids, ps: bad))


def test_dist() -> None:
    ids, ps = dist(LOGITS, Sampler.top_k(0.7, 5))
    p = expected(LOGITS, 0.7, k=5)
    assert ids.tolist() == torch.argsort(p, descending=True)[:5].tolist()
    assert torch.allclose(ps.double(), p[ids], atol=1e-6)
    assert dist(LOGITS, Sampler.greedy())[0].tolist() == [int(LOGITS.argmax())]
    assert dist(LOGITS, Sampler.greedy())[1].tolist() == [1.0]
    assert len(dist(LOGITS, Sampler.multinomial(), top_n=3)[0]) == 3
    ids, ps = dist(LOGITS, Sampler.custom(lambda i, p: i[0], candidates=4))
    assert ids.tolist() == torch.argsort(LOGITS, descending=True)[:4].tolist()


def test_presets() -> None:
    assert Sampler.reasoning() == Sampler.top_k_top_p(0.6, 20, 0.95)
    assert Sampler.top_k_top_p(0.5, 3, 0.9) == Sampler(temperature=0.5, topk=3, topp=0.9)
    assert len({Sampler.reasoning(), Sampler.reasoning(), Sampler.greedy()}) == 2  # hashable values


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Sampler.multinomial(-0.1), "temperature"),
        (lambda: Sampler.multinomial(float("nan")), "temperature"),
        (lambda: Sampler.top_p(1.0, 0.0), "top_p"),
        (lambda: Sampler.top_p(1.0, 1.01), "top_p"),
        (lambda: Sampler.top_k(1.0, 0), "top_k"),
        (lambda: Sampler.top_k(1.0, 2.5), "top_k"),
        (lambda: Sampler.min_p(1.0, -0.01), "min_p"),
        (lambda: Sampler.min_p(1.0, 1.5), "min_p"),
        (lambda: Sampler.top_k_top_p(1.0, 0, 0.5), "top_k"),
        (lambda: Sampler.custom("not callable"), "callable"),
        (lambda: Sampler.custom(lambda i, p: i[0], candidates=0), "candidates"),
    ],
)
def test_parameter_validation(make, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_shape_errors() -> None:
    with pytest.raises(ValueError, match="logits"):
        sample(torch.zeros(2, 3, 4), Sampler.greedy())
    with pytest.raises(ValueError, match="samplers"):
        sample(torch.zeros(2, 3), [Sampler.greedy()])
    with pytest.raises(ValueError, match="no finite logits"):
        sample(torch.full((1, 3), float("-inf")), Sampler.multinomial())
    with pytest.raises(ValueError, match="generators"):
        sample(torch.zeros(2, 3), Sampler.multinomial(), [generator(0)])


def test_any_integer_seeds_a_generator_as_torch_would() -> None:
    """torch reads a seed as 64 unsigned bits and overflows past them; ours takes any int,
    the same stream wherever torch takes the seed itself."""
    import torch

    from engine.sampling import generator

    for seed in (0, 7, -5, 2**63 - 1, -(2**63), 2**64 - 1):
        ours = torch.rand(4, generator=generator(seed))
        assert torch.equal(ours, torch.rand(4, generator=torch.Generator().manual_seed(seed)))
    assert torch.equal(torch.rand(4, generator=generator(2**80 + 3)), torch.rand(4, generator=generator(3)))
