"""engine sets libgomp's wait policy before torch loads it, and leaves a user's choice alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = (
    "import json, os, sys; import {first}; import engine.openmp_wait as w; "
    "print(json.dumps({{'env': {{k: os.environ.get(k) for k in w.OPENMP_DEFAULTS}}, "
    "'settings': w.openmp_settings()}}))"
)


def _probe(first: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(first=first)],
        env={**clean, **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("first", ["engine", "speech", "api.http.app"])
def test_the_defaults_are_set_before_torch_loads(first):
    got = _probe(first)
    assert got["env"] == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "100000"}
    assert got["settings"]["applied_before_torch"] is True


def test_a_users_setting_stands_whole():
    got = _probe("engine", OMP_WAIT_POLICY="PASSIVE")
    assert got["env"] == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None}
    got = _probe("engine", GOMP_SPINCOUNT="5")
    assert got["env"] == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "5"}


def test_torch_first_is_reported():
    got = _probe("torch")
    assert got["settings"]["applied_before_torch"] is False
