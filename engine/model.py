"""A served model: a Hugging Face checkpoint directory, loaded once, with its KV pool.

``Model.load(path_or_name)`` reads config.json, picks the architecture by the exact
``architectures[0]`` name, loads the full transformers model (language model and media
towers) from the safetensors with ``from_pretrained`` (sharded or not), the tokenizer,
the chat template and generation_config, wires the language model's attention to the
paged KV (``engine.attention``) and sizes the page pool. ``"tiny-qwen3-vl"``,
``"tiny-gemma4"`` (and ``"tiny"`` = tiny-qwen3-vl) name the fixture checkpoints, built on
first use. A ``CsmForConditionalGeneration`` checkpoint (``"tiny-csm"`` too) loads as an
``engine.speech.SpeechModel`` (``speak`` / ``speak_stream``). Nothing is fetched from a hub.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.architectures import Architecture, architecture_class
from engine.attention import AttentionBackend
from engine.attention import register as register_attention
from engine.attention_flashinfer import check_attention_choice, select_backend
from engine.errors import (
    CheckpointShapeError,
    InvalidRequestError,
    MissingCheckpointFileError,
    ModelLoadError,
    NoSpeechHeadError,
    SavedContextNotFoundError,
)
from engine.forward import ForwardRunner
from engine.kv_pool import KVPool, PoolStats, bytes_per_page
from engine.scheduler import Scheduler

if TYPE_CHECKING:
    from encoders import EncoderCache, MediaEncoder, Prepared
    from encoders.prepared import Encoded
    from engine.context import Context

TINY_ALIASES = {"tiny": "tiny-qwen3-vl"}
DEFAULT_CPU_KV_BYTES = 256 * 1024 * 1024
DEFAULT_CUDA_KV_FRACTION = 0.5

log = logging.getLogger(__name__)


def resolve_checkpoint(path_or_name: str | os.PathLike[str]) -> Path:
    """A checkpoint directory, or the folder of a tiny fixture model named ``name``."""
    ref = str(path_or_name)
    name = TINY_ALIASES.get(ref, ref)
    if name.startswith("tiny-") and not Path(ref).exists():
        from fixtures.tiny_models import TINY_MODELS, ensure_tiny_model

        if name not in TINY_MODELS:
            raise ModelLoadError(f"unknown tiny model {ref!r}; expected one of {', '.join(TINY_MODELS)}")
        return ensure_tiny_model(name)
    path = Path(ref).expanduser()
    if not path.exists():
        raise MissingCheckpointFileError(f"no checkpoint directory at {path}", path=str(path))
    if not path.is_dir():
        raise ModelLoadError(f"{path} is not a directory; expected a Hugging Face checkpoint folder")
    return path


def _read_config(path: Path) -> dict[str, Any]:
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


def _check_weights(path: Path) -> None:
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


def _check_tokenizer(path: Path) -> None:
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer.model").is_file():
        raise MissingCheckpointFileError(f"{path} has no tokenizer.json", path=str(path / "tokenizer.json"))


class _QuietTransformers:
    """Silence transformers' progress bars and info logs while loading."""

    def __enter__(self) -> None:
        from transformers.utils import logging as hf_logging

        self._bars = hf_logging.is_progress_bar_enabled()
        self._verbosity = hf_logging.get_verbosity()
        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()

    def __exit__(self, *exc: object) -> None:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity(self._verbosity)
        if self._bars:
            hf_logging.enable_progress_bar()


