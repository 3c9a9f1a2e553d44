"""CUDA-graph decode (engine.decode_graphs), rehearsed on the CPU.

``capture=False`` runs the graph's function eagerly through the same static buffers, the
padded buckets, the scratch page and the fixed page-table buffers of graph decode wrappers
(the stand-in flashinfer reads those buffers at run time, as a replayed kernel does). Only
the capture itself needs a GPU (tests/engine/test_cuda.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import pytest
import torch

from engine import Context, ContextClosedError, InvalidRequestError, Model, Sampler, max_tokens
from engine.attention_flashinfer import FlashInferBackend
from engine.decode_graphs import DecodeGraphs
from engine.forward import StepInput
from engine.scheduler import Scheduler
from media import Image
from tests.engine.conftest import TINY_GEMMA, TINY_QWEN
from tests.engine.fake_flashinfer import installed
from tests.engine.test_parity_media import IMG_A

PROMPTS = [
    "Tell me about the sea.",
    "Count to five.",
    "A haiku about paging, please, and be brief about it.",
    "Why?",
    "Name three colours that go well together in a painting of a harbour.",
]


@pytest.fixture(scope="module")
def fake_flashinfer():
    with installed() as fake:
        yield fake


def _on_fake(tiny_dir, name: str) -> Model:
    model = Model.load(tiny_dir(name), kv_pages=256, device="cpu", attention="torch")
    model.runner.backend = FlashInferBackend("cpu", workspace_bytes=1024, head_dims=None)
    model.attention_backend = "flashinfer"
    return model


@pytest.fixture(scope="module")
def pairs(fake_flashinfer, tiny_dir):
    """Per family: (the engine on the stand-in flashinfer, the same with graph decode)."""
    out = {}
    for name in (TINY_QWEN, TINY_GEMMA):
        plain, graphs = _on_fake(tiny_dir, name), _on_fake(tiny_dir, name)
        graphs.runner.graphs = DecodeGraphs(graphs.runner, max_batch=8, capture=False)
        graphs.runner.batch_argmax = True  # as on CUDA: greedy tokens come from the pass's argmax
        out[name] = (plain, graphs)
    return out


def _decode_all(model: Model, lengths: list[int], probs: list[list] | None = None) -> list[list[int]]:
    """Five contexts (one with an image) prefilled, then decoded together, greedy; they
    stop after different numbers of tokens, so the batch shrinks pass by pass. ``probs``
    collects each context's top-8 probabilities per step."""
    seen: list[list] = probs if probs is not None else []
    seen[:] = [[] for _ in PROMPTS]

    def greedy_recording(i: int) -> Sampler:
        def pick(ids, p):
            seen[i].append((list(ids[:8]), torch.as_tensor(p[:8], dtype=torch.float64)))
            return ids[0]

        return Sampler.custom(pick, temperature=0.0, candidates=8)

    async def go() -> list[list[int]]:
        contexts = []
        for i, prompt in enumerate(PROMPTS):
            ctx = Context(model)
            if i == 2:
                ctx.user(Image.from_bytes(IMG_A), prompt)
            else:
                ctx.user(prompt)
            contexts.append(ctx.cue())
        await asyncio.gather(*(c.flush() for c in contexts))
        return await _generate_all(contexts, [greedy_recording(i) for i in range(len(contexts))], lengths)

    return asyncio.run(go())


async def _generate_all(
    contexts: list[Context], samplers: list[Sampler], lengths: list[int]
) -> list[list[int]]:
    """Each context generated to its length with its sampler, all at once; their tokens.
    The contexts are closed after."""
    try:
        gens = await asyncio.gather(
            *(c.generate(s, max_tokens(n)) for c, s, n in zip(contexts, samplers, lengths, strict=True))
        )
        return [g.tokens for g in gens]
    finally:
        for c in contexts:
            c.close()


@pytest.mark.parametrize("name", [TINY_QWEN, TINY_GEMMA])
def test_graph_decode_equals_plain_decode(pairs, name):
    plain, graphs = pairs[name]
    lengths = [9, 3, 7, 5, 12]
    g = graphs.runner.graphs
    before = g.replays
    p_ours, p_plain = [], []
    ours = _decode_all(graphs, lengths, p_ours)
    assert ours == _decode_all(plain, lengths, p_plain)
    # The distributions too (fp32 on the CPU: the padded batch and the plain one differ
    # only in how the BLAS blocks their sums, ~1e-7 in a probability).
    for mine, theirs in zip(p_ours, p_plain, strict=True):
        for (ids_a, pa), (ids_b, pb) in zip(mine, theirs, strict=True):
            assert ids_a[:3] == ids_b[:3]
            assert (pa[:3] - pb[:3]).abs().max().item() < 1e-5
    assert [len(t) for t in ours] == lengths
    # Every decode pass but the first (the prompts' last-row logits come with prefill) ran
    # through the static buffers, in shrinking buckets.
    assert g.replays - before >= max(lengths) - 1
    assert {8, 4, 2, 1} <= set(g._attention)


