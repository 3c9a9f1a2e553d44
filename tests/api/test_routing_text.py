"""What the replica router matches (``api.serve_ray.routing_text``): requests whose KV pages
start alike have routing texts that start alike, media parts are short digests, and the
Responses API starts with its instructions, like a chat's system turn."""

from __future__ import annotations

import base64
import json
import os

from api.prefix_router import PrefixRouter
from api.serve_ray import routing_text

SYSTEM = "You answer questions about the pie-media service, briefly and precisely. " * 10


def text(path: str, body: dict) -> str | None:
    return routing_text(path, json.dumps(body).encode())


def chat(question: str, system: str = SYSTEM, model: str = "m", image: str | None = None) -> dict:
    content: list[dict] = [{"type": "text", "text": question}]
    if image is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": image}})
    return {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": content}],
    }


def test_chats_sharing_a_system_prompt_share_its_prefix() -> None:
    a, b = text("/v1/chat/completions", chat("What is 2+2?")), text("/v1/chat/completions", chat("Why?"))
    assert a is not None and b is not None
    shared = os.path.commonprefix((a, b))
    assert shared.startswith("m") and SYSTEM in shared and len(shared) / len(a) > 0.9
    assert not text("/v1/chat/completions", chat("Why?", model="n")).startswith(shared)  # type: ignore[union-attr]
    # A later turn of the same chat extends the first turn's text.
    first = chat("Tell me a joke.")
    second = {
        **first,
        "messages": [
            *first["messages"],
            {"role": "assistant", "content": "No."},
            {"role": "user", "content": "Please?"},
        ],
    }
    assert text("/v1/chat/completions", second).startswith(text("/v1/chat/completions", first))  # type: ignore[union-attr,arg-type]


def test_media_parts_are_digests_of_their_reference() -> None:
    big = "data:image/png;base64," + base64.b64encode(os.urandom(300_000)).decode()
    other = "data:image/png;base64," + base64.b64encode(os.urandom(1000)).decode()
    with_big = text("/v1/chat/completions", chat("What is it?", system="S", image=big))
    assert with_big is not None and len(with_big) < 200  # not the base64
    assert with_big == text("/v1/chat/completions", chat("What is it?", system="S", image=big))
    assert with_big != text("/v1/chat/completions", chat("What is it?", system="S", image=other))
    by_id = text("/v1/chat/completions", chat("What is it?", system="S", image="pie-media://abc"))
    assert by_id is not None and "image_url:" in by_id and by_id != with_big


def test_responses_completions_and_other_routes() -> None:
    first = {"model": "m", "instructions": "Be brief.", "input": "anything"}
    follow_up = {"model": "m", "instructions": "Be brief.", "input": "more", "previous_response_id": "resp_x"}
    # A follow-up's known start (its instructions) is a prefix of the first turn's text.
    assert text("/v1/responses", first).startswith(text("/v1/responses", follow_up))  # type: ignore[union-attr,arg-type]
    assert text("/v1/responses", {**first, "model": "n"}) != text("/v1/responses", first)
    # Without instructions: the input starts the conversation, unless it continues a stored one.
    plain = {"model": "m", "input": "hello"}
    items = {"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", "text": "hello"}]}]}
    assert text("/v1/responses", plain) == text("/v1/responses", items) is not None
    assert text("/v1/responses", {**plain, "previous_response_id": "resp_x"}) is None
    assert text("/v1/completions", {"model": "m", "prompt": "p"}) is not None
    assert text("/v1/embeddings", {"model": "m", "input": "p"}) is None
    assert routing_text("/v1/responses", b"not json") is None
    assert routing_text("/v1/chat/completions", b"[1, 2]") is None
    long = text("/v1/completions", {"model": "m", "prompt": "x" * 100_000})
    assert long is not None and len(long) == 16_384


def test_six_chats_with_one_system_prompt_meet_on_one_replica() -> None:
    """The case issue 34 saw: with the old key (system prompt + first question) these
    spread 3 and 3; by longest prefix they all go where the first went."""
    router = PrefixRouter()
    questions = ["What is 2+2?", "Name a colour.", "Why is the sky blue?", "Hi", "Define entropy.", "Go"]
    chosen = [router.route(text("/v1/chat/completions", chat(q)), {"a": 0, "b": 0}) for q in questions]  # type: ignore[arg-type]
    assert [c.replica for c in chosen] == ["a"] * 6
    # Another system prompt on an idle service goes to the replica holding less.
    assert (
        router.route(
            text("/v1/chat/completions", chat("Hi", system="Other. " * 40)), {"a": 0, "b": 0}
        ).replica
        == "b"
    )  # type: ignore[arg-type]
