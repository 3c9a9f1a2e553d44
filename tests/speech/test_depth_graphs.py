"""CUDA-graph frame head (speech.depth_graphs: a whole frame per replay), rehearsed on the CPU.

``capture=False`` runs the captured frame eagerly through the same static buffers, padded
buckets, fixed-address KV cache and on-device sampler; only the capture itself needs a GPU
(tests/speech/test_speech_cuda.py). Codes are compared exactly; the sampler
(speech.frame_head.choose) is also checked against the distribution transformers samples."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from api.model_ref import load_model
from media import InvalidRequestError
from speech import SpeechModel
from speech.depth_graphs import DepthGraphs
from speech.frame_head import GREEDY, FrameRequest, Sampling, choose, draw_noise, row_settings

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


def _requests(levels: list[Sampling], seeds: list[int | None] | None = None) -> list[FrameRequest]:
    seeds = seeds if seeds is not None else list(range(len(levels)))
    return [
        FrameRequest(s, s, torch.Generator().manual_seed(seed) if seed is not None else None)
        for s, seed in zip(levels, seeds, strict=True)
    ]


MIXED = [  # one bucket, per-row settings: greedy, top-k, no top-k, top-k 1 (= greedy), hot
    GREEDY,
    Sampling(True, 0.7, 5),
    Sampling(True, 1.3, None),
    GREEDY,
    Sampling(True, 0.9, 1),
    Sampling(True, 2.5, 40),
]


@pytest.mark.parametrize("n", [1, 3, 8])
def test_greedy_batches_equal_plain(csm, graphed, n):
    """1, 3 (bucket 4: one padding row) and 8 requests at once: the same codes as without graphs."""
    calls = [
        dict(text=t, speaker=i % 3, max_duration=SECONDS, temperature=0) for i, t in enumerate(TEXTS[:n])
    ]
    graphs = graphed.head.graphs
    before, sampled = graphs.replays, graphs.sampled_replays
    before_bucket = graphs.bucket_frames.get(graphs.bucket(n), 0)
    plain = _codes(csm, calls)
    mine = _codes(graphed, calls)
    for a, b in zip(plain, mine, strict=True):
        assert len(a) == 5
        np.testing.assert_array_equal(a, b)
    # one replay per pass (a whole frame of every stream in it), never more than one per
    # frame of each stream; all greedy: the argmax graph only
    assert 5 <= graphs.replays - before <= n * 5
    assert graphs.sampled_replays == sampled
    assert graphs.bucket_frames.get(graphs.bucket(n), 0) > before_bucket  # n streams shared passes


def test_seeded_sampling_equals_plain(csm, graphed):
    calls = [
        dict(text=t, speaker=0, max_duration=SECONDS, temperature=0.9, top_k=20, seed=10 + i)
        for i, t in enumerate(TEXTS[:5])
    ]
    graphs = graphed.head.graphs
    sampled = graphs.sampled_replays
    plain = _codes(csm, calls)
    mine = _codes(graphed, calls)
    for a, b in zip(plain, mine, strict=True):
        np.testing.assert_array_equal(a, b)
    assert graphs.sampled_replays >= sampled + 5
    # and the sampled codes are not all greedy's (the sampled rows took their own draws)
    greedy = _codes(csm, [{**c, "temperature": 0, "seed": None} for c in calls])
    assert any(not np.array_equal(a, g) for a, g in zip(plain, greedy, strict=True))


def test_mixed_rows_in_one_bucket(graphed):
    """Six streams with their own settings in bucket 8: through the graph the codes equal
    the plain head's, each stream's equal its codes alone (graph and plain), greedy rows
    and the top-k 1 row equal the argmax, and no sampled code leaves the codebook."""
    head = graphed.head
    saved = head.graphs
    graphs = DepthGraphs(graphed.hf, max_batch=8, capture=False)
    torch.manual_seed(3)
    hidden = torch.randn(len(MIXED), graphed.hf.config.hidden_size)
    try:
        head.graphs = None
        plain = [r.codes for r in head.run(hidden, _requests(MIXED))]
        argmax = [r.codes for r in head.run(hidden, _requests([GREEDY] * len(MIXED)))]
        alone_plain = [head.run(hidden[i : i + 1], _requests([s], [i]))[0].codes for i, s in enumerate(MIXED)]
        head.graphs = graphs
        mine = [r.codes for r in head.run(hidden, _requests(MIXED))]
        alone = [head.run(hidden[i : i + 1], _requests([s], [i]))[0].codes for i, s in enumerate(MIXED)]
    finally:
        head.graphs = saved
    assert graphs.bucket_frames == {8: 1, 1: len(MIXED)} and graphs.sampled_replays == 5
    assert mine == plain == alone == alone_plain
    assert [mine[i] for i in (0, 3, 4)] == [argmax[i] for i in (0, 3, 4)]
    assert mine[1] != argmax[1] or mine[2] != argmax[2] or mine[5] != argmax[5]
    assert max(max(c) for c in mine) < graphed.codebook_size


def test_sampler_draws_transformers_distribution():
    """``choose``'s exponential race over one row of logits: the frequencies of 20,000
    seeded draws match softmax(top-k(logits / T)) as transformers' multinomial samples it
    (within 0.012 absolute, ~4 standard errors), with suppressed and filtered ids never drawn."""
    logits = torch.tensor([[2.0, 1.5, 0.3, 0.0, -0.5, 3.0, 1.0, -2.0]])
    suppress = torch.zeros(8, dtype=torch.bool)
    suppress[5] = True  # the largest logit, suppressed
    draws = 20_000
    gen = torch.Generator().manual_seed(0)
    noise = torch.empty(draws, 8).exponential_(generator=gen)
    settings = torch.tensor([[0.0, 0.8, 4.0]]).expand(draws, 3)
    codes = choose(logits.expand(draws, 8), suppress, settings, noise)
    freq = torch.bincount(codes, minlength=8).double() / draws
    scores = (logits[0].masked_fill(suppress, float("-inf")) / 0.8).double()
    kth = scores.topk(4).values[-1]
    expected = scores.masked_fill(scores < kth, float("-inf")).softmax(-1)
    assert (freq - expected).abs().max().item() < 0.012, (freq, expected)
    assert freq[5] == 0 and (freq[expected == 0] == 0).all()
    # a temperature past float32's range samples uniformly over the kept ids, never a suppressed one
    hot = row_settings([FrameRequest(GREEDY, Sampling(True, 1e39, None))], 8)[:, 1].expand(draws, 3)
    assert torch.isfinite(hot).all()
    uniform = torch.bincount(choose(logits.expand(draws, 8), suppress, hot, noise), minlength=8)
    assert uniform[5] == 0 and (uniform[~suppress].double() / draws - 1 / 7).abs().max().item() < 0.012
    # a greedy row in the same batch takes the argmax whatever its noise
    mixed = torch.tensor([[1.0, 1.0, 8.0], [0.0, 0.8, 4.0]])
    assert choose(logits.expand(2, 8), suppress, mixed, noise[:2])[0].item() == 0


def test_draws_come_from_each_streams_generator():
    """A sampled stream fills its (num_codebooks, V) block from its own generator, in one
    draw, whatever its neighbours; a greedy stream's block is left alone."""
    out = torch.full((3, 4, 5), -1.0)
    requests = _requests([Sampling(True, 0.9, None), GREEDY, Sampling(True, 0.5, 2)], [7, 8, 9])
    draw_noise(out, requests)
    assert torch.equal(out[0], torch.empty(4, 5).exponential_(generator=torch.Generator().manual_seed(7)))
    assert (out[1] == -1).all()
    assert torch.equal(out[2], torch.empty(4, 5).exponential_(generator=torch.Generator().manual_seed(9)))
    settings = row_settings(requests, 5)
    assert settings.tolist() == [
        [[0.0, 0.8999999761581421, 5.0], [0.0, 0.8999999761581421, 5.0]],
        [[1.0, 1.0, 5.0], [1.0, 1.0, 5.0]],
        [[0.0, 0.5, 2.0], [0.0, 0.5, 2.0]],
    ]


