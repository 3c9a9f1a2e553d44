"""Constrained decoding: a JSON schema, a regex or a Lark grammar as a token mask.

The grammar engine is llguidance (an existing library; chosen over xgrammar and
outlines-core because it compiles a JSON schema against a 151k-token vocabulary in about
0.03 s where xgrammar took 1.3 s here, it needs no per-vocabulary precomputation, and one
package gives JSON schema, regex and Lark). What this module adds is the binding to the
engine: a ``Grammar`` is an immutable description (reusable across requests); a
``GrammarMatcher`` is one generation's parser state, built per ``Context.stream`` call.
Before each token the matcher's allowed-token bitmask sets every other logit to -inf, so
every sampler (greedy, top-k/top-p/min-p, custom) draws only tokens the grammar allows;
after it the sampled token advances the parser.

llguidance is imported lazily: the engine loads without it and a request that asks for a
grammar gets a typed error saying how to install it.
"""

from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from engine.errors import EngineError, InvalidRequestError

GrammarKind = Literal["json_schema", "json", "regex", "lark"]

MAX_GRAMMAR_CHARS = 256 * 1024
"""Longest schema/regex/grammar source accepted (compiling is linear-ish, but unbounded
input is an allocation the caller controls)."""


class GrammarError(EngineError, InvalidRequestError):
    """The schema, regex or grammar cannot be compiled (its message says where)."""

    code = "invalid_grammar"


class GrammarUnavailableError(EngineError):
    """llguidance is not installed."""

    code = "grammar_unavailable"


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf  # noqa: F401
    except ImportError:
        raise GrammarUnavailableError(
            "constrained decoding needs llguidance: pip install llguidance"
        ) from None
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """What generated text must match. Build with the constructors:
    ``Grammar.json_schema({...})``, ``Grammar.json()``, ``Grammar.regex(r"\\d+")``,
    ``Grammar.lark(text)``."""

    kind: GrammarKind
    source: str
    """The schema as JSON text, the regex, or the Lark grammar ("" for any JSON)."""

    def __post_init__(self) -> None:
        if len(self.source) > MAX_GRAMMAR_CHARS:
            raise GrammarError(
                f"{self.kind} source is {len(self.source)} characters; the limit is {MAX_GRAMMAR_CHARS}",
                limit=MAX_GRAMMAR_CHARS,
                actual=len(self.source),
            )

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> Grammar:
        """Output is one JSON value valid against ``schema`` (a dict or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema))  # key order kept: it orders the output

    @classmethod
    def json(cls) -> Grammar:
        """Output is one JSON object (OpenAI's ``response_format={"type": "json_object"}``)."""
        return cls("json", "")

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Output matches ``pattern`` as a whole."""
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> Grammar:
        """Output is a sentence of the Lark grammar (llguidance's Lark dialect, ``start``
        rule first)."""
        return cls("lark", grammar)

    def compiled(self) -> str:
        """The llguidance grammar text (compiled once per distinct grammar)."""
        return _compile(self.kind, self.source)

    def __repr__(self) -> str:
        src = self.source if len(self.source) <= 60 else self.source[:57] + "..."
        return f"Grammar.{self.kind}({src!r})" if self.source else f"Grammar.{self.kind}()"


JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How generated JSON is laid out: ``json.dumps``'s separators and no other whitespace.
llguidance's default allows any run of whitespace between tokens, which a weak model
fills forever; a schema's own ``x-guidance`` options still override this."""

_COMPILED: dict[tuple[str, str], str] = {}
_COMPILED_MAX = 256
_LOCK = threading.Lock()


def _compile(kind: str, source: str) -> str:
    with _LOCK:
        hit = _COMPILED.get((kind, source))
    if hit is not None:
        return hit
    llg = _llguidance()
    try:
        if kind == "json_schema":
            text = llg.LLMatcher.grammar_from_json_schema(source, defaults=JSON_LAYOUT)
        elif kind == "json":
            text = llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
        elif kind == "regex":
            text = llg.LLMatcher.grammar_from_regex(source)
        else:
            text = llg.LLMatcher.grammar_from_lark(source)
    except ValueError as e:
        raise GrammarError(f"cannot compile the {kind}: {e}") from None
    error = llg.LLMatcher.validate_grammar(text)
    if error and not error.startswith("WARNING"):
        raise GrammarError(f"cannot compile the {kind}: {error.strip()[:500]}")
    with _LOCK:
        if len(_COMPILED) >= _COMPILED_MAX:
            _COMPILED.pop(next(iter(_COMPILED)))
        _COMPILED[(kind, source)] = text
    return text


# One llguidance tokenizer per HF tokenizer (building it walks the whole vocabulary).
_TOKENIZERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def _tokenizer_for(tokenizer: Any, vocab: int, eos: list[int]) -> Any:
    llg = _llguidance()
    with _LOCK:
        hit = _TOKENIZERS.get(tokenizer)
        if hit is not None and hit[0] == (vocab, tuple(eos)):
            return hit[1]
    try:
        lt = llg.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos or None)
    except ValueError as e:
        raise GrammarUnavailableError(f"this model's tokenizer cannot drive a grammar: {e}") from None
    with _LOCK:
        _TOKENIZERS[tokenizer] = ((vocab, tuple(eos)), lt)
    return lt


