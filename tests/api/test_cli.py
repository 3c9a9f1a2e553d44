from __future__ import annotations

import json
import subprocess
import sys

from api.cli import main


def test_inspect_reports_each_kind_as_json(samples, capsys):
    files = [
        samples / "images/photo_640x480.jpg",
        samples / "audio/tone_44k1_stereo.flac",
        samples / "video/h264_320x240_30fps_3s.mp4",
    ]
    rc = main(["inspect", "--json", "--max-frames", "4", *map(str, files)])
    assert rc == 0
    recs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["kind"] for r in recs] == ["image", "audio", "video"]
    assert recs[0]["width"] == 640 and recs[0]["height"] == 480
    assert recs[1]["sample_rate"] == 44100 and recs[1]["channels"] == 2
    video = recs[2]
    assert video["sampled_frames"] == 4
    assert video["sampled_indices"][0] == 0 and video["sampled_indices"][-1] == video["frame_count"] - 1
    assert video["sampled_timestamps"] == sorted(video["sampled_timestamps"])
    assert all(len(r["content_hash"]) == 32 for r in recs)


def test_inspect_typed_error_and_nonzero_exit(samples, capsys):
    rc = main(
        ["inspect", "--json", str(samples / "images/rgba.png"), str(samples / "hostile/image_truncated.jpg")]
    )
    assert rc == 1
    ok, bad = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert ok["kind"] == "image"
    assert bad["error"]["code"] == "corrupt"


def test_inspect_missing_file(tmp_path, capsys):
    rc = main(["inspect", str(tmp_path / "nope.png")])
    assert rc == 1
    assert "not_found" in capsys.readouterr().out


def test_console_script_runs_as_a_process(samples):
    out = subprocess.run(
        [sys.executable, "-m", "api.cli", "inspect", str(samples / "hostile/text_file.txt")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert "unsupported_format" in out.stdout


def test_caption_batches_good_images_and_reports_bad_ones(samples, capsys):
    files = [
        samples / "images/photo_640x480.jpg",
        samples / "hostile/image_truncated.jpg",
        samples / "images/rgba.png",
    ]
    rc = main(["caption", "--json", "--max-tokens", "4", *map(str, files)])
    assert rc == 1
    recs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["file"] for r in recs] == [str(f) for f in files]
    assert isinstance(recs[0]["caption"], str) and recs[0]["caption"]
    assert recs[1]["error"]["code"] == "corrupt"
    assert isinstance(recs[2]["caption"], str)


def test_caption_matches_engine_directly(samples, capsys, tiny_dir):
    from engine import Model, caption

    path = samples / "images/photo_640x480.jpg"
    expected = caption(Model.load(tiny_dir("tiny-qwen3-vl")), path, max_tokens=6)
    assert main(["caption", "--json", "--max-tokens", "6", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["caption"] == expected


def test_caption_unknown_model_is_a_clear_error(samples, capsys):
    rc = main(["caption", "--model", "/no/such/dir", str(samples / "images/rgba.png")])
    assert rc == 2
    assert "neither a checkpoint directory" in capsys.readouterr().err


def test_models_build_tiny_into_a_folder(tmp_path, capsys):
    import json as _json

    assert main(["models", "build-tiny", "--out", str(tmp_path)]) == 0
    lines = dict(line.split("\t") for line in capsys.readouterr().out.splitlines())
    assert set(lines) == {"tiny-qwen3-vl", "tiny-gemma4", "tiny-csm"}
    for name, path in lines.items():
        cfg = _json.loads((tmp_path / name / "config.json").read_text())
        assert cfg["architectures"], name
        assert (tmp_path / name / "model.safetensors").is_file()
        assert str(tmp_path) in path


def test_speak_writes_a_readable_clip(tmp_path, capsys):
    from media import Audio

    out = tmp_path / "hello.flac"
    assert main(["speak", "hello there", "-o", str(out), "--max-duration", "0.4"]) == 0
    clip = Audio.from_bytes(out.read_bytes())
    assert clip.sample_rate == 24000 and clip.channels == 1
    assert 0.0 < clip.duration <= 0.4 + 0.05
    assert "24000 Hz" in capsys.readouterr().out


def test_speak_typed_errors_exit_2(tmp_path, capsys):
    assert main(["speak", "", "-o", str(tmp_path / "a.wav")]) == 2
    assert "empty_text" in capsys.readouterr().err
    assert main(["speak", "hi", "-o", str(tmp_path / "a.wav"), "--speaker", "99"]) == 2
    assert "unsupported_voice" in capsys.readouterr().err
    assert main(["speak", "hi", "-o", str(tmp_path / "a.wav"), "--model", "tiny-qwen3-vl"]) == 2
    assert "no_speech_head" in capsys.readouterr().err
    assert not (tmp_path / "a.wav").exists()


def test_run_speak_writes_readable_file(tmp_path, capsys):
    from api.speak_cmd import run_speak
    from media import Audio

    out = tmp_path / "hi.flac"
    assert run_speak("Hello there.", str(out), max_duration=0.4, temperature=0) == 0
    back = Audio.from_bytes(out.read_bytes())
    assert back.sample_rate == 24000 and back.duration <= 0.4 + 1e-9
    assert "24000 Hz" in capsys.readouterr().out
    assert run_speak("Hello.", str(tmp_path / "x.aiff")) == 2
    assert "unsupported_audio_format" in capsys.readouterr().err
    assert run_speak("", str(tmp_path / "x.wav")) == 2
    assert "empty_text" in capsys.readouterr().err
    assert run_speak("Hello.", str(tmp_path / "x.wav"), model="/no/such/dir") == 2
    assert "model_not_found" in capsys.readouterr().err


def test_inspect_with_model_reports_token_budget(samples, capsys):
    from encoders import encoder_for
    from fixtures.tiny_models import ensure_tiny_model
    from media import Image

    image = samples / "images/photo_640x480.jpg"
    rc = main(["inspect", "--json", "--model", "tiny", str(image), str(samples / "audio/tone_16k_mono.wav")])
    assert rc == 1  # audio is a typed error for Qwen3-VL
    img, aud = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    expected = encoder_for(ensure_tiny_model("tiny-qwen3-vl")).prepare(Image.from_path(image))
    view = img["model_view"]
    assert view["token_count"] == expected.token_count
    assert view["grid"] == list(expected.grid)
    assert view["position_span"] == expected.position_span
    assert view["kv_rows"] == expected.num_rows
    assert aud["kind"] == "audio" and aud["model_view"]["error"]["code"] == "unsupported_media"

    rc = main(["inspect", "--json", "--model", "tiny-gemma4", str(samples / "audio/tone_16k_mono.wav")])
    assert rc == 0
    gemma = json.loads(capsys.readouterr().out)["model_view"]
    assert gemma["token_count"] > 0 and gemma["position_span"] == gemma["kv_rows"]
