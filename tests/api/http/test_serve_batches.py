"""The OpenAI Batch API flow with the official client, end to end on the real server:
answers equal the chat endpoint's for the same requests; bad lines go to the error file."""

from __future__ import annotations

import base64
import io
import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.api.http.conftest import Server

QWEN = "tiny-qwen3-vl"


def _requests(samples: Path) -> list[dict]:
    url = "data:image/png;base64," + base64.b64encode((samples / "images" / "rgba.png").read_bytes()).decode()
    bodies = [
        {
            "model": QWEN,
            "max_tokens": 6,
            "temperature": 0,
            "messages": [{"role": "user", "content": "Hello"}],
        },
        {
            "model": QWEN,
            "max_tokens": 6,
            "temperature": 0,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": url}},
                        {"type": "text", "text": "What is it?"},
                    ],
                }
            ],
        },
        {
            "model": QWEN,
            "max_tokens": 4,
            "temperature": 0,
            "n": 2,
            "messages": [{"role": "user", "content": "Two answers"}],
        },
    ]
    return [
        {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": b}
        for i, b in enumerate(bodies)
    ]


def _wait(client: openai.OpenAI, batch_id: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = client.batches.retrieve(batch_id)
        if b.status in ("completed", "failed", "cancelled") and (b.output_file_id or b.error_file_id):
            return b
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} not done in {timeout} s: {b}")


def test_batch_flow_equals_chat(client: openai.OpenAI, samples: Path) -> None:
    reqs = _requests(samples)
    bad = [
        '{"custom_id": "bad-json", "method": "POST", "url": "/v1/chat/completions", "body": ',
        json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}}),
        json.dumps(
            {
                "custom_id": "bad-image",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": QWEN,
                    "max_tokens": 2,
                    "messages": [
                        {
                            "role": "user",
                            "content": [
                                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
                            ],
                        }
                    ],
                },
            }
        ),
    ]
    data = ("\n".join([json.dumps(r) for r in reqs] + bad) + "\n").encode()
    f = client.files.create(file=("batch.jsonl", io.BytesIO(data)), purpose="batch")
    assert f.purpose == "batch" and f.bytes == len(data)
    batch = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.status in ("validating", "in_progress", "completed", "finalizing")
    done = _wait(client, batch.id)
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (6, 3, 3)
    out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    errs = [json.loads(x) for x in client.files.content(done.error_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == ["req-0", "req-1", "req-2"]
    assert sorted(e["custom_id"] for e in errs) == ["bad-image", "bad-url", "line-4"]
    bad_image = json.loads(bad[2])["body"]
    with pytest.raises(openai.APIStatusError) as direct_error:
        client.chat.completions.create(**bad_image)
    status = {e["custom_id"]: e["response"]["status_code"] for e in errs}
    assert status["bad-image"] == direct_error.value.status_code == 415  # same path, same answer
    assert status["bad-url"] == status["line-4"] == 400
    for o in out:
        body = next(r["body"] for r in reqs if r["custom_id"] == o["custom_id"])
        direct = client.chat.completions.create(**body)
        got = o["response"]["body"]
        assert [c["message"]["content"] for c in got["choices"]] == [
            c.message.content for c in direct.choices
        ]
        assert got["usage"]["prompt_tokens"] == direct.usage.prompt_tokens
    listed = client.batches.list()
    assert batch.id in {b.id for b in listed.data}


def test_batch_errors(server: Server, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.batches.create(
            input_file_id="file-" + "0" * 32, endpoint="/v1/chat/completions", completion_window="24h"
        )
    f = client.files.create(file=("x.txt", io.BytesIO(b"{}")), purpose="user_data")
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    r = httpx.post(f"{server.v1}/files", files={"file": ("a.jsonl", b"x")}, data={"purpose": "nope"})
    assert r.status_code == 400
    assert httpx.get(f"{server.v1}/batches/batch_nope").status_code == 404
    assert httpx.get(f"{server.v1}/files/../../etc/passwd/content").status_code == 404


def _run_batch(client: openai.OpenAI, endpoint: str, lines: list[str]):
    data = ("\n".join(lines) + "\n").encode()
    f = client.files.create(file=("batch.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h")
    assert batch.endpoint == endpoint
    done = _wait(client, batch.id)
    assert done.status == "completed"
    out = {
        o["custom_id"]: o
        for o in map(json.loads, client.files.content(done.output_file_id).text.splitlines())
    }
    errs = {}
    if done.error_file_id:
        errs = {
            e["custom_id"]: e
            for e in map(json.loads, client.files.content(done.error_file_id).text.splitlines())
        }
    return done, out, errs


def test_a_completions_batch_equals_the_completions_endpoint(client: openai.OpenAI) -> None:
    bodies = {
        "text": {"model": QWEN, "prompt": "Once upon", "max_tokens": 5, "temperature": 0},
        "ids": {"model": QWEN, "prompt": [5, 17, 99, 3], "max_tokens": 4, "temperature": 0},
        "two-seeded": {"model": QWEN, "prompt": ["a", "b c"], "max_tokens": 3, "n": 2, "seed": 7},
        "scored": {"model": QWEN, "prompt": "score this text", "max_tokens": 0, "echo": True, "logprobs": 2},
    }
    lines = [
        json.dumps({"custom_id": k, "method": "POST", "url": "/v1/completions", "body": b})
        for k, b in bodies.items()
    ]
    bad = {
        "chat-url": {"url": "/v1/chat/completions", "body": {"model": QWEN, "messages": []}},
        "suffix": {"url": "/v1/completions", "body": {"model": QWEN, "prompt": "x", "suffix": "y"}},
        "stream": {"url": "/v1/completions", "body": {"model": QWEN, "prompt": "x", "stream": True}},
        "no-prompt": {"url": "/v1/completions", "body": {"model": QWEN}},
    }
    lines += [json.dumps({"custom_id": k, "method": "POST", **v}) for k, v in bad.items()]
    done, out, errs = _run_batch(client, "/v1/completions", lines)
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (8, 4, 4)
    assert set(out) == set(bodies) and set(errs) == set(bad)
    assert {k: e["response"]["status_code"] for k, e in errs.items()} == dict.fromkeys(bad, 400)
    assert "/v1/completions" in errs["chat-url"]["response"]["body"]["error"]["message"]
    assert "suffix" in errs["suffix"]["response"]["body"]["error"]["message"]
    for key, body in bodies.items():
        got = out[key]["response"]["body"]
        direct = client.completions.create(**body)
        assert got["object"] == "text_completion"
        assert [(c["index"], c["text"], c["finish_reason"]) for c in got["choices"]] == [
            (c.index, c.text, c.finish_reason) for c in direct.choices
        ]
        assert got["usage"]["prompt_tokens"] == direct.usage.prompt_tokens
        if body.get("logprobs") is not None:
            assert got["choices"][0]["logprobs"]["tokens"] == direct.choices[0].logprobs.tokens
            assert got["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
                direct.choices[0].logprobs.token_logprobs, abs=1e-6
            )


def test_an_embeddings_batch_equals_the_embeddings_endpoint(client: openai.OpenAI) -> None:
    bodies = {
        "one": {"model": QWEN, "input": "a sentence to embed"},
        "many": {"model": QWEN, "input": ["first", "second one"], "pooling": "mean"},
    }
    lines = [
        json.dumps({"custom_id": k, "method": "POST", "url": "/v1/embeddings", "body": b})
        for k, b in bodies.items()
    ]
    lines.append(
        json.dumps(
            {
                "custom_id": "bad-dims",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": QWEN, "input": "x", "dimensions": 3},
            }
        )
    )
    done, out, errs = _run_batch(client, "/v1/embeddings", lines)
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 1)
    assert errs["bad-dims"]["response"]["status_code"] == 400
    assert "dimensions" in errs["bad-dims"]["response"]["body"]["error"]["message"]
    for key, body in bodies.items():
        got = out[key]["response"]["body"]
        plain = {k: v for k, v in body.items() if k != "pooling"}
        direct = client.embeddings.create(**plain, extra_body={"pooling": body.get("pooling", "last")})
        assert len(got["data"]) == len(direct.data)
        for g, d in zip(got["data"], direct.data, strict=True):
            assert g["index"] == d.index
            assert g["embedding"] == pytest.approx(d.embedding, abs=1e-6)
        assert got["usage"]["prompt_tokens"] == direct.usage.prompt_tokens


def test_a_batch_to_an_unserved_endpoint_is_refused(server: Server, client: openai.OpenAI) -> None:
    f = client.files.create(file=("b.jsonl", io.BytesIO(b'{"custom_id": "a"}\n')), purpose="batch")
    r = httpx.post(
        f"{server.v1}/batches",
        json={"input_file_id": f.id, "endpoint": "/v1/moderations", "completion_window": "24h"},
    )
    assert 400 <= r.status_code < 500
    assert "/v1/responses" in r.text  # the answer names what is served


def test_a_responses_batch_equals_the_responses_endpoint(client: openai.OpenAI) -> None:
    bodies = {
        "plain": {
            "model": QWEN,
            "input": "Say hi.",
            "max_output_tokens": 4,
            "temperature": 0,
            "store": False,
        },
        "instructed": {
            "model": QWEN,
            "instructions": "Be brief.",
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "Why?"}]}],
            "max_output_tokens": 5,
            "temperature": 0,
            "store": False,
        },
    }
    lines = [
        json.dumps({"custom_id": k, "method": "POST", "url": "/v1/responses", "body": b})
        for k, b in bodies.items()
    ]
    lines.append(
        json.dumps(
            {
                "custom_id": "bad",
                "method": "POST",
                "url": "/v1/responses",
                "body": {"model": QWEN, "input": []},
            }
        )
    )
    done, out, errs = _run_batch(client, "/v1/responses", lines)
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 1)
    assert errs["bad"]["response"]["status_code"] == 400
    for key, body in bodies.items():
        got = out[key]["response"]["body"]
        direct = client.responses.create(**body)
        assert got["object"] == "response" and got["status"] == direct.status
        assert got["output"][0]["content"][0]["text"] == direct.output_text
        assert got["usage"]["input_tokens"] == direct.usage.input_tokens
