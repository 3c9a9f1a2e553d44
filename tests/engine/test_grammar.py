"""Constrained decoding: JSON schema, regex and Lark grammars as a token mask.

The tiny models have random weights, so unconstrained they emit noise: whatever they
produce under a grammar is valid only because of the mask. Every output is checked with
``json.loads`` + ``jsonschema`` or ``re.fullmatch``, over several samplers and seeds, with
text and with an image in the context, on both architectures.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine import (
    CompletionParams,
    Context,
    Grammar,
    GrammarError,
    GrammarMatcher,
    Sampler,
    SyncContext,
    Turn,
    complete,
    run_sync,
)
from media import Image
from tests.engine.conftest import TINY_GEMMA, TINY_QWEN

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", None]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "pet", "ok"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "box": {
            "type": "object",
            "properties": {"w": {"type": "integer", "minimum": 1, "maximum": 99}, "h": {"type": "number"}},
            "required": ["w"],
            "additionalProperties": False,
        },
        "kind": {"anyOf": [{"const": "a"}, {"type": "integer", "minimum": -5, "maximum": 5}]},
    },
    "required": ["box", "kind"],
    "additionalProperties": False,
}
SAMPLERS = [
    Sampler.greedy(),
    Sampler.multinomial(1.0),
    Sampler.top_p(1.3, 0.9),
    Sampler.top_k(1.0, 5),
    Sampler.min_p(1.0, 0.05),
    Sampler.custom(lambda ids, ps: ids[-1]),  # the least probable allowed token
]


@pytest.fixture(scope="module")
def image(samples) -> Image:
    return Image.from_path(samples / "images" / "photo_640x480.jpg")


def _models(qwen, gemma):
    return {TINY_QWEN: qwen, TINY_GEMMA: gemma}


@pytest.mark.parametrize("name", [TINY_QWEN, TINY_GEMMA])
@pytest.mark.parametrize("schema", [PERSON, NESTED], ids=["person", "nested"])
def test_json_schema_output_always_validates(qwen, gemma, image, name, schema):
    model = _models(qwen, gemma)[name]
    grammar = Grammar.json_schema(schema)
    for i, sampler in enumerate(SAMPLERS):
        ctx = SyncContext(model, seed=i)
        if i % 2:
            ctx.user(image, "Describe it as JSON.")
        else:
            ctx.user("Describe a person as JSON.")
        g = ctx.cue().generate(sampler, max_tokens=120, grammar=grammar)
        ctx.close()
        assert g.finish_reason in ("grammar", "eos"), (sampler, g.text)
        value = json.loads(g.text)
        jsonschema.validate(value, schema)
        assert (
            list(value)[: len(schema["required"])]
            == [k for k in schema["properties"] if k in value][: len(schema["required"])]
        )  # properties come in the schema's order


def test_unconstrained_output_is_not_json(qwen):
    """The control: without the grammar the same prompt gives text no parser accepts, so
    the validity above is the mask's doing."""
    g = SyncContext(qwen).user("Describe a person as JSON.").cue().generate(max_tokens=30)
    with pytest.raises(ValueError):
        json.loads(g.text)


@pytest.mark.parametrize("name", [TINY_QWEN, TINY_GEMMA])
def test_regex_and_lark(qwen, gemma, name):
    model = _models(qwen, gemma)[name]
    pattern = r"(yes|no): [0-9]{2,4}-[a-z]{1,3}"
    for seed in range(4):
        g = SyncContext(model, seed=seed).user("Answer.").cue()
        out = g.generate(Sampler.multinomial(1.0), max_tokens=40, grammar=Grammar.regex(pattern))
        assert re.fullmatch(pattern, out.text), out.text
        assert out.finish_reason == "grammar"
    lark = 'start: "(" op " " num " " num ")"\nop: "+" | "*"\nnum: /[1-9][0-9]?/\n'
    out = SyncContext(model).user("Math.").cue().generate(max_tokens=40, grammar=Grammar.lark(lark))
    assert re.fullmatch(r"\((\+|\*) [1-9][0-9]? [1-9][0-9]?\)", out.text), out.text


