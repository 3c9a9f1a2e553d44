"""Inferlet tests: the example component (built once, cached by content), the tiny
models (loaded once per session) and one runtime serving them."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)  # tiny models gain nothing from intra-op threads (tests/engine/conftest.py)

EXAMPLES = Path(__file__).resolve().parents[2] / "inferlets" / "examples"


@pytest.fixture(scope="session")
def wasm() -> Path:
    from fixtures.paths import cache_root
    from inferlets import build_component

    return build_component(EXAMPLES, cache_root() / "inferlets-build")


@pytest.fixture(scope="session")
def model():
    from api.model_ref import load_model

    return load_model("tiny")


@pytest.fixture(scope="session")
def csm():
    from api.model_ref import load_model

    return load_model("tiny-csm", device="cpu")


@pytest.fixture(scope="session")
def rt(model, csm):
    from fixtures.paths import cache_root
    from inferlets import InferletRuntime

    return InferletRuntime({"tiny": model, "tiny-csm": csm}, cache_root())
