"""The real server driven by the official ``openai`` client: answers over HTTP equal the
engine's in-process answers token for token (greedy)."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import openai
import pytest

from tests.api.http.conftest import Server

QWEN = "tiny-qwen3-vl"
GEMMA = "tiny-gemma4"


def data_url(path: Path, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode()}"


@pytest.fixture(scope="module")
def local_qwen():
    from api.model_ref import load_model

    return load_model("tiny", device="cpu")


@pytest.fixture(scope="module")
def local_gemma():
    from api.model_ref import load_model

    return load_model("tiny-gemma4", device="cpu")


def in_process(model, parts: tuple, max_tokens: int) -> tuple[str, int, int]:
    """(text, prompt tokens, completion tokens) from the engine directly, greedy."""
    from engine import CompletionParams, Turn, complete, run_sync

    results, prompt = run_sync(
        complete(model, [Turn("user", parts)], CompletionParams(max_tokens=max_tokens))
    )
    return results[0].text, prompt, len(results[0].tokens)


def image_message(url: str, text: str = "Describe this image.") -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}],
        }
    ]


def test_models_and_health(server: Server, client: openai.OpenAI) -> None:
    names = {m.id for m in client.models.list()}
    assert {QWEN, GEMMA, "tiny-csm"} <= names
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/ready").status_code == 200


def test_data_url_image_equals_in_process(client: openai.OpenAI, samples: Path, local_qwen) -> None:
    from media import Image

    path = samples / "images" / "photo_640x480.jpg"
    r = client.chat.completions.create(
        model=QWEN, messages=image_message(data_url(path, "image/jpeg")), max_tokens=12, temperature=0
    )
    text, prompt, done = in_process(local_qwen, (Image.from_path(path), "Describe this image."), 12)
    assert r.choices[0].message.content == text
    assert r.usage.prompt_tokens == prompt and r.usage.completion_tokens == done
    assert r.usage.total_tokens == prompt + done
    assert r.choices[0].finish_reason in ("stop", "length")


def test_uploaded_image_by_id(server: Server, client: openai.OpenAI, samples: Path, local_qwen) -> None:
    from media import Image

    path = samples / "images" / "rgba.png"
    up = httpx.post(f"{server.v1}/media", files=[("file", ("rgba.png", path.read_bytes(), "image/png"))])
    assert up.status_code == 200, up.text
    item = up.json()["data"][0]["media"]
    assert item["kind"] == "image" and item["token_counts"][QWEN] > 0
    again = httpx.post(f"{server.v1}/media", files=[("file", ("copy.png", path.read_bytes(), "image/png"))])
    assert again.json()["data"][0]["media"]["id"] == item["id"]  # same bytes, same id
    r = client.chat.completions.create(
        model=QWEN, messages=image_message(f"pie-media://{item['id']}"), max_tokens=10, temperature=0
    )
    text, prompt, _ = in_process(local_qwen, (Image.from_path(path), "Describe this image."), 10)
    assert r.choices[0].message.content == text
    assert r.usage.prompt_tokens == prompt


def test_streaming_equals_whole(client: openai.OpenAI, samples: Path) -> None:
    url = data_url(samples / "images" / "cmyk.jpg", "image/jpeg")
    whole = client.chat.completions.create(
        model=QWEN, messages=image_message(url), max_tokens=16, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=QWEN,
            messages=image_message(url),
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_n2_sampled_choices_are_reproducible(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "Tell me a story."}]
    a = client.chat.completions.create(model=QWEN, messages=msgs, max_tokens=8, temperature=1.0, n=2, seed=7)
    b = client.chat.completions.create(model=QWEN, messages=msgs, max_tokens=8, temperature=1.0, n=2, seed=7)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    # seed + index per choice: deterministic, and the two choices are different samples
    assert a.choices[0].message.content != a.choices[1].message.content
    one = client.chat.completions.create(model=QWEN, messages=msgs, max_tokens=8, temperature=1.0, seed=7)
    assert one.choices[0].message.content == a.choices[0].message.content
    assert a.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt is counted once
    assert a.usage.completion_tokens >= 2


def test_n3_stream_reassembles_to_the_whole_answer(client: openai.OpenAI) -> None:
    """n choices streamed (their tokens of one pass share an SSE write): each choice's
    deltas, joined by index, give that choice's non-streamed answer, greedy."""
    msgs = [{"role": "user", "content": "Tell me a story."}]
    whole = client.chat.completions.create(model=QWEN, messages=msgs, max_tokens=12, temperature=0, n=3)
    chunks = list(
        client.chat.completions.create(
            model=QWEN, messages=msgs, max_tokens=12, temperature=0, n=3, stream=True
        )
    )
    texts, roles, finishes = ["", "", ""], [None] * 3, [None] * 3
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            roles[ch.index] = roles[ch.index] or ch.delta.role
            finishes[ch.index] = ch.finish_reason or finishes[ch.index]
    assert texts == [c.message.content for c in whole.choices]
    assert roles == ["assistant"] * 3
    assert finishes == [c.finish_reason for c in whole.choices]


