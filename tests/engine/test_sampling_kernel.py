"""The CPU sampling kernel (engine.sampling_kernel): exact kept sets, exact draws, no sort.

What "exact" is checked against:
- kept sets: `engine.sampling.probs` (transformers' warper chain, full sort) on rows without
  tied logits, token for token; and, on rows full of ties, a float64 reference written here
  from the definitions with the kernel's one extra rule (equal logits straddling a top-p
  boundary are kept highest id first), which transformers leaves to its unstable sort;
- draws: the torch inverse-CDF path (`_filter` + `_draw`) given the same uniforms, token for
  token (the kernel sums the same probabilities in another order, so a draw could differ only
  for a uniform within ~1e-7 of a CDF step: none of the fixed-seed draws here is);
- distributions: chi-square goodness of fit with p > 1e-6 (a correct sampler fails for at
  most one seed in a million; these seeds are fixed) and exact zero counts outside the kept
  set, over vocabularies where the kept set is far larger than any candidate window (a flat
  row whose nucleus holds 4,500 of 5,000 tokens, the tiny model's own 151,936-token row).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import sampling_kernel
from engine.sampling import Sampler, _draw, _filter, generator, probs, sample

pytestmark = pytest.mark.skipif(not sampling_kernel.available(), reason="numba kernel unavailable")
DELTA = 1e-6


def kernel_kept(logits: torch.Tensor, s: Sampler) -> np.ndarray:
    rows = logits.reshape(-1, logits.shape[-1]).float()
    n = rows.shape[0]
    return sampling_kernel.kept_masks(
        rows,
        np.full(n, s.temperature, np.float32),
        np.full(n, s.topk or 0, np.int64),
        np.full(n, s.topp, np.float64),
        np.full(n, s.minp, np.float64),
    )


def kernel_draw(logits: torch.Tensor, s: Sampler, u: torch.Tensor) -> torch.Tensor:
    n = logits.shape[0]
    return torch.from_numpy(
        sampling_kernel.sample_rows(
            logits,
            np.full(n, s.temperature, np.float32),
            np.full(n, s.topk or 0, np.int64),
            np.full(n, s.topp, np.float64),
            np.full(n, s.minp, np.float64),
            u.numpy(),
        )
    )


def reference_kept(row: torch.Tensor, s: Sampler) -> np.ndarray:
    """The definitions in float64: order by value descending, then id descending; top-k keeps
    values >= the k-th largest; top-p keeps a token while the mass before it is < p (over
    top-k's set); min-p keeps probability >= min_p * the top one."""
    t = (row.float() / torch.tensor(s.temperature, dtype=torch.float32)).double()
    v = t.shape[0]
    order = sorted(range(v), key=lambda j: (-float(t[j]), -j))
    q = torch.softmax(t, 0)
    keep = torch.ones(v, dtype=torch.bool)
    if s.topk is not None and s.topk < v:
        keep &= t >= t[order[s.topk - 1]]
    if s.topp < 1:
        mass = float(q[keep].sum())
        before, nucleus = 0.0, torch.zeros(v, dtype=torch.bool)
        for j in order:
            if not keep[j]:
                continue
            if before >= s.topp * mass:
                break
            nucleus[j] = True
            before += float(q[j])
        keep &= nucleus
    if s.minp > 0:
        keep &= q >= s.minp * q.max()
    return keep.numpy()


def cases(seed: int, count: int, vocab: int, ties: bool):
    g = torch.Generator().manual_seed(seed)
    for i in range(count):
        v = int(torch.randint(2, vocab, (1,), generator=g))
        row = torch.randn(v, generator=g) * float(torch.rand(1, generator=g) * 6 + 0.05)
        if ties:
            row = (row * 2).round() / 2
        t = float(torch.rand(1, generator=g)) * 1.5 + 0.1
        k = int(torch.randint(1, v + 2, (1,), generator=g)) if i % 2 else None
        p = float(torch.rand(1, generator=g)) * 0.999 + 0.001 if i % 5 else 1.0
        m = float(torch.rand(1, generator=g)) * 0.5 if i % 4 == 0 else 0.0
        yield row, Sampler(temperature=t, topk=k, topp=p, minp=m)


def test_kept_sets_equal_the_reference_warpers_without_ties() -> None:
    checked = 0
    for row, s in cases(seed=11, count=300, vocab=700, ties=False):
        want = (probs(row, s)[0] > 0).numpy()
        got = kernel_kept(row, s)[0]
        assert np.array_equal(got, want), (s, np.flatnonzero(got != want))
        checked += 1
    assert checked == 300


def test_kept_sets_with_ties_follow_the_definitions() -> None:
    for row, s in cases(seed=12, count=200, vocab=400, ties=True):
        want = reference_kept(row, s)
        got = kernel_kept(row, s)[0]
        assert np.array_equal(got, want), (s, np.flatnonzero(got != want))
        # Same size as transformers' set: only which of the tied tokens may differ.
        assert got.sum() == int((probs(row, s)[0] > 0).sum())


def test_draws_equal_the_torch_path_for_the_same_uniforms() -> None:
    """The same inverse-CDF draw as engine.sampling's torch code for the same uniform. The
    two exps (the kernel's polynomial, torch's) differ by an ulp here and there, so a draw
    may differ only where ``u`` falls within float rounding of a step of the CDF between
    the two tokens (relative 2e-6 of the kept mass: a few float32 roundings of a sum of
    ~3,000 terms), and rarely (here 1 in 4,800 draws)."""
    g = torch.Generator().manual_seed(13)
    differing = 0
    for row, s in cases(seed=13, count=120, vocab=3000, ties=False):
        rows = row.expand(40, -1).contiguous()
        u = torch.rand(40, generator=g, dtype=torch.float64)
        kept, ids = _filter(rows, [s] * 40)
        p = kept.softmax(dim=-1)
        pos = _draw(p, u)
        want = pos if ids is None else ids.gather(1, pos.unsqueeze(1)).squeeze(1)
        got = kernel_draw(rows, s, u)
        for r in (got != want).nonzero().flatten().tolist():
            differing += 1
            got_pos = int(got[r]) if ids is None else int((ids[r] == got[r]).nonzero()[0])
            lo, hi = sorted((int(pos[r]), got_pos))
            cdf = p[r].double().cumsum(0)
            x = float(u[r]) * float(cdf[-1])
            step = float((cdf[lo:hi] - x).abs().min())  # the steps between the two tokens
            assert step <= 2e-6 * float(cdf[-1]), (s, r, step)
    assert differing <= 4, differing


def test_flat_row_whose_nucleus_exceeds_any_candidate_window() -> None:
    """1,500 equal logits and top-p 0.9: exactly the 1,350 highest ids are kept (ties by
    highest id), more than the 1,024 candidates a top-k window would take; the draws are
    uniform over them (chi-square over 27 equal-probability buckets)."""
    v, n = 1500, 3000
    s = Sampler.top_p(1.0, 0.9)
    row = torch.zeros(v)
    kept = kernel_kept(row, s)[0]
    assert kept.sum() == 1350 and kept[150:].all() and not kept[:150].any()
    toks = sample(row.expand(n, -1), s, generator(0))
    counts = torch.bincount(toks, minlength=v).double()
    assert counts[:150].sum() == 0
    buckets = counts[150:].reshape(27, 50).sum(1)
    e = n / 27
    stat = float(((buckets - e) ** 2 / e).sum())
    df_half = torch.tensor(13.0, dtype=torch.float64)  # (27 - 1) / 2
    assert float(torch.special.gammaincc(df_half, torch.tensor(stat / 2, dtype=torch.float64))) > DELTA


def test_the_tiny_models_own_row() -> None:
    """A 151,936-token row shaped like the tiny model's (nearly flat: top-p 0.9 keeps ~86% of
    it): the same set as the full sort, and the draws are the torch path's."""
    g = torch.Generator().manual_seed(14)
    row = torch.randn(151_936, generator=g) * 0.16
    for s in (Sampler.top_p(0.8, 0.9), Sampler.min_p(1.0, 0.5), Sampler.top_k_top_p(0.7, 5000, 0.5)):
        want = (probs(row, s)[0] > 0).numpy()
        assert np.array_equal(kernel_kept(row, s)[0], want)
    s = Sampler.top_p(0.8, 0.9)
    u = torch.rand(8, generator=g, dtype=torch.float64)
    kept, _ = _filter(row[None], [s])
    want = _draw(kept.softmax(dim=-1).expand(8, -1), u)
    assert torch.equal(kernel_draw(row.expand(8, -1).contiguous(), s, u), want)


def test_wide_rows_masked_tokens_and_low_precision() -> None:
    """Logits spanning far more than the bins' 64 units (logit bias -100), -inf (masked)
    tokens, bfloat16 input: sets equal the reference, draws never reach a masked token."""
    g = torch.Generator().manual_seed(15)
    row = torch.randn(3000, generator=g) * 3
    row[::7] -= 100.0
    row[::11] = float("-inf")
    for s in (
        Sampler.top_p(0.5, 0.999),
        Sampler.min_p(0.3, 1e-30),
        Sampler.multinomial(0.2),
        Sampler.top_k(1.0, 2000),
    ):
        want = (probs(row, s)[0] > 0).numpy()
        assert np.array_equal(kernel_kept(row, s)[0], want), s
        toks = sample(row.expand(2000, -1), s, generator(1))
        assert torch.isfinite(row[toks]).all()
    half = row.to(torch.bfloat16)  # rounding makes ties: the reference with the tie rule
    s = Sampler.top_p(1.0, 0.9)
    assert np.array_equal(kernel_kept(half.float(), s)[0], reference_kept(half.float(), s))
    assert sample(half.expand(50, -1), s, generator(3)).shape == (50,)


def test_chi_square_through_the_kernel_on_a_peaked_vocabulary() -> None:
    """Each filter's distribution against its float64 definition (renormalised over the
    reference kept set) on a 300-token vocabulary."""
    g = torch.Generator().manual_seed(16)
    row = torch.randn(300, generator=g) * 2.5
    n = 40_000
    for s in (
        Sampler.top_p(0.9, 0.8),
        Sampler.top_k(1.2, 25),
        Sampler.min_p(1.0, 0.05),
        Sampler.top_k_top_p(0.7, 40, 0.9),
    ):
        keep = torch.from_numpy(reference_kept(row, s))
        p = torch.where(keep, torch.softmax(row.double() / s.temperature, 0), 0.0)
        p = p / p.sum()
        counts = torch.bincount(sample(row.expand(n, -1), s, generator(2)), minlength=300).double()
        assert counts[~keep].sum() == 0
        e = n * p[keep]
        stat = float(((counts[keep] - e) ** 2 / e).sum())
        df = int(keep.sum()) - 1
        pvalue = float(
            torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2))
        )
        assert pvalue > DELTA, (s, pvalue)


