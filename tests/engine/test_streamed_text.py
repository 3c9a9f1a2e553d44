"""The streamed text adds up to the whole decode of the generated tokens.

Gemma's vocabulary falls back to ``<0xHH>`` byte tokens, decoded as one group: 'N' alone
becomes two replacement characters once an invalid continuation byte follows. The tiny
Gemma-4's greedy answer to PROMPTS[0] ends in exactly such a run (a stream once sent the
text before it twice), so the deltas must hold a byte run back until it ends."""

from __future__ import annotations

import pytest

PROMPTS = ["The capital of France is", "Once upon a time", "One two", "a b c d"]


@pytest.fixture(scope="module")
def gemma():
    from api.model_ref import load_model

    return load_model("tiny-gemma4", device="cpu")


def _stream(model, prompt: str, max_tokens: int) -> tuple[str, list[int]]:
    from engine import Completion, CompletionParams, Sampler, run_sync

    async def go() -> tuple[str, list[int]]:
        c = Completion.from_prompt(
            model, prompt, CompletionParams(sampler=Sampler.greedy(), max_tokens=max_tokens)
        )
        text, tokens = "", []
        async with c:
            async for ev in c:
                text += ev.text
                tokens.append(ev.token)
        return text, tokens

    return run_sync(go())


@pytest.mark.parametrize("prompt", PROMPTS)
def test_deltas_add_up_to_the_whole_decode(gemma, prompt: str) -> None:
    for max_tokens in (9, 10, 24):
        text, tokens = _stream(gemma, prompt, max_tokens)
        assert text == gemma.detokenize(tokens, skip_special_tokens=True)


def test_the_byte_run_case_is_covered(gemma) -> None:
    """PROMPTS[0]'s answer really has a byte-token run that rewrites its first byte's text
    (else the test above would not check the case it is for)."""
    _, tokens = _stream(gemma, PROMPTS[0], 10)
    runs = [i for i, t in enumerate(tokens) if t in gemma.byte_fallback_ids]
    assert runs
    i = runs[-1]
    before = gemma.detokenize(tokens[:i], skip_special_tokens=True)
    after = gemma.detokenize(tokens[: i + 1], skip_special_tokens=True)
    assert not after.startswith(before)


def test_byte_level_bpe_has_no_byte_fallback_ids() -> None:
    from api.model_ref import load_model

    assert load_model("tiny", device="cpu").byte_fallback_ids == frozenset()