def test_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=QWEN,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for tok in content:
        assert tok.logprob <= 0 and len(tok.top_logprobs) == 3
        # greedy: the chosen token is the most probable one
        assert tok.top_logprobs[0].logprob == pytest.approx(tok.logprob, abs=1e-6)
    assert "".join(t.token for t in content).startswith(r.choices[0].message.content[:1])


def test_input_audio_on_gemma(client: openai.OpenAI, samples: Path, local_gemma) -> None:
    from media import Audio

    path = samples / "audio" / "tone_16k_mono.wav"
    msgs = [
        {
            "role": "user",
            "content": [
                {
                    "type": "input_audio",
                    "input_audio": {"data": base64.b64encode(path.read_bytes()).decode(), "format": "wav"},
                },
                {"type": "text", "text": "What do you hear?"},
            ],
        }
    ]
    r = client.chat.completions.create(model=GEMMA, messages=msgs, max_tokens=8, temperature=0)
    text, prompt, _ = in_process(local_gemma, (Audio.from_path(path), "What do you hear?"), 8)
    assert r.choices[0].message.content == text and r.usage.prompt_tokens == prompt


def test_video_url_on_qwen(client: openai.OpenAI, samples: Path, local_qwen) -> None:
    from media import Video

    path = samples / "video" / "h264_320x240_30fps_3s.mp4"
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "video_url", "video_url": {"url": data_url(path, "video/mp4")}},
                {"type": "text", "text": "What happens?"},
            ],
        }
    ]
    r = client.chat.completions.create(model=QWEN, messages=msgs, max_tokens=8, temperature=0)
    text, prompt, _ = in_process(local_qwen, (Video.from_path(path), "What happens?"), 8)
    assert r.choices[0].message.content == text and r.usage.prompt_tokens == prompt


@pytest.mark.parametrize(
    ("kwargs", "status", "code"),
    [
        ({"model": "no-such-model"}, 404, "model_not_found"),
        ({"presence_penalty": 2.5}, 400, "invalid_request"),
        ({"logit_bias": {"not-an-id": 1}}, 400, "invalid_request"),
        ({"logit_bias": {"999999999": 1}}, 400, "invalid_request"),
        ({"max_tokens": 10**6}, 400, "invalid_request"),
        ({"messages": []}, 400, "invalid_request"),
        ({"model": "tiny-csm"}, 404, "model_not_found"),
    ],
)
def test_typed_errors(client: openai.OpenAI, kwargs: dict, status: int, code: str) -> None:
    args = {"model": QWEN, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **kwargs}
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(**args)
    assert e.value.status_code == status
    assert e.value.body["code"] == code and e.value.body["message"]


def test_media_errors_are_4xx(client: openai.OpenAI, samples: Path) -> None:
    cases = [
        (image_message("data:image/png;base64,iVBORw0KGgo="), 400),  # truncated PNG
        (image_message("http://127.0.0.1:9/x.png"), 400),  # http and loopback: refused
        (image_message("https://127.0.0.1/x.png"), 400),  # loopback: refused
        (image_message("file:///etc/passwd"), 400),  # no local path allowed
        (image_message("pie-media://media-0000"), 404),
        (image_message("ftp://example.com/x.png"), 400),
        (
            [
                {
                    "role": "user",
                    "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}],
                }
            ],
            400,
        ),  # Qwen3-VL takes no audio
        (
            [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image_url",
                            "image_url": {"url": data_url(samples / "images" / "rgba.png", "image/png")},
                        }
                    ]
                    * 9,
                }
            ],
            400,
        ),  # over --limit-mm-per-prompt
    ]
    for messages, status in cases:
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(model=QWEN, messages=messages, max_tokens=2)
        assert e.value.status_code == status, (messages[0]["content"][0], e.value.body)
        assert e.value.body["code"]