def test_larger_batches_fall_back_to_the_plain_path(graphed):
    head = graphed.head
    saved = head.graphs
    small = head.graphs = DepthGraphs(graphed.hf, max_batch=2, capture=False)
    try:
        torch.manual_seed(1)
        hidden = torch.randn(3, graphed.hf.config.hidden_size)
        assert not small.takes(3) and small.takes(2) and not small.takes(0)
        over = head.run(hidden, _requests([GREEDY] * 3))
        assert small.replays == 0  # three streams: the plain path
        fits = head.run(hidden[:2], _requests([GREEDY] * 2))
        assert small.replays == 1  # the whole frame, every codebook: one replay
        head.graphs = None
        assert [r.codes for r in over] == [r.codes for r in head.run(hidden, _requests([GREEDY] * 3))]
        assert [r.codes for r in fits] == [r.codes for r in head.run(hidden[:2], _requests([GREEDY] * 2))]
    finally:
        head.graphs = saved


def test_padding_rows_do_not_reach_real_rows(graphed):
    """Bucket 4 with 3 real rows (greedy and sampled), the padding row poisoned (NaN hidden
    state, NaN settings and noise): the real rows' codes and frame embeddings are
    bit-for-bit those with a clean padding row, and equal the plain head's (codes exactly,
    embeddings up to float rounding: a batch of 4 vs 3 in the matmuls)."""
    hf = graphed.hf
    graphs = DepthGraphs(hf, max_batch=4, capture=False)
    torch.manual_seed(2)
    hidden = torch.randn(3, hf.config.hidden_size)
    levels = [GREEDY, Sampling(True, 0.8, 10), Sampling(True, 1.1, None)]

    def through_graphs(poison: bool) -> tuple[torch.Tensor, torch.Tensor]:
        graphs.hidden[3].fill_(float("nan") if poison else 0.0)
        graphs.settings[3].fill_(float("nan") if poison else 1.0)
        graphs.noise[3].fill_(float("nan") if poison else 1.0)
        return graphs.frame(hidden, _requests(levels))

    clean, poisoned = through_graphs(False), through_graphs(True)
    assert graphs._kv[0][0][3, :, 0].isnan().all()  # the poison ran: the padding row's cache
    assert torch.equal(clean[0], poisoned[0]) and torch.equal(clean[1], poisoned[1])
    assert torch.isfinite(poisoned[1]).all()
    codes, embeds = graphed.head._frame(hidden, _requests(levels))
    assert torch.equal(poisoned[0], codes)
    torch.testing.assert_close(poisoned[1], embeds, rtol=1e-5, atol=1e-5)


