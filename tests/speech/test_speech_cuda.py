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


def _check_passes_against_eager(model) -> list[float]:
    """Wrap the backbone graphs: after each pass they replay, run the same steps through the
    runner's eager path (graphs off, a head that only records) and compare the final hidden
    states of the pass's rows. Both read the same earlier K/V (the eager run rewrites the
    pass's own slots with its values, which the next pass then reads in both paths), so the
    rows differ only by bfloat16 rounding of different kernels. Returns the max abs
    difference per pass (fills as the model runs)."""
    runner, graphs = model.runner, model.runner.graphs
    replay = graphs.run
    diffs: list[float] = []

    class Recorder:
        def run(self, hidden, requests):
            seen.append(hidden.float().clone())
            return [None] * len(requests)

    seen: list[torch.Tensor] = []

    def run(steps):
        out = replay(steps)
        mine = graphs.hidden[: len(steps)].float().clone()
        head, runner.head, runner.graphs = runner.head, Recorder(), None
        try:
            runner.run(list(steps))
        finally:
            runner.head, runner.graphs = head, graphs
        eager = seen.pop()
        torch.testing.assert_close(mine, eager, atol=6e-2, rtol=3e-2)
        diffs.append((mine - eager).abs().max().item())
        return out

    graphs.run = run
    return diffs


@pytest.mark.parametrize("n", [1, 3, 8])
def test_cuda_graph_backbone_equals_eager(head64_pair, n):
    """Backbone and frame head from graphs against both eager on flashinfer, bfloat16.
    Every replayed backbone pass's hidden states equal an eager run of the same steps to
    bfloat16 rounding (a wrong page table, a padding row leaking or a stale embedding
    buffer differ by O(1)). The codes: at least 90% equal to the eager model's (a random
    checkpoint's near-tied logits can flip an argmax on bfloat16 rounding, after which a
    stream's frames part ways; a broken graph agrees on ~1/64)."""
    eager, graphed = head64_pair
    g = graphed.runner.graphs
    captures, replays = g.captures, g.replays
    diffs = _check_passes_against_eager(graphed)
    try:
        greedy, sampled = _calls(n)
        for calls in (greedy, sampled):
            theirs, ours = np.stack(_codes(eager, calls)), np.stack(_codes(graphed, calls))
            assert ours.shape == theirs.shape == (n, 6, graphed.num_codebooks)
            same = (ours == theirs).mean()
            assert same >= 0.9, f"{same:.1%} of the codes equal eager's; max pass difference {max(diffs)}"
    finally:
        del g.run  # the instance wrapper
    assert g.replays - replays >= 2 * 5 and len(diffs) >= 2 * 5  # frames 2..6 of both runs
    assert g.captures == captures
    assert graphed.pool.stats().in_use == 1  # only the scratch page stays taken