def test_openapi_lists_every_endpoint_and_errors(server: Server) -> None:
    spec = httpx.get(f"{server.url}/openapi.json").json()
    for path in (
        "/v1/chat/completions",
        "/v1/media",
        "/v1/media/{media_id}",
        "/v1/captions",
        "/v1/models",
        "/health",
        "/ready",
        "/metrics",
    ):
        assert path in spec["paths"], path
    chat = spec["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"400", "404", "413", "415", "429"} <= set(chat)
    docs = httpx.get(f"{server.url}/docs")
    assert docs.status_code == 200 and "cdn" not in docs.text.lower()


def test_openapi_documents_validation_failures_as_the_400_they_are(server: Server) -> None:
    """A query or body that fails validation is answered 400 in OpenAI's error shape; the
    document says so (FastAPI's default says 422 with a body of its own)."""
    spec = httpx.get(f"{server.url}/openapi.json").json()
    assert "HTTPValidationError" not in spec["components"]["schemas"]
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            for status, response in op["responses"].items():
                body = response.get("content", {}).get("application/json", {}).get("schema")
                assert status != "422" or body == error, (method, path)
    jobs = spec["paths"]["/v1/jobs"]["get"]["responses"]
    assert jobs["400"]["content"]["application/json"]["schema"] == error and "422" not in jobs
    r = httpx.get(f"{server.v1}/jobs", params={"limit": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit"
    # routes that answer 422 for their own reasons (an inferlet's trap, a remote fetch) keep it
    assert "422" in spec["paths"]["/v1/chat/completions"]["post"]["responses"]


def test_several_images_fetched_together_keep_their_order(
    client: openai.OpenAI, samples: Path, local_qwen
) -> None:
    """The media of a request are fetched and decoded at once; the prompt keeps the
    request's order (equal to the engine given the same parts in order), and a bad item
    among good ones is its own typed 4xx."""
    from media import Image

    paths = [samples / "images" / n for n in ("photo_640x480.jpg", "rgba.png", "cmyk.jpg")]
    mimes = ["image/jpeg", "image/png", "image/jpeg"]
    content = []
    for i, (p, m) in enumerate(zip(paths, mimes, strict=True)):
        content += [
            {"type": "image_url", "image_url": {"url": data_url(p, m)}},
            {"type": "text", "text": f"#{i}"},
        ]
    r = client.chat.completions.create(
        model=QWEN, messages=[{"role": "user", "content": content}], max_tokens=8, temperature=0
    )
    parts = []
    for i, p in enumerate(paths):
        parts += [Image.from_path(p), f"#{i}"]
    text, prompt, _ = in_process(local_qwen, tuple(parts), 8)
    assert r.choices[0].message.content == text and r.usage.prompt_tokens == prompt

    bad = content[:2] + [{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(
            model=QWEN, messages=[{"role": "user", "content": bad + content}], max_tokens=2
        )
    assert e.value.status_code == 400 and e.value.body["code"] == "corrupt"


def test_more_messages_than_openai_takes_is_a_400(server: Server) -> None:
    """OpenAI's limit, 2048 messages; the 2049th is refused before any template runs."""
    from api.http.schemas.chat import MAX_MESSAGES

    body = {
        "model": QWEN,
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1),
    }
    r = httpx.post(f"{server.v1}/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    body["messages"] = body["messages"][:MAX_MESSAGES]
    r = httpx.post(f"{server.v1}/chat/completions", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 2 * MAX_MESSAGES


def test_a_prompt_over_the_context_length_is_openais_400(server: Server) -> None:
    """Refused before any row is computed, with OpenAI's code; /v1/models says the limit."""
    cards = {m["id"]: m for m in httpx.get(f"{server.v1}/models").json()["data"]}
    limit = cards[QWEN]["max_model_len"]
    assert limit > 1000 and cards["tiny-csm"]["max_model_len"] is None
    words = "hello " * limit  # about a token a word: over the limit with the template
    for extra in ({}, {"max_tokens": 8}):
        r = httpx.post(
            f"{server.v1}/chat/completions",
            json={"model": QWEN, "messages": [{"role": "user", "content": words}], **extra},
            timeout=120,
        )
        error = r.json()["error"]
        assert r.status_code == 400 and error["code"] == "context_length_exceeded", r.text
        assert error["param"] == "messages" and str(limit) in error["message"]


def test_seeds_are_64_bit_integers(server: Server) -> None:
    """Past int64 (OpenAI's schema) a seed is a 400; the largest one still serves n choices
    (each seeded seed + i, past int64: no overflow inside)."""

    def ask(seed: int, n: int = 1) -> httpx.Response:
        body = {"model": QWEN, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        return httpx.post(
            f"{server.v1}/chat/completions", json={**body, "seed": seed, "n": n, "temperature": 1}
        )

    assert ask(2**80).status_code == 400 and ask(2**80).json()["error"]["param"] == "seed"
    assert ask(-(2**63) - 1).status_code == 400
    top = ask(2**63 - 1, n=3)
    assert top.status_code == 200 and len(top.json()["choices"]) == 3
    assert ask(2**63 - 1, n=3).json()["choices"] == top.json()["choices"]  # reproducible


def test_usage_reports_the_prompt_tokens_the_prefix_cache_served(client: openai.OpenAI) -> None:
    import uuid

    text = f"{uuid.uuid4().hex} " + "a long and unique prompt about caching " * 12
    messages = [{"role": "user", "content": text}]
    first = client.chat.completions.create(model=QWEN, messages=messages, max_tokens=2, temperature=0)
    again = client.chat.completions.create(model=QWEN, messages=messages, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # never seen: every row computed
    cached = again.usage.prompt_tokens_details.cached_tokens
    # Whole published pages (32 rows each) and the kept tail: all but the rows computed anew.
    assert 0 < cached <= again.usage.prompt_tokens
    assert again.choices[0].message.content == first.choices[0].message.content