def test_padding_rows_use_only_the_scratch_page(pairs):
    _, graphs = pairs[TINY_QWEN]
    g = graphs.runner.graphs
    _decode_all(graphs, [4, 4, 4, 4, 4])  # 5 contexts: bucket 8, three padding rows
    attention = g._attention[8]
    for ind_buf, idx_buf, last_buf in g._buffers[8]:
        indptr = ind_buf.tolist()
        padding = [idx_buf[indptr[i] : indptr[i + 1]].tolist() for i in range(5, 8)]
        assert padding == [[g.scratch_page]] * 3 and last_buf[5:].tolist() == [1, 1, 1]
    assert attention.wrappers and all(w.graph for w in attention.wrappers.values())
    assert graphs.pool.refcount(g.scratch_page) == 1  # held by the graphs alone


def test_warm_prepares_every_bucket_on_the_scratch_page(fake_flashinfer, tiny_dir):
    """warm() (Model.load calls it on CUDA, where it captures) runs a padding-only pass per
    bucket: wrappers exist for every bucket, no context page is touched, and decoding after
    it still equals the plain engine."""
    plain = _on_fake(tiny_dir, TINY_GEMMA)
    model = _on_fake(tiny_dir, TINY_GEMMA)
    g = model.runner.graphs = DecodeGraphs(model.runner, max_batch=6, capture=False)
    in_use = model.pool_stats().in_use
    k_before = [k.clone() for k, _ in (model.pool.kv(i) for i in range(len(model.pool.layers)))]
    g.warm()
    assert sorted(g._attention) == [1, 2, 4, 6] and all(a.wrappers for a in g._attention.values())
    assert model.pool_stats().in_use == in_use
    for i, before in enumerate(k_before):
        now = model.pool.kv(i)[0]
        same = (now == before) | (now.isnan() & before.isnan())  # the pool starts uninitialised
        changed = (~same).flatten(1).any(1).nonzero().flatten().tolist()
        assert set(changed) <= {g.scratch_page}, changed
    lengths = [4, 6, 2, 5, 3]
    assert _decode_all(model, lengths) == _decode_all(plain, lengths)


def test_which_passes_take_the_graphs(pairs):
    _, graphs = pairs[TINY_QWEN]
    g = graphs.runner.graphs
    pos = torch.zeros(3, 1, dtype=torch.long)
    one = StepInput(tokens=[5], positions=pos, kv_start=3, pages=[0])
    assert g.takes([one] * 8) and not g.takes([one] * 9) and not g.takes([])
    assert not g.takes(
        [StepInput(tokens=[5, 6], positions=torch.zeros(3, 2, dtype=torch.long), kv_start=3, pages=[0])]
    )
    assert not g.takes([StepInput(tokens=[5], positions=pos, kv_start=3, pages=[0], logits="all")])
    assert not g.takes(
        [StepInput(tokens=[5], positions=pos, kv_start=3, pages=[0], adapters=((object(), 1.0),))]
    )
    assert "DecodeGraphs(buckets=[1, 2, 4, 8]" in repr(g)
    # A pass whose page lists (shared prefixes counted per context) outgrow the fixed
    # index buffers runs as usual.
    long = graphs.pool.num_pages * graphs.pool.page_size // 4
    assert not g.takes([StepInput(tokens=[5], positions=pos, kv_start=long, pages=list(range(300)))] * 5)


def test_refusals(fake_flashinfer, tiny_dir):
    with pytest.raises(InvalidRequestError, match="CUDA"):
        Model.load(tiny_dir(TINY_QWEN), kv_pages=16, device="cpu", cuda_graphs=8)
    with pytest.raises(InvalidRequestError, match=">= 0"):
        Model.load(tiny_dir(TINY_QWEN), kv_pages=16, device="cpu", cuda_graphs=-1)
    torch_model = Model.load(tiny_dir(TINY_QWEN), kv_pages=16, device="cpu", attention="torch")
    with pytest.raises(ValueError, match="flashinfer"):
        DecodeGraphs(torch_model.runner, capture=False)
    kernels_only = _on_fake(tiny_dir, TINY_QWEN)
    kernels_only.runner.backend = FlashInferBackend("cpu", workspace_bytes=1024)  # 64/128/256 only
    with pytest.raises(ValueError, match="head size"):
        DecodeGraphs(kernels_only.runner, capture=False)
    g = DecodeGraphs(_on_fake(tiny_dir, TINY_QWEN).runner, max_batch=3, capture=False)
    assert g.buckets == [1, 2, 3]
    g.close()


