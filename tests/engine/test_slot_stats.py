"""A forward pass's scoring slots (logprob(s), entropy, dist) answered from each row's
softmax statistics (engine.slots, engine.sampling_kernel.RowSoftmax): the same values as
the definitions in float64 torch, on rows that test the kernel's shortcuts (ties at and
past the k-th place, the top tokens outside the first blocks, -inf tokens, fewer finite
tokens than k, a temperature that rounds neighbours together, a flat row, a small
vocabulary), and rows it must leave to torch (NaN, +inf, all -inf)."""

from __future__ import annotations

import math

import pytest
import torch

from engine import sampling_kernel
from engine.slots import Slot, SlotDistribution, SlotEntropy, SlotLogprobs, SlotRequest, compute

V = 151_936
TOKENS = (0, 1, 7, 99, 5003, V - 1)


def _rows() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    rows = {
        "normal": torch.randn(V, generator=g) * 2,
        "peaked": torch.randn(V, generator=g) * 10,
        "flat": torch.zeros(V),
        "near flat": torch.randn(V, generator=g) * 0.01,
        "small vocab": torch.randn(1000, generator=g) * 3,
    }
    r = torch.randn(V, generator=g)
    r[::3] = -math.inf
    rows["a third -inf"] = r
    r = torch.randn(V, generator=g)
    r[5000:5010] = 20.0  # a tie at the top, past the first blocks
    r[90_000] = 20.0
    rows["ties at the top"] = r
    r = torch.randn(V, generator=g)
    r[:10] = 20.0
    rows["top in the first block"] = r
    r = torch.full((V,), -math.inf)
    r[7], r[99_999] = 1.0, 0.5
    rows["two finite tokens"] = r
    r = torch.randn(V, generator=g).clamp(max=3.0)  # many tokens tied at the max
    rows["clamped"] = r
    return rows


def _reference(
    row: torch.Tensor, temperature: float, k: int
) -> tuple[list[int], list[float], float, list[float]]:
    """dist by the definition (by logit / T descending, equal values by lower id, zero
    probabilities left out), entropy and logprobs in float64."""
    x = row.double()
    lsm = torch.log_softmax(x, dim=-1)
    entropy = float(-(lsm.exp() * lsm.nan_to_num(neginf=0.0)).sum())
    scaled = row.float() / temperature
    p = torch.softmax(scaled.double(), dim=-1)
    order = torch.sort(-scaled, stable=True).indices[:k].tolist()  # equal values: lower id first
    kept = [j for j in order if float(p[j]) > 0 and float(torch.tensor(float(p[j])).float()) > 0]
    return (
        kept,
        [float(p[j]) for j in kept],
        entropy,
        lsm[list(t for t in TOKENS if t < row.shape[0])].tolist(),
    )


@pytest.mark.skipif(not sampling_kernel.available(), reason="numba kernel unavailable")
@pytest.mark.parametrize("name", list(_rows()))
@pytest.mark.parametrize(("temperature", "k"), [(1.0, 8), (0.7, 5), (1.3, 1), (2.5, 40), (0.05, 3)])
def test_scoring_slots_equal_the_definitions(name, temperature, k):
    row = _rows()[name]
    tokens = tuple(t for t in TOKENS if t < row.shape[0])
    requests = [
        SlotRequest(0, Slot.dist(temperature, k)),
        SlotRequest(0, Slot.entropy()),
        SlotRequest(0, Slot.logprobs(tokens)),
    ]
    dist, entropy, logprobs = compute(requests, row[None].contiguous(), [0, 0, 0], None, [])
    ids, probs, want_entropy, want_logprobs = _reference(row, temperature, k)
    assert isinstance(dist, SlotDistribution) and dist.ids == ids
    assert dist.probs == pytest.approx(probs, rel=1e-5, abs=1e-9)
    assert isinstance(entropy, SlotEntropy) and entropy.value == pytest.approx(want_entropy, abs=1e-4)
    assert isinstance(logprobs, SlotLogprobs)
    assert logprobs.values == pytest.approx(want_logprobs, abs=1e-4)


@pytest.mark.skipif(not sampling_kernel.available(), reason="numba kernel unavailable")
def test_rows_in_one_call_equal_rows_alone_and_slots_alone():
    """Each row's answers depend on that row only: several rows and slots in one call give
    what each slot gives alone (a dist at another temperature or k than the row's first
    one included)."""
    rows = _rows()
    logits = torch.stack([rows["normal"], rows["peaked"], rows["a third -inf"]])
    slots = [
        Slot.dist(1.0, 8),
        Slot.entropy(),
        Slot.logprobs([1, 2, 3]),
        Slot.dist(0.7, 3),
        Slot.dist(1.0, 20),
    ]
    requests = [SlotRequest(r, s) for r in range(3) for s in slots]
    together = compute(requests, logits, [q.row for q in requests], None, [])
    alone = [compute([SlotRequest(0, q.slot)], logits[q.row][None], [0], None, [])[0] for q in requests]
    assert together == alone


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_row_without_a_finite_max_is_answered_by_torch(bad):
    row = torch.randn(V, generator=torch.Generator().manual_seed(1))
    row[10] = bad
    requests = [
        SlotRequest(0, Slot.entropy()),
        SlotRequest(0, Slot.logprobs([10, 11])),
        SlotRequest(0, Slot.dist(1.0, 3)),
    ]
    entropy, logprobs, dist = compute(requests, row[None], [0, 0, 0], None, [])
    lse = torch.logsumexp(row, dim=-1)
    assert math.isnan(entropy.value)
    torch.testing.assert_close(torch.tensor(logprobs.values), row[[10, 11]] - lse, equal_nan=True)
    assert isinstance(dist, SlotDistribution)
    # and a finite row beside it still gets the kernel's answers
    fine = torch.randn(V, generator=torch.Generator().manual_seed(2))
    both = compute(
        [SlotRequest(0, Slot.entropy()), SlotRequest(1, Slot.entropy())],
        torch.stack([row, fine]),
        [0, 1],
        None,
        [],
    )
    assert math.isnan(both[0].value)
    assert both[1] == compute([SlotRequest(0, Slot.entropy())], fine[None], [0], None, [])[0]


def test_the_torch_path_gives_the_same_answers(monkeypatch):
    """Without the kernel (no numba, or logits on a GPU) torch answers, to float rounding."""
    rows = _rows()
    logits = torch.stack([rows["normal"], rows["a third -inf"], rows["ties at the top"]])
    slots = [Slot.dist(1.0, 8), Slot.entropy(), Slot.logprobs([1, 2, 5003]), Slot.dist(0.7, 3)]
    requests = [SlotRequest(r, s) for r in range(3) for s in slots]
    rows_read = [q.row for q in requests]
    kernel = compute(requests, logits, rows_read, None, [])
    monkeypatch.setattr(sampling_kernel, "available", lambda: False)
    plain = compute(requests, logits, rows_read, None, [])
    for a, b in zip(kernel, plain, strict=True):
        if isinstance(a, SlotDistribution):
            assert a.ids == b.ids and a.probs == pytest.approx(b.probs, rel=1e-5)
        elif isinstance(a, SlotEntropy):
            assert a.value == pytest.approx(b.value, abs=1e-4)
        else:
            assert a.values == pytest.approx(b.values, abs=1e-4)
