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
    rc = main(["inspect", "--json", str(samples / "images/rgba.png"), str(samples / "hostile/image_truncated.jpg")])
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
