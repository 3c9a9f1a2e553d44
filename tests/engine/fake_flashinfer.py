"""A stand-in for flashinfer's paged attention wrappers, in plain torch on the CPU.

It follows flashinfer's documented semantics (see ``_FakeWrapper``) so the flashinfer
backend's page tables, plans and masks are checked without a GPU; the GPU tests run the
real kernels through the same scenarios. ``use_cuda_graph=True`` decode wrappers behave as
flashinfer's: ``plan`` writes the page table into the caller's fixed buffers, and ``run``
reads those buffers (a replayed graph sees whatever the last plan wrote there).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch


class _FakeWrapper:
    """flashinfer's paged prefill/decode wrappers as documented (flashinfer 0.6.18,
    prefill.py / decode.py and include/flashinfer/attention/variants.cuh), in plain torch:

    * ``paged_kv_cache`` is ``(k_cache, v_cache)``, each (pages, page_size, kv_heads,
      head_dim) for ``"NHD"``; request b owns pages ``indices[indptr[b]:indptr[b+1]]`` and
      ``kv_len = (n_pages - 1) * page_size + last_page_len[b]`` rows;
    * queries of request b are rows ``qo_indptr[b]:qo_indptr[b+1]`` (decode: one each);
    * causal is aligned bottom-right: query i of qo_len sees kv j <= kv_len - qo_len + i;
    * ``window_left`` w >= 0 keeps kv j when ``j + qo_len + w >= kv_len + i``;
    * fp8 K/V (``kv_data_type`` float8_e4m3fn): read as ``value * k_scale`` / ``* v_scale``
      (scalar floats given to ``run``, 1.0 when absent);
    * ``custom_mask``: per request a row-major (qo_len, kv_len) boolean block, requests
      concatenated; it replaces ``causal``;
    * logits: ``sm_scale * q.k`` (default 1/sqrt(head_dim)), or with ``logits_soft_cap`` c
      ``c * tanh(sm_scale * q.k / c)``; GQA: query head h reads kv head h // group.

    Math in float32, output in the query dtype (as the kernels' fp32 accumulators)."""

    calls: list[tuple[str, str]]

    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD", **kwargs: Any):
        assert kv_layout == "NHD"
        assert workspace.dtype == torch.uint8
        self.planned: dict[str, Any] | None = None

    def _plan(self, kind: str, **p: Any) -> None:
        for name in ("qo_indptr", "kv_indptr", "kv_indices", "last"):
            assert p[name].dtype == torch.int32, (name, p[name].dtype)
        assert p["num_qo_heads"] % p["num_kv_heads"] == 0
        assert p["q_data_type"] is not None and p["kv_data_type"] is not None
        self.planned = p
        _FakeWrapper.calls.append(("plan", kind))

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache: tuple[torch.Tensor, torch.Tensor],
        *,
        k_scale: float | None = None,
        v_scale: float | None = None,
    ) -> torch.Tensor:
        p = self.planned
        assert p is not None, "run() before plan()"
        _FakeWrapper.calls.append(("run", type(self).__name__))
        k_cache, v_cache = paged_kv_cache
        _, page_size, kvh, hd = k_cache.shape
        assert (page_size, kvh, hd) == (p["page_size"], p["num_kv_heads"], p["head_dim"])
        assert q.is_contiguous() and q.dtype == p["q_data_type"] and k_cache.dtype == p["kv_data_type"]
        heads = p["num_qo_heads"]
        assert q.shape[1:] == (heads, hd)
        qo, kv = p["qo_indptr"].tolist(), p["kv_indptr"].tolist()
        indices, last = p["kv_indices"].long(), p["last"].tolist()
        assert q.shape[0] == qo[-1]
        scale = p["sm_scale"] if p["sm_scale"] is not None else hd**-0.5
        cap, w = p["logits_soft_cap"], p["window_left"]
        mask_at = 0
        out = torch.empty_like(q)
        for b in range(len(qo) - 1):
            pages = indices[kv[b] : kv[b + 1]]
            kv_len = (len(pages) - 1) * page_size + last[b]
            assert 1 <= last[b] <= page_size
            k = k_cache[pages].reshape(-1, kvh, hd)[:kv_len].float().repeat_interleave(heads // kvh, 1)
            v = v_cache[pages].reshape(-1, kvh, hd)[:kv_len].float().repeat_interleave(heads // kvh, 1)
            k, v = k * (1.0 if k_scale is None else k_scale), v * (1.0 if v_scale is None else v_scale)
            qb = q[qo[b] : qo[b + 1]].float()
            n = qb.shape[0]
            logits = torch.einsum("qhd,khd->hqk", qb, k)
            logits = cap * torch.tanh(logits * scale / cap) if cap else logits * scale
            i = torch.arange(n)[:, None]
            j = torch.arange(kv_len)[None, :]
            if p["custom_mask"] is not None:
                allowed = p["custom_mask"][mask_at : mask_at + n * kv_len].view(n, kv_len).cpu()
                mask_at += n * kv_len
            elif p["causal"]:
                allowed = j <= kv_len - n + i
            else:
                allowed = torch.ones(n, kv_len, dtype=torch.bool)
            if w >= 0:
                allowed = allowed & (j + n + w >= kv_len + i)
            probs = logits.masked_fill(~allowed.to(logits.device), float("-inf")).softmax(-1)
            out[qo[b] : qo[b + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
        if p["custom_mask"] is not None:
            assert mask_at == p["custom_mask"].numel()
        return out


class _FakePrefill(_FakeWrapper):
    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        *,
        custom_mask: torch.Tensor | None = None,
        causal: bool = False,
        sm_scale: float | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        q_data_type: Any = "float16",
        kv_data_type: Any = None,
    ) -> None:
        if custom_mask is not None:
            assert custom_mask.dtype == torch.bool
        self._plan(
            "prefill" if custom_mask is None else "custom",
            qo_indptr=qo_indptr,
            kv_indptr=paged_kv_indptr,
            kv_indices=paged_kv_indices,
            last=paged_kv_last_page_len,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim_qk,
            page_size=page_size,
            custom_mask=custom_mask,
            causal=causal,
            sm_scale=sm_scale,
            window_left=window_left,
            logits_soft_cap=logits_soft_cap,
            q_data_type=q_data_type,
            kv_data_type=kv_data_type,
        )


class _FakeDecode(_FakeWrapper):
    def __init__(
        self,
        workspace: torch.Tensor,
        kv_layout: str = "NHD",
        *,
        use_cuda_graph: bool = False,
        paged_kv_indptr_buffer: torch.Tensor | None = None,
        paged_kv_indices_buffer: torch.Tensor | None = None,
        paged_kv_last_page_len_buffer: torch.Tensor | None = None,
        **kwargs: Any,
    ):
        super().__init__(workspace, kv_layout, **kwargs)
        self.graph = use_cuda_graph
        if use_cuda_graph:
            for buf in (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer):
                assert buf is not None and buf.dtype == torch.int32, "graph mode needs int32 buffers"
            assert paged_kv_indptr_buffer.numel() == paged_kv_last_page_len_buffer.numel() + 1
        self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)

    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        q_data_type: Any = "float16",
        kv_data_type: Any = None,
        sm_scale: float | None = None,
    ) -> None:
        if self.graph:
            # flashinfer: the batch size is fixed for a graph wrapper; the table is copied
            # into the buffers, and the kernels read the buffers when the graph replays.
            ind_buf, idx_buf, last_buf = self.buffers
            assert last_page_len.numel() == last_buf.numel(), "batch size changed under a graph wrapper"
            assert indices.numel() <= idx_buf.numel(), "more pages than the indices buffer holds"
            ind_buf.copy_(indptr)
            idx_buf[: indices.numel()].copy_(indices)
            last_buf.copy_(last_page_len)
            indptr, indices, last_page_len = ind_buf, idx_buf, last_buf
        self._plan(
            "decode",
            qo_indptr=torch.arange(len(last_page_len) + 1, dtype=torch.int32),
            kv_indptr=indptr,
            kv_indices=indices,
            last=last_page_len,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            page_size=page_size,
            custom_mask=None,
            causal=True,
            sm_scale=sm_scale,
            window_left=window_left,
            logits_soft_cap=logits_soft_cap,
            q_data_type=q_data_type,
            kv_data_type=kv_data_type,
        )


@contextmanager
def installed() -> Iterator[types.ModuleType]:
    """``import flashinfer`` gives the stand-in while this is open."""
    fake = types.ModuleType("flashinfer")
    fake.__version__ = "fake"
    fake.BatchPrefillWithPagedKVCacheWrapper = _FakePrefill
    fake.BatchDecodeWithPagedKVCacheWrapper = _FakeDecode
    _FakeWrapper.calls = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "flashinfer", fake)
        yield fake
