"""``Completion.from_prompt`` (the legacy ``/v1/completions``): a raw prompt tokenized as
``tokenizer(prompt)`` gives the reference, greedy tokens equal transformers' ``generate``,
and the prompt's own log-probabilities equal the log-softmax of its forward logits."""

from __future__ import annotations

import pytest
import torch

from engine import Completion, CompletionParams, InvalidRequestError, Turn, complete, run_sync
from tests.engine.conftest import ATOL, reference_greedy, reference_logits

PROMPT = "Once upon a time, in a quiet town, there lived"
STEPS, TOP = 6, 3


def _run(model, prompt, params: CompletionParams) -> Completion:
    async def go() -> Completion:
        c = Completion.from_prompt(model, prompt, params)
        async with c:
            c.events = [ev async for ev in c]  # type: ignore[attr-defined]
        return c

    return run_sync(go())


@pytest.mark.parametrize("family", ["qwen", "gemma"])
def test_raw_prompt_equals_transformers(request, family: str) -> None:
    model, ref = request.getfixturevalue(family), request.getfixturevalue(f"{family}_ref")
    ids = model.tokenizer(PROMPT).input_ids  # the reference's tokens, BOS and all
    c = _run(model, PROMPT, CompletionParams(max_tokens=STEPS, ignore_eos=True, prompt_logprobs=TOP))
    assert c.prompt_ids == ids and c.prompt_tokens == len(ids)
    assert [ev.token for ev in c.events] == reference_greedy(ref, STEPS, input_ids=torch.tensor([ids]))

    lsm = torch.log_softmax(reference_logits(ref, input_ids=torch.tensor([ids])), dim=-1)
    assert [p.token for p in c.prompt_logprobs] == ids
    assert c.prompt_logprobs[0].logprob is None and c.prompt_logprobs[0].top_logprobs == ()
    for i, p in enumerate(c.prompt_logprobs[1:], start=1):
        row = lsm[i - 1]
        # log-softmax of logits within ATOL (conftest) moves by at most ~2 ATOL
        assert abs(p.logprob - float(row[p.token])) < 2 * ATOL
        assert [t for t, _ in p.top_logprobs] == row.topk(TOP).indices.tolist()


def test_token_ids_and_text_give_the_same_completion(qwen) -> None:
    ids = qwen.tokenizer(PROMPT).input_ids
    a = _run(qwen, PROMPT, CompletionParams(max_tokens=4, n=2))
    b = _run(qwen, ids, CompletionParams(max_tokens=4, n=2))
    assert [(e.index, e.token) for e in a.events] == [(e.index, e.token) for e in b.events]
    assert "prompt=" in repr(a) and "<" in repr(b)


def test_max_tokens_zero_scores_the_prompt_alone(gemma) -> None:
    c = _run(gemma, PROMPT, CompletionParams(max_tokens=0, prompt_logprobs=0))
    assert c.events == [] and c.completion_tokens == [0] and c.finished
    assert len(c.prompt_logprobs) == c.prompt_tokens and all(p.top_logprobs == () for p in c.prompt_logprobs)


def test_raw_prompt_errors(qwen) -> None:
    with pytest.raises(InvalidRequestError, match="empty"):
        _run(qwen, "", CompletionParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        _run(qwen, [1, 10**9], CompletionParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="raw prompt"):
        run_sync(complete(qwen, [Turn("user", ("hi",))], CompletionParams(prompt_logprobs=1)))
