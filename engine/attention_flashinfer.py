"""The ``flashinfer`` attention backend (CUDA only).

This module is imported lazily (``engine.attention_select.select_backend`` imports it only for a
CUDA device), and flashinfer itself more lazily still: importing this module never
imports it, and ``flashinfer_available`` checks ``torch.cuda.is_available()`` before
trying to, so CPU machines and CI never touch it. Install it with the ``cuda`` extra
(``flashinfer-python``).

API targeted: flashinfer 0.6.18 (``flashinfer/prefill.py``, ``flashinfer/decode.py`` at
commit fb28d72 of flashinfer-ai/flashinfer); the keyword names used here (``causal``,
``custom_mask``, ``window_left``, ``logits_soft_cap``, ``sm_scale``, ``q_data_type``,
``kv_data_type``) are the same back to 0.2.5.

How a pass maps onto flashinfer (per layer the protocol of ``engine.attention``):

* K/V are written with ``TorchBackend.write`` (``index_copy_`` of the pass's slots into the
  pool, as correct on CUDA as on CPU).
* The pool's per-layer K and V, each ``(num_pages, page_size, kv_heads, head_dim)``, are
  flashinfer's ``(k_cache, v_cache)`` tuple in ``"NHD"`` layout, passed without a copy.
* The sequences of a pass are split once per pass into up to three parts, each with its
  page-table arrays (``qo_indptr``, ``kv_indptr``, ``kv_indices``, ``kv_last_page_len``)
  built once and cached in ``meta.cache``:

  - ``decode``: one query row, plain causal: ``BatchDecodeWithPagedKVCacheWrapper``;
  - ``prefill``: several rows, plain causal: ``BatchPrefillWithPagedKVCacheWrapper`` with
    ``causal=True``. flashinfer aligns the causal mask bottom-right (query ``i`` of
    ``qo_len`` sits at KV row ``kv_len - qo_len + i``), which is our ``kv_start + i``, so
    chunks that start mid-context need nothing more;
  - ``custom``: sequences with a bidirectional media block on this layer
    (``meta.block_overlay_layers`` and ``seq.block_ids``): the prefill wrapper with a
    ``custom_mask`` built by ``engine.attention.sequence_mask`` (the same mask the torch
    backend uses, sliding window included, so ``window_left`` stays -1 there).

  Each part is planned once per pass per layer kind (head counts, head dim, window,
  softcap, scale, dtype; one wrapper per kind, so the plans of a pass never overwrite each
  other) and run in every layer of that kind.
* Sliding window: ``sequence_mask`` lets query row q see key row k when ``q - k < window``;
  flashinfer keeps k when ``k >= q - window_left``, so ``window_left = window - 1``.
* ``softcap`` is ``logits_soft_cap`` (``cap * tanh(scale * q.k / cap)``, as the torch
  backend), ``scaling`` is ``sm_scale``; GQA is native (``num_qo_heads`` a multiple of
  ``num_kv_heads``).

fp8 K/V (``Model.load(kv_dtype="fp8_e4m3")`` on this backend): the pool stores
float8_e4m3fn with one fixed scale per layer for K and one for V (``engine.kv_quant``,
``scales="tensor"``), written by ``KVPool.write``; the wrappers are planned with
``kv_data_type`` = the pool's fp8 dtype and run with ``k_scale`` / ``v_scale`` (scalars:
flashinfer's kernels take no per-row scale). int8 K/V have no flashinfer kernels and stay
on the torch backend (``engine.attention_select``).

flashinfer takes float16/bfloat16 only (``FLASHINFER_DTYPES``): ``select_backend`` keeps a
float32 model on the torch backend under ``"auto"`` and raises under ``"flashinfer"``.
One backend object serves one model; passes run one at a time (the scheduler's worker),
which the per-kind wrappers rely on.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from engine.attention import TORCH_BACKEND, BatchMeta, SeqMeta, sequence_mask
from engine.masks import sequence_causal_mask

log = logging.getLogger(__name__)

FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
WORKSPACE_BYTES = 128 * 1024 * 1024
"""flashinfer's float workspace (split-KV partial results); its docs recommend 128 MiB."""

KERNEL_HEAD_DIMS = (64, 128, 256)
"""Head sizes flashinfer ships kernels for (its JIT covers others only when a CUDA
toolchain is present, so other sizes go to the torch backend)."""

