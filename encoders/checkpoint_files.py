"""Reading the parts of a Hugging Face checkpoint directory that encoders need: JSON
configs, the processor config files, the tokenizer (parsed once per file), special token
ids, and the weights of a tower."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from encoders.errors import UnsupportedModelError


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise UnsupportedModelError(f"cannot read {path}: {e}") from e


@dataclass(frozen=True)
class ProcessorFiles:
    """The processor config files a checkpoint has (what a transformers processor's
    ``from_pretrained`` reads); each family decides which wins."""

    nested: dict[str, Any]
    """``processor_config.json`` (blocks such as ``image_processor`` and the processor's
    own keys); empty when absent."""
    preprocessor: dict[str, Any] | None
    """``preprocessor_config.json``, None when absent."""
    video_preprocessor: dict[str, Any] | None
    """``video_preprocessor_config.json``, None when absent."""


def read_processor_files(model_dir: Path) -> ProcessorFiles:
    def optional(name: str) -> dict[str, Any] | None:
        path = model_dir / name
        return read_json(path) if path.is_file() else None

    return ProcessorFiles(
        nested=optional("processor_config.json") or {},
        preprocessor=optional("preprocessor_config.json"),
        video_preprocessor=optional("video_preprocessor_config.json"),
    )


def load_tokenizer(model_dir: Path, *, required: bool = True) -> Any:
    """The checkpoint's ``tokenizer.json`` as a ``tokenizers.Tokenizer`` (None when absent
    and not ``required``)."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        if required:
            raise UnsupportedModelError(f"{model_dir} has no tokenizer.json")
        return None
    st = path.stat()
    return _tokenizer_from_file(str(path.resolve()), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=8)
def _tokenizer_from_file(path: str, mtime_ns: int, size: int) -> Any:
    """Parsing a real Qwen tokenizer.json takes ~0.5 s; encoders of one checkpoint share it
    (``tokenizers.Tokenizer.encode`` is safe to call from several threads)."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises its own Exception type
        raise UnsupportedModelError(f"cannot load {path}: {e}") from e


def special_token_id(
    config: dict[str, Any], keys: tuple[str, ...], token: str, tokenizer: Any, *, required: bool
) -> int | None:
    """The id of a special token: config.json's first key of ``keys`` that is set, else the
    tokenizer's id for ``token``; the two must agree where both give one."""
    from_config = next((config[k] for k in keys if config.get(k) is not None), None)
    from_tokenizer = tokenizer.token_to_id(token) if tokenizer is not None else None
    if from_config is not None and from_tokenizer is not None and int(from_config) != from_tokenizer:
        raise UnsupportedModelError(
            f"config.json {keys[0]}={from_config} disagrees with tokenizer.json {token}={from_tokenizer}"
        )
    value = from_config if from_config is not None else from_tokenizer
    if value is None and required:
        raise UnsupportedModelError(
            f"neither config.json ({keys[0]}) nor tokenizer.json ({token}) gives its id"
        )
    return None if value is None else int(value)


def weight_files(model_dir: Path, prefixes: tuple[str, ...]) -> list[Path]:
    """The safetensors files holding weights whose names start with ``prefixes`` (all
    files when the checkpoint is not sharded)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = read_json(index).get("weight_map", {})
        names = sorted({f for k, f in weight_map.items() if k.startswith(prefixes)})
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise UnsupportedModelError(f"{model_dir} has no *.safetensors weights")
    return files


def read_tower_weights(model_dir: Path, prefixes: dict[str, tuple[str, ...]]) -> dict[str, dict[str, Any]]:
    """Per tower name, its tensors from the checkpoint's safetensors (sharded or not), keyed
    by name with the first matching prefix of that tower cut off. Only the files that hold
    such weights are opened; every other tensor is skipped unread."""
    from safetensors import safe_open

    everything = tuple(p for group in prefixes.values() for p in group)
    state: dict[str, dict[str, Any]] = {name: {} for name in prefixes}
    for f in weight_files(model_dir, everything):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                for name, group in prefixes.items():
                    prefix = next((p for p in group if key.startswith(p)), None)
                    if prefix is not None:
                        state[name][key[len(prefix) :]] = st.get_tensor(key)
                        break
    return state
