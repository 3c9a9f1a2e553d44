"""``response_format`` over HTTP: json_schema / json_object (OpenAI) and the regex and
grammar extensions, with the official client; the answer equals the in-process one."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.api.http.conftest import Server

QWEN = "tiny-qwen3-vl"
GEMMA = "tiny-gemma4"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "population": {"type": "integer", "minimum": 0, "maximum": 10**7},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}
MSGS = [{"role": "user", "content": "A city as JSON."}]


@pytest.fixture(scope="module")
def local_qwen():
    from api.model_ref import load_model

    return load_model("tiny", device="cpu")


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}


@pytest.mark.parametrize("model", [QWEN, GEMMA])
def test_json_schema_validates_and_equals_in_process(client: openai.OpenAI, local_qwen, model: str) -> None:
    from engine import CompletionParams, Grammar, Turn, complete, run_sync

    r = client.chat.completions.create(
        model=model, messages=MSGS, max_tokens=80, temperature=0, response_format=json_schema_format(SCHEMA)
    )
    text = r.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert r.choices[0].finish_reason == "stop"
    if model == QWEN:
        params = CompletionParams(max_tokens=80, grammar=Grammar.json_schema(SCHEMA))
        results, _ = run_sync(complete(local_qwen, [Turn("user", ("A city as JSON.",))], params))
        assert results[0].text == text


def test_sampled_streamed_choices_all_validate(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=QWEN,
            messages=MSGS,
            max_tokens=80,
            temperature=1.0,
            n=3,
            seed=11,
            stream=True,
            response_format=json_schema_format(SCHEMA),
        )
    )
    texts = ["", "", ""]
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    for t in texts:
        jsonschema.validate(json.loads(t), SCHEMA)


def test_json_object_and_extensions(server: Server, client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=QWEN, messages=MSGS, max_tokens=60, temperature=0, response_format={"type": "json_object"}
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    pattern = r"[A-Z][a-z]{2,5} [0-9]{1,3}"
    r = client.chat.completions.create(
        model=GEMMA,
        messages=MSGS,
        max_tokens=30,
        temperature=0.8,
        seed=1,
        extra_body={"response_format": {"type": "regex", "regex": pattern}},
    )
    assert re.fullmatch(pattern, r.choices[0].message.content)
    lark = 'start: "yes" | "no"'
    r = client.chat.completions.create(
        model=QWEN,
        messages=MSGS,
        max_tokens=5,
        temperature=1.0,
        extra_body={"response_format": {"type": "grammar", "grammar": lark}},
    )
    assert r.choices[0].message.content in ("yes", "no")


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}},
        {"type": "regex", "regex": "(unclosed"},
        {"type": "grammar", "grammar": "start: missing_rule"},
        {"type": "json_schema", "json_schema": {"name": "x"}},
        {"type": "xml"},
    ],
)
def test_bad_formats_are_400(client: openai.OpenAI, fmt: dict) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=QWEN, messages=MSGS, max_tokens=5, extra_body={"response_format": fmt}
        )
    assert e.value.body["code"] in ("invalid_grammar", "invalid_request")
    assert e.value.body["message"]
