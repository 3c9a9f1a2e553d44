"""``/v1/embeddings`` with the official client equals ``model.embed`` in-process."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.api.http.conftest import Server

QWEN = "tiny-qwen3-vl"


@pytest.fixture(scope="module")
def local_qwen():
    from api.model_ref import load_model

    return load_model("tiny", device="cpu")


def test_text_embeddings_equal_in_process(client: openai.OpenAI, local_qwen) -> None:
    texts = ["a red apple", "the sea at night", "a red apple"]
    r = client.embeddings.create(model=QWEN, input=texts)
    assert [d.index for d in r.data] == [0, 1, 2]
    for d, text in zip(r.data, texts, strict=True):
        want = local_qwen.embed(text).numpy()
        np.testing.assert_allclose(np.array(d.embedding, dtype=np.float32), want, atol=1e-5)
    assert r.usage.prompt_tokens == sum(len(local_qwen.tokenize(t)) for t in texts)
    single = client.embeddings.create(model=QWEN, input="a red apple", encoding_format="base64")
    decoded = np.frombuffer(base64.b64decode(single.data[0].embedding), dtype=np.float32)
    np.testing.assert_allclose(decoded, r.data[0].embedding, atol=1e-6)


def test_token_ids_and_image_parts(server: Server, local_qwen, samples: Path) -> None:
    from media import Image

    ids = local_qwen.tokenize("token ids work too")
    path = samples / "images" / "rgba.png"
    url = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
    body = {
        "model": QWEN,
        "pooling": "mean",
        "input": [
            ids,
            [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "a picture"}],
        ],
    }
    r = httpx.post(f"{server.v1}/embeddings", json=body, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    np.testing.assert_allclose(data[0]["embedding"], local_qwen.embed(ids, pooling="mean").numpy(), atol=1e-5)
    want = local_qwen.embed([Image.from_path(path), "a picture"], pooling="mean").numpy()
    np.testing.assert_allclose(data[1]["embedding"], want, atol=1e-5)


def test_embedding_errors(server: Server) -> None:
    cases = [
        ({"model": "nope", "input": "x"}, 404),
        ({"model": QWEN, "input": "x", "pooling": "median"}, 400),
        ({"model": QWEN, "input": "x", "dimensions": 3}, 400),
        ({"model": QWEN, "input": ""}, 400),
        ({"model": "tiny-csm", "input": "x"}, 404),
    ]
    for body, status in cases:
        r = httpx.post(f"{server.v1}/embeddings", json=body, timeout=30)
        assert r.status_code == status, (body, r.status_code, r.text)
