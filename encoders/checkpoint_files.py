"""Reading the parts of a Hugging Face checkpoint directory that encoders need: JSON
configs, the tokenizer (parsed once per file), and which weight files hold a tower."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from encoders.errors import UnsupportedModelError


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise UnsupportedModelError(f"cannot read {path}: {e}") from e


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