class GrammarMatcher:
    """One generation's parser state for ``grammar`` over ``model``'s vocabulary."""

    def __init__(self, grammar: Grammar, model: Any):
        self.grammar = grammar
        vocab = int(model.arch.vocab_size)
        llg = _llguidance()
        tok = _tokenizer_for(model.tokenizer, vocab, list(model.eos_token_ids or ()))
        self._m = llg.LLMatcher(tok, grammar.compiled(), log_level=0)
        if self._m.is_error():
            raise GrammarError(f"cannot use the {grammar.kind}: {self._m.get_error()[:500]}")
        self.vocab = vocab
        self.tokens = 0

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more."""
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        """What was generated so far is a complete sentence of the grammar."""
        return self._m.is_accepting()

    def allowed(self) -> torch.Tensor:
        """(vocab,) bool: the tokens the grammar allows next."""
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        self._raise_if_failed()
        return torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self.vocab].astype(bool))

    def _raise_if_failed(self) -> None:
        """A matcher that gave up (llguidance's own limits: a lexer past its budget of
        expressions, ...) says why, instead of refusing the next token for no stated reason."""
        if self._m.is_error():
            reason = self._m.get_error().split("\n", 1)[0][:300]
            raise GrammarError(
                f"the {self.grammar.kind} cannot be followed past token {self.tokens} "
                f"(llguidance: {reason}); simplify it"
            )

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of (vocab,) ``logits`` with every token the grammar forbids at -inf."""
        allowed = self.allowed()
        n = logits.shape[-1]
        if n != allowed.shape[0]:  # a head wider than the vocabulary: its extra ids are never text
            fit = torch.zeros(n, dtype=torch.bool)
            k = min(n, allowed.shape[0])
            fit[:k] = allowed[:k]
            allowed = fit
        if not bool(allowed.any()):
            raise GrammarError("the grammar allows no token here (it cannot be completed)")
        return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

    def accept(self, token: int) -> None:
        """Advance past ``token`` (a typed error when the grammar forbids it: a custom
        sampler chose outside the mask)."""
        if not self._m.consume_token(int(token)):
            raise GrammarError(f"token {token} is not allowed by the {self.grammar.kind} here")
        self._raise_if_failed()  # taken, and then the matcher gave up
        self.tokens += 1

    def forced(self) -> list[int]:
        """Tokens the grammar forces next (llguidance's fast-forward tokens: the canonical
        tokenization of the bytes every continuation must start with), or none. The
        context appends them as a draft of one pass (jump-forward); each is still checked
        against the mask and the sampler, so the output equals step-by-step decoding."""
        if self._m.is_stopped() or self._m.is_error():
            return []
        return [int(t) for t in self._m.compute_ff_tokens()]

    def __repr__(self) -> str:
        state = "done" if self.done else ("accepting" if self.accepting else "open")
        return f"GrammarMatcher({self.grammar!r}, {self.tokens} tokens, {state})"


__all__ = ["Grammar", "GrammarMatcher", "GrammarError", "GrammarUnavailableError"]
