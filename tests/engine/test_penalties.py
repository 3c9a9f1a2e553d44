"""Logit bias and repetition / frequency / presence penalties: greedy tokens equal
transformers' ``generate`` under its own ``SequenceBiasLogitsProcessor`` and
``RepetitionPenaltyLogitsProcessor`` followed by OpenAI's frequency/presence formula (the
order vLLM applies them in); each choice counts its own output; drafting changes nothing;
log-probabilities stay the model's own."""

from __future__ import annotations

import pytest
import torch

from engine import (
    Completion,
    CompletionParams,
    DraftSpec,
    InvalidRequestError,
    Penalties,
    Sampler,
    SyncContext,
    Turn,
    max_tokens,
    run_sync,
)
from tests.engine.conftest import TINY_GEMMA, TINY_QWEN

NAMES = [TINY_QWEN, TINY_GEMMA]
PROMPT = "Count: one two three, one two three, one two three, and then"


class OpenAIPenalty:
    """OpenAI's frequency/presence penalty over the output tokens (the test's reference:
    transformers has no processor for it)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float):
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def reference_penalized(ref, name, ids, n, p: Penalties) -> list[int]:
    from transformers import (
        GenerationConfig,
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )

    inputs = {"input_ids": torch.tensor([ids])}
    if name == TINY_QWEN:
        inputs["mm_token_type_ids"] = torch.zeros(1, len(ids), dtype=torch.long)
    processors = LogitsProcessorList(
        [SequenceBiasLogitsProcessor({(t,): b for t, b in p.logit_bias})] if p.logit_bias else []
    )
    processors += [
        RepetitionPenaltyLogitsProcessor(p.repetition),
        OpenAIPenalty(len(ids), p.frequency, p.presence),
    ]
    config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    saved = ref.generation_config.eos_token_id
    ref.generation_config.eos_token_id = None
    try:
        with torch.no_grad():
            out = ref.generate(**inputs, generation_config=config, logits_processor=processors)
    finally:
        ref.generation_config.eos_token_id = saved
    return out[0, len(ids) :].tolist()


def _prompt(model) -> SyncContext:
    return SyncContext(model).user(PROMPT).cue()


@pytest.mark.parametrize("name", NAMES)
def test_penalized_greedy_equals_transformers(models, refs, name):
    model = models[name]
    plain_ctx = _prompt(model)
    ids = plain_ctx.token_ids
    plain = plain_ctx.generate(Sampler.greedy(), max_tokens(20)).tokens
    plain_ctx.close()
    # Ban the first token plain decoding takes and favour another: the output must move.
    p = Penalties.of(repetition=1.4, frequency=0.7, presence=0.5, logit_bias={plain[0]: -100.0, 17: 4.0})
    ctx = _prompt(model)
    got = ctx.generate(Sampler.greedy(), max_tokens(20), penalties=p).tokens
    ctx.close()
    assert got != plain and plain[0] not in got
    assert got == reference_penalized(refs[name], name, ids, 20, p)
    for single in (Penalties(repetition=1.8), Penalties(frequency=2.0), Penalties(presence=-1.5)):
        ctx = _prompt(model)
        out = ctx.generate(Sampler.greedy(), max_tokens(12), penalties=single).tokens
        ctx.close()
        assert out == reference_penalized(refs[name], name, ids, 12, single), single


def _completion(model, params):
    async def go():
        c = Completion(model, [Turn("user", (PROMPT,))], params)
        out: list[list[int]] = [[] for _ in range(params.n)]
        async with c:
            async for ev in c:
                out[ev.index].append(ev.token)
        return out

    return run_sync(go())


def test_each_choice_counts_its_own_output_and_drafting_changes_nothing(qwen):
    p = Penalties(frequency=1.2, repetition=1.3)
    (alone,) = _completion(qwen, CompletionParams(max_tokens=16, penalties=p))
    assert _completion(qwen, CompletionParams(max_tokens=16, n=3, penalties=p)) == [alone] * 3
    drafted = _completion(
        qwen, CompletionParams(max_tokens=16, penalties=p, speculative=DraftSpec("prompt_lookup", 4, 3, 1))
    )
    assert drafted == [alone]


def test_a_penalty_near_zero_still_samples(qwen):
    """repetition_penalty 5e-324 divides positive logits past float range (the fuzzer sent
    it); the tokens so pushed up stay finite, so greedy and sampling both take one of them."""
    seen = set(_prompt(qwen).token_ids)
    for sampler in (Sampler.greedy(), Sampler(temperature=1.0)):
        ctx = _prompt(qwen)
        out = ctx.generate(sampler, max_tokens(3), penalties=Penalties(repetition=5e-324)).tokens
        ctx.close()
        assert len(out) == 3 and out[0] in seen


def test_logprobs_stay_the_models_own(qwen):
    ctx = _prompt(qwen)
    raw = torch.log_softmax(ctx.flush(return_logits=True)[-1].float(), dim=-1)
    ev = next(
        iter(
            ctx.stream(
                Sampler.greedy(), max_tokens(1), logprobs=0, penalties=Penalties.of(logit_bias={42: 100.0})
            )
        )
    )
    assert ev.token == 42
    assert ev.logprob == pytest.approx(float(raw[42]), abs=1e-4)
    ctx.close()


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"presence": 2.5}, "presence_penalty must be in"),
        ({"frequency": float("nan")}, "frequency_penalty must be in"),
        ({"repetition": 0.0}, "repetition_penalty must be in"),
        ({"logit_bias": {1: 101.0}}, "must be in [-100, 100]"),
        ({"logit_bias": {i: 1.0 for i in range(301)}}, "the limit is 300"),
    ],
)
def test_bad_penalties_are_typed_errors(kwargs, words):
    with pytest.raises(InvalidRequestError) as e:
        Penalties.of(**kwargs)
    assert words in e.value.message


def test_a_bias_outside_the_vocabulary_is_refused(qwen):
    ctx = _prompt(qwen)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        ctx.generate(max_tokens=2, penalties=Penalties.of(logit_bias={10**9: 1.0}))
    ctx.close()
