"""Pie's ``grammar`` / ``matcher`` resources (engine/grammar_matcher.py) on the tiny models.

Random walks draw only from the BRLE mask the matcher hands out, as a guest's sampler
would: every walk ends terminated on text the grammar accepts (checked independently:
``json.loads`` + ``jsonschema``, ``re.fullmatch``), so every token the mask allowed kept
a valid prefix. Each mask is decoded and compared with llguidance's own bitmask, and its
length is the model's logits width (tiny-qwen3-vl's is wider than its tokenizer: the
padding ids must never be allowed).
"""

from __future__ import annotations

import json
import random
import re

import jsonschema
import numpy as np
import pytest

from engine import brle
from engine import grammar_matcher as gm
from engine.grammar import GrammarError
from engine.grammar_matcher import GrammarSource, GrammarTokenRejectedError, TokenMatcher, ebnf_to_lark
from media.errors import InvalidRequestError
from tests.engine.conftest import TINY_GEMMA, TINY_QWEN

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "pet": {"enum": ["cat", "dog", None]},
        "skills": {
            "type": "array",
            "items": {"type": "string", "maxLength": 4},
            "minItems": 1,
            "maxItems": 2,
        },
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "skills"],
}

# Pie 0.4.0's own built-in JSON grammar (runtime/src/inference/structured/json_schema.rs),
# with its control-character range written as escapes: a grammar in Pie's EBNF dialect.
PIE_JSON_EBNF = r"""
root ::= value
value ::= object | array | string | number | "true" | "false" | "null"
object ::= "{" ws (pair ("," ws pair)*)? ws "}"
pair ::= ws string ws ":" ws value
array ::= "[" ws (value ("," ws value)*)? ws "]"
string ::= "\"" char* "\""
char ::= [^"\\\x00-\x1f] | "\\" escape
escape ::= "\"" | "\\" | "/" | "b" | "f" | "n" | "r" | "t" | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F]
number ::= integer fraction? exponent?
integer ::= "-"? ("0" | [1-9] [0-9]*)
fraction ::= "." [0-9]+
exponent ::= [eE] [+-]? [0-9]+
ws ::= [ \t\n\r]*
"""

# A finite language in Pie's dialect (multi-line rule, comments, escapes, a negated class,
# bounded repeats, a lookahead hint), so a random walk always ends; and its regex twin.
POINT_EBNF = r"""
# a point, optionally labelled
root ::= "point(" num ", " num ")"
    label?
num ::= "-"? [0-9]{1,3}   # at most three digits
label ::= " \x23 " word (= "")
word ::= [a-z] [^\x00-\x60\x7b-\U0010FFFF]{0,4}
"""
POINT_RE = r"point\(-?[0-9]{1,3}, -?[0-9]{1,3}\)( # [a-z]{1,5})?"


@pytest.fixture(scope="module", params=[TINY_QWEN, TINY_GEMMA])
def model(request, models):
    return models[request.param]


def llg_allowed(matcher: TokenMatcher) -> np.ndarray:
    """llguidance's own bitmask for the matcher's state, as (vocab_size,) bool."""
    bits = np.frombuffer(matcher._m.compute_bitmask(), dtype=np.uint8)
    return np.unpackbits(bits, bitorder="little")[: matcher.vocab_size].astype(bool)


def walk(matcher: TokenMatcher, model, rng: random.Random, *, max_steps: int = 300) -> list[int]:
    """Draw tokens only from the matcher's BRLE mask until it terminates; checks every
    mask against llguidance's on the way. Returns the ids (stop token excluded)."""
    vocab = model.arch.vocab_size
    text_ids = len(model.tokenizer)
    out: list[int] = []
    for _ in range(max_steps):
        runs = matcher.next_token_mask_brle()
        assert sum(runs) == vocab and all(r >= 0 for r in runs)
        assert len(runs) <= 1 or all(r > 0 for r in runs[1:]), "the shortest BRLE"
        allowed = brle.decode(runs, vocab)
        np.testing.assert_array_equal(allowed, llg_allowed(matcher))
        assert not allowed[text_ids:].any(), "a padding id past the tokenizer was allowed"
        ids = np.flatnonzero(allowed).tolist()
        assert ids, f"nothing allowed after {model.detokenize(out)!r}"
        stops = [t for t in ids if t in matcher.stop_tokens]
        assert bool(stops) == matcher.is_complete()
        if stops and rng.random() < 0.5:
            matcher.accept_tokens([rng.choice(stops)])
            assert matcher.is_terminated()
            assert brle.count_true(matcher.next_token_mask_brle()) == 0
            return out
        token = rng.choice([t for t in ids if t not in matcher.stop_tokens] or stops)
        matcher.accept_tokens([token])
        if matcher.is_terminated():
            return out
        out.append(token)
    raise AssertionError(f"no termination in {max_steps} steps: {model.detokenize(out)!r}")


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_random_walk_ends_on_valid_json(model, seed):
    matcher = TokenMatcher(GrammarSource.from_json_schema(json.dumps(PERSON)), model)
    ids = walk(matcher, model, random.Random(seed))
    value = json.loads(model.detokenize(ids))
    jsonschema.validate(value, PERSON)
    assert set(value) <= set(PERSON["properties"]), "Pie's strict mode: no other keys"


