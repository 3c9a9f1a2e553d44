"""Constrained decoding: what the grammar library costs, and why llguidance.

    python -m bench.grammar

On the tiny Qwen3-VL checkpoint (its real 151k-token Qwen tokenizer), side by side in one
process:

* llguidance (what ``engine.grammar`` uses) and, when installed, xgrammar
  (``pip install xgrammar``): the one-off vocabulary index, compiling a JSON schema (cold,
  a new schema each time), and the per-token cost of computing the mask and advancing;
* our engine generating the same number of tokens with and without a JSON-schema grammar
  (greedy, tokens/s), i.e. what a ``response_format`` costs a request end to end.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script (python bench/grammar.py), this folder comes first on sys.path and its
# engine.py / inferlets.py / speech.py would shadow those packages: the repository root
# goes first instead. (python -m bench.grammar works either way.)
sys.path[:] = [str(Path(__file__).resolve().parents[1])] + [
    p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent
]

import json
import statistics
import time
from typing import Any

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "[0-9]{5}"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "address"],
}


def _schema(i: int) -> str:
    """A distinct schema per call (so no library cache answers)."""
    s = json.loads(json.dumps(SCHEMA))
    s["properties"][f"field_{i}"] = {"type": "integer"}
    return json.dumps(s)


def _median_ms(fn: Any, n: int) -> float:
    walls = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls) * 1e3


def _json_tokens(model: Any) -> list[int]:
    """A valid answer's tokens, to replay through each matcher."""
    text = json.dumps(
        {"name": "Ada", "age": 36, "tags": ["a", "c"], "address": {"city": "Paris", "zip": "75001"}}
    )
    return model.tokenize(text)


def bench_llguidance(model: Any, tokens: list[int]) -> dict[str, float]:
    import llguidance
    import llguidance.hf

    from engine.grammar import JSON_LAYOUT

    vocab = model.arch.vocab_size
    t0 = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(model.tokenizer, n_vocab=vocab, eos_token=list(model.eos_token_ids))
    index_s = time.perf_counter() - t0

    def compile_one(i: int) -> Any:
        g = llguidance.LLMatcher.grammar_from_json_schema(_schema(i), defaults=JSON_LAYOUT)
        return llguidance.LLMatcher(tok, g, log_level=0)

    compile_ms = _median_ms(compile_one, 5)
    m = compile_one(999)
    t0 = time.perf_counter()
    for t in tokens:
        m.compute_bitmask()
        m.consume_token(t)
    step_ms = (time.perf_counter() - t0) / len(tokens) * 1e3
    return {"index_s": index_s, "compile_ms": compile_ms, "step_ms": step_ms}


def bench_xgrammar(model: Any, tokens: list[int]) -> dict[str, float] | None:
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    vocab = model.arch.vocab_size
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(model.tokenizer, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    index_s = time.perf_counter() - t0

    def compile_one(i: int) -> Any:
        return xgr.GrammarMatcher(compiler.compile_json_schema(_schema(i), any_whitespace=False))

    compile_ms = _median_ms(compile_one, 5)
    m = compile_one(999)
    mask = xgr.allocate_token_bitmask(1, vocab)
    t0 = time.perf_counter()
    for t in tokens:
        m.fill_next_token_bitmask(mask)
        m.accept_token(t)
    step_ms = (time.perf_counter() - t0) / len(tokens) * 1e3
    return {"index_s": index_s, "compile_ms": compile_ms, "step_ms": step_ms}


def bench_engine(model: Any, repeats: int = 3) -> tuple[float, float, int]:
    """Greedy tokens/s with and without the schema, the same token count on both sides,
    interleaved medians."""
    from bench.timing import interleaved
    from engine import Grammar, Sampler, SyncContext, max_tokens

    grammar = Grammar.json_schema(SCHEMA)
    probe = SyncContext(model).user("Describe a person as JSON.").cue()
    n = len(probe.generate(Sampler.greedy(), max_tokens=96, grammar=grammar).tokens)
    probe.close()

    def run(g: Grammar | None) -> int:
        ctx = SyncContext(model).user("Describe a person as JSON.").cue()
        out = ctx.generate(Sampler.greedy(), max_tokens(n), grammar=g).tokens
        ctx.close()
        return len(out)

    r = interleaved({"grammar": lambda: run(grammar), "plain": lambda: run(None)}, repeats)
    assert r["grammar"][1] == r["plain"][1] == n
    return n / r["grammar"][0], n / r["plain"][0], n


def main() -> int:
    torch.set_num_threads(2)
    from api.model_ref import load_model

    model = load_model("tiny", device="cpu")
    tokens = _json_tokens(model)
    rows = {"llguidance": bench_llguidance(model, tokens), "xgrammar": bench_xgrammar(model, tokens)}
    print(f"vocabulary {model.arch.vocab_size} tokens; JSON schema with a nested object, enum array, pattern")
    print(f"{'library':12} {'index (s)':>10} {'compile (ms)':>13} {'mask+advance (ms/token)':>25}")
    for name, r in rows.items():
        if r is None:
            print(f"{name:12} not installed (pip install {name} to compare)")
            continue
        print(f"{name:12} {r['index_s']:10.2f} {r['compile_ms']:13.1f} {r['step_ms']:25.3f}")
    lg, xg = rows["llguidance"], rows["xgrammar"]
    if xg is not None:
        print(
            f"xgrammar / llguidance: index {xg['index_s'] / lg['index_s']:.1f}x, "
            f"compile {xg['compile_ms'] / lg['compile_ms']:.1f}x, per token {xg['step_ms'] / lg['step_ms']:.1f}x"
        )
    with_g, without, n = bench_engine(model)
    print(
        f"engine, greedy, {n} tokens: {with_g:.1f} tok/s with the schema vs {without:.1f} without "
        f"({with_g / without:.2f}x)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