def test_unsampleable_rows_are_marked_not_raised() -> None:
    rows = torch.zeros(4, 50)
    rows[1] = float("nan")
    rows[2] = float("-inf")
    rows[3, 7] = float("inf")
    u = torch.full((4,), 0.5, dtype=torch.float64)
    got = kernel_draw(rows, Sampler.top_p(1.0, 0.9), u).tolist()
    assert got[1:] == [-1, -1, -1] and 0 <= got[0] < 50
    with pytest.raises(ValueError, match="no finite logits"):
        sample(rows[1:2], Sampler.top_p(1.0, 0.9))


def test_a_top_p_row_costs_little_more_than_plain_temperature() -> None:
    """Not a timing: the work is bounded because only the cut's bin is sorted. The flat
    151,936-token row's top-p bin holds a few dozen tokens, not the vocabulary."""
    row = torch.randn(151_936, generator=torch.Generator().manual_seed(17)) * 0.16
    t = row / 0.8
    width = min(1 / 64, float(t.max() - t.min()) / (sampling_kernel.BINS - 1))
    per_bin = torch.bincount(((t.max() - t) / width).long().clamp(max=sampling_kernel.BINS - 1))
    assert int(per_bin.max()) < 200
    assert math.isfinite(width)


def test_a_batch_equals_its_rows_sampled_alone() -> None:
    """A call of many rows (split over two threads where there are two cores) draws what
    each row draws alone, with its own sampler and uniform; one NaN or +inf anywhere in a
    row (here past the last whole block of 64) marks that row, and only it."""
    g = torch.Generator().manual_seed(18)
    n, v = 13, 1000
    rows = torch.randn(n, v, generator=g) * torch.linspace(0.1, 6.0, n)[:, None]
    rows[3, 990] = float("nan")
    rows[8, 997] = float("inf")
    rows[5, ::9] = float("-inf")
    rows[5, ::13] -= 100.0
    temperature = np.linspace(0.1, 2.0, n).astype(np.float32)
    top_k = np.where(np.arange(n) % 3 == 0, 40, 0).astype(np.int64)
    top_p = np.where(np.arange(n) % 2 == 0, 0.8, 1.0)
    min_p = np.where(np.arange(n) % 4 == 1, 0.05, 0.0)
    u = torch.rand(n, generator=g, dtype=torch.float64).numpy()
    together = sampling_kernel.sample_rows(rows, temperature, top_k, top_p, min_p, u)
    alone = [
        int(
            sampling_kernel.sample_rows(
                rows[i : i + 1], *(a[i : i + 1] for a in (temperature, top_k, top_p, min_p, u))
            )[0]
        )
        for i in range(n)
    ]
    assert together.tolist() == alone
    assert [i for i in range(n) if together[i] < 0] == [3, 8]
    assert all(torch.isfinite(rows[i, together[i]]) for i in range(n) if i not in (3, 8))


