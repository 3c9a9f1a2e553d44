"""Thinking over HTTP: ``chat_template_kwargs`` (vLLM's) turns Gemma-4's thinking on in the
prompt, and the thought channel comes back as ``reasoning_content`` beside the answer,
whole or streamed. A grammar makes the tiny random model write a thought channel."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.api.http.conftest import Server

GEMMA = "tiny-gemma4"


@pytest.fixture(scope="module")
def local_models():
    from api.model_ref import load_model

    return load_model("tiny-gemma4", device="cpu"), load_model("tiny", device="cpu")


THINK_THEN_ANSWER = 'start: <|channel> "thought\\n" /[a-z]{4,8}/ <channel|> /[a-z]{3,6}/'


def test_thoughts_come_back_apart_from_the_answer(client: openai.OpenAI, server: Server) -> None:
    kw = dict(
        model=GEMMA,
        messages=[{"role": "user", "content": "Think, then answer."}],
        max_tokens=40,
        temperature=0,
        extra_body={
            "chat_template_kwargs": {"enable_thinking": True},
            "response_format": {"type": "grammar", "grammar": THINK_THEN_ANSWER},
        },
    )
    r = client.chat.completions.create(**kw)
    message = r.choices[0].message
    thought, answer = message.model_extra["reasoning_content"], message.content
    assert thought.isalpha() and 4 <= len(thought) <= 8, message
    assert answer.isalpha() and 3 <= len(answer) <= 6
    streamed_thought = streamed_answer = ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed_thought += (c.delta.model_extra or {}).get("reasoning_content") or ""
            streamed_answer += c.delta.content or ""
    assert (streamed_thought, streamed_answer) == (thought, answer)
    # Thinking on changes the prompt (no empty thought channel in the cue); off is the default.
    on = r.usage.prompt_tokens
    off = client.chat.completions.create(
        model=GEMMA, messages=[{"role": "user", "content": "Think, then answer."}], max_tokens=1
    ).usage.prompt_tokens
    assert on != off
    # Without a thought channel, the answer is all content.
    plain = client.chat.completions.create(
        model=GEMMA, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert plain.choices[0].message.model_extra.get("reasoning_content") is None


def test_template_kwargs_the_engine_sets_are_refused(server: Server) -> None:
    body = {
        "model": GEMMA,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "chat_template_kwargs": {"add_generation_prompt": False},
    }
    r = httpx.post(f"{server.v1}/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "set by the engine" in r.json()["error"]["message"]


def test_a_responses_answer_carries_its_thoughts_as_a_reasoning_item(client: openai.OpenAI) -> None:
    kw = dict(
        model=GEMMA,
        input="Think, then answer.",
        max_output_tokens=40,
        temperature=0,
        store=False,
        reasoning={"effort": "medium"},  # turns the template's thinking on
        extra_body={"text": {"format": {"type": "grammar", "grammar": THINK_THEN_ANSWER}}},
    )
    r = client.responses.create(**kw)
    kinds = [o.type for o in r.output]
    assert kinds == ["reasoning", "message"]
    thought = r.output[0].content[0].text
    assert thought.isalpha() and r.output_text.isalpha()
    events = list(client.responses.create(**kw, stream=True))
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.output_index for e in done] == [0, 1] and done[0].item.type == "reasoning"
    assert done[0].item.content[0].text == thought
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == r.output_text and events[-1].response.output_text == r.output_text


def test_without_thinking_asked_for_the_channel_stays_in_the_answer(client: openai.OpenAI) -> None:
    """As vLLM without --reasoning-parser: nothing is split unless thinking is on."""
    r = client.chat.completions.create(
        model=GEMMA,
        messages=[{"role": "user", "content": "Answer."}],
        max_tokens=40,
        temperature=0,
        extra_body={"response_format": {"type": "grammar", "grammar": THINK_THEN_ANSWER}},
    )
    message = r.choices[0].message
    assert message.model_extra.get("reasoning_content") is None
    assert message.content.startswith("thought\n")  # the markers are special tokens: no text


def test_the_server_flag_splits_every_answer(local_models) -> None:
    from api.http.generation import reasoning_of
    from api.http.settings import ServeSettings

    gemma, qwen = local_models
    auto, default = ServeSettings(reasoning_parser="auto"), ServeSettings()
    assert reasoning_of(auto, gemma, None).format.name == "gemma4"
    assert reasoning_of(auto, qwen, None).format.name == "qwen3"
    assert reasoning_of(default, gemma, None) is None
    assert reasoning_of(default, gemma, {"enable_thinking": True}) is not None
    assert reasoning_of(default, gemma, {"enable_thinking": False}) is None
