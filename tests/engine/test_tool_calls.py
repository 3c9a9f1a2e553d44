"""Tool calling: tools and tool turns render as the reference template renders them, the
Hermes blocks Qwen writes parse back into calls (a stream releases the same content as the
whole text), and a forced choice yields only calls whose arguments fit their schemas."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine import (
    Completion,
    CompletionParams,
    InvalidRequestError,
    SyncContext,
    Turn,
    check_tools,
    run_sync,
    tool_call_format,
)
from engine.tool_calls import HERMES
from tests.tool_definitions import TIME, WEATHER

CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}},
}
CONVERSATION = [
    {"role": "system", "content": "Use the tools."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
    {"role": "user", "content": "And tomorrow?"},
]


def _reference_ids(model, messages, tools):
    text = model.tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    return model.tokenizer.encode(text, add_special_tokens=False)


def _extra(message):
    return {k: v for k, v in message.items() if k in ("tool_calls", "tool_call_id")} or None


def test_tools_and_tool_turns_equal_the_reference_template(qwen):
    want = _reference_ids(qwen, CONVERSATION, [WEATHER, TIME])
    whole = Completion(
        qwen,
        [Turn(m["role"], (m["content"],), _extra(m)) for m in CONVERSATION],
        CompletionParams(max_tokens=1),
        tools=[WEATHER, TIME],
    )

    async def prompt_of(c):
        await c.start()
        try:
            return c._contexts[0].token_ids[: c.prompt_tokens]
        finally:
            await c.aclose()

    assert run_sync(prompt_of(whole)) == want
    # Role calls, one at a time, append the same rows.
    ctx = (
        SyncContext(qwen)
        .use_tools([WEATHER, TIME])
        .system("Use the tools.")
        .user("Weather in Oslo?")
        .assistant("", tool_calls=[CALL])
        .tool('{"sky": "clear"}', call_id="call_1")
        .user("And tomorrow?")
        .cue()
    )
    assert ctx.token_ids == want
    ctx.close()


def test_tools_come_before_the_first_turn_and_need_a_template_that_renders_them(qwen, gemma):
    ctx = SyncContext(qwen).user("hi")
    with pytest.raises(InvalidRequestError, match="before the first turn"):
        ctx.use_tools([WEATHER])
    ctx.close()
    # The tiny Gemma-4 template renders no tools (and no parser reads Gemma's call format).
    with pytest.raises(InvalidRequestError, match="tool calling is not supported for gemma4"):
        tool_call_format(gemma)
    assert not gemma.chat.renders_tools and qwen.chat.renders_tools


def test_hermes_blocks_parse_into_calls():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    out = HERMES.parse(text)
    assert out.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [
        ("get_weather", {"city": "Oslo", "days": 2}),
        ("get_time", {"zone": "UTC"}),
    ]
    assert len({c.id for c in out.calls}) == 2 and all(c.id.startswith("call_") for c in out.calls)
    # Only a call: no content. A block cut off by max_tokens but whole JSON still parses.
    assert HERMES.parse('\n<tool_call>\n{"name": "f", "arguments": {}}').content is None
    assert HERMES.parse('<tool_call>{"name": "f", "arguments": {}}').calls[0].name == "f"
    # No call, or a block that is not a call: the text comes back as it is.
    for plain in ["just words", 'x <tool_call>\n{"name": "f", "argu', "<tool_call>[1, 2]</tool_call>"]:
        out = HERMES.parse(plain)
        assert out.content == plain and out.calls == ()


@pytest.mark.parametrize(
    "text",
    [
        "plain answer, no calls  \n",
        'Sure.\n\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {"b": [1]}}\n</tool_call>',
        "a < b and <tool_ <tool_call>broken",
        "ends with a partial marker <tool_c",
    ],
)
def test_a_stream_releases_what_the_whole_text_parses_to(text):
    whole = HERMES.parse(text)
    for step in (1, 2, 3, 7):  # every way of cutting the text into pieces of that size
        split = HERMES.stream()
        released = "".join(split.feed(text[i : i + step]) for i in range(0, len(text), step))
        rest, calls = split.finish()
        assert (released + rest) == (whole.content or "")
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole.calls]
        if whole.calls:  # nothing of a call leaks into the content
            assert "<tool_call" not in released


def _generate(model, grammar, max_tokens=80):
    c = Completion(
        model,
        [Turn("user", ("What is the weather in Oslo?",))],
        CompletionParams(max_tokens=max_tokens, grammar=grammar),
        tools=[WEATHER, TIME],
    )

    async def run():
        await c.start()
        try:
            return "".join([ev.text async for ev in c])
        finally:
            await c.aclose()

    return run_sync(run())


@pytest.mark.parametrize("parallel", [False, True])
def test_a_forced_choice_yields_only_calls_whose_arguments_fit(qwen, parallel):
    fmt = tool_call_format(qwen)
    named = _generate(qwen, fmt.grammar([WEATHER], qwen.tokenizer, parallel=False))
    out = fmt.parse(named)
    assert out.content is None and [c.name for c in out.calls] == ["get_weather"]
    jsonschema.validate(json.loads(out.calls[0].arguments), WEATHER["function"]["parameters"])

    text = _generate(qwen, fmt.grammar([WEATHER, TIME], qwen.tokenizer, parallel=parallel), max_tokens=120)
    out = fmt.parse(text)
    assert out.content is None and out.calls, text
    if not parallel:
        assert len(out.calls) == 1
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in out.calls:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_tool_checks():
    check_tools([WEATHER, TIME], "get_time")
    with pytest.raises(InvalidRequestError, match="not one of the tools"):
        check_tools([WEATHER], "get_time")
    with pytest.raises(InvalidRequestError, match="same function name"):
        check_tools([WEATHER, WEATHER], "auto")
    with pytest.raises(InvalidRequestError, match="needs tools"):
        check_tools([], "required")
    with pytest.raises(InvalidRequestError, match='"type": "function"'):
        check_tools([{"type": "function", "function": {"description": "no name"}}], "auto")
