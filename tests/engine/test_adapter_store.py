"""The adapter store (Pie's ``pie:core/adapter``): names per model and namespace, fork,
destroy, PEFT save/load inside a sandbox.

Parity tolerance: the conftest's ATOL, as the LoRA parity tests (tests/engine/test_lora.py)
use it: ours adds ``s * (x A^T) B^T`` per row, peft's merged model computes
``x (W + s B A)^T``; a missing or wrongly scaled adapter moves logits by 1e-2 or more.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from engine import AdapterMismatchError, AdapterNotFoundError, Context, ForwardPassError
from engine import evolution as zo
from engine.adapter_store import (
    DEFAULT_TARGETS,
    AdapterArgumentError,
    AdapterExistsError,
    AdapterPathError,
    AdapterStore,
    resolve_path,
)
from fixtures.tiny_lora import build_adapter
from tests.engine.conftest import assert_logits_close, pass_logits, reference_logits

PROMPT = "Tell me about cats and the sea."


def _logits(model, adapter=None, text: str = PROMPT) -> torch.Tensor:
    return pass_logits(model, text, adapter)


def _ref_logits(model_dir, adapter_dir, ids: list[int]) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    base = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()
    return reference_logits(
        merged, input_ids=torch.tensor([ids]), mm_token_type_ids=torch.zeros(1, len(ids), dtype=torch.long)
    )


def _trained(store, model, name: str):
    """An adapter with non-zero A and B: initialized, then one ES generation."""
    a = store.create(model, name, rank=4, seed=0)
    zo.initialize(a, 4, 8.0, 6, 0.5, 0.2, seed=1)
    zo.update(a, [3.0, 1.0, 2.0, 0.0, 5.0, 4.0], [11, 12, 13, 14, 15, 16], 0.0)
    assert all(b.abs().max() > 0 for _, b in a.weights.values())
    return a


def test_create_open_fork_destroy_per_model_and_namespace(qwen, gemma):
    store = AdapterStore()
    a = store.create(qwen, "draft")
    # Pie's targets: q/k/v of every decoder layer of the language model; B = 0: no effect yet.
    assert set(a.targets) == set(DEFAULT_TARGETS)
    assert len(a.weights) == 3 * qwen.arch.hf.config.text_config.num_hidden_layers
    assert all(p.startswith("model.language_model.layers.") for p in a.weights)
    assert all(b.abs().max() == 0 for _, b in a.weights.values())
    assert store.open(qwen, "draft") is a
    assert store.open(qwen, "other") is None
    assert store.open(qwen, "draft", namespace="tenant-b") is None  # namespaces never see each other
    assert store.open(gemma, "draft") is None  # nor models
    b = store.create(qwen, "draft", namespace="tenant-b")
    assert b is not a and store.open(qwen, "draft", namespace="tenant-b") is b
    with pytest.raises(AdapterExistsError):
        store.create(qwen, "draft")
    f = a.fork("draft-2")
    assert store.open(qwen, "draft-2") is f and f.namespace == a.namespace
    assert f.adapter is not a.adapter and f.adapter.digest == a.adapter.digest
    with pytest.raises(AdapterExistsError):
        a.fork("draft-2")
    assert store.names(qwen) == ["draft", "draft-2"]
    a.destroy()
    assert store.open(qwen, "draft") is None
    with pytest.raises(AdapterNotFoundError):
        _ = a.adapter
    with pytest.raises(AdapterNotFoundError):
        a.fork("again")
    assert store.create(qwen, "draft") is not a  # the name is free again
    assert store.open(qwen, "draft-2") is f  # the fork lives on


def test_fork_copies_weights_and_zo_state_independently(qwen):
    store = AdapterStore()
    a = _trained(store, qwen, "a")
    f = a.fork("f")
    assert f.evolution is not None and f.evolution is not a.evolution
    before = {p: (x.clone(), y.clone()) for p, (x, y) in a.weights.items()}
    zo.update(f, [1.0] * 6, [1, 2, 3, 4, 5, 6], 0.0)
    for p, (x, y) in a.weights.items():  # the original did not move
        assert torch.equal(x, before[p][0]) and torch.equal(y, before[p][1])
    assert any(not torch.equal(y, f.weights[p][1]) for p, (_, y) in a.weights.items())
    assert a.evolution.generation == 1 and f.evolution.generation == 2


def test_saved_adapter_loads_in_peft_with_the_same_logits(qwen, tmp_path):
    store = AdapterStore()
    a = _trained(store, qwen, "trained")
    out = a.save("/scratch/adapters/trained", sandbox=tmp_path)  # the guest's view of the sandbox
    assert out == tmp_path.resolve() / "adapters" / "trained"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(out))
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8.0
    ours = _logits(qwen, a.adapter)
    ids = qwen.tokenize(PROMPT)
    ref = _ref_logits(qwen.path, out, ids)
    assert_logits_close(ours, ref, "adapter_store saved adapter vs peft")
    assert (ours - _logits(qwen)).abs().max().item() > 1e-2  # the adapter matters


def test_load_a_peft_adapter_then_save_round_trips(qwen, tmp_path):
    store = AdapterStore()
    src = build_adapter(qwen.path, tmp_path / "sandbox" / "peft", seed=5, std=0.05)
    a = store.create(qwen, "loaded")
    digest = a.adapter.digest
    a.load("peft", sandbox=tmp_path / "sandbox")
    assert a.adapter.digest != digest and a.rank == 4 and a.evolution is None
    ref = _ref_logits(qwen.path, src, qwen.tokenize(PROMPT))
    assert_logits_close(_logits(qwen, a.adapter), ref, "adapter_store loaded peft adapter")
    # saved and loaded again: the same weights, the same digest, and a ZO state comes back
    zo_a = _trained(store, qwen, "zo")
    zo_a.save("zo", sandbox=tmp_path / "sandbox")
    b = store.create(qwen, "b")
    b.load("zo", sandbox=tmp_path / "sandbox")
    assert b.adapter.digest == zo_a.adapter.digest
    assert b.evolution is not None and b.evolution.sigma == zo_a.evolution.sigma
    assert b.evolution.generation == zo_a.evolution.generation
    for k in zo_a.evolution.shapes:
        assert torch.equal(b.evolution.diag_c[k], zo_a.evolution.diag_c[k])
    assert torch.equal(_logits(qwen, b.adapter), _logits(qwen, zo_a.adapter))
    assert torch.equal(zo.perturbed(b, 99).weights[k[0]][1], zo.perturbed(zo_a, 99).weights[k[0]][1])


def test_a_loaded_adapter_replaces_the_snapshot_not_a_running_one(qwen, tmp_path):
    store = AdapterStore()
    build_adapter(qwen.path, tmp_path / "p", seed=6)
    a = store.create(qwen, "a")
    old = a.adapter
    a.load("p", sandbox=tmp_path)
    assert a.adapter is not old
    assert torch.equal(_logits(qwen, old), _logits(qwen))  # the old snapshot (B = 0) still runs as it was


def test_paths_outside_the_sandbox_are_refused(qwen, tmp_path):
    store = AdapterStore()
    box = tmp_path / "box"
    box.mkdir()
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", box / "link")
    a = store.create(qwen, "a")
    for bad in ("../outside/x", "/etc/x", str(tmp_path / "outside" / "x"), "link/x", "/scratch/../x", ""):
        with pytest.raises(AdapterPathError):
            a.save(bad, sandbox=box)
        with pytest.raises(AdapterPathError):
            a.load(bad, sandbox=box)
    assert not os.listdir(tmp_path / "outside")
    # inside: relative, absolute under the sandbox, or under the guest's /scratch
    assert resolve_path(box, "x/y") == box.resolve() / "x" / "y"
    assert resolve_path(box, str(box / "x")) == box.resolve() / "x"
    assert resolve_path(box, "/scratch/x") == box.resolve() / "x"
    with pytest.raises(AdapterNotFoundError):
        a.load("missing", sandbox=box)


def test_bad_input_gives_typed_errors(qwen, gemma, tmp_path):
    store = AdapterStore()
    with pytest.raises(AdapterArgumentError):
        store.create(qwen, "r0", rank=0)
    with pytest.raises(AdapterArgumentError):
        store.create(qwen, "")
    with pytest.raises(AdapterArgumentError):
        store.create(qwen, "nan", alpha=float("nan"))
    with pytest.raises(AdapterArgumentError):
        store.create(qwen, "none", targets=["no_such_proj"])
    with pytest.raises(AdapterArgumentError):
        store.create("tiny-qwen3-vl", "str-model")
    with pytest.raises(AdapterArgumentError):
        AdapterStore().fork(store.create(qwen, "mine"), "theirs")  # another store's adapter
    # an adapter of another model: its files do not fit, its snapshot is refused by the pass
    g = _trained(store, gemma, "g")
    g.save("g", sandbox=tmp_path)
    q = store.create(qwen, "q")
    with pytest.raises(AdapterMismatchError):
        q.load("g", sandbox=tmp_path)
    ctx = Context(qwen)
    with pytest.raises(ForwardPassError, match="not loaded for this model"):
        ctx.forward().adapter(g.adapter)
    with pytest.raises(ForwardPassError, match="not loaded for this model"):
        ctx.forward().adapter(zo.perturbed(g, 3))
    ctx.close()
