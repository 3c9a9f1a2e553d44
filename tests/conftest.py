from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="session")
def samples() -> Path:
    """Root of the generated sample media: images/, audio/, video/, hostile/."""
    from fixtures.samples import ensure_samples

    return ensure_samples()


@pytest.fixture(scope="session")
def tiny_dir():
    """name -> folder of a tiny fixture checkpoint (``tiny-qwen3-vl``, ``tiny-gemma4``,
    ``tiny-csm``), built on first use: what ``Model.load`` / ``SpeechModel.load`` take."""
    from fixtures.tiny_models import ensure_tiny_model

    return ensure_tiny_model


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    """Ray Serve's in-process driver (tests/api/replicas/test_ray_serve.py) leaves C-level
    fault-signal handlers behind after shutdown that break wasmtime's trap handling: a guest
    that traps later in the same process kills it with SIGILL (seen with test_hostile). Those
    tests run last, together, so nothing after them runs wasm in this process."""
    last = [item for item in items if "replicas/test_ray_serve.py" in item.nodeid]
    if last:
        items[:] = [item for item in items if item not in last] + last
