"""api.model_ref: tiny names resolve here (and only here); load_model dispatches by architecture."""

from __future__ import annotations

import pytest

from api.model_ref import ModelNotFoundError, load_model, resolve_model_dir
from engine import MissingCheckpointFileError, Model, ModelLoadError
from speech import NoSpeechHeadError, SpeechModel


def test_tiny_names_and_directories_resolve(tiny_dir, tmp_path):
    assert resolve_model_dir("tiny") == tiny_dir("tiny-qwen3-vl")
    for name in ("tiny-qwen3-vl", "tiny-gemma4", "tiny-csm"):
        assert resolve_model_dir(name) == tiny_dir(name)
    assert resolve_model_dir(tmp_path) == tmp_path
    assert resolve_model_dir(str(tmp_path)) == tmp_path


def test_unknown_names_and_paths_are_typed_errors(tmp_path):
    for ref in ("tiny-llama", str(tmp_path / "nowhere"), tmp_path / "nowhere", 42):
        with pytest.raises(ModelNotFoundError) as e:
            load_model(ref)
        assert isinstance(e.value, MissingCheckpointFileError) and isinstance(e.value, ModelLoadError)
        assert e.value.code == "model_not_found"
    with pytest.raises(ModelNotFoundError, match="unknown tiny model 'tiny-llama'"):
        resolve_model_dir("tiny-llama")
    with pytest.raises(ModelNotFoundError, match="neither a checkpoint directory"):
        resolve_model_dir(tmp_path / "nowhere")
    afile = tmp_path / "weights.bin"
    afile.write_bytes(b"")
    with pytest.raises(ModelNotFoundError):
        resolve_model_dir(afile)


def test_load_model_dispatches_by_architecture(tiny_dir):
    speech = load_model("tiny-csm", device="cpu")
    assert isinstance(speech, SpeechModel) and speech.architecture == "CsmForConditionalGeneration"
    served = load_model("tiny", device="cpu", kv_pages=8)
    assert isinstance(served, Model) and served.architecture == "Qwen3VLForConditionalGeneration"
    assert served.pool_stats().num_pages == 8
    assert isinstance(load_model(tiny_dir("tiny-gemma4"), device="cpu", kv_pages=8), Model)


def test_one_set_of_options_loads_either_kind():
    speech = load_model("tiny-csm", device="cpu", kv_pages=8, attention="auto", page_size=16)
    assert isinstance(speech, SpeechModel) and speech.device.type == "cpu"
    with pytest.raises(TypeError, match="kv_page"):
        load_model("tiny-csm", kv_page=8)


def test_the_loaders_take_directories_only(tiny_dir):
    for name in ("tiny-qwen3-vl", "tiny"):
        with pytest.raises(ModelLoadError, match="api.model_ref"):
            Model.load(name)
    with pytest.raises(ModelLoadError, match="api.model_ref"):
        SpeechModel.load("tiny-csm")
    with pytest.raises(NoSpeechHeadError):
        SpeechModel.load(tiny_dir("tiny-gemma4"))
    with pytest.raises(ModelLoadError, match="not served"):
        Model.load(tiny_dir("tiny-csm"))  # the engine does not dispatch to speech
