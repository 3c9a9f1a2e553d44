"""The shape every model-specific media encoder shares: prepare (cached by content
hash + parameters), encode a batch (cached per item), count tower calls; and what an
encoder read from a checkpoint directory keeps (:class:`CheckpointEncoder`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Self

import torch

from encoders.cache import EncoderCache
from encoders.errors import UnsupportedMediaKindError, UnsupportedModelError
from encoders.prepared import Encoded, MediaKind, Prepared
from media import Audio, Image, InvalidRequestError, Video, cache_scope, check_int, check_number


def model_fingerprint(model_dir: str | Path | None, config: dict[str, Any]) -> str:
    """Identity of a checkpoint for cache keys: its config plus the names, sizes and
    headers of its weight files (reading headers only, never the tensors)."""
    h = hashlib.blake2b(digest_size=12)
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    if model_dir is not None:
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}".encode())
            with f.open("rb") as fh:
                h.update(fh.read(1 << 16))
    return h.hexdigest()


def optional_positive(name: str, value: Any, *, integer: bool, kind: str) -> Any:
    """``value`` checked as a positive int (``integer``) or a positive finite number; None
    passes through (the parameter was not given)."""
    if value is None:
        return None
    if integer:
        return check_int(name, value, min=1, kind=kind)
    return check_number(name, value, min=0, min_open=True, kind=kind)


def kind_of(media: Image | Audio | Video) -> MediaKind:
    if isinstance(media, Image):
        return "image"
    if isinstance(media, Audio):
        return "audio"
    if isinstance(media, Video):
        return "video"
    raise TypeError(f"expected media.Image, media.Audio or media.Video, got {type(media).__name__}")


class MediaEncoder(ABC):
    """Base for per-model encoders. Subclasses set ``family``/``kinds`` and implement
    ``_prepare`` and ``_encode``; caching and counting live here once."""

    family: str = ""
    kinds: frozenset[MediaKind] = frozenset()

    @property
    def max_audio_seconds(self) -> float | None:
        """The longest audio clip the tower takes whole (None: no audio, or no limit);
        ``media.split_audio`` cuts longer ones for tasks that need every second."""
        return None

    def __init__(self, *, name: str, fingerprint: str, cache: EncoderCache | None = None):
        self.name = name
        self.fingerprint = fingerprint
        self.cache = cache if cache is not None else EncoderCache()
        self.tower_calls = 0
        self.prepare_calls = 0

    # -- public -------------------------------------------------------------------------
    def prepare(self, media: Image | Audio | Video, **params: Any) -> Prepared:
        kind = kind_of(media)
        if kind not in self.kinds:
            raise UnsupportedMediaKindError(
                f"model {self.name!r} ({self.family}) cannot take {kind} input; it accepts: "
                f"{', '.join(sorted(self.kinds)) or 'no media'}",
                kind=kind,
            )
        key = self.cache_key(media.content_hash, kind, params)
        hit = self.cache.get_prepared(key)
        if hit is not None:
            return hit
        self.prepare_calls += 1
        prepared = self._prepare(kind, media, key, **params)
        self.cache.put_prepared(key, prepared)
        return prepared

    def encode(self, batch: list[Prepared]) -> list[Encoded]:
        """Embeddings for each item; items already in the cache skip the tower, the rest
        run through it together (grouped by kind)."""
        out: list[Encoded | None] = [self.cache.get(p.cache_key) for p in batch]
        todo: dict[MediaKind, list[int]] = {}
        for i, (p, enc) in enumerate(zip(batch, out, strict=True)):
            if enc is None:
                if p.family != self.family:
                    raise ValueError(f"Prepared from family {p.family!r} given to a {self.family!r} encoder")
                todo.setdefault(p.kind, []).append(i)
        for kind, idxs in todo.items():
            self.tower_calls += 1
            with torch.inference_mode():
                results = self._encode(kind, [batch[i] for i in idxs])
            for i, enc in zip(idxs, results, strict=True):
                self.cache.put(batch[i].cache_key, enc)
                out[i] = enc
        return out  # type: ignore[return-value]

    def describe(self, prepared: Prepared) -> dict[str, Any]:
        """A JSON-ready summary of a Prepared (``pie-media inspect``, the API)."""
        out: dict[str, Any] = {
            "kind": prepared.kind,
            "family": prepared.family,
            "token_count": prepared.token_count,
            "grid": list(prepared.grid),
            "num_rows": prepared.num_rows,
            "position_span": prepared.position_span,
            "inputs": {k: list(v.shape) for k, v in prepared.inputs.items()},
        }
        if prepared.timestamps is not None:
            out["timestamps"] = list(prepared.timestamps)
        out.update({k: v for k, v in prepared.meta.items() if k != "params"})
        return out

    def _check_params(self, params: dict[str, Any], allowed: set[str] | frozenset[str], kind: str) -> None:
        unknown = sorted(set(params) - set(allowed))
        if unknown:
            raise InvalidRequestError(
                f"unknown {kind} parameter(s) for {self.family} ({self.name}): {', '.join(unknown)}; "
                f"accepted: {', '.join(sorted(allowed))}",
                kind=kind,
            )

    def cache_key(self, content_hash: str, kind: str, params: dict[str, Any]) -> str:
        """The key of the prepared item and its encoder output, under the current cache
        scope (``encoders.cache_scope``: one tenant's hits never answer another's)."""
        p = json.dumps(params, sort_keys=True, default=str)
        scope = cache_scope()
        key = f"{self.fingerprint}:{kind}:{content_hash}:{p}"
        return f"{key}:scope={json.dumps(scope)}" if scope else key

    # -- subclass hooks -------------------------------------------------------------------
    @abstractmethod
    def _prepare(self, kind: MediaKind, media: Any, cache_key: str, **params: Any) -> Prepared: ...

    @abstractmethod
    def _encode(self, kind: MediaKind, items: list[Prepared]) -> list[Encoded]: ...


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """What :meth:`CheckpointEncoder.from_config` was given: the checkpoint directory, its
    parsed ``config.json``, the cache, and where the towers run."""

    model_dir: Path
    config: dict[str, Any]
    cache: EncoderCache | None
    device: torch.device
    dtype: torch.dtype

    def placed_like(self, modules: Iterable[torch.nn.Module]) -> Checkpoint:
        """Device and dtype of the first of ``modules`` that has parameters (towers the
        engine already holds win), else unchanged."""
        for module in modules:
            param = next(module.parameters(), None)
            if param is not None:
                return dataclasses.replace(self, device=param.device, dtype=param.dtype)
        return self


class CheckpointEncoder(MediaEncoder):
    """A :class:`MediaEncoder` built from a Hugging Face checkpoint directory: keeps its
    ``config.json``, directory and tokenizer, and the device and dtype its towers run in
    (towers are built on first use, under ``_tower_lock``). Subclasses set
    ``display_name`` and implement ``_from_checkpoint``."""

    display_name: str = ""
    """The family as messages name it, e.g. ``"Qwen3-VL"``."""

    def __init__(self, checkpoint: Checkpoint, *, tokenizer: Any, fingerprint_suffix: str = ""):
        super().__init__(
            name=checkpoint.model_dir.name,
            fingerprint=model_fingerprint(checkpoint.model_dir, checkpoint.config) + fingerprint_suffix,
            cache=checkpoint.cache,
        )
        self.config = checkpoint.config
        self.model_dir = checkpoint.model_dir
        self.tokenizer = tokenizer
        self.device = torch.device(checkpoint.device)
        self.dtype = checkpoint.dtype
        self._tower_lock = threading.Lock()

    @classmethod
    def from_config(
        cls,
        model_dir: str | Path | None,
        config: dict[str, Any],
        *,
        cache: EncoderCache | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        **options: Any,
    ) -> Self:
        """The encoder of the checkpoint in ``model_dir`` (``config``: its parsed
        ``config.json``): processor configs and tokenizer read from there, towers on
        ``device`` in ``dtype``. ``options`` are the family's: see its
        ``_from_checkpoint``."""
        if model_dir is None:
            raise UnsupportedModelError(
                f"{cls.display_name} needs its checkpoint directory (processor configs, tokenizer)"
            )
        return cls._from_checkpoint(
            Checkpoint(Path(model_dir), config, cache, torch.device(device), dtype), **options
        )

    @classmethod
    @abstractmethod
    def _from_checkpoint(cls, checkpoint: Checkpoint, **options: Any) -> Self: ...