def test_json_schema_greedy_text_walk(qwen):
    """A guest's loop over a whole answer: accept a valid JSON's tokens one at a time, the
    mask allowing each before it is taken, then a stop token."""
    matcher = TokenMatcher(GrammarSource.from_json_schema(PERSON), qwen)
    ids = qwen.tokenize(json.dumps({"name": "Al", "age": 30, "skills": ["go"]}))
    for t in ids:
        assert not matcher.is_complete()
        assert brle.decode(matcher.next_token_mask_brle(), qwen.arch.vocab_size)[t]
        matcher.accept_tokens([t])
    assert matcher.is_complete() and not matcher.is_terminated()
    stop = min(matcher.stop_tokens)
    assert brle.decode(matcher.next_token_mask_brle(), qwen.arch.vocab_size)[stop]
    matcher.accept_tokens([stop])
    assert matcher.is_terminated()


def test_json_schema_strict_like_pie(qwen):
    extra = qwen.tokenize('{"name": "Al", "age": 3, "skills": ["a"], "zz": 1}')
    with pytest.raises(GrammarTokenRejectedError):
        TokenMatcher(GrammarSource.from_json_schema(PERSON), qwen).accept_tokens(extra)
    open_schema = {**PERSON, "additionalProperties": True}
    TokenMatcher(GrammarSource.from_json_schema(open_schema), qwen).accept_tokens(extra)


def test_any_json(qwen):
    g = GrammarSource.any_json()
    for text in ['[1, "x", {"a": null}]', "3.5", '"s"', '{"k": [true, false]}']:
        m = TokenMatcher(g, qwen)
        m.accept_tokens(qwen.tokenize(text))
        assert m.is_complete(), text
    with pytest.raises(GrammarTokenRejectedError):
        TokenMatcher(g, qwen).accept_tokens(qwen.tokenize("{]"))


@pytest.mark.parametrize("seed", range(4))
def test_regex_random_walk(model, seed):
    pattern = r"[0-9]{3}-[a-z]{2,4}( ok| no)?"
    matcher = TokenMatcher(GrammarSource.from_regex(pattern), model)
    text = model.detokenize(walk(matcher, model, random.Random(seed)))
    assert re.fullmatch(pattern, text), text


def test_regex_first_mask_is_the_prefixes(qwen):
    matcher = TokenMatcher(GrammarSource.from_regex("yes|no"), qwen)
    ids = np.flatnonzero(brle.decode(matcher.next_token_mask_brle(), qwen.arch.vocab_size))
    texts = {qwen.detokenize([int(t)]) for t in ids}
    assert texts and all("yes".startswith(s) or "no".startswith(s) for s in texts), texts
    assert {"yes", "no"} <= texts


@pytest.mark.parametrize("seed", range(4))
def test_ebnf_random_walk(model, seed):
    matcher = TokenMatcher(GrammarSource.from_ebnf(POINT_EBNF), model)
    text = model.detokenize(walk(matcher, model, random.Random(seed)))
    assert re.fullmatch(POINT_RE, text), text


def test_ebnf_pie_builtin_json_grammar(qwen):
    g = GrammarSource.from_ebnf(PIE_JSON_EBNF)
    for text in ['{"a": [1, 2.5e3, "x\\n\\u00e9"], "b": null}', "[ ]", "-0.5E+2", '"\\"q\\""', "true"]:
        m = TokenMatcher(g, qwen)
        m.accept_tokens(qwen.tokenize(text))
        assert m.is_complete(), text
        json.loads(text)
    for text in ['{"a" 1}', "01", '"\x01"', "[1,]"]:
        m = TokenMatcher(g, qwen)
        with pytest.raises(GrammarTokenRejectedError):
            m.accept_tokens(qwen.tokenize(text))
            if not m.is_complete():  # a valid prefix only: the stop token must be refused
                m.accept_tokens([min(m.stop_tokens)])


def test_ebnf_to_lark_keeps_every_rule_a_rule():
    lark = ebnf_to_lark('root ::= item-x.y+ "!"\nitem-x.y ::= [a-c\\]-] | "\\u0041\\x42"')
    assert lark.splitlines() == [
        'start: r1_item_x_y+ "!"',
        r"r1_item_x_y: /[\u{61}-\u{63}\u{5d}\u{2d}]/ | " + '"AB"',
    ]


