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