PartKind = Literal["decode", "prefill", "custom"]


def flashinfer_available() -> tuple[bool, str]:
    """(True, version) when flashinfer can be used here, else (False, why not).

    CUDA is checked first, so a CPU machine never imports flashinfer."""
    if not torch.cuda.is_available():
        return False, "flashinfer needs a CUDA device and torch.cuda.is_available() is False"
    try:
        import flashinfer
    except Exception as e:  # ImportError, or a compiled extension that fails to load
        return False, f"flashinfer does not import ({type(e).__name__}: {e}); install pie-media[cuda]"
    return True, f"flashinfer {getattr(flashinfer, '__version__', '(unknown version)')}"


def kv_scales(pool: Any) -> dict[str, float]:
    """The ``run`` keywords of a pool with fp8 pages and per-layer scales (``k_scale``,
    ``v_scale``: Python floats, fixed, so a captured CUDA graph holds them); else none."""
    fmt = pool.kv_format
    if fmt.scales != "tensor":
        return {}
    return {"k_scale": fmt.tensor_scale, "v_scale": fmt.tensor_scale}


def query_rows(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    *,
    scaling: float,
    sliding_window: int | None,
    softcap: float | None,
) -> tuple[torch.Tensor, tuple[Any, ...]]:
    """The (rows, heads, head_dim) queries flashinfer takes, from the attention hook's
    (1, heads, rows, head_dim), and the layer kind they are planned by: layers of one kind
    share a plan within a pass."""
    q = query[0].transpose(0, 1)
    kind = (
        query.shape[1],
        k_cache.shape[2],
        k_cache.shape[3],
        sliding_window,
        softcap,
        scaling,
        q.dtype,
        k_cache.dtype,
    )
    return q, kind


@dataclass
class _Part:
    """Sequences of one pass attended by one flashinfer call, with their page tables."""

    kind: PartKind
    seqs: list[SeqMeta]
    rows: torch.Tensor | None
    """Their query rows in the batch, in order; None when the part is the whole batch."""
    qo_indptr: torch.Tensor
    """(B + 1,) int32 on the CPU: query rows per sequence, prefix-summed."""
    kv_indptr: torch.Tensor
    """(B + 1,) int32 on the CPU: pages per sequence, prefix-summed."""
    kv_indices: torch.Tensor
    """(kv_indptr[-1],) int32 on the device: every sequence's pages in order."""
    kv_last_page_len: torch.Tensor
    """(B,) int32 on the CPU: rows used in each sequence's last page (1..page_size)."""


