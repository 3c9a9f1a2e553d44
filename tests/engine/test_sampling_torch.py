"""The torch sampling path (what runs on a GPU): filtered rows drawn from their top
candidates when the kept set provably lies inside them, else from the whole row; either
way the same tokens as the whole-row reference (`_filter` + `_draw`) for the same uniforms.
Run here on CPU tensors, calling the torch path directly (the CPU itself uses the kernel)."""

from __future__ import annotations

import pytest
import torch

from engine import sampling
from engine.sampling import Sampler, _draw, _filter, _sample_torch, _window_draw

SAMPLERS = [
    Sampler.top_p(0.8, 0.9),
    Sampler.top_p(1.0, 0.3),
    Sampler.top_k(0.7, 20),
    Sampler.min_p(1.0, 0.2),
    Sampler.top_k_top_p(0.6, 40, 0.95),
    Sampler(temperature=1.1, topk=50, topp=0.8, minp=0.1),
    Sampler.multinomial(0.9),
]


def reference(scores: torch.Tensor, samplers: list[Sampler], u: torch.Tensor) -> torch.Tensor:
    kept, ids = _filter(scores, samplers)
    out = _draw(kept.softmax(dim=-1), u)
    return out if ids is None else ids.gather(1, out.unsqueeze(1)).squeeze(1)


@pytest.mark.parametrize("window", [64, 1024])
def test_same_tokens_as_the_whole_row(monkeypatch, window: int) -> None:
    monkeypatch.setattr(sampling, "WINDOW", window)
    g = torch.Generator().manual_seed(21)
    for scale in (0.2, 2.0, 6.0):  # flat rows (the window misses), peaked rows (it holds)
        scores = torch.randn(len(SAMPLERS) * 6, 3000, generator=g) * scale
        samplers = SAMPLERS * 6
        u = torch.rand(len(samplers), generator=g, dtype=torch.float64)
        assert torch.equal(_sample_torch(scores, samplers, u), reference(scores, samplers, u))


def test_the_window_holds_peaked_rows_and_refuses_flat_ones() -> None:
    g = torch.Generator().manual_seed(22)
    s = [Sampler.top_p(0.8, 0.9)] * 4
    u = torch.rand(4, generator=g, dtype=torch.float64)
    peaked = torch.randn(4, 5000, generator=g) * 6
    _, ok = _window_draw(peaked, s, u, 256)
    assert ok.all()
    flat = torch.zeros(4, 5000)  # the nucleus holds 4,500 tokens: never inside 256
    _, ok = _window_draw(flat, s, u, 256)
    assert not ok.any()
    assert set(_sample_torch(flat, s, u).tolist()) <= set(range(5000))
    tie = torch.randn(1, 3000, generator=g) * 6
    tie[0, tie[0].topk(300).indices[250:]] = tie[0].topk(300).values[249]  # ties across the window's edge
    _, ok = _window_draw(tie, [Sampler.top_k(1.0, 250)], u[:1], 256)
    assert not ok.any()  # the top-k set spills past the window: the whole row decides
