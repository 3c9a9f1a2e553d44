"""The scheduler's overlap: a plain generation submits each decode step before its token is
known, and the forward worker runs it as soon as the pass that samples that token ends.

Whatever the overlap does, the tokens are the plain loop's: greedy ones, seeded sampled
ones (alone and sharing passes), a stop mid-pass ends exactly there with the last token
pending, a seeded generator gets back the draw of a step computed in vain, and a context
left mid-stream can be used again at once. Each case runs with the overlap on and off
on the same model (``Scheduler.overlap``; on by default only on CUDA)."""

from __future__ import annotations

import asyncio

import pytest

from engine import Context, ContextClosedError, Model, Penalties, Sampler, max_tokens, stop_strings
from tests.engine.conftest import TINY_QWEN


@pytest.fixture(scope="module")
def model(tiny_dir):
    return Model.load(tiny_dir(TINY_QWEN), kv_pages=256, page_size=8, device="cpu")


def _prompt(i: int) -> str:
    return f"Prompt number {i}: tell me about the sea and the sky."


def _both(model: Model, fn) -> tuple:
    """``fn()`` with the overlap on, then off; the scheduler's overlapped-pass count of the
    first run comes back too."""
    saved = model.scheduler.overlap
    try:
        model.scheduler.overlap = True
        before = model.scheduler.stats.overlapped_passes
        on = asyncio.run(fn())
        overlapped = model.scheduler.stats.overlapped_passes - before
        model.scheduler.overlap = False
        off = asyncio.run(fn())
    finally:
        model.scheduler.overlap = saved
    return on, off, overlapped


async def _generate(model: Model, i: int, sampler: Sampler, n: int, seed: int | None = None, **kw):
    async with Context(model, seed=seed) as ctx:
        ctx.user(_prompt(i)).cue()
        out = await ctx.generate(sampler, max_tokens=n, stop=kw.get("stop"), penalties=kw.get("penalties"))
        return out.tokens, out.reason.kind, ctx.token_ids, ctx.pending


def test_greedy_tokens_are_the_plain_loops_and_passes_overlap(model):
    async def many():
        return await asyncio.gather(*(_generate(model, i, Sampler.greedy(), 12) for i in range(4)))

    on, off, overlapped = _both(model, many)
    assert on == off
    assert all(len(t) == 12 and pending == 1 for t, _, _, pending in on)
    assert overlapped >= 8  # decode passes went to the worker while the one before ran


def test_seeded_sampling_alone_and_shared_equals_the_plain_loop(model):
    sampler = Sampler.top_p(0.9, 0.8)

    async def alone():
        return [await _generate(model, 0, sampler, 10, seed=7)]

    async def shared():  # the same seeded request beside others, some greedy
        jobs = [_generate(model, 0, sampler, 10, seed=7)]
        jobs += [_generate(model, i, Sampler.greedy(), 6 + i) for i in range(1, 4)]
        jobs += [_generate(model, 5, Sampler.top_k(1.1, 20), 9, seed=3)]
        return await asyncio.gather(*jobs)

    a_on, a_off, _ = _both(model, alone)
    s_on, s_off, _ = _both(model, shared)
    assert a_on == a_off
    assert s_on == s_off
    assert s_on[0] == a_on[0]  # whatever else shares its passes


def test_a_stop_mid_pass_ends_exactly_there(model):
    # Stop on the 4th greedy token's text (found first), so the step submitted ahead of the
    # 5th token was computed in vain: the generation still ends at the 4th, pending.
    async def first():
        async with Context(model) as ctx:
            ctx.user(_prompt(1)).cue()
            return (await ctx.generate(Sampler.greedy(), max_tokens=6, stop=None)).tokens

    tokens = asyncio.run(first())
    stop_text = model.detokenize(tokens[3:4])
    assert stop_text, "the 4th token must have text to stop on"

    async def stopped():
        return [
            await _generate(model, 1, Sampler.greedy(), 30, stop=stop_strings(stop_text) | max_tokens(30))
        ]

    on, off, _ = _both(model, stopped)
    assert on == off
    got, reason, ids, pending = on[0]
    assert reason == "stop_string" and len(got) <= 4 and pending == 1


def test_the_draw_of_a_step_computed_in_vain_is_given_back(model):
    # Two generations on one seeded context: the second's tokens depend on the generator's
    # state after the first, which a dropped step must not have moved.
    async def two_turns():
        async with Context(model, seed=11) as ctx:
            ctx.user(_prompt(2)).cue()
            first = await ctx.generate(Sampler.multinomial(0.9), max_tokens=5, stop=None)
            ctx.fill(" and then")
            second = await ctx.generate(Sampler.multinomial(0.9), max_tokens=5, stop=None)
            return first.tokens, second.tokens

    # A stop string that fires on whatever comes: every generation leaves a step in vain.
    async def stopped_early():
        async with Context(model, seed=5) as ctx:
            ctx.user(_prompt(3)).cue()
            out = []
            for _ in range(3):
                g = await ctx.generate(Sampler.multinomial(1.0), stop=max_tokens(3))
                out.append(g.tokens)
            return out

    on, off, _ = _both(model, two_turns)
    assert on == off
    on, off, _ = _both(model, stopped_early)
    assert on == off


