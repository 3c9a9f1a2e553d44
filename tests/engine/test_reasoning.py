"""Thinking: per-conversation template options reach the template as the reference's
keywords do, and a thinking model's thoughts split from its answer by the marker tokens,
the same whole or token by token."""

from __future__ import annotations

import pytest

from engine import InvalidRequestError, SyncContext, reasoning_markers


def test_enable_thinking_renders_as_the_reference(gemma):
    ctx = SyncContext(gemma).template_options(enable_thinking=True).system("Be brief.").user("Hi").cue()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = gemma.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=True
    )
    assert ctx.token_ids == gemma.tokenizer.encode(text, add_special_tokens=False)
    plain = SyncContext(gemma).system("Be brief.").user("Hi").cue()
    assert plain.token_ids != ctx.token_ids  # thinking off: an empty thought channel in the cue
    ctx.close()
    plain.close()
    late = SyncContext(gemma).user("Hi")
    with pytest.raises(InvalidRequestError, match="before the first turn"):
        late.template_options(enable_thinking=True)
    with pytest.raises(InvalidRequestError, match="set by the engine"):
        SyncContext(gemma).template_options(tools=[])
    late.close()


def _split(markers, pieces):
    """(thoughts, answer) fed piece by piece: pieces are (token id, text)."""
    split = markers.split()
    thoughts = answer = ""
    for token, text in pieces:
        if split.passthrough(token):
            answer += text
            continue
        t, a = split.feed(token, text)
        thoughts, answer = thoughts + t, answer + a
    return thoughts, answer


def test_gemma_thoughts_split_from_the_answer(gemma):
    m = reasoning_markers(gemma)
    assert m is not None and m.format.name == "gemma4"
    word = 100  # any ordinary token id
    pieces = [
        (m.start_id, ""),
        (word, "thou"),
        (word, "ght\n"),
        (word, "I should"),
        (word, " greet."),
        (m.end_id, ""),
        (word, "Hello"),
        (word, "!"),
    ]
    assert _split(m, pieces) == ("I should greet.", "Hello!")
    # No thought channel: all answer; a thought that never ends: all thoughts.
    assert _split(m, [(word, "Hi"), (word, " there")]) == ("", "Hi there")
    assert _split(m, [(m.start_id, ""), (word, "thought\nhmm")]) == ("hmm", "")
    # The channel's name is dropped only at the start.
    assert _split(m, [(m.start_id, ""), (word, "thinking it over"), (m.end_id, "")]) == (
        "thinking it over",
        "",
    )


def test_qwen_think_tags_split_and_leave_no_marker_text(qwen):
    m = reasoning_markers(qwen)
    assert m is not None and m.format.name == "qwen3"
    word = 100
    pieces = [(m.start_id, "<think>"), (word, "\nPonder.\n"), (m.end_id, "</think>"), (word, "\n\nDone.")]
    assert _split(m, pieces) == ("\nPonder.\n", "\n\nDone.")
