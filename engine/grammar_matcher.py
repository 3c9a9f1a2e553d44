"""Pie's ``grammar`` and ``matcher`` resources (``pie:core/inference``) on llguidance.

A ``GrammarSource`` is what a guest builds with ``grammar.from-json-schema`` / ``json`` /
``from-regex`` / ``from-ebnf``: checked (compiled once) when it is made, so a bad schema,
regex or EBNF is a typed ``GrammarError`` naming what is wrong, never a failure at the
first token. A ``TokenMatcher`` is one ``matcher``: ``accept_tokens`` (all or nothing: a
token the grammar forbids raises ``GrammarTokenRejectedError`` and the state is as
before), ``next_token_mask_brle`` (Pie's BRLE over the model's whole logits width; ids the
tokenizer does not have are never allowed), ``is_terminated``, ``reset``.

The grammar engine is llguidance, as in ``engine/grammar.py`` (whose compile cache,
JSON layout and per-tokenizer llguidance tokenizer this module shares). What is added:

- **Pie's EBNF.** Pie 0.4.0 parses xgrammar-style EBNF (``root ::= ...``; rules start at
  the beginning of a line and may run over several lines; ``"..."`` strings with C
  escapes, ``[...]`` classes with ranges and negation, ``( )``, ``|``, ``* + ?``,
  ``{n}`` ``{n,}`` ``{n,m}``, ``#`` comments, an optional rule-level lookahead
  ``(= ...)``). ``ebnf_to_lark`` reads that dialect, with Pie's lexical rules and its
  error messages (line and column), and writes the same grammar in llguidance's Lark.
  Every rule stays a context-free rule (none becomes a greedy lexer terminal), so the
  language is the one Pie's byte-level parser accepts. A lookahead is kept as what
  xgrammar defines it to be, a hint the grammar already implies: it is checked and
  dropped.
- **Pie's matcher semantics.** The stop tokens (the model's EOS ids: for the chat models
  here they include the end-of-turn token Pie's host uses, ``instruct().seal()``) are
  allowed exactly when the text so far is a complete sentence; accepting one terminates
  the matcher; a terminated matcher allows nothing and accepts nothing; ``reset``
  starts over.
- **Pie's JSON schema defaults.** Pie compiles schemas in strict mode: an object schema
  with ``properties`` and no ``additionalProperties`` allows no other keys. The same
  rule is applied here (``additionalProperties: false`` written in where absent); the
  layout is the engine's compact one (``JSON_LAYOUT``), which is valid JSON as Pie's is.
  ``json()`` is any JSON value, as Pie's built-in JSON grammar.
- **A cache per (model, grammar):** the first matcher compiles the grammar against the
  model's vocabulary; later ones copy that compiled matcher (microseconds).
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from engine import brle
from engine.grammar import Grammar, GrammarError, _llguidance, _tokenizer_for

GrammarSourceKind = Literal["json_schema", "json", "regex", "ebnf"]

_KIND_NAMES = {"json_schema": "JSON schema", "json": "JSON grammar", "regex": "regex", "ebnf": "EBNF grammar"}


class GrammarTokenRejectedError(GrammarError):
    """``accept_tokens`` got a token the grammar does not allow at that point (``details``:
    ``token``, ``index`` in the list given). Nothing of the call was accepted."""

    code = "grammar_token_rejected"


# --------------------------------------------------------------------------------------
# Pie's EBNF -> llguidance Lark
# --------------------------------------------------------------------------------------

_SIMPLE_ESCAPES = {
    "'": 0x27,
    '"': 0x22,
    "?": 0x3F,
    "\\": 0x5C,
    "a": 0x07,
    "b": 0x08,
    "f": 0x0C,
    "n": 0x0A,
    "r": 0x0D,
    "t": 0x09,
    "v": 0x0B,
    "0": 0x00,
    "e": 0x1B,
}
_CLASS_ESCAPES = set("^$\\.*+?()[]{}|/-")
_HEX = set("0123456789abcdefABCDEF")


def _is_name_char(c: str, first: bool) -> bool:
    return (
        c == "_"
        or c == "-"
        or c == "."
        or ("a" <= c <= "z")
        or ("A" <= c <= "Z")
        or (not first and c.isdigit())
    )


@dataclass
class _Tok:
    kind: str  # name, string, class, int, or the punctuation itself: ::= ( (= ) { } | , * + ?
    value: Any
    line: int
    col: int


class _EbnfLexer:
    """Pie's EBNF lexer rules (ebnf.rs), re-stated: whitespace and ``#`` comments between
    tokens; names of ``[A-Za-z_.-][A-Za-z0-9_.-]*``; strings on one line; classes on one
    line with their extra escapes; integers only as repetition bounds."""

    def __init__(self, text: str):
        self.s = text
        self.i = 0
        self.line = 1
        self.col = 1

    def _err(self, msg: str, line: int | None = None, col: int | None = None) -> GrammarError:
        return GrammarError(
            f"EBNF error at line {line or self.line}, column {col or self.col}: {msg}",
            line=line or self.line,
            column=col or self.col,
        )

    def _peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.s[j] if j < len(self.s) else ""

    def _advance(self, n: int = 1) -> None:
        for _ in range(n):
            c = self._peek()
            if not c:
                return
            if c == "\n" or (c == "\r" and self._peek(1) != "\n"):
                self.line += 1
                self.col = 1
            else:
                self.col += 1
            self.i += 1

    def _escape(self, extra: set[str]) -> int:
        """The codepoint of the escape at the cursor (a backslash), consumed."""
        c = self._peek(1)
        if c in extra:
            self._advance(2)
            return ord(c)
        if c in _SIMPLE_ESCAPES:
            self._advance(2)
            return _SIMPLE_ESCAPES[c]
        if c == "x":
            n = 0
            while self._peek(2 + n) in _HEX and self._peek(2 + n):
                n += 1
            if n == 0:
                raise self._err("invalid \\x escape: no hex digits")
            cp = int(self.s[self.i + 2 : self.i + 2 + n], 16)
            self._advance(2 + n)
            return cp
        if c in ("u", "U"):
            n = 4 if c == "u" else 8
            digits = self.s[self.i + 2 : self.i + 2 + n]
            if len(digits) != n or not set(digits) <= _HEX:
                raise self._err(f"invalid \\{c} escape: need {n} hex digits")
            self._advance(2 + n)
            return int(digits, 16)
        raise self._err(f"invalid escape sequence: \\{c}" if c else "unexpected end of input")

    def _codepoint(self, extra: set[str]) -> int:
        if self._peek() == "\\":
            cp = self._escape(extra)
        else:
            cp = ord(self._peek())
            self._advance()
        if cp > 0x10FFFF or 0xD800 <= cp <= 0xDFFF:
            raise self._err(f"invalid codepoint: U+{cp:04X}")
        return cp

    def _skip(self) -> None:
        while True:
            c = self._peek()
            if c in (" ", "\t", "\n", "\r") and c:
                self._advance()
            elif c == "#":
                while self._peek() and self._peek() not in "\r\n":
                    self._advance()
            else:
                return

    def tokens(self) -> list[_Tok]:
        out: list[_Tok] = []
        while True:
            self._skip()
            line, col, c = self.line, self.col, self._peek()
            if not c:
                out.append(_Tok("eof", None, line, col))
                break
            if c == "(" and self._peek(1) == "=":
                self._advance(2)
                out.append(_Tok("(=", None, line, col))
            elif c in "(){}|,*+?":
                self._advance()
                out.append(_Tok(c, None, line, col))
            elif c == ":":
                if self.s.startswith("::=", self.i):
                    self._advance(3)
                    out.append(_Tok("::=", None, line, col))
                else:
                    raise self._err("unexpected character ':'")
            elif c == '"':
                self._advance()
                cps: list[int] = []
                while self._peek() != '"':
                    if self._peek() in ("", "\n", "\r"):
                        raise self._err("unterminated string literal")
                    cps.append(self._codepoint(set()))
                self._advance()
                out.append(_Tok("string", "".join(map(chr, cps)), line, col))
            elif c == "[":
                out.append(self._char_class(line, col))
            elif _is_name_char(c, True):
                start = self.i
                while self._peek() and _is_name_char(self._peek(), self.i == start):
                    self._advance()
                out.append(_Tok("name", self.s[start : self.i], line, col))
            elif c.isdigit():
                start = self.i
                while self._peek().isdigit() and self._peek():
                    self._advance()
                if self.i - start > 16:
                    raise self._err("integer too large", line, col)
                out.append(_Tok("int", int(self.s[start : self.i]), line, col))
            else:
                raise self._err(f"unexpected character: {c!r}")
        return out

    def _char_class(self, line: int, col: int) -> _Tok:
        """``[...]`` as (negated, [(lo, hi), ...]); a ``-`` between two members is a range,
        anywhere else it is itself (Pie's rule)."""
        self._advance()
        negated = self._peek() == "^"
        if negated:
            self._advance()
        items: list[int | None] = []  # None: an unescaped dash
        while self._peek() != "]":
            c = self._peek()
            if not c:
                raise self._err("unterminated character class")
            if c in "\r\n":
                raise self._err("character class should not contain newline")
            if c == "-":
                self._advance()
                items.append(None)
            else:
                items.append(self._codepoint(_CLASS_ESCAPES))
        self._advance()
        ranges: list[tuple[int, int]] = []
        dash = ord("-")
        k = 0
        while k < len(items):
            lo = dash if items[k] is None else items[k]
            if k + 2 < len(items) and items[k + 1] is None:
                hi = dash if items[k + 2] is None else items[k + 2]
                if lo > hi:
                    raise self._err("invalid character class: lower bound > upper bound", line, col)
                ranges.append((lo, hi))
                k += 3
            else:
                ranges.append((lo, lo))
                k += 1
        return _Tok("class", (negated, ranges), line, col)


def _lark_class(negated: bool, ranges: list[tuple[int, int]]) -> str:
    if not ranges:
        if negated:
            return r"/(?s:.)/"
        raise GrammarError("EBNF error: an empty character class [] matches nothing")
    parts = "".join(f"\\u{{{lo:x}}}" if lo == hi else f"\\u{{{lo:x}}}-\\u{{{hi:x}}}" for lo, hi in ranges)
    return f"/[{'^' if negated else ''}{parts}]/"


class _EbnfToLark:
    """Recursive descent over Pie's EBNF rules (ebnf.rs: rule, choices, sequence,
    element, quantifier), writing each construct as its Lark equivalent."""

    def __init__(self, toks: list[_Tok]):
        self.t = toks
        self.p = 0
        self.names: dict[str, str] = {}

    def _err(self, msg: str, tok: _Tok | None = None) -> GrammarError:
        tok = tok or self.t[self.p]
        return GrammarError(
            f"EBNF error at line {tok.line}, column {tok.col}: {msg}", line=tok.line, column=tok.col
        )

    def _peek(self) -> _Tok:
        return self.t[self.p]

    def _take(self, kind: str, msg: str) -> _Tok:
        tok = self.t[self.p]
        if tok.kind != kind:
            raise self._err(msg)
        self.p += 1
        return tok

    def _is_rule_start(self, k: int) -> bool:
        return self.t[k].kind == "name" and self.t[k + 1].kind == "::="

    def convert(self) -> str:
        # Rule names first (two passes, as Pie does): every ``name ::=`` opens a rule.
        for k, tok in enumerate(self.t):
            if tok.kind != "::=":
                continue
            if k == 0:
                raise self._err("::= should not be the first token", tok)
            prev = self.t[k - 1]
            if prev.kind != "name":
                raise self._err("::= should be preceded by an identifier", prev)
            if k >= 2 and self.t[k - 2].line == prev.line:
                raise self._err("rule name should be at the beginning of the line", prev)
            if prev.value in self.names:
                raise self._err(f'rule "{prev.value}" defined multiple times', prev)
            safe = "".join(ch if ch.isalnum() else "_" for ch in prev.value.lower())
            self.names[prev.value] = "start" if prev.value == "root" else f"r{len(self.names)}_{safe}"
        if "root" not in self.names:
            raise GrammarError(
                'EBNF error: root rule "root" not found (Pie\'s grammars start at `root ::= ...`)'
            )
        lines = []
        while self._peek().kind != "eof":
            if not self._is_rule_start(self.p):
                raise self._err("expected rule name")
            name = self._take("name", "expected rule name").value
            self.p += 1  # ::=
            body = self._choices()
            if self._peek().kind == "(=":  # a lookahead hint: checked, then dropped
                self.p += 1
                self._choices()
                self._take(")", "expected )")
            lines.append(f"{self.names[name]}: {body}")
        return "\n".join(lines) + "\n"

    def _choices(self) -> str:
        alts = [self._sequence()]
        while self._peek().kind == "|":
            self.p += 1
            alts.append(self._sequence())
        return " | ".join(alts)

    def _sequence(self) -> str:
        items = [self._quantified()]
        while not (self._peek().kind in ("|", ")", "(=", "eof") or self._is_rule_start(self.p)):
            items.append(self._quantified())
        return " ".join(items)

    def _quantified(self) -> str:
        elem = self._element()
        kind = self._peek().kind
        if kind in ("*", "+", "?"):
            self.p += 1
            return f"{elem}{kind}"
        if kind == "{":
            self.p += 1
            lo = self._int()
            if self._peek().kind == ",":
                self.p += 1
                if self._peek().kind == "}":
                    self.p += 1
                    return f"{elem}{{{lo},}}"
                hi = self._int()
                if hi < lo:
                    raise self._err("lower bound is larger than upper bound")
                self._take("}", "expected }")
                return f"{elem}{{{lo},{hi}}}"
            self._take("}", "expected ',' or '}' in repetition range")
            return f"{elem}{{{lo}}}"
        return elem

    def _int(self) -> int:
        return int(self._take("int", "expected integer").value)

    def _element(self) -> str:
        tok = self._peek()
        if tok.kind == "(":
            self.p += 1
            if self._peek().kind == ")":
                self.p += 1
                return '""'
            inner = self._choices()
            self._take(")", "expected )")
            return f"({inner})"
        if tok.kind == "class":
            self.p += 1
            try:
                return _lark_class(*tok.value)
            except GrammarError:
                raise self._err("an empty character class [] matches nothing", tok) from None
        if tok.kind == "string":
            self.p += 1
            return json.dumps(tok.value, ensure_ascii=False)
        if tok.kind == "name":
            if tok.value not in self.names:
                raise self._err(f'rule "{tok.value}" is not defined')
            self.p += 1
            return self.names[tok.value]
        what = {"eof": "end of input", "string": "a string"}.get(tok.kind, repr(tok.kind))
        raise self._err(f"expected an element (string, [class], rule name or group), got {what}")


def ebnf_to_lark(ebnf: str) -> str:
    """Pie's EBNF (root rule ``root``) as an llguidance Lark grammar (root ``start``).
    Raises ``GrammarError`` with the line and column of what Pie's parser would refuse."""
    return _EbnfToLark(_EbnfLexer(ebnf).tokens()).convert()


# --------------------------------------------------------------------------------------
# GrammarSource
# --------------------------------------------------------------------------------------

_DATA_KEYS = frozenset({"const", "enum", "default", "examples"})


def _engine_kind(kind: GrammarSourceKind) -> str:
    """The engine ``Grammar`` kind a source kind compiles to."""
    return {"json_schema": "json_schema", "json": "json_schema", "regex": "regex", "ebnf": "lark"}[kind]


def _strict(schema: Any) -> Any:
    """``schema`` with Pie's strict-mode default: ``additionalProperties: false`` on every
    (sub)schema that lists ``properties`` and says nothing about other keys."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _DATA_KEYS else _strict(v)) for k, v in schema.items()}
    if (
        isinstance(schema.get("properties"), dict)
        and "additionalProperties" not in schema
        and "patternProperties" not in schema
        and "unevaluatedProperties" not in schema
    ):
        out["additionalProperties"] = False
    return out


@dataclass(frozen=True)
class GrammarSource:
    """Pie's ``grammar`` resource: what a matcher's text must match. Build it with
    ``from_json_schema`` / ``any_json`` / ``from_regex`` / ``from_ebnf``; each compiles
    the source once and raises ``GrammarError`` (an ``InvalidRequestError``) naming what
    is wrong. Equal sources share compiled matchers."""

    kind: GrammarSourceKind
    text: str
    """The schema's JSON text as given, the regex, the EBNF ("" for any JSON)."""
    grammar: Grammar = field(repr=False, compare=False)
    """The engine grammar it compiles to (llguidance JSON schema / regex / Lark)."""

    @classmethod
    def from_json_schema(cls, schema: str | dict[str, Any] | bool) -> GrammarSource:
        """One JSON value valid against ``schema`` (its JSON text, as Pie takes it, or a
        dict). Strict as Pie's: objects with ``properties`` allow no other keys unless
        the schema says ``additionalProperties``."""
        text = schema if isinstance(schema, str) else json.dumps(schema)
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}", kind="json_schema") from None
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise GrammarError(
                f"a JSON schema must be an object (or true), got {type(schema).__name__}", kind="json_schema"
            )
        return cls._checked("json_schema", text, lambda: Grammar.json_schema(_strict(schema)))

    @classmethod
    def any_json(cls) -> GrammarSource:
        """Any one JSON value (Pie's ``grammar.json()``)."""
        return cls._checked("json", "", lambda: Grammar.json_schema({}))

    @classmethod
    def from_regex(cls, pattern: str) -> GrammarSource:
        """Text matching ``pattern`` as a whole (Rust ``regex`` syntax, as Pie's)."""
        if not isinstance(pattern, str):
            raise GrammarError(f"a regex must be a string, got {type(pattern).__name__}", kind="regex")
        return cls._checked("regex", pattern, lambda: Grammar.regex(pattern))

    @classmethod
    def from_ebnf(cls, ebnf: str) -> GrammarSource:
        """A sentence of the EBNF grammar, in Pie's dialect (``root ::= ...``, see
        ``ebnf_to_lark``)."""
        if not isinstance(ebnf, str):
            raise GrammarError(f"an EBNF grammar must be a string, got {type(ebnf).__name__}", kind="ebnf")
        return cls._checked("ebnf", ebnf, lambda: Grammar.lark(ebnf_to_lark(ebnf)))

    @classmethod
    def _checked(cls, kind: GrammarSourceKind, text: str, build: Any) -> GrammarSource:
        try:
            grammar = build()
            grammar.compiled()
        except GrammarError as e:
            msg = e.message.removeprefix(f"cannot compile the {_engine_kind(kind)}: ")
            if "regex parse error" in msg:  # llguidance quotes the Rust regex crate: keep its verdict
                verdict = [ln.strip() for ln in msg.splitlines() if ln.strip().startswith("error:")]
                msg = f"{text!r}: {verdict[0].removeprefix('error:').strip()}" if verdict else msg
            if not msg.startswith(("EBNF error", "invalid ", "the ", "a ")):
                msg = f"invalid {_KIND_NAMES[kind]}: {msg}"
            raise GrammarError(msg, **{**e.details, "kind": kind}) from None
        return cls(kind, text, grammar)

    def __str__(self) -> str:
        """Readable and whole (Pie's ``to-string``: a debug form, not to be parsed)."""
        if self.kind == "json":
            return "json: any JSON value"
        return f"{self.kind}: {self.text}"

    def __repr__(self) -> str:
        if self.kind == "json":
            return "GrammarSource.any_json()"
        ctor = {"json_schema": "from_json_schema", "regex": "from_regex", "ebnf": "from_ebnf"}[self.kind]
        text = self.text if len(self.text) <= 60 else self.text[:57] + "..."
        return f"GrammarSource.{ctor}({text!r})"


