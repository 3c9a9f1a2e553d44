"""Speculative decoding: drafts verified in one pass change how many passes a generation
takes, never which tokens it gives.

The tiny models have random weights, so an n-gram drafter rarely guesses them right on
ordinary text; the tests that need acceptances use the Qwen tiny model's copy-heavy
prompt, on which its greedy output repeats one token (drafts are then accepted), and an
"oracle" drafter that proposes the plain run's own continuation with every other token
wrong (acceptances and rejections in the same generation).
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Sequence

import pytest

from engine import (
    Context,
    InvalidRequestError,
    PromptLookupDrafter,
    Sampler,
    SyncContext,
    max_tokens,
    run_sync,
    stop_strings,
)
from engine.drafting import DraftSpec
from media import Image
from tests.engine.conftest import TINY_GEMMA, TINY_QWEN

COPY = "a b c d e f g a b c d e f g a b c d"


@pytest.fixture(scope="module")
def image(samples) -> Image:
    return Image.from_path(samples / "images" / "photo_640x480.jpg")


def _models(qwen, gemma):
    return {TINY_QWEN: qwen, TINY_GEMMA: gemma}


class Oracle:
    """Drafts the known continuation ``truth`` with every ``wrong``-th drafted token
    replaced by a wrong one: steps accept a prefix, then reject."""

    def __init__(self, truth: Sequence[int], prompt_len: int, *, k: int = 4, wrong: int = 3):
        self.truth, self.prompt_len, self.k, self.wrong = list(truth), prompt_len, k, wrong
        self.seen = 0
        self.drafts = 0

    def update(self, accepted: Sequence[int]) -> None:
        self.seen += len(accepted)

    def draft(self) -> list[int]:
        at = self.seen - self.prompt_len
        out = list(self.truth[at : at + self.k])
        for i in range(len(out)):
            self.drafts += 1
            if self.drafts % self.wrong == 0:
                out[i] = (out[i] + 1) % 50
        return out


def _gen(model, prompt, *, image=None, drafter=None, sampler=None, seed=None, **kw):
    async def run():
        ctx = Context(model, seed=seed)
        if image is not None:
            ctx.user(image, prompt)
        else:
            ctx.user(prompt)
        ctx.cue()
        try:
            return await ctx.generate(sampler, drafter=drafter, **kw), len(ctx.token_ids)
        finally:
            ctx.close()

    return run_sync(run())


@pytest.mark.parametrize("name", [TINY_QWEN, TINY_GEMMA])
def test_greedy_with_a_drafter_equals_plain_greedy(qwen, gemma, image, name):
    model = _models(qwen, gemma)[name]
    for img in (None, image):
        plain, _ = _gen(model, COPY, image=img, max_tokens=24)
        prompt_len = _gen(model, COPY, image=img, max_tokens=1)[1] - 1
        for drafter in (PromptLookupDrafter(), Oracle(plain.tokens, prompt_len)):
            before = model.counters.accepted_draft_tokens
            passes = model.scheduler.stats.passes
            got, _ = _gen(model, COPY, image=img, drafter=drafter, max_tokens=24)
            assert got.tokens == plain.tokens and got.text == plain.text
            assert got.reason == plain.reason
            if isinstance(drafter, Oracle):  # two of three drafts right: fewer passes
                assert model.counters.accepted_draft_tokens - before >= 8
                assert model.scheduler.stats.passes - passes < 24


def test_prompt_lookup_pays_off_when_the_output_repeats(qwen):
    """The Qwen tiny model's greedy output on COPY repeats one token: the n-gram drafter
    guesses it (its overlapping copy continues the repeat) and the passes halve or better."""
    plain_passes = qwen.scheduler.stats.passes
    plain, _ = _gen(qwen, COPY, max_tokens=40)
    plain_passes = qwen.scheduler.stats.passes - plain_passes
    assert len(set(plain.tokens[5:])) == 1, "the fixture's premise: greedy repeats a token"
    passes = qwen.scheduler.stats.passes
    got, _ = _gen(qwen, COPY, drafter=PromptLookupDrafter(num_draft=4), max_tokens=40)
    assert got.tokens == plain.tokens
    assert qwen.scheduler.stats.passes - passes <= plain_passes // 2


def test_prompt_lookup_drafter_proposes_what_followed():
    d = PromptLookupDrafter(max_ngram=3, num_draft=3)
    d.update([1, 2, 3, 4, 5, 9, 2, 3])
    assert d.draft() == [4, 5, 9]  # "2 3" was followed by 4 5 9
    d.update([7])
    assert d.draft() == []  # "3 7", "7": never seen
    d2 = PromptLookupDrafter(num_draft=4)
    d2.update([5, 6, 6, 6])
    assert d2.draft() == [6, 6, 6, 6]  # the overlapping copy continues the repeat
    d3 = PromptLookupDrafter(max_ngram=2, num_draft=2)
    d3.update([1, 2, 8, 0, 2, 9, 1, 2])
    assert d3.draft() == [8, 0]  # the longest n-gram wins ("1 2" -> 8), not the latest "2" -> 9
    with pytest.raises(InvalidRequestError):
        PromptLookupDrafter(num_draft=0)
    with pytest.raises(InvalidRequestError):
        DraftSpec(method="medusa")


def test_concurrent_contexts_share_passes_and_match_plain(qwen):
    prompts = [COPY, "x y x y x y x", "one two three one two three one"]
    plain = [_gen(qwen, p, max_tokens=16)[0].tokens for p in prompts]

    async def run():
        async def one(p):
            ctx = Context(qwen)
            ctx.user(p)
            ctx.cue()
            try:
                return (await ctx.generate(drafter=PromptLookupDrafter(), max_tokens=16)).tokens
            finally:
                ctx.close()

        return await asyncio.gather(*(one(p) for p in prompts))

    qwen.scheduler.stats.max_steps_in_pass = 0
    assert run_sync(run()) == plain
    assert qwen.scheduler.stats.max_steps_in_pass >= 2


@pytest.mark.parametrize("name", [TINY_QWEN, TINY_GEMMA])
def test_seeded_sampling_with_a_drafter_is_reproducible_and_equals_plain(qwen, gemma, name):
    """Each emitted token takes the one uniform plain decoding would have spent on it, so
    the same seed gives the same tokens with or without drafts."""
    model = _models(qwen, gemma)[name]
    sampler = Sampler.top_k(1.0, 5)
    for seed in (1, 2, 3):
        plain, n = _gen(model, COPY, sampler=sampler, seed=seed, max_tokens=12)
        a, _ = _gen(
            model, COPY, sampler=sampler, seed=seed, max_tokens=12, drafter=Oracle(plain.tokens, n - 12)
        )
        b, _ = _gen(
            model, COPY, sampler=sampler, seed=seed, max_tokens=12, drafter=Oracle(plain.tokens, n - 12)
        )
        assert a.tokens == b.tokens == plain.tokens


def test_sampled_distribution_matches_the_plain_sampler(qwen):
    """Two-sample chi-square over the first three tokens (top-k 2: at most 8 outcomes),
    N = 300 independent seeded draws per arm, each arm its own seeds. The drafter proposes
    the greedy continuation, which the sampler takes with probability p(x) < 1, so steps
    both accept and reject. Threshold: chi-square(7) at p = 0.001 is 24.3; a drafter
    accepted too often (e.g. always) would move the mass of these cells by far more than
    the ~0.05 in total variation N = 300 can resolve (the statistic would be in the
    hundreds)."""
    n_draws, sampler = 300, Sampler.top_k(1.0, 2)
    greedy, _ = _gen(qwen, "p q r", max_tokens=3)

    async def arm(first_seed: int, drafted: bool) -> Counter:
        root = Context(qwen)
        root.user("p q r")
        root.cue()
        await root.flush()
        prompt_len = len(root)

        async def one(seed: int) -> tuple[int, ...]:
            ctx = root.fork().reseed(seed)
            try:
                d = _GreedyDrafter(greedy.tokens, prompt_len) if drafted else None
                return tuple((await ctx.generate(sampler, max_tokens=3, drafter=d)).tokens)
            finally:
                ctx.close()

        out: Counter = Counter()
        for chunk in range(0, n_draws, 50):
            seeds = range(first_seed + chunk, first_seed + chunk + 50)
            out.update(await asyncio.gather(*(one(s) for s in seeds)))
        root.close()
        return out

    accepted = qwen.counters.accepted_draft_tokens
    plain = run_sync(arm(10_000, False))
    drafted = run_sync(arm(20_000, True))
    assert 0 < qwen.counters.accepted_draft_tokens - accepted < 2 * n_draws  # accepts and rejects
    cells = set(plain) | set(drafted)
    assert len(cells) <= 8
    chi2 = sum(
        (plain[c] - drafted[c]) ** 2 / (plain[c] + drafted[c]) for c in cells if plain[c] + drafted[c] > 0
    )
    assert chi2 < 24.3, (chi2, plain, drafted)
    tv = sum(abs(plain[c] - drafted[c]) for c in cells) / (2 * n_draws)
    assert tv < 0.1 + 2 / math.sqrt(n_draws), tv


class _GreedyDrafter:
    def __init__(self, truth: Sequence[int], prompt_len: int):
        self.truth, self.prompt_len, self.seen = list(truth), prompt_len, 0

    def update(self, accepted: Sequence[int]) -> None:
        self.seen += len(accepted)

    def draft(self) -> list[int]:
        at = self.seen - self.prompt_len
        return self.truth[at:]


def test_max_tokens_stop_strings_and_logprobs_hold_with_multi_token_steps(qwen):
    plain, n = _gen(qwen, COPY, max_tokens=30)
    for budget in (1, 2, 5, 7):
        got, _ = _gen(qwen, COPY, drafter=PromptLookupDrafter(num_draft=8), max_tokens=budget)
        assert got.tokens == plain.tokens[:budget] and got.reason.kind == "length"
    # A stop string inside a run of accepted drafts: the text ends before it, tokens too.
    stop = plain.text[9:13]
    want, _ = _gen(qwen, COPY, stop=stop_strings(stop) | max_tokens(30))
    got, _ = _gen(
        qwen, COPY, drafter=PromptLookupDrafter(num_draft=8), stop=stop_strings(stop) | max_tokens(30)
    )
    assert got.reason.kind == "stop_string" and got.text == want.text and got.tokens == want.tokens

    async def events(drafter):
        ctx = Context(qwen)
        ctx.user(COPY)
        ctx.cue()
        try:
            return [ev async for ev in ctx.stream(max_tokens=12, logprobs=3, drafter=drafter)]
        finally:
            ctx.close()

    a = run_sync(events(None))
    b = run_sync(events(Oracle(plain.tokens, n - 30)))
    assert [e.token for e in a] == [e.token for e in b]
    assert "".join(e.text for e in b) == "".join(e.text for e in a)
    for x, y in zip(a, b, strict=True):
        assert abs(x.logprob - y.logprob) < 1e-4
        assert [t for t, _ in x.top_logprobs] == [t for t, _ in y.top_logprobs]


def test_pages_return_and_the_context_continues_as_plain(qwen):
    """Rejected rows go back (drafts crossing page boundaries), a generation that stops on
    an accepted draft leaves a context that continues exactly as the plain one does, and
    closing returns every page."""
    in_use = qwen.pool.stats().in_use
    prompt = " ".join(["a b c d"] * 6)  # the drafts of the long run cross 32-row pages

    async def run(drafter_for):
        ctx = Context(qwen)
        ctx.user(prompt)
        ctx.cue()
        first = await ctx.generate(max_tokens=7, drafter=drafter_for())
        second = await ctx.generate(max_tokens=40, drafter=drafter_for())
        rows = len(ctx)
        ctx.close()
        return first.tokens, second.tokens, rows

    plain = run_sync(run(lambda: None))
    got = run_sync(run(lambda: PromptLookupDrafter(num_draft=8)))
    assert got == plain
    assert qwen.pool.stats().in_use == in_use


def test_generated_tokens_and_latency_counters_count_every_token(qwen):
    c = qwen.counters
    tokens, itl = c.generated_tokens, c.itl.n
    got, _ = _gen(qwen, COPY, drafter=PromptLookupDrafter(), max_tokens=20)
    assert c.generated_tokens - tokens == len(got.tokens) == 20
    assert c.itl.n - itl == 19  # one observation per token after the first


def test_a_bad_draft_is_a_typed_error_and_frees_nothing_twice(qwen):
    class Bad:
        def update(self, accepted):
            pass

        def draft(self):
            return [1, qwen.arch.vocab_size + 5]

    with pytest.raises(InvalidRequestError):
        _gen(qwen, COPY, drafter=Bad(), max_tokens=5)


def test_sync_context_passes_the_drafter(qwen):
    plain, _ = _gen(qwen, COPY, max_tokens=10)
    with SyncContext(qwen) as ctx:
        ctx.user(COPY).cue()
        got = ctx.generate(max_tokens=10, drafter=PromptLookupDrafter())
        assert got.tokens == plain.tokens
        ctx.rewind(len(got.tokens))
        assert [ev.token for ev in ctx.stream(max_tokens=10, drafter=PromptLookupDrafter())] == plain.tokens


def test_verify_draft_returns_the_accepted_prefix_plus_the_next_token(qwen, gemma):
    for model in (qwen, gemma):
        plain, _ = _gen(model, COPY, max_tokens=12)
        truth = plain.tokens

        async def run(model=model, truth=truth):
            ctx = Context(model)
            ctx.user(COPY)
            ctx.cue()
            try:
                got = await ctx.verify_draft(truth[:4])  # pending prompt: prefilled first
                assert got == truth[:5]
                wrong = [truth[5], truth[6], (truth[7] + 1) % 50, truth[8]]
                got2 = await ctx.verify_draft(wrong)  # pending last token: one pass
                assert got2 == truth[5:8]
                got3 = await ctx.verify_draft([])
                assert got3 == truth[8:9]
                rest = await ctx.generate(max_tokens=3)
                assert rest.tokens == truth[9:12]
            finally:
                ctx.close()

        run_sync(run())


@pytest.mark.parametrize("with_drafter", [False, True])
def test_closing_a_context_mid_stream_is_context_closed_and_frees_its_pages(qwen, with_drafter):
    """Closing while a pass of the stream runs (plain or drafted step) ends the stream with
    ContextClosedError, not an internal assertion, and the pages come back."""
    from engine import ContextClosedError

    before = qwen.pool_stats().in_use

    async def main():
        ctx = Context(qwen)
        ctx.user(COPY)
        ctx.cue()
        drafter = PromptLookupDrafter(num_draft=4) if with_drafter else None
        n = 0
        with pytest.raises(ContextClosedError):
            async for _ in ctx.stream(Sampler.greedy(), max_tokens=40, stop=None, drafter=drafter):
                n += 1
                if n == 3:
                    ctx.close()
        assert n == 3

    asyncio.run(main())
    assert qwen.pool_stats().in_use == before
