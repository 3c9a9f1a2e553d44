"""How `pie-media serve`'s model options become `Model.load` arguments."""

from __future__ import annotations

import pydantic
import pytest
import torch

from api.cli import main
from api.http.settings import ServeSettings


def test_auto_dtype_follows_the_device() -> None:
    cpu = ServeSettings(device="cpu").model_load_options()
    assert cpu == {"device": "cpu", "dtype": torch.float32, "attention": "auto", "max_speech_streams": 16}
    cuda = ServeSettings(device="cuda:1", attention="flashinfer").model_load_options()
    assert cuda["dtype"] is torch.bfloat16 and cuda["device"] == "cuda:1"
    assert ServeSettings().model_load_options()["device"] == ("cuda" if torch.cuda.is_available() else "cpu")


def test_speech_streams_reach_speech_models_only() -> None:
    from api.model_ref import load_model

    opts = ServeSettings(device="cpu", max_speech_streams=3).model_load_options()
    assert load_model("tiny-csm", **opts).capacity.max_streams == 3
    assert load_model("tiny", **opts).name == "tiny-qwen3-vl"  # Model.load never sees the option


def test_explicit_options_pass_through() -> None:
    opts = ServeSettings(device="cpu", dtype="float16", kv_pages=64, cuda_graphs=32).model_load_options()
    assert opts["dtype"] is torch.float16 and opts["kv_pages"] == 64 and opts["cuda_graphs"] == 32


@pytest.mark.parametrize("bad", [{"dtype": "int8"}, {"kv_pages": 0}, {"cuda_graphs": -1}])
def test_bad_values_are_refused(bad: dict) -> None:
    with pytest.raises(pydantic.ValidationError):
        ServeSettings(**bad)


def test_serve_refuses_bad_options_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--cuda-graphs", "-1"]) == 2
    assert "cuda_graphs" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        main(["serve", "--dtype", "int8"])