# --------------------------------------------------------------------------------------
# TokenMatcher
# --------------------------------------------------------------------------------------

_PER_MODEL_MAX = 64
"""Compiled grammars kept per model (least recently used dropped first)."""

_CACHE: weakref.WeakKeyDictionary[Any, OrderedDict[GrammarSource, Any]] = weakref.WeakKeyDictionary()
_CACHE_LOCK = threading.Lock()


def _compiled_matcher(grammar: GrammarSource, model: Any) -> Any:
    """A fresh llguidance matcher of ``grammar`` over ``model``'s vocabulary: a copy of the
    one compiled for this (model, grammar) pair, compiled on first use."""
    with _CACHE_LOCK:
        per = _CACHE.setdefault(model, OrderedDict())
        proto = per.get(grammar)
        if proto is not None:
            per.move_to_end(grammar)
            return proto.deep_copy()
    llg = _llguidance()
    vocab = int(model.arch.vocab_size)
    tok = _tokenizer_for(model.tokenizer, vocab, sorted(model.eos_token_ids or ()))
    proto = llg.LLMatcher(tok, grammar.grammar.compiled(), log_level=0)
    if proto.is_error():
        raise GrammarError(
            f"cannot use the {_KIND_NAMES[grammar.kind]} with this model: {proto.get_error()[:500]}",
            kind=grammar.kind,
        )
    with _CACHE_LOCK:
        per = _CACHE.setdefault(model, OrderedDict())
        per[grammar] = proto
        while len(per) > _PER_MODEL_MAX:
            per.popitem(last=False)
        return proto.deep_copy()