def test_json_object_mode(qwen):
    out = SyncContext(qwen, seed=3).user("JSON please").cue()
    g = out.generate(Sampler.top_k(1.0, 3), max_tokens=60, grammar=Grammar.json())
    if g.finish_reason != "length":  # an open-ended object may run past the budget
        assert isinstance(json.loads(g.text), dict)
    else:
        assert g.text.startswith("{")


def test_greedy_under_a_grammar_takes_the_best_allowed_token(qwen):
    """At every step the chosen token is the argmax of the logits over the allowed set."""
    grammar = Grammar.regex(r"[a-z]{3,6}")
    ctx = SyncContext(qwen).user("Say a word.").cue()
    fork = ctx.fork()
    g = ctx.generate(max_tokens=10, grammar=grammar)
    matcher = GrammarMatcher(grammar, qwen)
    for token in g.tokens:
        logits = fork.next_token_logits()
        allowed = matcher.allowed()
        best = int(torch.where(allowed, logits[: allowed.shape[0]], float("-inf")).argmax())
        assert token == best
        matcher.accept(token)
        fork.fill_tokens([token])
    assert re.fullmatch(r"[a-z]{3,6}", g.text)


def test_completion_choices_each_follow_the_grammar(qwen, image):
    params = CompletionParams(
        sampler=Sampler.multinomial(1.0), max_tokens=100, n=3, seed=7, grammar=Grammar.json_schema(PERSON)
    )
    results, _ = run_sync(complete(qwen, [Turn("user", (image, "JSON"))], params))
    texts = [r.text for r in results]
    for r in results:
        jsonschema.validate(json.loads(r.text), PERSON)
        assert r.finish_reason == "stop"
    assert len(set(texts)) > 1  # seeded choices still differ inside the grammar


def test_bad_grammars_are_typed_errors(qwen):
    for make in (
        lambda: Grammar.json_schema("{not json"),
        lambda: Grammar.json_schema([1, 2]),
        lambda: GrammarMatcher(Grammar.regex("(unclosed"), qwen),
        lambda: GrammarMatcher(Grammar.lark("start: undefined_rule"), qwen),
        lambda: GrammarMatcher(Grammar.json_schema({"type": "no-such-type"}), qwen),
        lambda: Grammar.regex("a" * (256 * 1024 + 1)),
    ):
        with pytest.raises(GrammarError) as e:
            make()
        assert e.value.code == "invalid_grammar"


def test_custom_sampler_choosing_outside_the_grammar_is_a_typed_error(qwen):
    ctx = Context(qwen).user("digits").cue()
    bad = Sampler.custom(lambda ids, ps: 0, temperature=1.0)  # token 0 is "!", not a digit

    with pytest.raises(GrammarError, match="not allowed"):
        run_sync(ctx.generate(bad, max_tokens=5, grammar=Grammar.regex("[0-9]+")))
    ctx.close()
    assert repr(Grammar.regex("[0-9]+")) == "Grammar.regex('[0-9]+')"


def test_a_grammar_past_llguidances_limits_says_so(qwen):
    """A regex whose lexer outgrows llguidance's budget: the error names that, not the
    token the sampler chose (it read "token 151645 is not allowed here" before)."""
    matcher = GrammarMatcher(Grammar.regex("(a|aa)*(b|bb)*" * 200), qwen)
    for token in qwen.tokenize("aab"):
        matcher.accept(token)
    with pytest.raises(GrammarError, match="cannot be followed.*too many expressions"):
        for token in sorted(qwen.eos_token_ids):  # allowed by the mask; the lexer gives up
            matcher.allowed()
            matcher.accept(token)


def test_mask_fits_a_head_wider_or_narrower_than_the_vocabulary(qwen):
    """Checkpoints pad their LM head past the tokenizer's vocabulary: the extra ids are
    masked out; a narrower row is masked on the ids it has."""
    matcher = GrammarMatcher(Grammar.regex("[0-9]"), qwen)
    allowed = matcher.allowed()
    wide = matcher.mask(torch.zeros(allowed.shape[0] + 64))
    assert torch.isinf(wide[allowed.shape[0] :]).all()
    assert torch.equal(torch.isfinite(wide[: allowed.shape[0]]), allowed)
    narrow = matcher.mask(torch.zeros(allowed.shape[0] - 10))
    assert torch.equal(torch.isfinite(narrow), allowed[:-10])
