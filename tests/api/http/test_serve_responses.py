"""The Responses API with the official client on the real server: an answer equals the
chat endpoint's for the same conversation (text, image, instructions, JSON format), a
stored response is continued by ``previous_response_id`` as the whole conversation would
be, function calls come back as items and go back in as items, a stream's events add up to
the answer, and bad requests are typed 4xx."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from tests.api.http.conftest import Server

QWEN = "tiny-qwen3-vl"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Oslo", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def chat_text(client: openai.OpenAI, messages: list, **kw) -> tuple[str, int]:
    r = client.chat.completions.create(model=QWEN, messages=messages, temperature=0, **kw)
    return r.choices[0].message.content, r.usage.prompt_tokens


def test_an_answer_equals_the_chat_endpoints(client: openai.OpenAI, samples: Path) -> None:
    r = client.responses.create(
        model=QWEN, input="Say hello.", instructions="Be brief.", max_output_tokens=8, temperature=0
    )
    text, prompt = chat_text(
        client,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}],
        max_tokens=8,
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.model == QWEN
    assert r.output_text == text and r.usage.input_tokens == prompt and r.usage.output_tokens == 8
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    url = "data:image/png;base64," + base64.b64encode((samples / "images" / "rgba.png").read_bytes()).decode()
    image = client.responses.create(
        model=QWEN,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is it?"},
                    {"type": "input_image", "image_url": url},
                ],
            }
        ],
        max_output_tokens=6,
        temperature=0,
    )
    text, prompt = chat_text(
        client,
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is it?"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
        max_tokens=6,
    )
    assert image.output_text == text and image.usage.input_tokens == prompt


def test_previous_response_id_continues_the_stored_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(model=QWEN, input="Pick a colour.", max_output_tokens=5, temperature=0)
    second = client.responses.create(
        model=QWEN, input="Why that one?", previous_response_id=first.id, max_output_tokens=5, temperature=0
    )
    text, prompt = chat_text(
        client,
        [
            {"role": "user", "content": "Pick a colour."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Why that one?"},
        ],
        max_tokens=5,
    )
    assert second.output_text == text and second.usage.input_tokens == prompt
    assert second.previous_response_id == first.id
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=QWEN, input="x", previous_response_id=first.id, max_output_tokens=2)
    unstored = client.responses.create(model=QWEN, input="x", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_function_calls_go_out_and_come_back_as_items(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=QWEN,
        input="Weather in Oslo?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
        temperature=0,
    )
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    follow = client.responses.create(
        model=QWEN,
        previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'}],
        tools=[WEATHER],
        max_output_tokens=4,
        temperature=0,
    )
    # The same conversation sent whole to chat: the call as an assistant turn, the result as a tool turn.
    chat = client.chat.completions.create(
        model=QWEN,
        messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": '{"sky": "clear"}'},
        ],
        tools=[
            {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["parameters"]}}
        ],
        max_tokens=4,
        temperature=0,
    )
    assert follow.usage.input_tokens == chat.usage.prompt_tokens
    assert follow.output_text == (chat.choices[0].message.content or "")


def test_a_json_schema_format_is_followed(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
    }
    r = client.responses.create(
        model=QWEN,
        input="A number as JSON.",
        text={"format": {"type": "json_schema", "name": "num", "schema": schema}},
        max_output_tokens=30,
        temperature=0,
    )
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_a_stream_adds_up_to_the_answer(client: openai.OpenAI) -> None:
    kw = dict(model=QWEN, input="Tell me a story.", max_output_tokens=12, temperature=0, store=False)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert deltas == done.text == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == 12


def test_streamed_function_calls(client: openai.OpenAI) -> None:
    kw = dict(
        model=QWEN,
        input="Weather?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=40,
        temperature=0,
        store=False,
    )
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    args = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    want = [(i.name, i.arguments) for i in whole.output if i.type == "function_call"]
    assert [(i.name, i.arguments) for i in done if i.type == "function_call"] == want and args == [
        a for _, a in want
    ]
    assert events[-1].type == "response.completed"


@pytest.mark.parametrize(
    "body, status",
    [
        ({"input": "x", "previous_response_id": "resp_" + "0" * 32}, 404),
        ({"input": "x", "previous_response_id": "nonsense"}, 404),
        ({"input": "x", "tool_choice": "required"}, 400),
        ({"input": [{"type": "function_call_output"}]}, 400),
        ({"input": "x", "max_output_tokens": 0}, 400),
        ({"input": []}, 400),
        ({"input": [{"role": "user", "content": "x"}], "model": ""}, 404),
        (
            {
                "input": [
                    {
                        "role": "user",
                        "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}],
                    }
                ]
            },
            415,  # as the chat endpoint answers bytes that are no image
        ),
    ],
)
def test_bad_requests(server: Server, body: dict, status: int) -> None:
    r = httpx.post(f"{server.v1}/responses", json={"model": QWEN, **body}, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]


def test_a_long_text_input_is_one_message(server: Server) -> None:
    body = {"model": QWEN, "input": "word " * 1500, "max_output_tokens": 1, "store": False}
    r = httpx.post(f"{server.v1}/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] > 1500
