"""Penalties and logit bias: what they cost a decode step, ours beside transformers'.

    python -m bench.penalties

On the tiny Qwen3-VL checkpoint (151k-token vocabulary, so the logits row dominates what a
penalty touches), greedy, 64 new tokens after a chat prompt, best of 7, in one process:

* our engine plain, then with logit_bias, repetition_penalty, frequency/presence penalties
  and all of them (``engine.Penalties``): ms per token and the overhead over plain;
* transformers' ``generate`` plain and with its own ``RepetitionPenaltyLogitsProcessor``
  (and ``SequenceBiasLogitsProcessor``): ms per token, and the same ratio.

The aim: a penalty costs a small fraction of a decode step, however large the vocabulary
(only the rows of tokens that occurred are touched). Tokens are checked equal to
transformers' under the same processors (greedy), so the comparison is of equal work.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [str(Path(__file__).resolve().parents[1])] + [
    p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent
]

import json
import time

import torch

TOKENS = 64
ROUNDS = 7
PROMPT = "Count from one to fifty in words, one number per line."


def ours(model, penalties) -> tuple[float, list[int]]:
    from engine import Sampler, SyncContext, max_tokens

    best, tokens = float("inf"), []
    for _ in range(ROUNDS):
        ctx = SyncContext(model).user(PROMPT).cue()
        ctx.flush()
        t0 = time.perf_counter()
        tokens = ctx.generate(Sampler.greedy(), max_tokens(TOKENS), penalties=penalties).tokens
        best = min(best, time.perf_counter() - t0)
        ctx.close()
    return best / TOKENS * 1e3, tokens


def reference(ref, ids: list[int], processors) -> tuple[float, list[int]]:
    from transformers import GenerationConfig, LogitsProcessorList

    config = GenerationConfig(max_new_tokens=TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    ref.generation_config.eos_token_id = None
    inputs = {
        "input_ids": torch.tensor([ids]),
        "mm_token_type_ids": torch.zeros(1, len(ids), dtype=torch.long),
    }
    best, out = float("inf"), None
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        with torch.no_grad():
            out = ref.generate(
                **inputs, generation_config=config, logits_processor=LogitsProcessorList(processors)
            )
        best = min(best, time.perf_counter() - t0)
    assert out is not None
    return best / TOKENS * 1e3, out[0, len(ids) :].tolist()


def main() -> None:
    from transformers import (
        Qwen3VLForConditionalGeneration,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )

    from engine import Model, Penalties, SyncContext
    from fixtures.tiny_models import ensure_tiny_model

    path = ensure_tiny_model("tiny-qwen3-vl")
    model = Model.load(path, device="cpu")
    ref = Qwen3VLForConditionalGeneration.from_pretrained(path).eval()
    ids = SyncContext(model).user(PROMPT).cue().token_ids
    cases = {
        "logit_bias": Penalties.of(logit_bias={17: 4.0, 42: -100.0}),
        "repetition_penalty": Penalties(repetition=1.3),
        "frequency+presence": Penalties(frequency=0.7, presence=0.4),
        "all": Penalties.of(repetition=1.3, frequency=0.7, presence=0.4, logit_bias={17: 4.0}),
    }
    plain_ms, _ = ours(model, None)
    result: dict = {
        "vocab": model.arch.vocab_size,
        "tokens": TOKENS,
        "ours_plain_ms_per_token": round(plain_ms, 3),
    }
    for name, p in cases.items():
        ms, _ = ours(model, p)
        result[f"ours_{name}_ms_per_token"] = round(ms, 3)
        result[f"ours_{name}_overhead"] = round(ms / plain_ms - 1, 3)
    ref_plain, _ = reference(ref, ids, [])
    rep = Penalties.of(repetition=1.3, logit_bias={17: 4.0})
    ref_ms, ref_tokens = reference(
        ref, ids, [SequenceBiasLogitsProcessor({(17,): 4.0}), RepetitionPenaltyLogitsProcessor(1.3)]
    )
    _, our_tokens = ours(model, rep)
    result.update(
        transformers_plain_ms_per_token=round(ref_plain, 3),
        transformers_bias_repetition_ms_per_token=round(ref_ms, 3),
        transformers_bias_repetition_overhead=round(ref_ms / ref_plain - 1, 3),
        tokens_equal_to_transformers=our_tokens == ref_tokens,
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