def greedy_texts(model: Model, lengths: list[int]) -> list[list[int]]:
    """The text-only PROMPTS generated together, greedy, each to its length; their tokens."""

    contexts = [Context(model).user(p).cue() for p in PROMPTS]
    return asyncio.run(_generate_all(contexts, [Sampler.greedy()] * len(contexts), lengths))


@pytest.mark.parametrize("name", [TINY_QWEN, TINY_GEMMA])
def test_passes_fed_on_the_device_equal_the_plain_loop(pairs, name):
    """The device feed (engine.scheduler): with the overlap, a greedy graph pass whose
    tokens are the running pass's argmax is launched before that pass's tokens reach the
    host, its ids taken from the argmax on the device. Rehearsed here with the worker
    told to wait for the next pass (on the CPU a pass is over when it is launched): the
    tokens equal the plain engine's, contexts stopping at different lengths included."""
    plain, graphs = pairs[name]
    lengths = [9, 3, 7, 5, 12]
    with _feeding(graphs) as sched:
        fed = sched.stats.fed_passes
        ours = greedy_texts(graphs, lengths)
        assert sched.stats.fed_passes - fed >= max(lengths) // 2  # most passes fed ahead
    assert ours == greedy_texts(plain, lengths)
    assert [len(t) for t in ours] == lengths
    assert not sched._prelaunched and not sched._queued  # nothing left behind
    assert not plain.scheduler._queued  # passes are queued and unqueued with the feed off too


@contextlib.contextmanager
def _feeding(model: Model) -> Iterator[Scheduler]:
    """The scheduler set to feed passes on the device (as on CUDA), restored after. The
    worker waits up to 0.2 s for the next pass: on the CPU a pass is over when launched."""
    sched = model.scheduler
    saved = (sched.overlap, sched.device_feed, sched.feed_wait_s)
    sched.overlap, sched.device_feed, sched.feed_wait_s = True, True, 0.2
    try:
        yield sched
    finally:
        sched.overlap, sched.device_feed, sched.feed_wait_s = saved


def test_fed_greedy_rows_share_passes_with_seeded_sampled_ones(pairs):
    """Greedy contexts (fed on the device) and seeded top-p ones (drawn on the host side,
    never fed) in the same passes: every context's tokens are what the plain loop gives;
    passes with a sampled row are launched in turn, the others fed."""
    _, graphs = pairs[TINY_QWEN]

    async def mixed() -> list[list[int]]:
        async def one(i: int) -> list[int]:
            sampler = Sampler.top_p(0.9, 0.8) if i % 2 else Sampler.greedy()
            async with Context(graphs, seed=100 + i) as ctx:
                ctx.user(PROMPTS[i]).cue()
                # the sampled ones stop early: the greedy ones' later passes are fed
                return (await ctx.generate(sampler, max_tokens(5 if i % 2 else 12 + i))).tokens

        return list(await asyncio.gather(*(one(i) for i in range(len(PROMPTS)))))

    plain = asyncio.run(mixed())  # the CPU defaults: no overlap, no feed
    with _feeding(graphs) as sched:
        fed_before = sched.stats.fed_passes
        fed = asyncio.run(mixed())
        assert sched.stats.fed_passes > fed_before
    assert fed == plain


def test_closing_a_fed_context_mid_stream_leaves_no_step_behind(pairs):
    """A context closed while its consumer holds a token (its next pass possibly launched
    already): another context started at that moment, which may get its pages, still
    makes its own tokens, and every page comes back."""
    _, graphs = pairs[TINY_QWEN]
    greedy = Sampler.greedy()

    async def alone(prompt: str) -> list[int]:
        async with Context(graphs) as ctx:
            ctx.user(prompt).cue()
            return (await ctx.generate(greedy, max_tokens(6))).tokens

    async def run():
        solo = await alone(PROMPTS[1])
        free = graphs.pool.available()
        a = Context(graphs).user(PROMPTS[0]).cue()
        others = [asyncio.ensure_future(alone(PROMPTS[3]))]
        got, b_task = [], None
        with pytest.raises(ContextClosedError):
            async for ev in a.stream(greedy, max_tokens(20)):
                got.append(ev.token)
                if len(got) == 3:
                    a.close()
                    b_task = asyncio.ensure_future(alone(PROMPTS[1]))
        assert b_task is not None
        b = await b_task
        await asyncio.gather(*others)
        await graphs.scheduler.pass_over()
        return solo, b, free, graphs.pool.available()

    with _feeding(graphs) as sched:
        fed_before = sched.stats.fed_passes
        solo, b, free, after = asyncio.run(run())
        assert sched.stats.fed_passes > fed_before
    assert b == solo
    assert after == free
    assert not graphs.scheduler._prelaunched and not graphs.scheduler._queued
