"""Speech on a GPU (skipped without one): every CUDA graph of a speech pass against eager CUDA.

Real capture and replay. The frame head (speech.depth_graphs: codebook 0, every depth step
with its on-device code choice and the frame embedding, one replay per pass):
``SpeechModel.load(cuda_graphs=8)`` on the tiny CSM in float32 captures the greedy and the
sampler graph of buckets 1, 2, 4 and 8 at load; batches of 1, 3 (a padding row) and 8
requests, greedy and seeded sampled, give the codes the same model gives without graphs.
The backbone's frame passes (engine.decode_graphs with ``inputs="embeds"``, through
speech.backbone.backbone_graphs) need flashinfer (bfloat16, 64-wide heads): a random CSM
variant of that shape, graphs against the same model eager on flashinfer, greedy and
seeded. The tiny CSM in float32 keeps eager backbone passes (torch attention).
The CPU rehearsals of the same code are tests/speech/test_depth_graphs.py and
tests/speech/test_backbone_graphs.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

SECONDS = 6 / 12.5  # six frames
TEXTS = [f"Voice {i} says something of its own." for i in range(8)]


@pytest.fixture(scope="module")
def pair(tiny_dir):
    from speech import SpeechModel

    kw = {"device": "cuda", "dtype": torch.float32, "attention": "torch", "kv_pages": 64}
    return SpeechModel.load(tiny_dir("tiny-csm"), **kw), SpeechModel.load(
        tiny_dir("tiny-csm"), cuda_graphs=8, **kw
    )


@pytest.fixture(scope="module")
def head64_pair(tiny_dir, tmp_path_factory):
    """A random CSM whose backbone has 64-wide heads (flashinfer's kernels), in bfloat16 on
    flashinfer: (eager, with cuda_graphs=8)."""
    pytest.importorskip("flashinfer")
    from fixtures.tiny_csm import build_variant
    from speech import SpeechModel

    path = build_variant(
        tmp_path_factory.mktemp("csm-head64"),
        tiny_dir("tiny-csm"),
        seed=11,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
    )
    kw = {"device": "cuda", "dtype": torch.bfloat16, "attention": "flashinfer", "kv_pages": 64}
    return SpeechModel.load(path, **kw), SpeechModel.load(path, cuda_graphs=8, **kw)


def _codes(model, calls: list[dict]) -> list[np.ndarray]:
    async def go() -> list:
        return await asyncio.gather(*(model.speak_async(**c) for c in calls))

    return [s.codes for s in asyncio.run(go())]


def _calls(n: int) -> tuple[list[dict], list[dict]]:
    greedy = [
        dict(text=t, speaker=i % 3, max_duration=SECONDS, temperature=0) for i, t in enumerate(TEXTS[:n])
    ]
    sampled = [dict(c, temperature=0.9, top_k=20, seed=100 + i) for i, c in enumerate(greedy)]
    return greedy, sampled


def test_captured_at_load(pair):
    _, graphed = pair
    graphs = graphed.head.graphs
    assert graphs.capture and graphs.buckets == [1, 2, 4, 8]
    assert graphs.captures == 2 * len(graphs.buckets), graphs  # greedy and sampler, per bucket
    assert graphed.runner.graphs is None  # float32 on torch attention: eager backbone passes


@pytest.mark.parametrize("n", [1, 3, 8])
def test_cuda_graph_frames_equal_eager(pair, n):
    eager, graphed = pair
    graphs = graphed.head.graphs
    captures, replays, sampled_replays = graphs.captures, graphs.replays, graphs.sampled_replays
    greedy, sampled = _calls(n)
    for calls in (greedy, sampled):
        for a, b in zip(_codes(eager, calls), _codes(graphed, calls), strict=True):
            assert len(a) == 6
            np.testing.assert_array_equal(a, b)
    # one replay per pass: at most a stream's frames (6) per stream, both runs together
    assert 2 * 6 <= graphs.replays - replays <= 2 * 6 * n
    assert graphs.sampled_replays - sampled_replays >= 6
    assert graphs.captures == captures  # replayed, nothing captured late


def test_backbone_graphs_captured_at_load(head64_pair):
    _, graphed = head64_pair
    g = graphed.runner.graphs
    assert g is not None and g.capture and g.inputs == "embeds" and g.buckets == [1, 2, 4, 8]
    assert g.captures == len(g.buckets), g
    assert graphed.head.graphs.captures == 2 * len(g.buckets)
    assert graphed.capacity.num_pages == graphed.pool.num_pages - 1  # the scratch page


@pytest.mark.parametrize("n", [1, 3, 8])
def test_cuda_graph_backbone_equals_eager(head64_pair, n):
    """Backbone and frame head from graphs against both eager on flashinfer (bfloat16:
    the same kernels on the same rows; the engine's decode graphs are held to the same
    exact greedy tokens in tests/engine/test_cuda.py)."""
    eager, graphed = head64_pair
    g = graphed.runner.graphs
    captures, replays = g.captures, g.replays
    greedy, sampled = _calls(n)
    for calls in (greedy, sampled):
        for a, b in zip(_codes(eager, calls), _codes(graphed, calls), strict=True):
            assert len(a) == 6
            np.testing.assert_array_equal(a, b)
    assert g.replays - replays >= 2 * 5  # frames 2..6 of both runs: backbone frame passes
    assert g.captures == captures
    assert graphed.pool.stats().in_use == 1  # only the scratch page stays taken
