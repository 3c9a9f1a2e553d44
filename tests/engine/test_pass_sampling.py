"""Sampling in the forward pass (engine.pass_sampling): every context's tokens are the ones it
would draw on its own (seeded ones included), alone or sharing its passes with others,
greedy and penalised rows included; grammar-constrained and custom-sampler contexts keep
their own path in the same passes; a row that cannot be sampled fails only its context."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine import Context, Grammar, Penalties, Sampler, SyncContext, max_tokens, pass_sampling
from engine.forward import StepInput
from engine.pass_sampling import SampleRequest, sample_pass
from engine.sampling import generator, sample

N = 8
SPECS = [
    ("Tell me a story.", Sampler.top_p(0.8, 0.9), 1, None),
    ("Name three colours.", Sampler.top_k(0.7, 20), 2, None),
    ("Count to ten.", Sampler.min_p(1.0, 0.3), 3, None),
    ("What is a cat?", Sampler.multinomial(1.0), 4, Penalties.of(repetition=1.3, logit_bias={11: 5.0})),
    ("Say hello.", Sampler.greedy(), None, Penalties.of(frequency=0.5)),
    ("Describe rain.", Sampler.greedy(), None, None),
    ("Pick a number.", Sampler.top_k_top_p(0.6, 20, 0.95), 7, None),
]


def by_hand(model, prompt: str, sampler: Sampler, seed: int | None, penalties: Penalties | None) -> list[int]:
    """The per-context path: each step's logits read from the context, penalties applied,
    then ``engine.sampling.sample`` with a generator seeded as the context's own."""
    ctx = SyncContext(model, seed=seed).user(prompt).cue()
    g = generator(seed) if seed is not None else None
    adjust = penalties.start(ctx.token_ids) if penalties is not None else None
    out: list[int] = []
    for _ in range(N):
        row = ctx.next_token_logits()
        if adjust is not None:
            row = adjust.apply(row)
        token = int(sample(row[None], sampler, g)[0])
        if adjust is not None:
            adjust.add(token)
        out.append(token)
        ctx.fill_tokens([token])
    ctx.close()
    return out


async def generate(model, specs, extra=()) -> list[list[int]]:
    contexts = [Context(model, seed=seed).user(prompt).cue() for prompt, _, seed, _ in specs]

    async def one(ctx, sampler, penalties):
        return (await ctx.generate(sampler, max_tokens(N), penalties=penalties)).tokens

    try:
        return await asyncio.gather(
            *(one(c, s, p) for c, (_, s, _, p) in zip(contexts, specs, strict=True)), *extra
        )
    finally:
        for c in contexts:
            c.close()


@pytest.fixture
def batches(monkeypatch):
    """The row count of every batched sampling call (the real one runs)."""
    sizes: list[int] = []
    real = pass_sampling.sample_or_mark

    def counting(logits, samplers, generators):
        sizes.append(logits.shape[0])
        return real(logits, samplers, generators)

    monkeypatch.setattr(pass_sampling, "sample_or_mark", counting)
    return sizes


def test_tokens_equal_the_per_context_path_alone_and_together(qwen, batches) -> None:
    want = [by_hand(qwen, *spec) for spec in SPECS]
    assert len({tuple(w) for w in want}) == len(want)
    batches.clear()
    together = asyncio.run(generate(qwen, SPECS))
    assert together == want
    assert max(batches) == len(SPECS)  # every context's row in one call
    assert sum(batches) >= len(SPECS) * (N - 1)  # the decode steps were all drawn in passes
    for spec, w in zip(SPECS, want, strict=True):
        assert asyncio.run(generate(qwen, [spec])) == [w]


def test_grammar_and_custom_samplers_share_passes_on_their_own_path(qwen, batches) -> None:
    def second(ids, ps):
        return ids[1]

    async def constrained(model):
        ctx = Context(model, seed=5).user("Digits only.").cue()
        try:
            out = await ctx.generate(
                Sampler.top_p(1.0, 0.9), max_tokens(N), grammar=Grammar.regex("[0-9]{4,12}")
            )
            return out.tokens
        finally:
            ctx.close()

    async def custom(model):
        ctx = Context(model).user("Anything.").cue()
        try:
            return (await ctx.generate(Sampler.custom(second, candidates=4), max_tokens(N))).tokens
        finally:
            ctx.close()

    async def alone(coro):
        return await coro

    grammar_alone = asyncio.run(alone(constrained(qwen)))
    custom_alone = asyncio.run(alone(custom(qwen)))
    batches.clear()
    results = asyncio.run(generate(qwen, SPECS[:2], extra=(constrained(qwen), custom(qwen))))
    assert results[:2] == [by_hand(qwen, *spec) for spec in SPECS[:2]]
    assert results[2] == grammar_alone and results[3] == custom_alone
    assert qwen.detokenize(results[2], skip_special_tokens=True).isdigit()
    assert max(batches) == 2  # only the two plain contexts' rows were batched


def test_a_row_without_finite_logits_is_left_to_its_context() -> None:
    vocab = 50
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=g)
    logits[1] = float("nan")
    hidden = torch.zeros(4)

    def step(kind: str, sampler: Sampler | None, seed: int = 0) -> StepInput:
        request = SampleRequest(sampler, generator(seed)) if sampler is not None else None
        return StepInput(
            tokens=[1],
            positions=torch.zeros(1, 1, dtype=torch.long),
            kv_start=0,
            pages=[0],
            logits=kind,
            sample=request,
        )

    steps = [
        step("last", Sampler.top_p(1.0, 0.9), 1),
        step("last", Sampler.top_p(1.0, 0.9), 2),
        step("last+hidden", Sampler.top_k(1.0, 5), 3),
        step("last", None),
    ]
    out = [logits[0], logits[1], (logits[2], hidden), logits[0]]
    sample_pass(steps, out)
    assert steps[1].sampled is None and steps[3].sampled is None
    assert steps[0].sampled == int(sample(logits[0][None], Sampler.top_p(1.0, 0.9), generator(1))[0])
    assert steps[2].sampled == int(sample(logits[2][None], Sampler.top_k(1.0, 5), generator(3))[0])


def test_consecutive_rows_are_sampled_without_a_copy() -> None:
    rows = torch.randn(4, 30)
    view = pass_sampling._stacked([rows[i] for i in range(4)])
    assert view.data_ptr() == rows.data_ptr() and torch.equal(view, rows)
    shuffled = pass_sampling._stacked([rows[2], rows[0]])
    assert torch.equal(shuffled, rows[[2, 0]])
