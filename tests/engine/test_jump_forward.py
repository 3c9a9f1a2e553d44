"""Grammar jump-forward: tokens the grammar forces are checked in the pass of the token
before them, so a constrained generation takes fewer passes and gives the tokens a
step-by-step constrained loop gives (one pass per token, written out here by hand with
``next_token_logits`` and the matcher)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine import Context, Grammar, GrammarMatcher, Sampler, run_sync, sampling
from media import Image
from tests.engine.conftest import TINY_GEMMA, TINY_QWEN

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "colour": {"enum": ["red", "green"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "colour", "count", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def image(samples) -> Image:
    return Image.from_path(samples / "images" / "photo_640x480.jpg")


def _fill(ctx: Context, image: Image | None) -> None:
    if image is not None:
        ctx.user(image, "JSON please")
    else:
        ctx.user("JSON please")
    ctx.cue()


async def _step_by_step(model, grammar, sampler, seed, image, limit=80) -> list[int]:
    """The reference: one pass per token, the mask and the sampler applied by hand."""
    ctx = Context(model)
    _fill(ctx, image)
    matcher = GrammarMatcher(grammar, model)
    gen = sampling.generator(seed) if seed is not None else None
    out: list[int] = []
    try:
        while not matcher.done and len(out) < limit:
            logits = await ctx.next_token_logits()
            token = int(sampling.sample(matcher.mask(logits)[None], sampler, gen)[0])
            matcher.accept(token)
            out.append(token)
            ctx.fill_tokens([token])
    finally:
        ctx.close()
    return out


async def _jump(model, grammar, sampler, seed, image, limit=80) -> list[int]:
    ctx = Context(model, seed=seed)
    _fill(ctx, image)
    try:
        gen = await ctx.generate(sampler, max_tokens=limit, grammar=grammar)
        return gen.tokens
    finally:
        ctx.close()


@pytest.mark.parametrize("name", [TINY_QWEN, TINY_GEMMA])
def test_jump_forward_equals_step_by_step_in_fewer_passes(qwen, gemma, image, name):
    model = {TINY_QWEN: qwen, TINY_GEMMA: gemma}[name]
    grammar = Grammar.json_schema(SCHEMA)
    runs = (
        (None, Sampler.greedy(), None),
        (None, Sampler.top_k(1.0, 20), 7),
        (image, Sampler.greedy(), None),
    )
    for img, sampler, seed in runs:
        want = run_sync(_step_by_step(model, grammar, sampler, seed, img))
        passes, drafted = model.scheduler.stats.passes, model.counters.accepted_draft_tokens
        got = run_sync(_jump(model, grammar, sampler, seed, img))
        used = model.scheduler.stats.passes - passes
        assert got == want
        value = json.loads(model.detokenize(got, skip_special_tokens=True))
        jsonschema.validate(value, SCHEMA)
        # The keys, quotes and separators are forced: far fewer passes than tokens.
        forced = model.counters.accepted_draft_tokens - drafted
        assert forced >= 8
        assert used <= len(got) - forced + 1  # prefill + one pass per free token (at most)


def test_forced_tokens_of_a_fixed_prefix(qwen):
    m = GrammarMatcher(Grammar.json_schema(SCHEMA), qwen)
    forced = m.forced()
    assert qwen.detokenize(forced).startswith('{"name":')  # llguidance stops before a token that could merge
    m2 = GrammarMatcher(Grammar.regex(r"\d+"), qwen)
    assert m2.forced() == []


def test_jump_forward_respects_max_tokens_and_custom_samplers(qwen):
    grammar = Grammar.json_schema(SCHEMA)
    full = run_sync(_jump(qwen, grammar, Sampler.greedy(), None, None))
    for budget in (1, 3, 6):
        got = run_sync(_jump(qwen, grammar, Sampler.greedy(), None, None, limit=budget))
        assert got == full[:budget]
    # A custom sampler sees every step (no jump-forward): same tokens as greedy here.
    passes = qwen.scheduler.stats.passes
    custom = run_sync(_jump(qwen, grammar, Sampler.custom(lambda ids, ps: ids[0]), None, None))
    assert custom == full
    assert qwen.scheduler.stats.passes - passes >= len(full) - 1  # one per token after the first
