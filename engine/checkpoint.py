"""Reading a Hugging Face checkpoint directory: the one loader behind ``engine.Model.load``
and ``speech.SpeechModel.load``.

A checkpoint is a directory (nothing is fetched from a hub, and names are not resolved
here: the tiny fixture names are resolved by the CLI / ``api.model_ref``). The steps, each
failing with a typed ``ModelLoadError`` that names the file or the weights:

- ``resolve_checkpoint(path)``: the directory, or ``MissingCheckpointFileError`` /
  ``ModelLoadError`` (not a directory);
- ``read_config(path)`` and ``architecture_name(config)`` (``architectures[0]``);
- ``check_weights(path)`` (single-file or sharded safetensors, every shard present) and
  ``check_tokenizer(path)``;
- ``load_pretrained(path, class_name, dtype=...)``: transformers' ``from_pretrained``
  with its errors mapped and its loading report checked (``CheckpointShapeError`` for
  weights of the wrong shape or missing ones); ``load_part(path, what, loader)`` for the
  tokenizer / processor; ``place_model(hf, device)`` moves the model and sets eval mode;
- ``quiet_transformers()``: transformers' progress bars and info logs off while loading.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from engine.errors import CheckpointShapeError, MissingCheckpointFileError, ModelLoadError

T = TypeVar("T")

TINY_NAMES_HINT = (
    "pass a checkpoint directory (tiny fixture names such as 'tiny-qwen3-vl' are resolved by "
    "the CLI / api.model_ref.load_model)"
)


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """``path`` as a checkpoint directory; a typed ``ModelLoadError`` when it is not one."""
    if not isinstance(path, str | os.PathLike):
        raise ModelLoadError(f"expected a checkpoint directory, got {type(path).__name__}; {TINY_NAMES_HINT}")
    p = Path(path).expanduser()
    if not p.exists():
        raise MissingCheckpointFileError(f"no checkpoint directory at {p}; {TINY_NAMES_HINT}", path=str(p))
    if not p.is_dir():
        raise ModelLoadError(f"{p} is not a directory; {TINY_NAMES_HINT}", path=str(p))
    return p


def read_config(path: Path) -> dict[str, Any]:
    """config.json of the checkpoint at ``path``, as a dict."""
    cfg = path / "config.json"
    if not cfg.is_file():
        raise MissingCheckpointFileError(f"{path} has no config.json", path=str(cfg))
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{cfg} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{cfg} must hold a JSON object")
    return data


def architecture_name(config: dict[str, Any]) -> str | None:
    """``architectures[0]`` of a config (None when it names none)."""
    archs = config.get("architectures")
    if isinstance(archs, list | tuple) and archs and isinstance(archs[0], str):
        return archs[0]
    return None


def check_weights(path: Path) -> None:
    """The safetensors weights are there: one file, or every shard the index lists."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {e}") from e
        missing = sorted(s for s in shards if not (path / s).is_file())
        if missing:
            raise MissingCheckpointFileError(
                f"{path}: weight shard(s) listed in the index are missing: {', '.join(missing)}",
                missing=missing,
            )
        return
    if not any(path.glob("*.safetensors")):
        raise MissingCheckpointFileError(f"{path} has no *.safetensors weights", path=str(path))


def check_tokenizer(path: Path) -> None:
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer.model").is_file():
        raise MissingCheckpointFileError(f"{path} has no tokenizer.json", path=str(path / "tokenizer.json"))


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' progress bars and info logs inside the block."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def load_pretrained(path: Path, class_name: str, *, dtype: torch.dtype) -> Any:
    """``transformers.<class_name>.from_pretrained(path)``, quietly, with one error mapping.

    Mismatched shapes are loaded as fresh weights and reported by transformers; they (and
    weights the architecture needs that the checkpoint lacks) become a
    ``CheckpointShapeError`` naming them."""
    import transformers

    from engine.fp8_checkpoint import is_fp8_checkpoint, load_fp8_pretrained

    model_cls = getattr(transformers, class_name)
    with quiet_transformers():
        try:
            if is_fp8_checkpoint(path):  # block-wise FP8 weights, dequantized into ``dtype``
                hf, info = load_fp8_pretrained(path, model_cls, dtype=dtype)
            else:
                hf, info = model_cls.from_pretrained(
                    path, dtype=dtype, output_loading_info=True, ignore_mismatched_sizes=True
                )
        except (RuntimeError, ValueError) as e:
            text = str(e)
            if "size mismatch" in text or "shape" in text.lower():
                raise CheckpointShapeError(f"{path}: weights do not fit the config: {text}") from e
            raise ModelLoadError(f"{path}: cannot load {class_name}: {text}") from e
        except OSError as e:
            raise ModelLoadError(f"{path}: cannot read the checkpoint: {e}") from e
    check_loading_info(path, info)
    return hf


def load_part(path: Path, what: str, loader: Callable[[Path], T]) -> T:
    """``loader(path)`` (a tokenizer's or processor's ``from_pretrained``), quietly; any
    failure is a ``ModelLoadError`` saying it could not load ``what``."""
    with quiet_transformers():
        try:
            return loader(path)
        except Exception as e:  # tokenizers / processors raise their own exception types
            raise ModelLoadError(f"{path}: cannot load the {what}: {e}") from e


def place_model(hf: Any, device: torch.device) -> Any:
    """The model moved to ``device`` in eval mode."""
    try:
        return hf.to(device).eval()
    except (RuntimeError, AssertionError) as e:
        raise ModelLoadError(f"cannot place the model on {device}: {e}") from e


def default_device() -> torch.device:
    """CUDA when available, else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def check_loading_info(path: Path, info: dict[str, Any]) -> None:
    missing = list(info.get("missing_keys") or [])
    mismatched = list(info.get("mismatched_keys") or [])
    if mismatched:
        shown = ", ".join(_describe_mismatch(m) for m in mismatched[:5])
        raise CheckpointShapeError(f"{path}: {len(mismatched)} weight(s) have the wrong shape: {shown}")
    if missing:
        shown = ", ".join(missing[:8])
        raise CheckpointShapeError(
            f"{path}: {len(missing)} weight(s) the architecture needs are not in the checkpoint: {shown}"
            + (" ..." if len(missing) > 8 else "")
        )


def _describe_mismatch(m: Any) -> str:
    if isinstance(m, tuple | list) and len(m) == 3:
        name, have, want = m
        return f"{name} (checkpoint {tuple(have)}, config expects {tuple(want)})"
    return str(m)