def test_a_context_left_mid_stream_is_usable_at_once(model):
    async def leave_and_reuse():
        async with Context(model, seed=1) as ctx:
            ctx.user(_prompt(4)).cue()
            seen = []
            async for ev in ctx.stream(Sampler.greedy(), max_tokens=20, stop=None):
                seen.append(ev.token)
                if len(seen) == 5:
                    break
            # No aclose: the generator is only dropped. The context is not busy.
            again = await ctx.generate(Sampler.greedy(), max_tokens=4, stop=None)
            return seen, again.tokens, ctx.token_ids

    on, off, _ = _both(model, leave_and_reuse)
    assert on == off


def test_penalties_and_plain_rows_share_passes(model):
    # A penalised greedy generation beside plain ones: the same tokens either way.
    async def mixed():
        jobs = [_generate(model, 6, Sampler.greedy(), 8, penalties=Penalties(repetition=1.3))]
        jobs += [_generate(model, i, Sampler.greedy(), 8) for i in range(2)]
        return await asyncio.gather(*jobs)

    on, off, _ = _both(model, mixed)
    assert on == off


def test_closing_mid_stream_leaves_no_step_to_write_freed_pages(model):
    # A is closed while its consumer holds a token (its next steps submitted); B, started at
    # that moment, may get A's pages: B's tokens are still B's own.
    greedy = Sampler.greedy()

    async def run():
        solo = (await _generate(model, 8, greedy, 6))[0]
        free = model.pool.available()
        a = Context(model).user(_prompt(7)).cue()
        got, b_task = [], None
        with pytest.raises(ContextClosedError):
            async for ev in a.stream(greedy, max_tokens=20, stop=None):
                got.append(ev.token)
                if len(got) == 3:
                    a.close()
                    b_task = asyncio.ensure_future(_generate(model, 8, greedy, 6))
        assert b_task is not None
        b = (await b_task)[0]
        await model.scheduler.pass_over()
        return solo, b, free, model.pool.available()

    saved = model.scheduler.overlap
    for overlap in (True, False):
        model.scheduler.overlap = overlap
        try:
            solo, b, free, after = asyncio.run(run())
        finally:
            model.scheduler.overlap = saved
        assert b == solo
        assert after == free


def test_the_overlap_is_on_for_cuda_off_on_the_cpu_unless_forced(monkeypatch):
    import torch

    from engine.scheduler import overlap_default

    monkeypatch.delenv("PIE_MEDIA_OVERLAP", raising=False)
    assert overlap_default(torch.device("cuda")) and not overlap_default(torch.device("cpu"))
    monkeypatch.setenv("PIE_MEDIA_OVERLAP", "1")
    assert overlap_default(torch.device("cpu"))
    monkeypatch.setenv("PIE_MEDIA_OVERLAP", "0")
    assert not overlap_default(torch.device("cuda"))


def test_seeded_penalised_generations_overlap_and_keep_their_tokens(model):
    penalties = Penalties(frequency=0.8, presence=0.4, logit_bias=((13, 5.0),))

    async def penalised():
        jobs = [
            _generate(model, i, Sampler.top_k(1.0, 40), 10, seed=20 + i, penalties=penalties)
            for i in range(3)
        ]
        return await asyncio.gather(*jobs)

    on, off, overlapped = _both(model, penalised)
    assert on == off
    assert overlapped >= 4


def test_a_dropped_draw_leaves_the_penalty_counts_as_they_were():
    from engine.penalties import Penalties as P

    state = P(frequency=1.0, repetition=1.5).start([5, 6])
    assert state is not None
    before = (dict(state._counts), list(state._seen))
    for token in (7, 5, 7):
        state.add(token)
    for token in (7, 5, 7):
        state.discard(token)
    assert (dict(state._counts), list(state._seen)) == before


def test_a_grammar_and_a_drafter_share_passes_with_overlapped_contexts(model):
    from engine import Grammar, PromptLookupDrafter

    async def constrained():
        async with Context(model) as ctx:
            ctx.user(_prompt(9)).cue()
            g = await ctx.generate(
                Sampler.greedy(), max_tokens=8, stop=None, grammar=Grammar.regex("[a-z ]{3,12}")
            )
            return g.tokens

    async def drafted():
        async with Context(model) as ctx:
            ctx.user(_prompt(10) + " the sea the sea the sea").cue()
            g = await ctx.generate(Sampler.greedy(), max_tokens=10, stop=None, drafter=PromptLookupDrafter())
            return g.tokens

    async def mixed():
        return await asyncio.gather(
            constrained(), drafted(), *(_generate(model, i, Sampler.greedy(), 10) for i in range(3))
        )

    on, off, overlapped = _both(model, mixed)
    assert on == off
