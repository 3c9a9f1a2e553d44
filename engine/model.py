"""A served model: a Hugging Face checkpoint directory, loaded once, with its KV pool.

``Model.load(path)`` takes a checkpoint directory, reads config.json, picks the
architecture by the exact ``architectures[0]`` name, loads the full transformers model
(language model and media towers) from the safetensors with ``from_pretrained`` (sharded
or not), the tokenizer, the chat template and generation_config, wires the language
model's attention to the paged KV (``engine.attention``) and sizes the page pool. The
checkpoint steps and their typed errors are ``engine.checkpoint``'s. Tiny fixture names
(``"tiny-qwen3-vl"``, ...) and speech checkpoints are resolved and dispatched above the
engine, by ``api.model_ref.load_model``. Nothing is fetched from a hub.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.architectures import Architecture, architecture_class
from engine.attention import AttentionBackend
from engine.attention import register as register_attention
from engine.attention_select import check_attention_choice, select_backend
from engine.checkpoint import (
    check_tokenizer,
    check_weights,
    default_device,
    load_part,
    load_pretrained,
    place_model,
    read_config,
    resolve_checkpoint,
)
from engine.errors import InvalidRequestError
from engine.forward import ForwardRunner
from engine.kv_pool import KVPool, PoolStats, bytes_per_page
from engine.kv_quant import resolve_kv_dtype
from engine.load_quantization import check_quantization, quantize_at_load
from engine.lora import Adapter, load_adapter
from engine.metrics import EngineCounters, MetricsSnapshot
from engine.saved import SavedContexts
from engine.scheduler import Scheduler
from media import check_int

if TYPE_CHECKING:
    from encoders import CacheStats, EncoderCache, MediaEncoder, Prepared
    from encoders.prepared import Encoded

DEFAULT_CPU_KV_BYTES = 256 * 1024 * 1024
DEFAULT_CUDA_KV_FRACTION = 0.5

log = logging.getLogger(__name__)


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
        quantization: str | None = None,
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
        self.quantization = quantization
        self.max_model_len: int | None = None
        """The longest prompt plus completion a ``Completion`` takes (None: no limit known);
        ``Model.load(max_model_len=...)``, else the checkpoint's position count."""
        """What the weights are stored as: None (the load dtype), "int8", "int4", "fp8" or
        "fp8-dequantized" (an FP8 checkpoint on the CPU); ``engine.quantization``."""
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
        self.saved = SavedContexts()
        self.live_contexts: weakref.WeakSet[Any] = weakref.WeakSet()
        self._adapters: weakref.WeakSet[Adapter] = weakref.WeakSet()
        self.counters = EngineCounters()
        """Every context built on this model and not yet collected (``open_contexts`` counts the open ones)."""
        """Contexts saved by name (``Context.save``), pinned with their pages."""

    # -- loading ----------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
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
        cuda_graphs: int = 0,
        quantization: str | None = None,
        kv_dtype: str | torch.dtype | None = None,
        max_model_len: int | None = None,
    ) -> Model:
        """Load the checkpoint directory ``path`` (a tiny fixture name is resolved to its
        directory by ``api.model_ref``; here it is a ``ModelLoadError``).

        device: default CUDA when available, else CPU. kv_pages: pool size in pages; else
        ``kv_memory`` bytes (default: 256 MiB on CPU, half the free GPU memory after
        loading on CUDA). page_size: rows per page. max_prefill_rows: rows per prefill
        chunk (a media span longer than that is still prefilled whole). attention: the
        attention backend, "auto" (flashinfer on CUDA with float16/bfloat16 when it
        imports, else torch), "torch" or "flashinfer" (``AttentionBackendUnavailableError``
        when it cannot run here). cuda_graphs: replay one-token decode passes of up to this
        many contexts from CUDA graphs (``engine.decode_graphs``; 0, the default: off). It
        needs CUDA and the flashinfer backend with kernels for the model's head size; else
        ``InvalidRequestError`` says which is missing. quantization: "int8" / "int4" (the
        language model's linear layers and LM head, weight-only) or "fp8" (CUDA) at load
        (``engine.quantization``; ``QuantizationUnavailableError`` for one the device cannot
        run); a checkpoint carrying an fp8 ``quantization_config`` loads as such without it.
        kv_dtype: what the KV pages store (``engine.kv_quant``; vLLM's ``--kv-cache-dtype``):
        None / "auto" (the model's dtype), "float32", "bfloat16", "float16", "int8" (per
        (row, kv head) scales, dequantized on read; torch backend) or "fp8_e4m3" (per
        (row, kv head) scales on the torch backend; one fixed scale per layer on
        flashinfer, whose fp8 kernels read it in place). A quantized pool holds ~2x (bf16)
        to ~4x (float32) the rows in the same ``kv_memory``.
        max_model_len: the longest prompt plus completion a ``Completion`` takes (vLLM's
        ``--max-model-len``; default and ceiling: the checkpoint's
        ``max_position_embeddings``); past it, ``ContextLengthExceededError``.
        """
        check_attention_choice(attention)
        resolve_kv_dtype(kv_dtype, dtype)  # an unknown name fails before anything loads
        path = resolve_checkpoint(path)
        config = read_config(path)
        check_quantization(
            quantization, config, torch.device(device) if device is not None else default_device()
        )
        arch_cls = architecture_class(config.get("architectures"))
        check_weights(path)
        check_tokenizer(path)
        if page_size < 1:
            raise InvalidRequestError(f"page_size must be >= 1, got {page_size}")
        if max_prefill_rows < 1:
            raise InvalidRequestError(f"max_prefill_rows must be >= 1, got {max_prefill_rows}")
        dev = torch.device(device) if device is not None else default_device()
        kv_format = resolve_kv_dtype(kv_dtype, dtype)
        # before the weights load; an fp8 pool read by flashinfer keeps one scale per layer
        backend = select_backend(attention, device=dev, dtype=dtype, kv_format=kv_format)
        if backend.name == "flashinfer" and kv_format.scales == "row":
            kv_format = resolve_kv_dtype(kv_dtype, dtype, scales="tensor")

        import transformers

        register_attention()
        hf = load_pretrained(path, arch_cls.name, dtype=dtype)
        tokenizer = load_part(path, "tokenizer", transformers.AutoTokenizer.from_pretrained)
        try:
            generation_config = transformers.GenerationConfig.from_pretrained(path)
        except OSError:
            generation_config = hf.generation_config

        hf = place_model(hf, dev)
        hf.set_attn_implementation({"text_config": register_attention()})
        arch = arch_cls(hf)
        quantization = quantize_at_load(
            hf, arch.language_model, path, config, quantization, device=dev, dtype=dtype
        )
        layouts = arch.layer_layouts()
        per_page = bytes_per_page(layouts, page_size, kv_format)
        if kv_pages is None:
            budget = kv_memory if kv_memory is not None else _default_kv_bytes(dev)
            kv_pages = max(1, budget // per_page)
        pool = KVPool(
            layouts,
            num_pages=int(kv_pages),
            page_size=page_size,
            dtype=dtype,
            device=dev,
            kv_dtype=kv_format,
        )
        trained = _max_positions(hf.config)
        if max_model_len is not None:
            max_model_len = check_int("max_model_len", max_model_len, min=1)
            if trained is not None and max_model_len > trained:
                raise InvalidRequestError(
                    f"max_model_len {max_model_len} is over the model's {trained} positions",
                    param="max_model_len",
                    limit=trained,
                )
        if cuda_graphs < 0:
            raise InvalidRequestError(f"cuda_graphs must be >= 0 (0: off), got {cuda_graphs}")
        if cuda_graphs and dev.type != "cuda":
            raise InvalidRequestError(f"cuda_graphs needs a CUDA device; this model is on {dev}")
        model = cls(
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
            quantization=quantization,
        )
        if cuda_graphs:
            from engine.decode_graphs import DecodeGraphs

            try:
                model.runner.graphs = DecodeGraphs(model.runner, max_batch=cuda_graphs)
            except ValueError as e:
                raise InvalidRequestError(f"cuda_graphs cannot be used with this model: {e}") from None
            model.runner.graphs.warm()  # every bucket captured before the first request
        model.max_model_len = max_model_len if max_model_len is not None else trained
        return model

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
        raw = self._backend_decode
        if raw is not None:
            return raw(ids if isinstance(ids, list) else list(ids), skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def text_decoder(self) -> Callable[[list[int]], str]:
        """``detokenize(ids, skip_special_tokens=True)`` as one call for a list of ids (the
        backend's own decode where it serves): what a streamed generation calls every token."""
        raw = self._backend_decode
        if raw is not None:
            return functools.partial(raw, skip_special_tokens=True)
        return lambda ids: self.detokenize(ids, skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        """``detokenize([token], skip_special_tokens=True)``, memoised (at most one string
        per vocabulary entry): a streamed generation decodes its newest token on its own
        every step (``engine.incremental_text``)."""
        texts = self._token_texts
        text = texts.get(token)
        if text is None:
            text = texts[token] = self.detokenize([token], skip_special_tokens=True)
        return text

    @functools.cached_property
    def _token_texts(self) -> dict[int, str]:
        return {}

    @functools.cached_property
    def _backend_decode(self) -> Callable[..., str] | None:
        """The ``tokenizers`` backend's own ``decode`` when transformers' ``decode`` would
        only wrap it: a streamed generation decodes its whole output every token, and the
        wrapper's conversion of the id list costs 4x the decode itself (42 us against 9 us
        for 40 ids here). None (transformers' ``decode``) when the tokenizer class decodes
        its own way or cleans up spaces after."""
        tokenizer = self.tokenizer
        backend = getattr(tokenizer, "_tokenizer", None)
        try:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend
        except ImportError:  # an older transformers: keep its decode
            return None
        if backend is None or not isinstance(tokenizer, TokenizersBackend):
            return None
        if type(tokenizer)._decode is not TokenizersBackend._decode:
            return None
        if getattr(tokenizer, "clean_up_tokenization_spaces", False):
            return None
        return backend.decode

    @functools.cached_property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of a byte-fallback vocabulary's ``<0xHH>`` tokens (SentencePiece-style, e.g.
        Gemma's). A run of them decodes as one group, so the text of its first bytes can
        change when the next byte arrives ('N' alone, two replacement characters once an
        invalid continuation byte follows): streamed text holds such a run back until it
        ends. Empty for byte-level BPE (Qwen), whose partial characters show as U+FFFD."""
        vocab = self.tokenizer.get_vocab()
        return frozenset(
            i for tok, i in vocab.items() if len(tok) == 6 and tok.startswith("<0x") and tok[5] == ">"
        )

    # -- media ------------------------------------------------------------------------------
    def metrics(self) -> MetricsSnapshot:
        """A snapshot of the engine's counters: tokens, passes and batch sizes, KV pages,
        encoder cache, open contexts, time-to-first-token and inter-token histograms."""
        pool = self.pool_stats()
        cache = self.encoder_cache_stats
        sched = self.scheduler.stats
        c = self.counters
        return MetricsSnapshot(
            prompt_tokens=max(0, self.runner.rows_computed - c.fed_back_tokens),
            generated_tokens=c.generated_tokens,
            passes=sched.passes,
            steps=sched.steps,
            max_steps_in_pass=sched.max_steps_in_pass,
            overlapped_passes=sched.overlapped_passes,
            device_fed_passes=sched.fed_passes,
            rows_computed=self.runner.rows_computed,
            pages_used=pool.in_use,
            pages_shared=pool.shared,
            pages_cached=pool.cached,
            pages_free=pool.free,
            encoder_cache_hits=cache.hits if cache else 0,
            encoder_cache_misses=cache.misses if cache else 0,
            open_contexts=self.open_contexts,
            ttft=c.ttft.to_dict(),
            itl=c.itl.to_dict(),
            kv_capacity_rows=pool.capacity_rows,
            kv_dtype=pool.kv_dtype,
            encoder_cache_bytes=cache.bytes if cache else 0,
            prepared_cache_bytes=cache.prepared_bytes if cache else 0,
            drafted_tokens=c.drafted_tokens,
            accepted_draft_tokens=c.accepted_draft_tokens,
            staged_hits=c.staged_hits,
            staged_misses=c.staged_misses,
        )

    @property
    def open_contexts(self) -> int:
        """Contexts of this model that are open (not closed, not collected)."""
        return sum(1 for c in list(self.live_contexts) if not c.closed)

    @property
    def encoder_cache_stats(self) -> CacheStats | None:
        """Hits/misses of the encoder cache (None until the encoder is first used)."""
        return self._encoder.cache.stats if self._encoder is not None else None

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

    def load_adapter(self, path: str | Path, name: str | None = None) -> Adapter:
        """Load a PEFT LoRA adapter for this model's language model (typed errors if it
        does not fit); push it on a context's ``adapters`` stack to use it."""
        lm = self.arch.language_model
        prefix = next(n for n, m in self.arch.hf.named_modules() if m is lm)
        adapter = load_adapter(self.arch.hf, prefix, path, name)
        self._adapters.add(adapter)
        return adapter

    def owns_adapter(self, adapter: Adapter) -> bool:
        """Whether ``adapter`` was loaded for this model (``load_adapter``)."""
        return adapter in self._adapters

    def prepare(self, media: Any, **params: Any) -> Prepared:
        from encoders import Prepared

        if isinstance(media, Prepared):
            if params:
                raise InvalidRequestError("preparation parameters given with an already Prepared item")
            return media
        return self.encoder.prepare(media, **params)

    def encode(self, items: list[Prepared]) -> list[Encoded]:
        return self.encoder.encode(items)

    # -- saved contexts ---------------------------------------------------------------------
    def saved_names(self) -> list[str]:
        """``self.saved.names()``."""
        return self.saved.names()

    def delete_saved(self, name: str) -> None:
        """``self.saved.delete(name)``."""
        self.saved.delete(name)

    def __repr__(self) -> str:
        s = self.pool.stats()
        return (
            f"Model({self.architecture}, {self.path}, device={self.device}, dtype={self.dtype}, "
            f"kv_pages={s.num_pages}x{s.page_size}"
            + (f", quantization={self.quantization}" if self.quantization else "")
            + (f", kv_dtype={s.kv_dtype}" if self.pool.kv_format.quantized else "")
            + ")"
        )


def _default_kv_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * DEFAULT_CUDA_KV_FRACTION)
    return DEFAULT_CPU_KV_BYTES


def _max_positions(config: Any) -> int | None:
    """The checkpoint's trained position count (its text config's ``max_position_embeddings``)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(text, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None
