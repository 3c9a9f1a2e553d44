"""The replica router's affinity key: requests whose KV pages start alike (the same model
and first content parts) share a key, so they land on the replica holding those pages;
the Responses API keys on its instructions, like a chat's system turn."""

from __future__ import annotations

import json

from api.serve_ray import affinity_key


def key(path: str, body: dict) -> str | None:
    return affinity_key(path, json.dumps(body).encode())


def test_chat_completions_and_responses_share_keys_by_prefix() -> None:
    chat = {
        "model": "m",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a"}],
    }
    other_question = {**chat, "messages": [chat["messages"][0], {"role": "user", "content": "b"}]}
    # Two parts name the prefix: the system turn and the first question.
    assert key("/v1/chat/completions", chat) != key("/v1/chat/completions", other_question)
    assert key("/v1/chat/completions", chat) is not None
    responses = {"model": "m", "instructions": "Be brief.", "input": "anything"}
    follow_up = {"model": "m", "instructions": "Be brief.", "input": "more", "previous_response_id": "resp_x"}
    assert key("/v1/responses", responses) == key("/v1/responses", follow_up) is not None
    assert key("/v1/responses", {**responses, "model": "n"}) != key("/v1/responses", responses)
    # Without instructions: the input starts the conversation, unless it continues a stored one.
    plain = {"model": "m", "input": "hello"}
    items = {"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": "hello"}]}]}
    assert key("/v1/responses", plain) == key("/v1/responses", items) is not None
    assert key("/v1/responses", {**plain, "previous_response_id": "resp_x"}) is None
    assert key("/v1/completions", {"model": "m", "prompt": "p"}) is not None
    assert key("/v1/embeddings", {"model": "m", "input": "p"}) is None
    assert affinity_key("/v1/responses", b"not json") is None
