"""``IncrementalText`` gives the whole decode after every token, with the real tokenizers:
Qwen's byte-level BPE (multi-byte characters split across tokens) and Gemma's SentencePiece
vocabulary (leading-space markers, ``<0xHH>`` byte-fallback runs, special tokens skipped)."""

from __future__ import annotations

import random

import pytest

from engine.incremental_text import IncrementalText


@pytest.fixture(scope="module", params=["tiny", "tiny-gemma4"])
def tokenizer_model(request):
    from api.model_ref import load_model

    return load_model(request.param, device="cpu")


def _sequences(model) -> list[list[int]]:
    texts = [
        "Hello there, how are you today? Très bien: 東京 and 😀 emoji, résumé naïve.",
        "  leading spaces\nnew lines\t\ttabs and   runs of spaces ",
        "Ω≈ç√∫˜µ≤≥÷ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝒷𝓎𝓉𝑒𝓈",
    ]
    seqs = [model.tokenize(t) for t in texts]
    rng = random.Random(3)
    vocab = model.arch.vocab_size
    special = sorted(model.tokenizer.all_special_ids)[:4]
    byte_ids = sorted(model.byte_fallback_ids)
    for _ in range(12):  # random ids, byte-fallback runs and special tokens mixed in
        seq = [rng.randrange(vocab) for _ in range(rng.randrange(5, 40))]
        for _ in range(3):
            at = rng.randrange(len(seq))
            if byte_ids:
                seq[at:at] = rng.sample(byte_ids, 3)
            if special:
                seq.insert(rng.randrange(len(seq)), rng.choice(special))
        seqs.append(seq)
    return seqs


def test_every_prefix_decodes_as_the_whole(tokenizer_model) -> None:
    model = tokenizer_model

    def decode(ids):
        return model.detokenize(ids, skip_special_tokens=True)

    for one in (None, model.token_text):  # a settled one-token head decoded alone, or memoised
        windows = 0
        for seq in _sequences(model):
            text = IncrementalText(decode, model.byte_fallback_ids, one)
            for n, token in enumerate(seq, 1):
                assert text.push(token) == decode(seq[:n]), (seq[:n], repr(text))
            windows += len(seq) - text.full_decodes
        assert windows > 0.9 * sum(len(s) for s in _sequences(model))  # windows, not whole decodes