def test_violating_token_raises_and_changes_nothing(model):
    matcher = TokenMatcher(GrammarSource.from_regex("abc[0-9]+"), model)
    good = model.tokenize("abc12")
    matcher.accept_tokens(good[:1])
    before_mask = matcher.next_token_mask_brle()
    bad = model.tokenize("x")[0]
    with pytest.raises(GrammarTokenRejectedError) as info:
        matcher.accept_tokens([*good[1:], bad])
    assert info.value.code == "grammar_token_rejected"
    assert info.value.details == {"token": bad, "index": len(good) - 1}
    assert isinstance(info.value, InvalidRequestError)
    assert matcher.next_token_mask_brle() == before_mask and matcher.tokens == 1
    stop = min(matcher.stop_tokens)
    for ids in ([model.arch.vocab_size], [-1], [stop]):  # outside the vocabulary; a stop token too early
        with pytest.raises(GrammarTokenRejectedError):
            matcher.accept_tokens(ids)
        assert matcher.next_token_mask_brle() == before_mask and not matcher.is_terminated()
    matcher.accept_tokens(good[1:])
    assert matcher.is_complete()
    matcher.accept_tokens([stop])
    with pytest.raises(GrammarTokenRejectedError, match="terminated"):
        matcher.accept_tokens(model.tokenize("1"))
    assert matcher.is_terminated()


def test_reset(model):
    g = GrammarSource.from_regex("[0-9]{2}")
    matcher = TokenMatcher(g, model)
    first = matcher.next_token_mask_brle()
    walk(matcher, model, random.Random(0))
    assert matcher.is_terminated()
    matcher.reset()
    assert not matcher.is_terminated() and matcher.tokens == 0
    assert matcher.next_token_mask_brle() == first
    assert re.fullmatch("[0-9]{2}", model.detokenize(walk(matcher, model, random.Random(1))))


def test_compiled_grammar_cached_per_model(qwen, monkeypatch):
    g = GrammarSource.from_regex("cache[0-9]")
    first = TokenMatcher(g, qwen)
    assert g in gm._CACHE[qwen]

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(gm, "_tokenizer_for", no_compile)
    second = TokenMatcher(GrammarSource.from_regex("cache[0-9]"), qwen)  # an equal source
    first.accept_tokens(qwen.tokenize("cache"))
    assert second.tokens == 0 and second.next_token_mask_brle() != first.next_token_mask_brle()
    second.reset()  # from the cache as well


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: GrammarSource.from_json_schema("{"), ["JSON schema", "not valid JSON"]),
        (lambda: GrammarSource.from_json_schema("[1]"), ["must be an object", "list"]),
        (lambda: GrammarSource.from_json_schema('{"type": "nonsense"}'), ["JSON schema", "nonsense"]),
        (lambda: GrammarSource.from_json_schema({"$ref": "#/nope"}), ["JSON schema", "/nope"]),
        (lambda: GrammarSource.from_regex("(ab"), ["regex", "'(ab'", "unclosed group"]),
        (lambda: GrammarSource.from_regex("[z-a]"), ["regex", "[z-a]"]),
        (lambda: GrammarSource.from_ebnf('start: "a"'), ["EBNF", "line 1, column 6", ":"]),
        (lambda: GrammarSource.from_ebnf('foo ::= "a"'), ["EBNF", 'root rule "root" not found']),
        (
            lambda: GrammarSource.from_ebnf("root ::= missing"),
            ["line 1, column 10", '"missing" is not defined'],
        ),
        (lambda: GrammarSource.from_ebnf('root ::= "a"\nroot ::= "b"'), ["line 2", "defined multiple times"]),
        (lambda: GrammarSource.from_ebnf('root ::= "ab'), ["unterminated string"]),
        (lambda: GrammarSource.from_ebnf("root ::= [z-a]"), ["lower bound > upper bound"]),
        (lambda: GrammarSource.from_ebnf('root ::= "a"{3,1}'), ["lower bound is larger"]),
        (lambda: GrammarSource.from_ebnf('root ::= "a" x ::= "b"'), ["beginning of the line"]),
        (lambda: GrammarSource.from_ebnf("root ::= ("), ["line 1, column 11", "end of input"]),
        (lambda: GrammarSource.from_ebnf('root ::= "\\q"'), ["invalid escape sequence"]),
        (lambda: GrammarSource.from_ebnf("root ::= []"), ["empty character class"]),
    ],
)
def test_bad_sources_give_a_typed_error(make, words):
    with pytest.raises(GrammarError) as info:
        make()
    assert isinstance(info.value, InvalidRequestError) and info.value.code == "invalid_grammar"
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_str_and_repr():
    assert str(GrammarSource.from_regex("yes|no")) == "regex: yes|no"
    assert repr(GrammarSource.from_regex("yes|no")) == "GrammarSource.from_regex('yes|no')"
    assert str(GrammarSource.any_json()) == "json: any JSON value"
    assert repr(GrammarSource.any_json()) == "GrammarSource.any_json()"
    schema = json.dumps(PERSON)
    assert str(GrammarSource.from_json_schema(schema)) == f"json_schema: {schema}"
    assert repr(GrammarSource.from_ebnf(PIE_JSON_EBNF)).startswith(
        "GrammarSource.from_ebnf('\\nroot ::= value"
    )
    assert (
        GrammarSource.from_regex("a")
        == GrammarSource.from_regex("a")
        != GrammarSource.from_ebnf('root ::= "a"')
    )
