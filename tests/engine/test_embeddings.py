"""Embeddings: the pooled final hidden states equal transformers' ``hidden_states[-1]``
pooled the same way, for text and image content, on both tiny families."""

from __future__ import annotations

import pytest
import torch

from engine import POOLINGS, InvalidRequestError, embed_many_async, run_sync
from media import Image
from tests.engine.conftest import ATOL
from tests.engine.test_parity_media import IMG_A, _pil, gemma_processor, qwen_processor  # noqa: F401

TEXT = "A small cat sleeps on a warm windowsill."


def _reference_states(ref, **inputs) -> torch.Tensor:
    with torch.no_grad():
        return ref(**inputs, output_hidden_states=True).hidden_states[-1][0].float()


def _pooled(states: torch.Tensor, pooling: str) -> torch.Tensor:
    v = {"last": states[-1], "cls": states[0], "mean": states.mean(0), "max": states.max(0).values}[pooling]
    return torch.nn.functional.normalize(v, dim=0)


@pytest.mark.parametrize("family", ["qwen", "gemma"])
def test_text_embeddings_equal_reference(request, family: str) -> None:
    model, ref = request.getfixturevalue(family), request.getfixturevalue(f"{family}_ref")
    ids = model.tokenize(TEXT)
    inputs = {"input_ids": torch.tensor([ids])}
    if family == "qwen":
        inputs["mm_token_type_ids"] = torch.zeros(1, len(ids), dtype=torch.long)
    states = _reference_states(ref, **inputs)
    for pooling in POOLINGS:
        ours = model.embed(TEXT, pooling=pooling)
        # Same float32 sums reordered (see conftest's ATOL): far below a wrong row or pooling.
        assert (ours - _pooled(states, pooling)).abs().max() < ATOL, pooling
    raw = model.embed(TEXT, pooling="mean", normalize=False)
    assert (raw - states.mean(0)).abs().max() < ATOL


@pytest.mark.parametrize("family", ["qwen", "gemma"])
def test_image_embeddings_equal_reference(request, family: str) -> None:
    model, ref = request.getfixturevalue(family), request.getfixturevalue(f"{family}_ref")
    processor = request.getfixturevalue(f"{family}_processor")
    marker = model.arch.media_marker("image")
    kwargs = {"max_soft_tokens": 70} if family == "gemma" else {}
    inputs = dict(processor(text=[marker + TEXT], images=[_pil(IMG_A)], return_tensors="pt", **kwargs))
    image = model.prepare(Image.from_bytes(IMG_A), **kwargs)
    states = _reference_states(ref, **inputs)
    for pooling in POOLINGS:
        ours = model.embed([image, TEXT], pooling=pooling)
        assert (ours - _pooled(states, pooling)).abs().max() < ATOL, pooling


def test_batched_equals_one_by_one(qwen) -> None:
    contents = ["one", "two words", [Image.from_bytes(IMG_A), "three"], "four four four"]
    together = run_sync(embed_many_async(qwen, contents, pooling="mean"))
    alone = torch.stack([qwen.embed(c, pooling="mean") for c in contents])
    assert together.shape == (4, qwen.arch.hidden_size)
    assert (together - alone).abs().max() < ATOL
    assert qwen.open_contexts == 0


def test_bad_embedding_requests(qwen) -> None:
    with pytest.raises(InvalidRequestError, match="pooling"):
        qwen.embed("x", pooling="median")
    with pytest.raises(InvalidRequestError, match="empty"):
        qwen.embed("")
    with pytest.raises(InvalidRequestError, match="no contents"):
        qwen.embed_many([])