class Model:
    """A loaded checkpoint. Build with ``Model.load``; open contexts with ``Context(model)``."""

    def __init__(
        self,
        *,
        path: Path,
        config: dict[str, Any],
        hf: Any,
        arch: Architecture,
        tokenizer: Any,
        generation_config: Any,
        device: torch.device,
        dtype: torch.dtype,
        pool: KVPool,
        max_prefill_rows: int,
        max_batch_rows: int,
        encoder_cache: EncoderCache | None,
        chat_template_kwargs: dict[str, Any],
        attention: AttentionBackend | None = None,
    ):
        from engine.chat import ChatTemplate

        self.path = path
        self.config = config
        self.hf = hf
        self.arch = arch
        self.tokenizer = tokenizer
        self.generation_config = generation_config
        self.device = device
        self.dtype = dtype
        self.pool = pool
        self.max_prefill_rows = max_prefill_rows
        self.runner = ForwardRunner(arch, pool, device=device, encode=self.encode, backend=attention)
        self.attention_backend: str = attention.name if attention is not None else "torch"
        """Name of the attention backend the forward passes use ("torch" or "flashinfer")."""
        self.scheduler = Scheduler(self.runner, max_batch_rows=max_batch_rows)
        self.chat = ChatTemplate(tokenizer, getattr(tokenizer, "chat_template", None), **chat_template_kwargs)
        self._encoder_cache = encoder_cache
        self._encoder: MediaEncoder | None = None
        self._encoder_lock = threading.Lock()
        self._saved: dict[str, Context] = {}

    # -- loading ----------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        path_or_name: str | os.PathLike[str],
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        kv_pages: int | None = None,
        kv_memory: int | None = None,
        page_size: int = 32,
        max_prefill_rows: int = 2048,
        max_batch_rows: int = 8192,
        encoder_cache: EncoderCache | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        attention: str = "auto",
    ) -> Model:
        """Load a checkpoint directory (or a tiny fixture name).

        device: default CUDA when available, else CPU. kv_pages: pool size in pages; else
        ``kv_memory`` bytes (default: 256 MiB on CPU, half the free GPU memory after
        loading on CUDA). page_size: rows per page. max_prefill_rows: rows per prefill
        chunk (a media span longer than that is still prefilled whole). attention: the
        attention backend, "auto" (flashinfer on CUDA with float16/bfloat16 when it
        imports, else torch), "torch" or "flashinfer" (``AttentionBackendUnavailableError``
        when it cannot run here); validated but unused for speech checkpoints.
        """
        check_attention_choice(attention)  # before the speech branch, which ignores it
        path = resolve_checkpoint(path_or_name)
        config = _read_config(path)
        if (config.get("architectures") or [None])[0] == "CsmForConditionalGeneration":
            from engine.speech import SpeechModel  # speech out: no contexts, no KV pool

            return SpeechModel.load(path, config, device=device, dtype=dtype)  # type: ignore[return-value]
        arch_cls = architecture_class(config.get("architectures"))
        _check_weights(path)
        _check_tokenizer(path)
        if page_size < 1:
            raise InvalidRequestError(f"page_size must be >= 1, got {page_size}")
        if max_prefill_rows < 1:
            raise InvalidRequestError(f"max_prefill_rows must be >= 1, got {max_prefill_rows}")
        dev = torch.device(device) if device is not None else _default_device()
        backend = select_backend(attention, device=dev, dtype=dtype)  # before the weights load

        import transformers

        register_attention()
        model_cls = getattr(transformers, arch_cls.name)
        with _QuietTransformers():
            try:
                # Mismatched shapes are loaded as fresh weights and reported in ``info``;
                # _check_loading_info turns them into a CheckpointShapeError naming them.
                hf, info = model_cls.from_pretrained(
                    path, dtype=dtype, output_loading_info=True, ignore_mismatched_sizes=True
                )
            except (RuntimeError, ValueError) as e:
                text = str(e)
                if "size mismatch" in text or "shape" in text.lower():
                    raise CheckpointShapeError(f"{path}: weights do not fit the config: {text}") from e
                raise ModelLoadError(f"{path}: cannot load {arch_cls.name}: {text}") from e
            except OSError as e:
                raise ModelLoadError(f"{path}: cannot read the checkpoint: {e}") from e
            try:
                tokenizer = transformers.AutoTokenizer.from_pretrained(path)
            except Exception as e:  # tokenizers raises its own exception types
                raise ModelLoadError(f"{path}: cannot load the tokenizer: {e}") from e
        _check_loading_info(path, info)
        try:
            generation_config = transformers.GenerationConfig.from_pretrained(path)
        except OSError:
            generation_config = hf.generation_config

        try:
            hf = hf.to(dev).eval()
        except (RuntimeError, AssertionError) as e:
            raise ModelLoadError(f"cannot place the model on {dev}: {e}") from e
        hf.set_attn_implementation({"text_config": register_attention()})
        arch = arch_cls(hf)
        layouts = arch.layer_layouts()
        per_page = bytes_per_page(layouts, page_size, dtype)
        if kv_pages is None:
            budget = kv_memory if kv_memory is not None else _default_kv_bytes(dev)
            kv_pages = max(1, budget // per_page)
        pool = KVPool(layouts, num_pages=int(kv_pages), page_size=page_size, dtype=dtype, device=dev)
        return cls(
            path=path,
            config=config,
            hf=hf,
            arch=arch,
            tokenizer=tokenizer,
            generation_config=generation_config,
            device=dev,
            dtype=dtype,
            pool=pool,
            max_prefill_rows=max_prefill_rows,
            max_batch_rows=max_batch_rows,
            encoder_cache=encoder_cache,
            chat_template_kwargs=chat_template_kwargs or {},
            attention=backend,
        )

    # -- facts ------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.path.name

    @property
    def architecture(self) -> str:
        return self.arch.name

    @property
    def eos_token_ids(self) -> frozenset[int]:
        ids = self.generation_config.eos_token_id
        if ids is None:
            ids = self.hf.config.get_text_config().eos_token_id
        if ids is None:
            return frozenset()
        return frozenset([ids] if isinstance(ids, int) else ids)

    @property
    def media_kinds(self) -> frozenset[str]:
        return frozenset(self.arch.placeholder_ids())

    def pool_stats(self) -> PoolStats:
        return self.pool.stats()

    # -- text -------------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def detokenize(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -- media ------------------------------------------------------------------------------
    @property
    def encoder(self) -> MediaEncoder:
        """The checkpoint's media encoder, sharing this model's loaded towers."""
        if self._encoder is None:
            with self._encoder_lock:
                if self._encoder is None:
                    from encoders import EncoderCache, encoder_for

                    cache = self._encoder_cache if self._encoder_cache is not None else EncoderCache()
                    self._encoder = encoder_for(self.path, cache=cache, **self.arch.encoder_kwargs())
        return self._encoder

    def prepare(self, media: Any, **params: Any) -> Prepared:
        from encoders import Prepared

        if isinstance(media, Prepared):
            if params:
                raise InvalidRequestError("preparation parameters given with an already Prepared item")
            return media
        return self.encoder.prepare(media, **params)

    def encode(self, items: list[Prepared]) -> list[Encoded]:
        return self.encoder.encode(items)

    # -- speech -----------------------------------------------------------------------------
    def speak(self, text: str, *args: Any, **kwargs: Any) -> Any:
        """Only CSM checkpoints speak (``Model.load`` returns an ``engine.speech.SpeechModel``)."""
        raise NoSpeechHeadError(
            f"model {self.name!r} ({self.architecture}) has no speech head; load a CSM checkpoint to speak",
            model=self.name,
            architecture=self.architecture,
        )

    def speak_stream(self, text: str, *args: Any, **kwargs: Any) -> Any:
        return self.speak(text, *args, **kwargs)

    # -- saved contexts ---------------------------------------------------------------------
    def saved_names(self) -> list[str]:
        return sorted(self._saved)

    def delete_saved(self, name: str) -> None:
        ctx = self._saved.pop(name, None)
        if ctx is None:
            raise SavedContextNotFoundError(f"no context saved as {name!r}", name=name)
        ctx.close()

    def _saved_context(self, name: str) -> Context:
        ctx = self._saved.get(name)
        if ctx is None:
            raise SavedContextNotFoundError(f"no context saved as {name!r}", name=name)
        return ctx

    def __repr__(self) -> str:
        s = self.pool.stats()
        return (
            f"Model({self.architecture}, {self.path}, device={self.device}, dtype={self.dtype}, "
            f"kv_pages={s.num_pages}x{s.page_size})"
        )


def _default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _default_kv_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * DEFAULT_CUDA_KV_FRACTION)
    return DEFAULT_CPU_KV_BYTES


def _check_loading_info(path: Path, info: dict[str, Any]) -> None:
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
