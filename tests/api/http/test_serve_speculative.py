"""The ``speculative`` extension field of /v1/chat/completions: prompt-lookup drafts
change how many passes a reply takes, never its text."""

from __future__ import annotations

import openai
import pytest

QWEN = "tiny-qwen3-vl"
COPY = [{"role": "user", "content": "a b c d e f g a b c d e f g a b c d"}]
SPEC = {"method": "prompt_lookup", "num_draft": 4, "max_ngram": 3}


@pytest.mark.parametrize("stream", [False, True])
def test_speculative_field_gives_the_same_text(client: openai.OpenAI, stream: bool) -> None:
    def ask(extra: dict) -> tuple[str, str | None]:
        kw = dict(model=QWEN, messages=COPY, max_tokens=24, temperature=0, extra_body=extra)
        if not stream:
            r = client.chat.completions.create(**kw)
            return r.choices[0].message.content, r.choices[0].finish_reason
        text, reason = "", None
        for c in client.chat.completions.create(stream=True, **kw):
            for ch in c.choices:
                text += ch.delta.content or ""
                reason = ch.finish_reason or reason
        return text, reason

    plain = ask({})
    assert ask({"speculative": SPEC}) == plain
    assert (
        ask({"speculative": {"num_draft": 8}, "stop": [plain[0][5:8]]})[0]
        == ask({"stop": [plain[0][5:8]]})[0]
    )


def test_seeded_sampled_reply_is_the_same_with_drafts(client: openai.OpenAI) -> None:
    kw = dict(model=QWEN, messages=COPY, max_tokens=16, temperature=1.0, top_p=0.9, seed=5, n=2)
    plain = client.chat.completions.create(**kw)
    drafted = client.chat.completions.create(**kw, extra_body={"speculative": SPEC})
    assert [c.message.content for c in drafted.choices] == [c.message.content for c in plain.choices]


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "medusa"},
        {"num_draft": 0},
        {"num_draft": 99},
        {"min_ngram": 4, "max_ngram": 2},
        {"nope": 1},
    ],
)
def test_bad_speculative_options_are_400(client: openai.OpenAI, spec: dict) -> None:
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=QWEN, messages=COPY, max_tokens=5, extra_body={"speculative": spec}
        )
