"""What a user names as a model: a checkpoint directory, or a tiny fixture checkpoint
(``tiny`` = ``tiny-qwen3-vl``, ``tiny-gemma4``, ``tiny-csm``), built on first use.

This is the one place tiny names are resolved, and ``load_model`` the one entry point that
loads any checkpoint by its architecture: a CSM checkpoint as a ``speech.SpeechModel``,
everything else as an ``engine.Model`` (which refuses architectures it does not serve).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine import MissingCheckpointFileError

if TYPE_CHECKING:
    from engine import Model
    from speech import SpeechModel

TINY_ALIASES = {"tiny": "tiny-qwen3-vl"}


class ModelNotFoundError(MissingCheckpointFileError):
    """The model named is neither a checkpoint directory nor a tiny model name."""

    code = "model_not_found"


def tiny_model_names() -> tuple[str, ...]:
    from fixtures.tiny_models import TINY_MODELS

    return (*TINY_ALIASES, *TINY_MODELS)


def resolve_model_dir(ref: str | os.PathLike[str]) -> Path:
    """The checkpoint directory ``ref`` names: a tiny model's folder (built on first use) or
    ``ref`` itself; ``ModelNotFoundError`` (a ``MissingCheckpointFileError``) when it is neither."""
    from fixtures.tiny_models import TINY_MODELS, ensure_tiny_model

    names = ", ".join(tiny_model_names())
    if not isinstance(ref, str | os.PathLike):
        raise ModelNotFoundError(
            f"a model is a checkpoint directory or a tiny model name ({names}), got {ref!r}"
        )
    text = os.fspath(ref)
    name = TINY_ALIASES.get(text, text)
    if name in TINY_MODELS:
        return ensure_tiny_model(name)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if name.startswith("tiny-") and not path.exists():
        raise ModelNotFoundError(f"unknown tiny model {text!r}; expected one of {names}", path=str(path))
    raise ModelNotFoundError(
        f"model {text!r} is neither a checkpoint directory nor a tiny model name ({names})", path=str(path)
    )


def load_model(ref: str | os.PathLike[str], **kwargs: Any) -> Model | SpeechModel:
    """Load what ``ref`` names (see ``resolve_model_dir``), dispatched by the exact
    ``architectures[0]`` of its config.json: ``CsmForConditionalGeneration`` gives a
    ``speech.SpeechModel``, anything else ``engine.Model.load(dir, **kwargs)``.

    ``kwargs`` are ``Model.load``'s options plus ``max_speech_streams`` and
    ``speech_realtime_safety``. A speech model takes ``device``, ``dtype``, ``attention``,
    ``kv_pages``, ``cuda_graphs``, ``quantization`` (int8 / int4 weights, ``SpeechModel.load``)
    and those two (``max_streams``, ``realtime_safety``) and ignores the rest (prefill
    and graph options of the text engine), so one set of options can load any model; a name
    ``Model.load`` does not know is a ``TypeError``."""
    import inspect

    from engine import Model, architecture_name, read_config
    from speech import CSM_ARCHITECTURE, SpeechModel

    path = resolve_model_dir(ref)
    max_speech_streams = kwargs.pop("max_speech_streams", None)
    realtime_safety = kwargs.pop("speech_realtime_safety", None)
    if architecture_name(read_config(path)) != CSM_ARCHITECTURE:
        from media import warm_kernels

        warm_kernels()  # the image fast paths compile now, not on the first request
        return Model.load(path, **kwargs)
    known = inspect.signature(Model.load).parameters
    unknown = sorted(k for k in kwargs if k not in known or k == "path")
    if unknown:
        raise TypeError(f"load_model() got unexpected keyword argument(s): {', '.join(unknown)}")
    speech_options = {
        k: v
        for k, v in kwargs.items()
        if k in ("device", "dtype", "attention", "kv_pages", "cuda_graphs", "quantization")
    }
    if max_speech_streams is not None:
        speech_options["max_streams"] = max_speech_streams
    if realtime_safety is not None:
        speech_options["realtime_safety"] = realtime_safety
    return SpeechModel.load(path, **speech_options)
