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


def resolve_model_ref(ref: str) -> str | Path:
    """What ``engine.Model.load`` takes: a tiny model's name as is, else a directory."""
    from fixtures.tiny_models import TINY_MODELS

    if ref in TINY_ALIASES or ref in TINY_MODELS:
        return TINY_ALIASES.get(ref, ref)
    return resolve_model_dir(ref)
