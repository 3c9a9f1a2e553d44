"""How `pie-media serve`'s model options become `Model.load` arguments."""

from __future__ import annotations

import pydantic
import pytest
import torch

from api.cli import main
from api.http.settings import ServeSettings


def test_auto_dtype_follows_the_device() -> None:
    cpu = ServeSettings(device="cpu").model_load_options()
    cpu.pop("encoder_cache")
    assert cpu == {
        "device": "cpu",
        "dtype": torch.float32,
        "attention": "auto",
        "max_speech_streams": "auto",
        "speech_realtime_safety": 0.8,
    }
    cuda = ServeSettings(device="cuda:1", attention="flashinfer").model_load_options()
    assert cuda["dtype"] is torch.bfloat16 and cuda["device"] == "cuda:1"
    assert ServeSettings().model_load_options()["device"] == ("cuda" if torch.cuda.is_available() else "cpu")


def test_speech_streams_reach_speech_models_only() -> None:
    from api.model_ref import load_model

    opts = ServeSettings(device="cpu", max_speech_streams=3).model_load_options()
    assert load_model("tiny-csm", **opts).capacity.max_streams == 3
    assert load_model("tiny", **opts).name == "tiny-qwen3-vl"  # Model.load never sees the option


def test_the_realtime_rule_can_be_turned_off() -> None:
    assert (
        ServeSettings(device="cpu", speech_realtime_safety="off").model_load_options()[
            "speech_realtime_safety"
        ]
        is None
    )
    assert (
        ServeSettings(device="cpu", speech_realtime_safety=0.5).model_load_options()["speech_realtime_safety"]
        == 0.5
    )
    with pytest.raises(pydantic.ValidationError):
        ServeSettings(speech_realtime_safety=1.5)


def test_max_model_len_reaches_chat_models_only() -> None:
    from api.model_ref import load_model

    opts = ServeSettings(device="cpu", max_model_len=512).model_load_options()
    assert load_model("tiny", **opts).max_model_len == 512
    assert load_model("tiny-csm", **opts).capacity.max_streams is None  # speech ignores it (auto)


def test_explicit_options_pass_through() -> None:
    opts = ServeSettings(device="cpu", dtype="float16", kv_pages=64, cuda_graphs=32).model_load_options()
    assert opts["dtype"] is torch.float16 and opts["kv_pages"] == 64 and opts["cuda_graphs"] == 32


def test_cache_budgets_reach_each_models_encoder(samples) -> None:
    """--encoder-cache-mib / --prepared-cache-mib size each text model's own encoder cache
    (one per model); 0 keeps nothing, and the engine's metrics say what each holds."""
    from api.model_ref import load_model
    from media import Image

    image = Image.from_path(samples / "images" / "rgba.png")
    held = {}
    for mib in (0, 8):
        settings = ServeSettings(device="cpu", encoder_cache_mib=mib, prepared_cache_mib=2 * mib)
        a, b = settings.model_load_options()["encoder_cache"], settings.model_load_options()["encoder_cache"]
        assert a is not b and (a.byte_budget, a.prepared_byte_budget) == (mib << 20, 2 * mib << 20)
        model = load_model("tiny", **settings.model_load_options())
        encoder = model.encoder
        assert encoder.cache.byte_budget == mib << 20
        encoder.encode([encoder.prepare(image)])
        encoder.encode([encoder.prepare(image)])
        m = model.metrics()
        held[mib] = (
            m.encoder_cache_bytes,
            m.prepared_cache_bytes,
            encoder.prepare_calls,
            encoder.tower_calls,
        )
    assert held[0] == (0, 0, 2, 2)  # nothing kept: the repeat prepares and encodes again
    embeddings, prepared, prepares, towers = held[8]
    assert embeddings > 0 and prepared > 0 and (prepares, towers) == (1, 1)


@pytest.mark.parametrize(
    "bad",
    [
        {"dtype": "int8"},
        {"kv_pages": 0},
        {"cuda_graphs": -1},
        {"encoder_cache_mib": -1},
        {"prepared_cache_mib": -1},
        {"decoded_media_cache_mib": -1},
        {"max_model_len": 0},
        {"reasoning_parser": "deepseek"},
    ],
)
def test_bad_values_are_refused(bad: dict) -> None:
    with pytest.raises(pydantic.ValidationError):
        ServeSettings(**bad)


def test_serve_refuses_bad_options_before_loading(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--cuda-graphs", "-1"]) == 2
    assert "cuda_graphs" in capsys.readouterr().err
    for flag in ("--encoder-cache-mib", "--prepared-cache-mib", "--decoded-media-cache-mib"):
        assert main(["serve", flag, "-1"]) == 2
        assert flag[2:].replace("-", "_") in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        main(["serve", "--dtype", "int8"])
