"""``pie:core/model``: a served model by name and its tokenizer, as the model's own
tokenizer has them (``vocabs``: every id with its bytes; ``split-regex``: the
pre-tokenizer's pattern; ``special-tokens``: the added special tokens)."""

from __future__ import annotations

import functools
import json
from typing import Any

from inferlets.host.binding import Interface, Resource, wit
from media import InvalidRequestError


class ModelRes(Resource):
    WIT = ("pie:core/model", "model")

    def __init__(self, name: str, model: Any):
        self.name = name
        self.model = model

    def __repr__(self) -> str:
        return f"ModelRes({self.name!r})"


class TokenizerRes(Resource):
    WIT = ("pie:core/model", "tokenizer")

    def __init__(self, model: ModelRes):
        self.model_res = model
        self.model = model.model


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: a token string -> its bytes."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def token_bytes(model: Any) -> tuple[list[int], list[bytes]]:
    """Every vocabulary id with its bytes (byte-level BPE undone; SentencePiece's ``▁`` is a
    space and ``<0xNN>`` a byte)."""
    cached = getattr(model, "_pie_token_bytes", None)
    if cached is not None:
        return cached
    tok = model.tokenizer
    vocab: dict[str, int] = tok.get_vocab()
    dec = _byte_decoder()
    byte_level = _is_byte_level(tok)
    ids, out = [], []
    for text, i in sorted(vocab.items(), key=lambda kv: kv[1]):
        if byte_level and all(ch in dec for ch in text):
            b = bytes(dec[ch] for ch in text)
        elif len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            b = bytes([int(text[3:5], 16)])
        else:
            b = text.replace("▁", " ").encode("utf-8")
        ids.append(int(i))
        out.append(b)
    model._pie_token_bytes = (ids, out)
    return ids, out


def _is_byte_level(tok: Any) -> bool:
    backend = getattr(tok, "backend_tokenizer", None) or getattr(tok, "_tokenizer", None)
    if backend is None:
        return False
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # noqa: BLE001 - a tokenizer without a JSON form: not byte-level
        return False
    return "ByteLevel" in json.dumps(spec.get("pre_tokenizer")) or "ByteLevel" in json.dumps(
        spec.get("decoder")
    )


def split_regex(model: Any) -> str:
    """The pre-tokenizer's split pattern ("" when it has none)."""
    tok = model.tokenizer
    backend = getattr(tok, "backend_tokenizer", None) or getattr(tok, "_tokenizer", None)
    if backend is None:
        return ""
    try:
        spec = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    except Exception:  # noqa: BLE001
        return ""
    stack = [spec]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            pattern = node.get("pattern")
            if isinstance(pattern, dict) and "Regex" in pattern:
                return str(pattern["Regex"])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return ""


class ModelIface(Interface):
    NAME = "pie:core/model"
    RESOURCES = (ModelRes, TokenizerRes)

    @wit("[static]model.load")
    def load(self, name: str) -> ModelRes:
        return self.host.model_res(name)

    @wit("[method]model.tokenizer")
    def tokenizer(self, m: ModelRes) -> TokenizerRes:
        return TokenizerRes(m)

    @wit("[method]model.default-system-speculation")
    def default_system_speculation(self, m: ModelRes) -> bool:
        """True for text models: Pie's SDK then asks argmax generators' passes for the
        engine's drafts (``output-speculative-tokens``: prompt lookup over the context) and
        feeds them back as speculative tokens, verified exactly by the next pass."""
        from engine import Model

        return isinstance(m.model, Model)

    @wit("[method]tokenizer.encode")
    def encode(self, t: TokenizerRes, text: str) -> list[int]:
        return t.model.tokenize(self.host.state.text(text))

    @wit("[method]tokenizer.decode")
    def decode(self, t: TokenizerRes, tokens: list[int]) -> str:
        self.host.state.buffer(tokens, "token ids", 4)
        vocab = t.model.arch.vocab_size
        bad = [i for i in tokens if not 0 <= i < vocab]
        if bad:
            raise InvalidRequestError(f"token id(s) outside the vocabulary [0, {vocab}): {bad[:5]}")
        return t.model.detokenize(tokens)

    @wit("[method]tokenizer.vocabs")
    def vocabs(self, t: TokenizerRes) -> tuple[list[int], list[bytes]]:
        return token_bytes(t.model)

    @wit("[method]tokenizer.split-regex")
    def split_regex(self, t: TokenizerRes) -> str:
        return split_regex(t.model)

    @wit("[method]tokenizer.special-tokens")
    def special_tokens(self, t: TokenizerRes) -> tuple[list[int], list[bytes]]:
        tok = t.model.tokenizer
        added = getattr(tok, "added_tokens_decoder", {}) or {}
        pairs = sorted(
            (int(i), str(getattr(a, "content", a))) for i, a in added.items() if getattr(a, "special", True)
        )
        return [i for i, _ in pairs], [s.encode("utf-8") for _, s in pairs]
