from __future__ import annotations

import json

import pytest
import torch

from encoders import Encoded, EncoderCache, UnsupportedModelError, encoder_for


def _enc(rows: int, hidden: int = 16) -> Encoded:
    return Encoded(embeddings=torch.zeros(rows, hidden, dtype=torch.float32))


def test_lru_evicts_by_bytes_and_counts():
    one = _enc(4).nbytes()
    cache = EncoderCache(byte_budget=3 * one)
    for k in "abc":
        cache.put(k, _enc(4))
    assert cache.get("a") is not None  # a is now most recent
    cache.put("d", _enc(4))  # evicts b, the least recently used
    assert cache.get("b") is None
    assert all(cache.get(k) is not None for k in "acd")
    assert cache.stats.evictions == 1
    assert cache.stats.hits == 4 and cache.stats.misses == 1
    assert cache.stats.bytes == 3 * one


def test_item_larger_than_budget_is_not_cached():
    cache = EncoderCache(byte_budget=10)
    cache.put("x", _enc(4))
    assert len(cache) == 0 and cache.get("x") is None


def test_deepstack_counts_toward_bytes():
    e = Encoded(embeddings=torch.zeros(2, 8), deepstack=[torch.zeros(2, 8), torch.zeros(2, 8)])
    assert e.nbytes() == 3 * 2 * 8 * 4


@pytest.mark.parametrize(
    "arch,needle",
    [
        ("Qwen3ForCausalLM", "no media encoder"),
        ("CsmForConditionalGeneration", "takes no image/audio/video input"),
        ("LlamaForCausalLM", "no media encoder"),
    ],
)
def test_registry_exact_architecture(tmp_path, arch, needle):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch]}))
    with pytest.raises(UnsupportedModelError) as ei:
        encoder_for(tmp_path)
    assert needle in str(ei.value) and ei.value.code == "unsupported_model"


def test_registry_missing_or_bad_config(tmp_path):
    with pytest.raises(UnsupportedModelError, match="no config.json"):
        encoder_for(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UnsupportedModelError, match="not valid JSON"):
        encoder_for(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UnsupportedModelError, match="architectures"):
        encoder_for(tmp_path)


def _prepared(rows: int, key: str):
    from encoders import Prepared

    return Prepared(
        kind="image",
        family="test",
        input_ids=(1,) * rows,
        placeholder_id=1,
        token_count=rows,
        grid=(1, 1, rows),
        positions=torch.zeros(1, rows, dtype=torch.long),
        position_span=rows,
        prefix_tokens=(),
        suffix_tokens=(),
        inputs={"pixel_values": torch.zeros(rows, 100)},
        content_hash=key,
        cache_key=key,
    )


def test_prepared_entries_are_bounded_by_bytes():
    from encoders.cache import prepared_nbytes

    one = prepared_nbytes(_prepared(10, "a"))
    assert one == 10 * 100 * 4 + 10 * 8
    cache = EncoderCache(prepared_byte_budget=2 * one)
    for k in "abc":
        cache.put_prepared(k, _prepared(10, k))
    assert cache.get_prepared("a") is None  # evicted, least recently used
    assert cache.get_prepared("b") is not None and cache.get_prepared("c") is not None
    cache.put_prepared("huge", _prepared(100, "huge"))  # bigger than the budget: not kept
    assert cache.get_prepared("huge") is None and cache.get_prepared("b") is not None
