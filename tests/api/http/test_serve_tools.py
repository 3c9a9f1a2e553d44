"""Tool calling on ``/v1/chat/completions`` with the official client, on the real server:
a forced call (named or required) comes back as ``tool_calls`` whose arguments fit the
schema and equal the engine's own output token for token; a stream assembles to the whole
answer; a conversation carrying calls and tool results costs the tokens the reference
template renders; and what cannot be served is a typed 400."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.api.http.conftest import Server
from tests.tool_definitions import TIME, WEATHER

QWEN = "tiny-qwen3-vl"
GEMMA = "tiny-gemma4"
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def qwen():
    from api.model_ref import load_model

    return load_model("tiny", device="cpu")


def engine_text(model, messages, tools, grammar, max_tokens):
    """The text the engine generates for the same request, in process (greedy)."""
    from engine import Completion, CompletionParams, Turn, run_sync

    async def go():
        turns = [Turn(m["role"], (m["content"],)) for m in messages]
        c = Completion(model, turns, CompletionParams(max_tokens=max_tokens, grammar=grammar), tools=tools)
        async with c:
            return "".join([ev.text async for ev in c])

    return run_sync(go())


def test_a_named_function_is_called_as_the_engine_calls_it(client: openai.OpenAI, qwen) -> None:
    from engine import tool_call_format

    r = client.chat.completions.create(
        model=QWEN,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's reason when the caller named the function
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
    fmt = tool_call_format(qwen)
    text = engine_text(qwen, ASK, [WEATHER, TIME], fmt.grammar([WEATHER], qwen.tokenizer, parallel=False), 60)
    (want,) = fmt.parse(text).calls
    assert (call.function.name, call.function.arguments) == (want.name, want.arguments)


def test_required_calls_stream_as_the_whole_answer(client: openai.OpenAI) -> None:
    kw = dict(
        model=QWEN,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=120,
        temperature=0,
        parallel_tool_calls=False,
    )
    whole = client.chat.completions.create(**kw)
    (call,) = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    calls: dict[int, dict] = {}
    content, reason = "", None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                got = calls.setdefault(d.index, {"name": "", "arguments": ""})
                got["name"] += d.function.name or ""
                got["arguments"] += d.function.arguments or ""
            reason = c.finish_reason or reason
    assert content == "" and reason == "tool_calls"
    assert list(calls.values()) == [{"name": call.function.name, "arguments": call.function.arguments}]


def test_a_conversation_with_calls_and_results_is_the_reference_prompt(client: openai.OpenAI, qwen) -> None:
    call = {
        "id": "call_7",
        "type": "function",
        "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'},
    }
    messages = [
        {"role": "user", "content": "What time is it?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_7", "content": "12:00"},
    ]
    r = client.chat.completions.create(
        model=QWEN, messages=messages, tools=[TIME], max_tokens=3, temperature=0
    )
    ref_messages = [
        messages[0],
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{**call, "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}],
        },
        messages[2],
    ]
    text = qwen.tokenizer.apply_chat_template(
        ref_messages, tools=[TIME], tokenize=False, add_generation_prompt=True
    )
    assert r.usage.prompt_tokens == len(qwen.tokenizer.encode(text, add_special_tokens=False))
    # "auto" on a random model writes no call: plain content, the usual finish reason.
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


def test_tool_choice_none_leaves_the_text_alone(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=QWEN, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=5, temperature=0
    )
    assert r.choices[0].message.tool_calls is None and isinstance(r.choices[0].message.content, str)
    # An empty tool list (some clients always send one) is a plain chat.
    plain = client.chat.completions.create(model=QWEN, messages=ASK, max_tokens=5, temperature=0)
    empty = client.chat.completions.create(
        model=QWEN, messages=ASK, tools=[], tool_choice="auto", max_tokens=5, temperature=0
    )
    assert empty.choices[0].message.content == plain.choices[0].message.content
    assert empty.usage.prompt_tokens == plain.usage.prompt_tokens


@pytest.mark.parametrize(
    "change, param, words",
    [
        ({"tool_choice": "required", "tools": None}, "tool_choice", "needs tools"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "x"}}, "tools": None},
            "tool_choice",
            "needs tools",
        ),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not one of the tools",
        ),
        ({"model": GEMMA}, "tools", "not supported for gemma4"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "leave out response_format",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
            "tools",
            "",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools", "same function name"),
    ],
)
def test_tool_requests_that_cannot_be_served_are_400s(server: Server, change, param, words) -> None:
    body = {"model": QWEN, "messages": ASK, "tools": [WEATHER], "max_tokens": 4, **change}
    if body["tools"] is None:
        del body["tools"]
    if param == "tools" and "parameters" in json.dumps(change):
        body["tool_choice"] = "required"  # the schema is compiled when a call is forced
    r = httpx.post(f"{server.v1}/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"]
