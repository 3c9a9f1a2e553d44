"""Model.load: checkpoints in, typed errors for everything that is not one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine import (
    CheckpointShapeError,
    MissingCheckpointFileError,
    Model,
    ModelLoadError,
    Sampler,
    SyncContext,
    UnsupportedArchitectureError,
    default_device,
    max_tokens,
)
from tests.engine.conftest import TINY_GEMMA, assert_logits_close


def _copy(src: Path, dst: Path, *, skip: tuple[str, ...] = ()) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.name in skip or f.name.startswith("."):
            continue
        if f.suffix == ".safetensors":
            (dst / f.name).symlink_to(f)
        else:
            shutil.copy(f, dst / f.name)
    return dst


def _edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        node = cfg
        *parents, leaf = key.split("__")
        for p in parents:
            node = node[p]
        node[leaf] = value
    (folder / "config.json").write_text(json.dumps(cfg))


def test_tiny_checkpoints_load(gemma, qwen):
    assert gemma.architecture == "Gemma4ForConditionalGeneration"
    assert qwen.architecture == "Qwen3VLForConditionalGeneration"
    assert default_device().type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert gemma.eos_token_ids == {1, 6} and qwen.eos_token_ids == {151645, 151643}
    assert qwen.media_kinds == {"image", "video"} and gemma.media_kinds == {"image", "video", "audio"}


def test_names_are_not_resolved_by_the_engine(tmp_path):
    """Model.load takes a directory: tiny names are the CLI's / api.model_ref's to resolve."""
    for ref in ("tiny-qwen3-vl", "tiny", "tiny-llama"):
        with pytest.raises(MissingCheckpointFileError, match="pass a checkpoint directory") as e:
            Model.load(ref)
        assert "api.model_ref" in str(e.value)
    afile = tmp_path / "config.json"
    afile.write_text("{}")
    with pytest.raises(ModelLoadError, match="not a directory"):
        Model.load(afile)


def test_missing_things_are_named(tmp_path, gemma):
    with pytest.raises(MissingCheckpointFileError):
        Model.load(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(MissingCheckpointFileError, match="config.json"):
        Model.load(empty)
    no_weights = _copy(gemma.path, tmp_path / "no_weights", skip=("model.safetensors",))
    with pytest.raises(MissingCheckpointFileError, match="safetensors"):
        Model.load(no_weights)
    no_tok = _copy(gemma.path, tmp_path / "no_tok", skip=("tokenizer.json",))
    with pytest.raises(MissingCheckpointFileError, match="tokenizer"):
        Model.load(no_tok)
    bad = _copy(gemma.path, tmp_path / "bad_json")
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="JSON"):
        Model.load(bad)


def test_unsupported_architectures_are_refused_before_loading(tmp_path, qwen):
    text_only = _copy(qwen.path, tmp_path / "qwen3")
    _edit_config(text_only, architectures=["Qwen3ForCausalLM"])
    with pytest.raises(UnsupportedArchitectureError, match="text-only"):
        Model.load(text_only)
    unknown = _copy(qwen.path, tmp_path / "unknown")
    _edit_config(unknown, architectures=["FancyNewModel"])
    with pytest.raises(UnsupportedArchitectureError, match="FancyNewModel"):
        Model.load(unknown)
    none = _copy(qwen.path, tmp_path / "none")
    _edit_config(none, architectures=[])
    with pytest.raises(UnsupportedArchitectureError):
        Model.load(none)


def test_weights_of_the_wrong_shape(tmp_path, gemma):
    wrong = _copy(gemma.path, tmp_path / "wrong")
    _edit_config(wrong, text_config__intermediate_size=96)
    with pytest.raises(CheckpointShapeError):
        Model.load(wrong)


def test_sharded_checkpoint_loads_and_matches(tmp_path, gemma):
    sharded = tmp_path / "sharded"
    gemma.hf.save_pretrained(sharded, max_shard_size="300KB")
    for f in gemma.path.iterdir():
        if not f.name.startswith(".") and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, sharded / f.name)
    assert len(list(sharded.glob("*.safetensors"))) > 1
    model = Model.load(sharded, kv_pages=32, device="cpu")
    a = SyncContext(model).user("Hello, sharded world.").cue()
    b = SyncContext(gemma).user("Hello, sharded world.").cue()
    assert_logits_close(
        a.flush(return_logits=True), b.flush(return_logits=True), "sharded vs single-file load"
    )
    a.close()
    b.close()
    shard = sorted(sharded.glob("*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(MissingCheckpointFileError, match=shard.name):
        Model.load(sharded)


def test_bfloat16_load_generates(tiny_dir):
    model = Model.load(tiny_dir(TINY_GEMMA), dtype=torch.bfloat16, kv_pages=16)
    assert model.pool.k[0].dtype == torch.bfloat16
    out = SyncContext(model).user("Hi").cue().generate(Sampler.greedy(), max_tokens(4))
    assert len(out.tokens) == 4
