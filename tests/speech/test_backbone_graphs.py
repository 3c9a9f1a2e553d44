"""The speech backbone's frame passes from CUDA graphs (engine.decode_graphs with
``inputs="embeds"``, wired by speech.backbone.backbone_graphs), rehearsed on the CPU.

The models attend through the stand-in flashinfer of tests/engine/fake_flashinfer.py (the
graph decode wrappers' fixed page-table buffers read at run time, as a replayed kernel
does) and ``capture=False`` runs each bucket's function eagerly through the static
embeddings / hidden-state buffers, padded buckets and scratch page; only the capture itself
needs a GPU (tests/speech/test_speech_cuda.py). Codes are compared exactly; hidden states
to 1e-5 absolute and relative (they are bit-for-bit equal on this CPU today; float32 allows
a padded batch of B rows and the plain pass of n rows to differ in how a BLAS blocks their
sums, ~1e-7 at these sizes, and the stand-in attends per request the same way in both)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
import pytest
import torch

from engine.attention_flashinfer import FlashInferBackend
from engine.decode_graphs import DecodeGraphs
from engine.forward import StepInput
from speech import SpeechModel
from speech.backbone import backbone_graphs
from speech.depth_graphs import DepthGraphs
from tests.engine.fake_flashinfer import installed

SECONDS = 5 / 12.5  # five frames
TEXTS = [f"Voice {i} reads a line of its own." for i in range(8)]


@pytest.fixture(scope="module")
def fake_flashinfer():
    with installed() as fake:
        yield fake


def _on_fake(tiny_dir) -> SpeechModel:
    model = SpeechModel.load(tiny_dir("tiny-csm"), device="cpu", attention="torch", warm_up_frames=False)
    model.runner.backend = FlashInferBackend("cpu", workspace_bytes=1024, head_dims=None)
    model.attention_backend = "flashinfer"
    return model


@pytest.fixture(scope="module")
def pair(fake_flashinfer, tiny_dir):
    """(the CSM on the stand-in flashinfer, the same with backbone and frame-head graphs)."""
    plain, graphed = _on_fake(tiny_dir), _on_fake(tiny_dir)
    graphed.runner.graphs = backbone_graphs(graphed.runner, 8, capture=False)
    graphed.head.graphs = DepthGraphs(graphed.hf, 8, capture=False)
    return plain, graphed


def _speak(model: SpeechModel, calls: list[dict]) -> list[np.ndarray]:
    async def go() -> list:
        return await asyncio.gather(*(model.speak_async(**c) for c in calls))

    return [s.codes for s in asyncio.run(go())]


def _recording(model: SpeechModel) -> Callable[[], list[list[torch.Tensor]]]:
    """What gives, per request in the order prepared, the hidden states the frame head received for
    it, frame by frame (instance wrappers of ``prepare`` and the head's ``run``; the
    passes group streams as their timing falls, so rows are matched by request)."""
    order: list[object] = []
    rows: dict[int, list[torch.Tensor]] = {}
    prepare, run = model.prepare, model.head.run

    def prepared(*args, **kwargs):
        job = prepare(*args, **kwargs)
        order.append(job.request)
        return job

    def ran(hidden, requests):
        for h, r in zip(hidden, requests, strict=True):
            rows.setdefault(id(r), []).append(h.clone())
        return run(hidden, requests)

    model.prepare, model.head.run = prepared, ran  # type: ignore[method-assign]
    return lambda: [rows.get(id(r), []) for r in order]


@pytest.mark.parametrize("n", [1, 3, 8])
def test_frame_passes_equal_plain(csm, pair, n):
    """1, 3 (bucket 4: a padding row) and 8 streams, greedy then seeded sampled: the codes
    of the graphed model equal the plain one's and (greedy) the torch backend's; every
    frame pass after the prompts' prefill replayed the backbone, and the frame head saw
    the same hidden states (to 1e-5, see the module doc)."""
    plain, graphed = pair
    g = graphed.runner.graphs
    greedy = [
        dict(text=t, speaker=i % 3, max_duration=SECONDS, temperature=0) for i, t in enumerate(TEXTS[:n])
    ]
    sampled = [dict(c, temperature=0.8, top_k=12, seed=40 + i) for i, c in enumerate(greedy)]
    for calls in (greedy, sampled):
        recorded_plain, recorded_graphed = _recording(plain), _recording(graphed)
        try:
            before = g.replays
            ours, theirs = _speak(graphed, calls), _speak(plain, calls)
            seen_graphed, seen_plain = recorded_graphed(), recorded_plain()
        finally:
            for m in pair:  # the instance wrappers
                del m.prepare, m.head.run
        for a, b in zip(ours, theirs, strict=True):
            assert len(a) == 5
            np.testing.assert_array_equal(a, b)
        assert g.replays - before >= 4  # frames 2..5 of every stream: frame passes
        for mine, theirs_rows in zip(seen_graphed, seen_plain, strict=True):
            assert len(mine) == len(theirs_rows) == 5
            torch.testing.assert_close(torch.stack(mine), torch.stack(theirs_rows), rtol=1e-5, atol=1e-5)
    for a, b in zip(_speak(csm, greedy), _speak(graphed, greedy), strict=True):
        np.testing.assert_array_equal(a, b)


def test_padding_rows_never_leak(pair):
    """Three streams (bucket 4) with the padding row's input embedding NaN: the codes
    equal the plain model's, the padding row's hidden state is NaN (the poison ran), every
    padding row's page table is the scratch page alone, and the contexts' pages come back."""
    plain, graphed = pair
    g = graphed.runner.graphs
    calls = [dict(text=t, speaker=1, max_duration=SECONDS, temperature=0) for t in TEXTS[:3]]
    assert g.embeds is not None and g.hidden is not None
    g.embeds[3:].fill_(float("nan"))  # passes of 3 streams never write rows 3..
    before = g.replays
    np.testing.assert_array_equal(np.stack(_speak(graphed, calls)), np.stack(_speak(plain, calls)))
    assert g.replays > before and g.hidden[3].isnan().all()
    for ind_buf, idx_buf, last_buf in g._buffers[4]:
        indptr = ind_buf.tolist()
        assert idx_buf[indptr[3] : indptr[4]].tolist() == [g.scratch_page] and last_buf[3] == 1
    assert graphed.pool.refcount(g.scratch_page) == 1  # held by the graphs alone
    assert graphed.pool.stats().in_use == 1  # the scratch page: every context's pages came back
    g.embeds.zero_()


def test_which_passes_take_the_backbone_graphs(pair):
    _, graphed = pair
    g = graphed.runner.graphs
    pos = torch.zeros(1, 1, dtype=torch.long)
    row = torch.zeros(1, graphed.hf.config.hidden_size)
    frame = StepInput(tokens=[5], positions=pos, kv_start=3, pages=[0], embeds=row, logits="head")
    assert g.takes([frame] * 8) and not g.takes([frame] * 9) and not g.takes([])
    two = StepInput(
        tokens=[5, 6], positions=torch.zeros(1, 2, dtype=torch.long), kv_start=3, pages=[0], logits="head"
    )
    no_embeds = StepInput(tokens=[5], positions=pos, kv_start=3, pages=[0], logits="head")
    logits = StepInput(tokens=[5], positions=pos, kv_start=3, pages=[0], embeds=row, logits="last")
    prefill = StepInput(
        tokens=[5, 6], positions=two.positions, kv_start=0, pages=[0], embeds=row.repeat(2, 1)
    )
    for other in (two, no_embeds, logits, prefill):
        assert not g.takes([frame, other]), other
    # the text engine's kind of graphs never takes an embedding pass, and this kind needs a head
    ids = DecodeGraphs(graphed.runner, max_batch=2, capture=False)
    assert not ids.takes([frame]) and "inputs=ids" in repr(ids) and "inputs=embeds" in repr(g)
    ids.close()
    head, graphed.runner.head = graphed.runner.head, None
    try:
        with pytest.raises(ValueError, match="head"):
            DecodeGraphs(graphed.runner, max_batch=2, capture=False, inputs="embeds")
    finally:
        graphed.runner.head = head
    with pytest.raises(ValueError, match="inputs"):
        DecodeGraphs(graphed.runner, max_batch=2, capture=False, inputs="pixels")  # type: ignore[arg-type]


def test_backbone_graphs_only_where_the_engine_graphs_run(fake_flashinfer, csm, tiny_dir):
    """The torch backend: None (eager backbone passes, the reason logged). On flashinfer:
    every bucket warmed on the scratch page, nothing else of the pool touched."""
    assert backbone_graphs(csm.runner, 4, capture=False) is None
    model = _on_fake(tiny_dir)
    in_use = model.pool.stats().in_use
    g = backbone_graphs(model.runner, 6, capture=False)
    assert g is not None and g.inputs == "embeds" and g.buckets == [1, 2, 4, 6]
    assert sorted(g._attention) == [1, 2, 4, 6] and all(a.wrappers for a in g._attention.values())
    assert model.pool.stats().in_use == in_use + 1  # the scratch page
    g.close()
    assert model.pool.stats().in_use == in_use
