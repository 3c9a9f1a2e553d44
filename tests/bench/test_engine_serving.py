"""The serving workload of bench/engine.py: its requests cover the ranges it claims, and a
reference row is cut exactly where the engine's stop rules stop."""

from __future__ import annotations

import numpy as np

from bench.engine import SERVING_SIZES, cut_generation, serving_requests


class CharModel:
    """One token per character (ids = code points); EOS is id 0."""

    eos_token_ids = frozenset({0})

    def tokenize(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def detokenize(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 0))


def test_requests_cover_the_workload():
    reqs = serving_requests(CharModel(), 48, 1.5)
    assert len(reqs) == 48
    arrivals = [r.arrival for r in reqs]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals) and 15 < arrivals[-1] < 60
    assert min(len(r.text) for r in reqs) <= 12 and max(len(r.text) for r in reqs) >= 390
    assert {min(r.max_tokens for r in reqs), max(r.max_tokens for r in reqs)} == {8, 128}
    sizes = {None if r.image is None else r.image.size for r in reqs}
    assert None in sizes and len(sizes) >= 4 and sizes <= set(SERVING_SIZES)
    assert 5 <= sum(r.stop is not None for r in reqs) <= 30
    again = serving_requests(CharModel(), 48, 1.5)  # seeded
    assert [(r.text, r.max_tokens, r.stop) for r in again] == [(r.text, r.max_tokens, r.stop) for r in reqs]
    assert all(
        np.array_equal(np.asarray(a.image), np.asarray(b.image))
        for a, b in zip(again, reqs, strict=True)
        if a.image
    )


def test_cut_generation_follows_the_engines_stop_rules():
    model = CharModel()
    req = serving_requests(model, 1, 1.0)[0]
    req.max_tokens, req.stop = 10, "lo"
    ids = model.tokenize("hello world")
    assert cut_generation(model, req, ids) == (ids[:5], "hel", "stop_string")
    req.stop = None
    assert cut_generation(model, req, ids) == (ids[:10], "hello worl", "length")
    assert cut_generation(model, req, ids[:3] + [0] + ids[3:]) == (ids[:3] + [0], "hel", "eos")