def page_tables(
    seqs: Sequence[SeqMeta], page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """flashinfer's CSR page table of ``seqs``: (qo_indptr, kv_indptr, kv_indices,
    kv_last_page_len); indptrs and last-page lengths on the CPU (``plan`` reads them
    there), indices on the pages' device."""
    n_pages = [-(-s.kv_len // page_size) for s in seqs]
    qo = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    qo[1:] = torch.tensor([s.q_len for s in seqs], dtype=torch.int32).cumsum(0)
    kv = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    kv[1:] = torch.tensor(n_pages, dtype=torch.int32).cumsum(0)
    indices = torch.cat([s.pages[:n] for s, n in zip(seqs, n_pages, strict=True)]).to(torch.int32)
    last = torch.tensor([s.kv_len - (n - 1) * page_size for s, n in zip(seqs, n_pages, strict=True)])
    return qo, kv, indices, last.to(torch.int32)


def split_pass(meta: BatchMeta, page_size: int, blocks: bool) -> list[_Part]:
    """The pass's sequences as decode / prefill / custom-mask parts (empty ones left out),
    built once per pass (and per ``blocks``) and shared by every layer."""
    key = ("flashinfer", "parts", page_size, blocks)
    if key in meta.cache:
        return meta.cache[key]
    groups: dict[PartKind, list[SeqMeta]] = {"decode": [], "prefill": [], "custom": []}
    for seq in meta.seqs:
        # block_ids.any(): one device sync per media sequence and pass (this is cached).
        if seq.mask is not None or (
            blocks and seq.block_ids is not None and bool((seq.block_ids >= 0).any())
        ):
            groups["custom"].append(seq)
        else:
            groups["decode" if seq.q_len == 1 else "prefill"].append(seq)
    parts = []
    device = meta.slots.device
    for kind, seqs in groups.items():
        if not seqs:
            continue
        whole = len(seqs) == len(meta.seqs)
        rows = None
        if not whole:
            rows = torch.cat([torch.arange(s.q_start, s.q_start + s.q_len) for s in seqs]).to(device)
        parts.append(_Part(kind, seqs, rows, *page_tables(seqs, page_size)))
    meta.cache[key] = parts
    return parts


class FlashInferBackend:
    """Paged attention with flashinfer's batch prefill/decode kernels (see the module doc)."""

    name = "flashinfer"

    def __init__(
        self,
        device: torch.device | str,
        *,
        workspace_bytes: int = WORKSPACE_BYTES,
        head_dims: Sequence[int] | None = KERNEL_HEAD_DIMS,
    ):
        """``head_dims``: head sizes sent to flashinfer (None: all); layers with another
        size use the torch backend."""
        self.device = torch.device(device)
        self.head_dims = None if head_dims is None else frozenset(head_dims)
        self.workspace_bytes = workspace_bytes
        self._workspace: torch.Tensor | None = None
        self._wrappers: dict[tuple[Any, ...], Any] = {}
        self._fallback_logged: set[int] = set()
        self.plans = 0
        """flashinfer ``plan`` calls made (one per pass, part kind and layer kind is right)."""

    @property
    def num_wrappers(self) -> int:
        """flashinfer wrappers made so far (one per part kind and layer kind attended)."""
        return len(self._wrappers)

    def write(self, meta: BatchMeta, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        TORCH_BACKEND.write(meta, layer, key, value)

    def attend(
        self,
        meta: BatchMeta,
        layer: int,
        query: torch.Tensor,
        *,
        scaling: float,
        sliding_window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        kc, vc = meta.pool.kv(layer)
        _, page_size, kv_heads, head_dim = kc.shape
        if not self.covers(head_dim):
            # flashinfer's prebuilt kernels cover the usual head sizes only; a layer with
            # another (tiny test models: 16, 32) is attended by the torch backend, which
            # is correct on CUDA too.
            if head_dim not in self._fallback_logged:
                self._fallback_logged.add(head_dim)
                log.warning(
                    "flashinfer: head_dim %d has no kernel; those layers use torch attention", head_dim
                )
            return TORCH_BACKEND.attend(
                meta, layer, query, scaling=scaling, sliding_window=sliding_window, softcap=softcap
            )
        heads = query.shape[1]
        blocks = layer in meta.block_overlay_layers
        q, layer_kind = query_rows(query, kc, scaling=scaling, sliding_window=sliding_window, softcap=softcap)
        parts = split_pass(meta, page_size, blocks)
        scales = kv_scales(meta.pool)
        out: torch.Tensor | None = None
        for part in parts:
            wrapper = self._planned(meta, part, layer_kind, page_size, blocks)
            if part.rows is None:
                return wrapper.run(q.contiguous(), (kc, vc), **scales).transpose(0, 1).unsqueeze(0)
            o = wrapper.run(q.index_select(0, part.rows), (kc, vc), **scales)
            if out is None:
                out = q.new_empty(q.shape[0], heads, o.shape[2])
            out.index_copy_(0, part.rows, o)
        assert out is not None
        return out.transpose(0, 1).unsqueeze(0)

    # -- plans ------------------------------------------------------------------------------
    def _planned(
        self, meta: BatchMeta, part: _Part, layer_kind: tuple[Any, ...], page_size: int, blocks: bool
    ) -> Any:
        """The wrapper of this part and layer kind, planned for this pass (once). ``blocks``
        is part of the key: it changes which sequences the part holds."""
        key = (part.kind, blocks, *layer_kind)
        wrapper = self._wrappers.get(key)
        if wrapper is None:
            wrapper = self._wrappers[key] = self._new_wrapper(part.kind, layer_kind)
        pass_key = ("flashinfer", "planned", key)
        if pass_key not in meta.cache:
            self._plan(wrapper, part, layer_kind, page_size)
            meta.cache[pass_key] = True
        return wrapper

    def workspace(self) -> torch.Tensor:
        """The float workspace, shared by every wrapper (also the CUDA-graph ones): it only
        holds split-KV partials during a run, and the runs of a pass are sequential on one
        stream. Each wrapper keeps its own plan."""
        if self._workspace is None:
            self._workspace = torch.empty(self.workspace_bytes, dtype=torch.uint8, device=self.device)
        return self._workspace

    def covers(self, head_dim: int) -> bool:
        """Whether layers of this head size are attended by flashinfer (not the fallback)."""
        return self.head_dims is None or head_dim in self.head_dims

    def new_decode_wrapper(
        self,
        layer_kind: tuple[Any, ...],
        graph_buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> Any:
        """A batch decode wrapper; with ``graph_buffers`` (indptr (B + 1,), indices
        (max pages,), last page lengths (B,), int32 on the device) one for CUDA-graph
        replay at batch size B, whose ``plan`` writes the page table into those buffers."""
        import flashinfer

        heads, kv_heads = layer_kind[0], layer_kind[1]
        extra: dict[str, Any] = {}
        if graph_buffers is not None:
            indptr, indices, last = graph_buffers
            extra = {
                "use_cuda_graph": True,
                "paged_kv_indptr_buffer": indptr,
                "paged_kv_indices_buffer": indices,
                "paged_kv_last_page_len_buffer": last,
            }
        # Tensor-core decode pays off for wide GQA groups (vLLM's rule of thumb: > 4).
        return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace(), "NHD", use_tensor_cores=heads // kv_heads > 4, **extra
        )

    def plan_decode(
        self,
        wrapper: Any,
        layer_kind: tuple[Any, ...],
        page_size: int,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_last_page_len: torch.Tensor,
    ) -> None:
        """Plan a decode wrapper for one pass (int32 page table as ``page_tables`` gives)."""
        part = _Part("decode", [], None, kv_indptr, kv_indptr, kv_indices, kv_last_page_len)
        self._plan(wrapper, part, layer_kind, page_size)

    def _new_wrapper(self, kind: PartKind, layer_kind: tuple[Any, ...]) -> Any:
        import flashinfer

        if kind == "decode":
            return self.new_decode_wrapper(layer_kind)
        return flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace(), "NHD")

    def _plan(self, wrapper: Any, part: _Part, layer_kind: tuple[Any, ...], page_size: int) -> None:
        self.plans += 1
        heads, kv_heads, head_dim, window, softcap, scaling, q_dtype, kv_dtype = layer_kind
        common: dict[str, Any] = {
            "sm_scale": scaling,
            "logits_soft_cap": softcap,
            "q_data_type": q_dtype,
            "kv_data_type": kv_dtype,
        }
        window_left = window - 1 if window is not None else -1
        if part.kind == "decode":
            wrapper.plan(
                part.kv_indptr,
                part.kv_indices,
                part.kv_last_page_len,
                heads,
                kv_heads,
                head_dim,
                page_size,
                window_left=window_left,
                **common,
            )
        elif part.kind == "prefill":
            wrapper.plan(
                part.qo_indptr,
                part.kv_indptr,
                part.kv_indices,
                part.kv_last_page_len,
                heads,
                kv_heads,
                head_dim,
                page_size,
                causal=True,
                window_left=window_left,
                **common,
            )
        else:
            mask = torch.cat([_custom_mask(s, window, part.kv_indices.device) for s in part.seqs])
            # Index arrays on the mask's device: plan() packs the mask with an indptr
            # derived from qo_indptr, and flashinfer versions before 0.6 required it on the
            # mask's device.
            dev = mask.device
            wrapper.plan(
                part.qo_indptr.to(dev),
                part.kv_indptr.to(dev),
                part.kv_indices,
                part.kv_last_page_len.to(dev),
                heads,
                kv_heads,
                head_dim,
                page_size,
                custom_mask=mask,
                causal=False,
                window_left=-1,  # the window is in the mask
                **common,
            )


def _custom_mask(seq: SeqMeta, window: int | None, device: torch.device) -> torch.Tensor:
    """(q_len * kv_len,) flattened row-major boolean mask (True = attend), flashinfer's
    ``custom_mask`` layout for one request."""
    mask = sequence_mask(seq, sliding_window=window, blocks=True, device=device)
    if mask is None:  # no block rows after all: causal
        mask = sequence_causal_mask(seq.kv_start, seq.kv_len, device=device)
    return mask.flatten()
