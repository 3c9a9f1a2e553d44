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
