"""CUDA-graph depth decoder (speech.depth_graphs), rehearsed on the CPU.

``capture=False`` runs each captured step eagerly through the same static buffers, padded
buckets and fixed-address KV cache; only the capture itself needs a GPU
(tests/speech/test_speech_cuda.py). Codes are compared exactly."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from api.model_ref import load_model
from media import InvalidRequestError
from speech import SpeechModel
from speech.depth_graphs import DepthGraphs
from speech.frame_head import GREEDY, FrameRequest, Sampling
from speech.hf_cache import cache_keyword

SECONDS = 5 / 12.5  # five frames
TEXTS = [f"Voice {i} says something of its own." for i in range(8)]


@pytest.fixture(scope="module")
def graphed(tiny_dir):
    """tiny-csm with the rehearsal depth graphs (buckets 1, 2, 4, 8) installed."""
    model = SpeechModel.load(tiny_dir("tiny-csm"), device="cpu")
    model.head.graphs = DepthGraphs(model.hf, max_batch=8, capture=False)
    return model


def _codes(model: SpeechModel, calls: list[dict]) -> list[np.ndarray]:
    async def go() -> list:
        return await asyncio.gather(*(model.speak_async(**c) for c in calls))

    return [s.codes for s in asyncio.run(go())]


def _plain_depth(
    hf, hidden: torch.Tensor, first: torch.Tensor, codes: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Logits of every depth step, as FrameHead does without graphs (``codes[i]`` fed at step i+1)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.depth_decoder.config)
    ids = torch.stack([torch.zeros_like(first), first], dim=-1)
    out = []
    with torch.inference_mode():
        for i in range(hf.config.num_codebooks - 1):
            step = hf.depth_decoder(
                input_ids=ids,
                backbone_last_hidden_state=hidden if i == 0 else None,
                use_cache=True,
                logits_to_keep=1,
                **{cache_keyword(hf.depth_decoder): cache},
            )
            out.append(step.logits[:, -1].clone())
            ids = codes[i][:, None]
    return out


@pytest.mark.parametrize("n", [1, 3, 8])
def test_greedy_batches_equal_plain(csm, graphed, n):
    """1, 3 (bucket 4: one padding row) and 8 requests at once: the same codes as without graphs."""
    calls = [
        dict(text=t, speaker=i % 3, max_duration=SECONDS, temperature=0) for i, t in enumerate(TEXTS[:n])
    ]
    graphs = graphed.head.graphs
    before, before_bucket = graphs.replays, graphs.bucket_steps.get(graphs.bucket(n), 0)
    plain = _codes(csm, calls)
    mine = _codes(graphed, calls)
    for a, b in zip(plain, mine, strict=True):
        assert len(a) == 5
        np.testing.assert_array_equal(a, b)
    # every frame's depth steps ran through the graphs (fewer replays than frames x steps
    # means passes shared them)
    steps = graphed.num_codebooks - 1
    assert steps <= graphs.replays - before <= n * 5 * steps
    assert graphs.bucket_steps.get(graphs.bucket(n), 0) > before_bucket  # n streams shared passes


def test_seeded_sampling_equals_plain(csm, graphed):
    calls = [
        dict(text=t, speaker=0, max_duration=SECONDS, temperature=0.9, top_k=20, seed=10 + i)
        for i, t in enumerate(TEXTS[:5])
    ]
    plain = _codes(csm, calls)
    mine = _codes(graphed, calls)
    for a, b in zip(plain, mine, strict=True):
        np.testing.assert_array_equal(a, b)
    # and the sampled codes are not all greedy's (the sampled rows took their own draws)
    greedy = _codes(csm, [{**c, "temperature": 0, "seed": None} for c in calls])
    assert any(not np.array_equal(a, g) for a, g in zip(plain, greedy, strict=True))


def _requests(n: int, sampled: bool = False) -> list[FrameRequest]:
    level = Sampling(True, 0.8, 10) if sampled else GREEDY
    return [
        FrameRequest(level, level, torch.Generator().manual_seed(i) if sampled else None) for i in range(n)
    ]


def test_larger_batches_fall_back_to_the_plain_path(graphed):
    head = graphed.head
    saved = head.graphs
    small = head.graphs = DepthGraphs(graphed.hf, max_batch=2, capture=False)
    try:
        torch.manual_seed(1)
        hidden = torch.randn(3, graphed.hf.config.hidden_size)
        assert not small.takes(3) and small.takes(2) and not small.takes(0)
        over = head.run(hidden, _requests(3))
        assert small.replays == 0  # three streams: the plain path
        fits = head.run(hidden[:2], _requests(2))
        assert small.replays == graphed.num_codebooks - 1
        head.graphs = None
        assert [r.codes for r in over] == [r.codes for r in head.run(hidden, _requests(3))]
        assert [r.codes for r in fits] == [r.codes for r in head.run(hidden[:2], _requests(2))]
        # seeded sampled rows draw the same through the graphs (per-row generators)
        plain = [r.codes for r in head.run(hidden[:2], _requests(2, sampled=True))]
        head.graphs = small
        assert [r.codes for r in head.run(hidden[:2], _requests(2, sampled=True))] == plain
    finally:
        head.graphs = saved


def test_padding_rows_do_not_reach_real_rows(graphed):
    """Bucket 4 with 3 real rows, the padding row poisoned (NaN hidden state, a different
    code): the real rows' logits are bit-for-bit those with a clean padding row, finite, and
    the plain path's up to float rounding (a batch of 4 vs 3 in the matmuls), same argmax."""
    hf = graphed.hf
    graphs = DepthGraphs(hf, max_batch=4, capture=False)
    torch.manual_seed(2)
    hidden = torch.randn(3, hf.config.hidden_size)
    first = torch.randint(0, 60, (3,))
    codes = [torch.randint(0, 60, (3,)) for _ in range(graphs.steps)]
    plain = _plain_depth(hf, hidden, first, codes)

    def through_graphs(poison: bool) -> list[torch.Tensor]:
        out = []
        for i in range(graphs.steps):
            if poison:
                graphs.hidden[3].fill_(float("nan"))
                graphs.ids[3] = 63
            else:
                graphs.hidden[3].zero_()
                graphs.ids[3] = 0
            out.append(graphs.step(i, first if i == 0 else codes[i - 1], hidden if i == 0 else None).clone())
        return out

    clean, poisoned = through_graphs(False), through_graphs(True)
    assert graphs.hidden[3].isnan().all() and graphs.logits[3].isnan().all()  # the poison ran
    for c, p, ref in zip(clean, poisoned, plain, strict=True):
        assert c.shape == ref.shape == (3, graphs.vocab)
        assert torch.equal(c, p) and torch.isfinite(p).all()
        torch.testing.assert_close(p, ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(p.argmax(-1), ref.argmax(-1))


def test_step_and_construction_checks(graphed):
    hf = graphed.hf
    with pytest.raises(ValueError, match="CUDA"):
        DepthGraphs(hf, max_batch=4, capture=True)
    with pytest.raises(ValueError, match="max_batch"):
        DepthGraphs(hf, max_batch=0, capture=False)
    graphs = DepthGraphs(hf, max_batch=5, capture=False)
    assert graphs.buckets == [1, 2, 4, 5]
    with pytest.raises(ValueError, match="out of range"):
        graphs.step(graphs.steps, torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="hidden"):
        graphs.step(0, torch.zeros(1, dtype=torch.long))
    graphs.warm()  # every bucket and step runs through the buffers
    assert graphs.replays == 0 and "capture=False" in repr(graphs)


def test_load_refuses_cuda_graphs_off_cuda(tiny_dir):
    with pytest.raises(InvalidRequestError, match="CUDA device"):
        SpeechModel.load(tiny_dir("tiny-csm"), device="cpu", cuda_graphs=8)
    with pytest.raises(InvalidRequestError, match=">= 0"):
        SpeechModel.load(tiny_dir("tiny-csm"), device="cpu", cuda_graphs=-1)
    # the served loader passes the option through (it used to drop it for speech models)
    with pytest.raises(InvalidRequestError, match="CUDA device"):
        load_model("tiny-csm", device="cpu", cuda_graphs=4)
