"""EleutherAI's lm-evaluation-harness through ``POST /v1/completions`` agrees with its own
transformers backend on the same tiny checkpoint: ``local-completions`` (echoed prompt
logprobs, ``logprobs: 1``) against ``hf`` for loglikelihoods and their ``is_greedy`` flags,
and greedy ``generate_until`` texts equal.

Tolerance: 2.5e-5 on a summed loglikelihood. Both sides compute in float32 from the same
weights; ours attends over paged K/V in other batch shapes, so sums of a few
log-softmax values differ by float reordering (seen: ~2e-6)."""

from __future__ import annotations

import pytest

from tests.api.http.conftest import Server

pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval's API models need its [api] extra

GEMMA = "tiny-gemma4"  # Gemma-4 is a causal LM to lm-eval's hf backend (a Qwen3-VL config is not)

PAIRS = [
    ("The capital of France is", " Paris"),
    ("One two", " three four five"),
    ("Once upon a time, in a quiet town,", " there lived an old clockmaker."),
]


@pytest.fixture(scope="module")
def harness(server: Server, tiny_dir):
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    folder = str(tiny_dir(GEMMA))
    api = LocalCompletionsAPI(
        base_url=f"{server.v1}/completions",
        model=GEMMA,
        tokenizer_backend="huggingface",
        tokenizer=folder,
        num_concurrent=1,
        max_retries=1,
        batch_size=1,
    )
    hf = HFLM(pretrained=folder, device="cpu", dtype="float32", batch_size=4)
    return api, hf


def _instances(kind: str, args: list[tuple]) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def test_loglikelihoods_equal_the_hf_backend(harness) -> None:
    api, hf = harness
    # The tokens the model would write itself, so that is_greedy is True for some pairs
    # (a pair whose text re-tokenizes differently at the seam is False on both sides).
    contexts = ["Hello", "One two", "The", "It was the best of times"]
    firsts = hf.generate_until(
        _instances(
            "generate_until", [(c, {"until": [], "max_gen_toks": 1, "do_sample": False}) for c in contexts]
        )
    )
    pairs = [*PAIRS, *((c, t) for c, t in zip(contexts, firsts, strict=True) if t)]
    ours = api.loglikelihood(_instances("loglikelihood", pairs))
    theirs = hf.loglikelihood(_instances("loglikelihood", pairs))
    for (ll, is_greedy), (ref, ref_greedy) in zip(ours, theirs, strict=True):
        assert ll == pytest.approx(ref, abs=2.5e-5)
        assert is_greedy == ref_greedy
    assert any(g for _, g in theirs) and not all(g for _, g in theirs)


def test_greedy_generations_equal_the_hf_backend(harness) -> None:
    api, hf = harness
    gen = {"until": ["\n\n"], "max_gen_toks": 10, "do_sample": False}
    requests = [(ctx, dict(gen)) for ctx, _ in PAIRS]
    ours = api.generate_until(_instances("generate_until", requests))
    theirs = hf.generate_until(_instances("generate_until", [(c, dict(gen)) for c, _ in PAIRS]))
    assert ours == theirs
