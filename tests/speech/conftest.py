"""The tiny CSM checkpoint, loaded once per module of speech tests."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Tiny models gain nothing from intra-op threads (see tests/engine/conftest.py).
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def csm(tiny_dir):
    from speech import SpeechModel

    return SpeechModel.load(tiny_dir("tiny-csm"), device="cpu")
