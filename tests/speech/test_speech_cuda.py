"""Speech on a GPU (skipped without one): CUDA-graph depth decoder against the eager CUDA path.

Real capture and replay (speech.depth_graphs): ``SpeechModel.load(cuda_graphs=8)`` captures
every depth step of buckets 1, 2, 4 and 8 at load; batches of 1, 3 (a padding row) and 8
requests, greedy and seeded sampled, give the codes the same model gives without graphs.
The CPU rehearsal of the same code is tests/speech/test_depth_graphs.py."""

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


def _codes(model, calls: list[dict]) -> list[np.ndarray]:
    async def go() -> list:
        return await asyncio.gather(*(model.speak_async(**c) for c in calls))

    return [s.codes for s in asyncio.run(go())]


def test_captured_at_load(pair):
    _, graphed = pair
    graphs = graphed.head.graphs
    assert graphs.capture and graphs.buckets == [1, 2, 4, 8]
    assert graphs.captures == len(graphs.buckets) * (graphed.num_codebooks - 1), graphs


@pytest.mark.parametrize("n", [1, 3, 8])
def test_cuda_graph_depth_equals_eager(pair, n):
    eager, graphed = pair
    graphs = graphed.head.graphs
    captures, replays = graphs.captures, graphs.replays
    greedy = [
        dict(text=t, speaker=i % 3, max_duration=SECONDS, temperature=0) for i, t in enumerate(TEXTS[:n])
    ]
    sampled = [dict(c, temperature=0.9, top_k=20, seed=100 + i) for i, c in enumerate(greedy)]
    for calls in (greedy, sampled):
        for a, b in zip(_codes(eager, calls), _codes(graphed, calls), strict=True):
            assert len(a) == 6
            np.testing.assert_array_equal(a, b)
    assert graphs.replays > replays and graphs.captures == captures  # replayed, nothing captured late