def test_frame_and_construction_checks(graphed):
    hf = graphed.hf
    with pytest.raises(ValueError, match="CUDA"):
        DepthGraphs(hf, max_batch=4, capture=True)
    with pytest.raises(ValueError, match="max_batch"):
        DepthGraphs(hf, max_batch=0, capture=False)
    graphs = DepthGraphs(hf, max_batch=5, capture=False)
    assert graphs.buckets == [1, 2, 4, 5]
    assert graphs.suppress.tolist() == graphed.suppress.tolist()
    with pytest.raises(ValueError, match="hidden states"):
        graphs.frame(torch.zeros(2, hf.config.hidden_size), _requests([GREEDY]))
    with pytest.raises(ValueError, match="hidden states"):
        graphs.frame(torch.zeros(6, hf.config.hidden_size), _requests([GREEDY] * 6))
    graphs.warm()  # both frames (greedy, sampler) of every bucket run through the buffers
    assert graphs.replays == 0 and "capture=False" in repr(graphs)


def test_load_refuses_cuda_graphs_off_cuda(tiny_dir):
    with pytest.raises(InvalidRequestError, match="CUDA device"):
        SpeechModel.load(tiny_dir("tiny-csm"), device="cpu", cuda_graphs=8)
    with pytest.raises(InvalidRequestError, match=">= 0"):
        SpeechModel.load(tiny_dir("tiny-csm"), device="cpu", cuda_graphs=-1)
    # the served loader passes the option through (it used to drop it for speech models)
    with pytest.raises(InvalidRequestError, match="CUDA device"):
        load_model("tiny-csm", device="cpu", cuda_graphs=4)
