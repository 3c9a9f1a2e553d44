"""Resolve what a user typed after ``--model``: a checkpoint directory, or the name of a
tiny fixture checkpoint (``tiny`` = ``tiny-qwen3-vl``), built on first use."""

from __future__ import annotations

from pathlib import Path

TINY_ALIASES = {"tiny": "tiny-qwen3-vl"}


def resolve_model_dir(ref: str) -> Path:
    from fixtures.tiny_models import TINY_MODELS, ensure_tiny_model

    name = TINY_ALIASES.get(ref, ref)
    if name in TINY_MODELS:
        return ensure_tiny_model(name)
    path = Path(ref).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"--model {ref!r} is neither a checkpoint directory nor a tiny model name "
            f"({', '.join(('tiny',) + TINY_MODELS)})"
        )
    return path