def test_the_kernels_constants_are_the_modules() -> None:
    """The compiled code reads its own copies (``engine/sampling_kernel_jit.py``, the file
    numba's cache is stamped with); they must be the ones the module documents."""
    from engine import sampling_kernel_jit

    assert (sampling_kernel_jit.BINS, sampling_kernel_jit.WIDEST) == (
        sampling_kernel.BINS,
        sampling_kernel.WIDEST,
    )


_NEW_PROCESS = """
import json, time
from engine import sampling_kernel
start = time.perf_counter()
sampling_kernel.warm_in_background()
assert sampling_kernel.wait_warm(300)
kernels = sampling_kernel._get()
print(json.dumps({
    "seconds": time.perf_counter() - start,
    "hits": sum(sum(k.stats.cache_hits.values()) for k in kernels.values()),
    "misses": sum(sum(k.stats.cache_misses.values()) for k in kernels.values()),
}))
"""


def _cache_files() -> dict[str, int]:
    """The kernels' files in numba's cache directory: name -> mtime (ns)."""
    directory = Path(sampling_kernel._get()["batch"].stats.cache_path)
    return {p.name: p.stat().st_mtime_ns for p in directory.glob("sampling_kernel_jit.*")}


def test_a_new_process_loads_the_kernels_from_numbas_cache() -> None:
    """Kernels defined inside a function (as they were) missed numba's disk cache in every
    process: a closure holding another jitted function pickles it with a fresh uuid, which
    is part of the cache key. So each start compiled again (7-15 s here) and added 11 files
    to the cache. Module-level kernels load: after this process's warm-up, a new process
    warming as a server does compiles nothing (numba's own hit/miss counts) and writes no
    file (~8 s here, mostly torch's import)."""
    sampling_kernel._warm()  # this process's compile (or load) saves what the cache lacks
    before = _cache_files()
    assert before
    run = subprocess.run(
        [sys.executable, "-c", _NEW_PROCESS],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["misses"] == 0 and got["hits"] >= 2, got
    assert _cache_files() == before
