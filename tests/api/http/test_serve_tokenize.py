"""``/tokenize`` and ``/detokenize`` (vLLM's) on the real server: a raw prompt's tokens are
the tokenizer's, a chat's are the template's (tools included) and cost what the chat
endpoint then reports, media counted as their placeholder rows."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import openai
import pytest

from tests.api.http.conftest import Server

QWEN = "tiny-qwen3-vl"
GEMMA = "tiny-gemma4"
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def tokenizers():
    from transformers import AutoTokenizer

    from fixtures.tiny_models import ensure_tiny_model

    return {name: AutoTokenizer.from_pretrained(ensure_tiny_model(name)) for name in (QWEN, GEMMA)}


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


@pytest.mark.parametrize("model", [QWEN, GEMMA])
def test_a_raw_prompt_is_the_tokenizers(server: Server, tokenizers, model: str) -> None:
    tok = tokenizers[model]
    text = "Once upon a time, <b>tags</b> and ünïcode."
    r = post(server, "/tokenize", {"model": model, "prompt": text, "return_token_strs": True}).json()
    assert r["tokens"] == tok(text).input_ids and r["count"] == len(r["tokens"])
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    models = httpx.get(f"{server.v1}/models", timeout=30).json()["data"]
    assert r["max_model_len"] == next(m["max_model_len"] for m in models if m["id"] == model)
    plain = post(server, "/tokenize", {"model": model, "prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == tok(text, add_special_tokens=False).input_ids
    back = post(server, "/detokenize", {"model": model, "tokens": plain["tokens"]}).json()
    assert back["prompt"] == text


def test_a_chat_costs_what_the_chat_endpoint_reports(
    server: Server, client: openai.OpenAI, samples: Path, tokenizers
) -> None:
    url = "data:image/png;base64," + base64.b64encode((samples / "images" / "rgba.png").read_bytes()).decode()
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What?"}],
        },
    ]
    r = post(server, "/tokenize", {"model": QWEN, "messages": messages}).json()
    chat = client.chat.completions.create(model=QWEN, messages=messages, max_tokens=1)
    assert r["count"] == chat.usage.prompt_tokens > 50  # the image's placeholder rows counted
    text = [{"role": "user", "content": "What time is it?"}]
    with_tools = post(server, "/tokenize", {"model": QWEN, "messages": text, "tools": [TIME]}).json()
    want = tokenizers[QWEN].apply_chat_template(
        text, tools=[TIME], tokenize=False, add_generation_prompt=True
    )
    assert with_tools["tokens"] == tokenizers[QWEN].encode(want, add_special_tokens=False)
    no_cue = post(
        server, "/tokenize", {"model": QWEN, "messages": text, "add_generation_prompt": False}
    ).json()
    cued = post(server, "/tokenize", {"model": QWEN, "messages": text}).json()
    assert cued["tokens"][: no_cue["count"]] == no_cue["tokens"] and cued["count"] > no_cue["count"]


@pytest.mark.parametrize(
    "path, body, status",
    [
        ("/tokenize", {"model": QWEN}, 400),
        ("/tokenize", {"model": QWEN, "prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400),
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404),
        ("/detokenize", {"model": QWEN, "tokens": [1, 10**9]}, 400),
        ("/detokenize", {"model": QWEN, "tokens": [-1]}, 400),
    ],
)
def test_bad_requests(server: Server, path: str, body: dict, status: int) -> None:
    assert post(server, path, body).status_code == status
