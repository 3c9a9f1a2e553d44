"""Scheduler: concurrent contexts share forward passes, a long prefill does not starve
running decodes, a media span is never split by the prefill budget, and a cancelled
context frees its pages while the others go on."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from engine import Context, Model, Sampler
from tests.engine.conftest import TINY_QWEN, WAIT_S, assert_logits_close

PREFILL = 16  # rows per prefill chunk
BUDGET = 24  # rows per forward pass: one chunk plus a few decode rows


@pytest.fixture(scope="module")
def small(tiny_dir):
    """The tiny Qwen3-VL with a small prefill chunk and per-pass row budget."""
    return Model.load(
        tiny_dir(TINY_QWEN),
        kv_pages=256,
        page_size=8,
        device="cpu",
        max_prefill_rows=PREFILL,
        max_batch_rows=BUDGET,
    )


class StepSpy:
    """Records the row count and token ids of every step of every pass."""

    def __init__(self, model: Model):
        self.runner = model.scheduler.runner
        self.passes: list[list[list[int]]] = []
        self._run = self.runner.run

    def __enter__(self) -> StepSpy:
        def run(steps):
            self.passes.append([list(s.tokens) for s in steps])
            return self._run(steps)

        self.runner.run = run
        return self

    def __exit__(self, *exc: object) -> None:
        del self.runner.run  # back to the class method


def _prompt(model: Model, i: int) -> list[int]:
    return model.tokenize(f"Prompt number {i}: tell me about the sea and the sky.")


async def _greedy(model: Model, ids: list[int], n: int) -> list[int]:
    async with Context(model) as ctx:
        ctx.fill_tokens(ids)
        out = await ctx.generate(Sampler.greedy(), max_tokens=n, stop=None)
        return out.tokens


def test_concurrent_decodes_share_forward_passes(small):
    n_ctx, n_tok = 4, 8
    prompts = [_prompt(small, i) for i in range(n_ctx)]
    solo = [asyncio.run(_greedy(small, p, n_tok)) for p in prompts]

    async def together():
        return await asyncio.gather(*(_greedy(small, p, n_tok) for p in prompts))

    with StepSpy(small) as spy:
        batched = asyncio.run(together())
    assert batched == solo
    steps = sum(len(p) for p in spy.passes)
    # Each context: its prefill chunks, then n_tok - 1 decode steps; run together the
    # decode steps of all four ride in the same passes.
    assert len(spy.passes) < steps / 2, (len(spy.passes), steps)
    assert max(len(p) for p in spy.passes) == n_ctx
    decode_passes = [p for p in spy.passes if all(len(s) == 1 for s in p)]
    assert len(decode_passes) >= n_tok - 1
    assert all(len(p) == n_ctx for p in decode_passes[: n_tok - 1])


def _decode_gaps(model: Model, long_rows: int, n_tok: int) -> tuple[list[int], int, int]:
    """Context A decodes while B prefills ``long_rows`` rows. Returns the number of passes
    between A's consecutive tokens while B prefilled, and the passes B's prefill took."""

    async def main():
        sched = model.scheduler.stats
        seen: list[int] = []
        b_span = [0, 0]
        async with Context(model) as a, Context(model) as b:
            a.fill_tokens(_prompt(model, 0))
            b.fill_tokens([(7 * i) % 1000 + 10 for i in range(long_rows)])

            async def decode_a():
                async for _ in a.stream(Sampler.greedy(), max_tokens=n_tok, stop=None):
                    seen.append(sched.passes)
                    if len(seen) == 2:
                        started.set()

            async def prefill_b():
                await started.wait()
                b_span[0] = sched.passes
                await b.flush()
                b_span[1] = sched.passes

            started = asyncio.Event()
            await asyncio.gather(decode_a(), prefill_b())
        during = [y - x for x, y in zip(seen, seen[1:], strict=False) if b_span[0] <= x < b_span[1]]
        return during, b_span[1] - b_span[0]

    return asyncio.run(main())


def test_long_prefill_does_not_starve_decodes(small):
    long_rows, n_tok = 10 * PREFILL, 30
    gaps, b_passes = _decode_gaps(small, long_rows, n_tok)
    # B's prefill is cut into 16-row chunks; every pass carries one chunk and A's decode row.
    # (B's span is read when its task starts, which can be while A's previous passes are still
    # in flight: with the scheduler's overlap, A's current pass and the one submitted ahead of
    # its token, so up to two are counted too.)
    assert long_rows // PREFILL <= b_passes <= long_rows // PREFILL + 2
    assert len(gaps) >= long_rows // PREFILL - 1
    assert all(g == 1 for g in gaps), gaps


def test_tight_budget_alternates_rather_than_starves(small):
    # With a pass budget of exactly one chunk, a chunk and a decode row no longer fit
    # together: FIFO order makes them take turns, so A still gets a token every 2 passes.
    saved = small.scheduler.max_batch_rows
    small.scheduler.max_batch_rows = PREFILL
    try:
        gaps, b_passes = _decode_gaps(small, 6 * PREFILL, 20)
    finally:
        small.scheduler.max_batch_rows = saved
    assert gaps and max(gaps) <= 2, gaps
    assert b_passes <= 2 * 6 + 1


def _image(seed: int, size: int = 128):
    from media import Image

    rng = np.random.default_rng(seed)
    return Image.from_array(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def test_media_span_larger_than_prefill_budget_is_whole(small, qwen):
    image = _image(1)
    prepared = small.prepare(image)
    assert prepared.num_rows > 2 * PREFILL  # the span alone exceeds a chunk (and the pass budget)
    ph = prepared.placeholder_id

    async def logits(model: Model) -> torch.Tensor:
        async with Context(model) as ctx:
            ctx.user("Look:", image, "what is it?").cue()
            return await ctx.flush(return_logits=True)

    with StepSpy(small) as spy:
        chunked = asyncio.run(logits(small))
    whole = asyncio.run(logits(qwen))  # max_prefill_rows 2048: one step
    assert_logits_close(chunked, whole, "scheduler: media span over the prefill budget")
    steps = [s for p in spy.passes for s in p]
    assert len(steps) > 1  # the text around it was chunked
    with_ph = [s for s in steps if ph in s]
    assert len(with_ph) == 1 and with_ph[0].count(ph) == prepared.token_count
    assert len(with_ph[0]) > BUDGET  # a step over the pass budget still runs (alone)


def test_cancelled_and_closed_contexts_free_pages_others_go_on(small):
    n_tok = 24
    prompts = [_prompt(small, i) for i in range(3)]
    expected = asyncio.run(_greedy(small, prompts[2], n_tok))
    baseline = small.pool_stats()

    async def main():
        ctxs = [Context(small) for _ in prompts]
        for c, p in zip(ctxs, prompts, strict=True):
            c.fill_tokens(p)
        progress = [0, 0, 0]
        all_started = asyncio.Event()

        async def run(i: int):
            toks = []
            async for ev in ctxs[i].stream(Sampler.greedy(), max_tokens=n_tok, stop=None):
                toks.append(ev.token)
                progress[i] += 1
                if min(progress) >= 4:
                    all_started.set()
            return toks

        tasks = [asyncio.create_task(run(i)) for i in range(3)]
        await asyncio.wait_for(all_started.wait(), WAIT_S)  # every stream is mid-flight
        mid = small.pool_stats()
        assert mid.in_use > baseline.in_use
        tasks[0].cancel()  # cancel a generate task mid-flight
        ctxs[1].close()  # close a context while its stream runs
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(results[0], asyncio.CancelledError)
        assert type(results[1]).__name__ == "ContextClosedError"
        assert ctxs[1].closed
        assert progress[0] < n_tok and progress[1] < n_tok
        ctxs[0].close()
        survivor = results[2]
        ctxs[2].close()
        return survivor

    assert asyncio.run(main()) == expected
    after = small.pool_stats()
    assert after.in_use == baseline.in_use
    assert after.in_use + after.cached + after.free == after.num_pages
