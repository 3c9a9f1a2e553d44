"""A stand-in for flashinfer's ragged prefill wrapper, in plain torch on the CPU.

It follows the documented semantics of ``flashinfer.BatchPrefillWithRaggedKVCacheWrapper``
(flashinfer 0.6.x, ``flashinfer/prefill.py``): ``plan(qo_indptr, kv_indptr, num_qo_heads,
num_kv_heads, head_dim_qk, *, causal, sm_scale, q_data_type, kv_data_type)`` once, then
``run(q, k, v)`` any number of times with q of shape (qo_indptr[-1], qo_heads, head_dim)
and k/v of shape (kv_indptr[-1], kv_heads, head_dim) ("NHD"); request b's queries are rows
``qo_indptr[b]:qo_indptr[b+1]`` and see its keys ``kv_indptr[b]:kv_indptr[b+1]`` (all of
them when not causal); logits ``sm_scale * q.k`` (default 1/sqrt(head_dim)). Math in
float32, output in the query dtype (the kernels accumulate in float32).

:func:`installed` puts it, beside the paged stand-ins of ``tests/engine/fake_flashinfer.py``,
under ``sys.modules["flashinfer"]``; every plan and run is recorded in ``FakeRagged.calls``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from tests.engine import fake_flashinfer


class FakeRagged:
    calls: list[str] = []

    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD", **kwargs: Any):
        assert kv_layout == "NHD"
        assert workspace.dtype == torch.uint8
        self.planned: dict[str, Any] | None = None

    def plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        head_dim_vo: int | None = None,
        *,
        causal: bool = False,
        sm_scale: float | None = None,
        q_data_type: Any = "float16",
        kv_data_type: Any = None,
        **kwargs: Any,
    ) -> None:
        assert qo_indptr.dtype == kv_indptr.dtype == torch.int32
        assert qo_indptr.device.type == "cpu", "plan reads the indptrs on the host"
        assert len(qo_indptr) == len(kv_indptr)
        assert num_qo_heads % num_kv_heads == 0
        self.planned = {
            "qo": qo_indptr.tolist(),
            "kv": kv_indptr.tolist(),
            "heads": num_qo_heads,
            "kv_heads": num_kv_heads,
            "head_dim": head_dim_qk,
            "causal": causal,
            "sm_scale": sm_scale,
            "q_dtype": q_data_type,
            "kv_dtype": kv_data_type if kv_data_type is not None else q_data_type,
        }
        FakeRagged.calls.append("plan")

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.planned
        assert p is not None, "run() before plan()"
        FakeRagged.calls.append("run")
        qo, kv, heads, kvh, hd = p["qo"], p["kv"], p["heads"], p["kv_heads"], p["head_dim"]
        assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        assert q.dtype == p["q_dtype"] and k.dtype == v.dtype == p["kv_dtype"]
        assert q.shape == (qo[-1], heads, hd) and k.shape == v.shape == (kv[-1], kvh, hd)
        scale = p["sm_scale"] if p["sm_scale"] is not None else hd**-0.5
        out = torch.empty_like(q)
        for b in range(len(qo) - 1):
            qb = q[qo[b] : qo[b + 1]].float()
            kb = k[kv[b] : kv[b + 1]].float().repeat_interleave(heads // kvh, 1)
            vb = v[kv[b] : kv[b + 1]].float().repeat_interleave(heads // kvh, 1)
            logits = torch.einsum("qhd,khd->hqk", qb, kb) * scale
            if p["causal"]:
                n, m = qb.shape[0], kb.shape[0]
                allowed = torch.arange(m)[None, :] <= m - n + torch.arange(n)[:, None]
                logits = logits.masked_fill(~allowed, float("-inf"))
            out[qo[b] : qo[b + 1]] = torch.einsum("hqk,khd->qhd", logits.softmax(-1), vb).to(q.dtype)
        return out


@contextmanager
def installed() -> Iterator[Any]:
    """``import flashinfer`` gives the stand-in (paged and ragged wrappers) while open."""
    with fake_flashinfer.installed() as fake:
        fake.BatchPrefillWithRaggedKVCacheWrapper = FakeRagged
        FakeRagged.calls = []
        yield fake