class TokenMatcher:
    """Pie's ``matcher``: one walk of ``grammar`` over ``model``'s token ids.

    ``model`` is an engine ``Model`` (what it needs: ``tokenizer``, ``arch.vocab_size``
    (the logits width, the mask's length), ``eos_token_ids`` (the stop tokens))."""

    def __init__(self, grammar: GrammarSource, model: Any):
        if not isinstance(grammar, GrammarSource):
            raise TypeError(f"grammar must be a GrammarSource, got {type(grammar).__name__}")
        self.grammar = grammar
        self.vocab_size = int(model.arch.vocab_size)
        self.stop_tokens = frozenset(int(t) for t in (model.eos_token_ids or ()))
        self._model = weakref.ref(model)
        self._m = _compiled_matcher(grammar, model)
        self._terminated = False
        self.tokens = 0
        """Tokens accepted since the start or the last reset (stop token included)."""

    def accept_tokens(self, ids: list[int]) -> None:
        """Advance past ``ids`` in order, all or none: a token out of the vocabulary, one
        the grammar forbids there, a stop token before the text is complete, or any token
        after termination raises ``GrammarTokenRejectedError`` and leaves the matcher as
        it was."""
        ids = [int(t) for t in ids]
        if not ids:
            return
        trial = self._m.deep_copy()
        terminated = self._terminated
        for k, t in enumerate(ids):
            why = None
            if not 0 <= t < self.vocab_size:
                why = f"is outside the vocabulary (0..{self.vocab_size - 1})"
            elif terminated:
                why = "comes after the matcher terminated"
            elif t in self.stop_tokens:
                if trial.is_accepting():
                    trial.consume_token(t)
                    terminated = True
                else:
                    why = "is a stop token and the text so far is not complete"
            elif not trial.consume_token(t):
                why = f"({self._text(t)!r}) is not allowed by the {_KIND_NAMES[self.grammar.kind]} here"
            if why is None and trial.is_error():
                reason = trial.get_error().split("\n", 1)[0][:300]
                raise GrammarError(
                    f"the {_KIND_NAMES[self.grammar.kind]} cannot be followed past token {self.tokens + k} "
                    f"(llguidance: {reason}); simplify it",
                    kind=self.grammar.kind,
                )
            if why is not None:
                raise GrammarTokenRejectedError(
                    f"token {t} (index {k} of {len(ids)}) {why}; no token of this call was accepted",
                    token=t,
                    index=k,
                )
        self._m = trial
        self._terminated = terminated
        self.tokens += len(ids)

    def _text(self, token: int) -> str:
        model = self._model()
        if model is None:
            return ""
        try:
            return str(model.tokenizer.decode([token]))
        except Exception:  # noqa: BLE001 - only for the message
            return ""

    def allowed(self) -> np.ndarray:
        """(vocab_size,) bool: the ids allowed next (none once terminated)."""
        if self._terminated:
            return np.zeros(self.vocab_size, dtype=bool)
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        if mask.size < self.vocab_size:  # never: llguidance's mask covers n_vocab
            mask = np.concatenate([mask, np.zeros(self.vocab_size - mask.size, dtype=bool)])
        return mask

    def next_token_mask_brle(self) -> list[int]:
        """Pie's ``next-token-logit-mask``: the allowed ids as a BRLE (runs alternating
        false, true, ..., starting with a false run) adding up to exactly ``vocab_size``."""
        return brle.encode(self.allowed())

    def is_terminated(self) -> bool:
        """A stop token was accepted (Pie's terminal state): nothing more is allowed."""
        return self._terminated

    def is_complete(self) -> bool:
        """The text so far is a whole sentence of the grammar (a stop token may follow)."""
        return not self._terminated and bool(self._m.is_accepting())

    def reset(self) -> None:
        """Back to the start of the grammar, as when made."""
        model = self._model()
        if model is None:
            self._m.reset()
        else:
            self._m = _compiled_matcher(self.grammar, model)
        self._terminated = False
        self.tokens = 0

    def __repr__(self) -> str:
        state = "terminated" if self._terminated else ("complete" if self._m.is_accepting() else "open")
        return f"TokenMatcher({self.grammar!r}, {self.tokens} tokens, {state})"


__all__ = [
    "GrammarSource",
    "GrammarSourceKind",
    "GrammarTokenRejectedError",
    "TokenMatcher",
    "ebnf_to_lark",
]
