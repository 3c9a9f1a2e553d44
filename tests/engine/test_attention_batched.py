"""The torch backend's batched prefill: the multi-row sequences of a pass attended in one
padded SDPA call per layer (``engine.attention._prefill_plan``), against the same backend
attending each sequence on its own (``TorchBackend(batch_sequences=False)``, the path the
parity tests held to transformers) and against a float64 softmax written from the mask rule.

Tolerance: float32 on the CPU. The batched call reorders the same float32 sums (padded
rows, another SDPA kernel for masked vs ``is_causal`` calls), which moves unit-scale
outputs by ~1e-7..1e-6; 1e-5 (absolute and relative) leaves room for that, while a wrong
mask, a padding key seen, or a row scattered to the wrong place moves outputs by 1e-2 or
more (random unit-variance K/V). The float64 reference gets 2e-5: float32 against exact.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine import Context, Sampler, max_tokens
from engine import attention as attn
from engine.attention import BatchMeta, SeqMeta, TorchBackend
from engine.kv_pool import KVPool, LayerLayout
from engine.masks import sequence_causal_mask
from media import Image
from tests.engine.test_parity_media import IMG_A, IMG_B

RTOL = ATOL = 1e-5
F64_ATOL = 2e-5
PER_SEQUENCE = TorchBackend(batch_sequences=False)
BATCHED = TorchBackend()

# (kv_start, q_len, media block as (first, end) query rows or None)
MIXED = [
    (37, 1, None),  # decode rows
    (5, 1, None),
    (64, 1, None),
    (0, 23, None),  # fresh prefills
    (0, 30, None),
    (0, 27, (4, 20)),  # a fresh prefill with an image block
    (19, 9, None),  # chunks continuing a KV prefix, starting mid-page
    (40, 12, None),
    (3, 14, (2, 11)),  # a chunk with a block, after a prefix
]


def _pass(
    shapes: list[tuple[int, int, tuple[int, int] | None]],
    *,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    page_size: int = 8,
    kv_dtype: str | None = None,
    seed: int = 0,
) -> tuple[BatchMeta, torch.Tensor]:
    """One layer's pass: earlier rows' K/V random in the pool (pages in random order), this
    pass's rows written through the backend; returns the meta and the (1, H, N, D) query."""
    gen = torch.Generator().manual_seed(seed)
    need = sum(-(-(s + n) // page_size) for s, n, _ in shapes)
    pool = KVPool(
        [LayerLayout(kv_heads, head_dim)], num_pages=need + 4, page_size=page_size, kv_dtype=kv_dtype
    )
    n_rows = sum(n for _, n, _ in shapes)
    prior = torch.randn(pool.num_pages * page_size, kv_heads, head_dim, generator=gen)
    everything = torch.arange(pool.num_pages * page_size)
    pool.write(0, everything, prior, torch.randn(prior.shape, generator=gen))
    pages = torch.randperm(pool.num_pages, generator=gen)
    seqs, slots, at, q_start = [], [], 0, 0
    for kv_start, q_len, block in shapes:
        n = -(-(kv_start + q_len) // page_size)
        table = pages[at : at + n]
        at += n
        rows = torch.arange(kv_start, kv_start + q_len)
        slots.append(table[rows // page_size] * page_size + rows % page_size)
        seq = SeqMeta(q_start=q_start, q_len=q_len, kv_start=kv_start, pages=table)
        if block is not None:
            ids = torch.full((q_len,), -1)
            ids[block[0] : block[1]] = 0
            seq.block_ids = ids
        seqs.append(seq)
        q_start += q_len
    meta = BatchMeta(pool=pool, seqs=seqs, slots=torch.cat(slots), block_overlay_layers=frozenset({0}))
    key = torch.randn(1, kv_heads, n_rows, head_dim, generator=gen)
    value = torch.randn(1, kv_heads, n_rows, head_dim, generator=gen)
    BATCHED.write(meta, 0, key, value)
    return meta, torch.randn(1, heads, n_rows, head_dim, generator=gen)


def _fresh(meta: BatchMeta, blocks: bool = True) -> BatchMeta:
    """The same pass with an empty per-pass cache (each backend builds its own tables)."""
    return BatchMeta(
        pool=meta.pool,
        seqs=meta.seqs,
        slots=meta.slots,
        block_overlay_layers=frozenset({0}) if blocks else frozenset(),
    )


def _float64(meta: BatchMeta, query: torch.Tensor, *, window, blocks, softcap, scaling) -> torch.Tensor:
    """Each sequence's attention in float64 from the pool's K/V and the mask rule."""
    outs = []
    for s in meta.seqs:
        k, v = meta.pool.read_pages(0, s.pages, s.kv_len, torch.float64)
        q = query[0, :, s.q_start : s.q_start + s.q_len].double()  # (H, n, D)
        g = q.shape[0] // k.shape[1]
        k = k.transpose(0, 1).repeat_interleave(g, 0)
        v = v.transpose(0, 1).repeat_interleave(g, 0)
        mask = sequence_causal_mask(
            s.kv_start,
            s.kv_len,
            window=window,
            block_ids=s.block_ids if blocks else None,
        )
        w = q @ k.transpose(1, 2) * scaling
        if softcap is not None:
            w = torch.tanh(w / softcap) * softcap
        w = w.masked_fill(~mask, float("-inf")).softmax(-1)
        outs.append(w @ v)
    return torch.cat(outs, dim=1).unsqueeze(0)


def _both(meta, query, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = kw.pop("blocks", True)
    ours = BATCHED.attend(_fresh(meta, blocks), 0, query, **kw)
    theirs = PER_SEQUENCE.attend(_fresh(meta, blocks), 0, query, **kw)
    return ours, theirs


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("window", [None, 8, 40])
@pytest.mark.parametrize("blocks", [True, False])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_mixed_pass_equals_per_sequence(kv_heads, window, blocks, softcap):
    """Decode rows, fresh prefills, prefix continuations, media blocks, sliding windows
    that bite some sequences and not others, GQA / MQA / MHA, softcap."""
    meta, query = _pass(MIXED, kv_heads=kv_heads)
    kw = {"scaling": 0.25, "sliding_window": window, "softcap": softcap}
    ours, theirs = _both(meta, query, blocks=blocks, **kw)
    assert ours.shape == theirs.shape == query.shape
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL)
    exact = _float64(meta, query, window=window, blocks=blocks, softcap=softcap, scaling=0.25)
    torch.testing.assert_close(ours.double(), exact, rtol=0, atol=F64_ATOL)


def _counting_sdpa(monkeypatch) -> list[tuple[int, ...]]:
    """Record the query shape of every SDPA call (the real function still runs)."""
    calls: list[tuple[int, ...]] = []
    real = attn.F.scaled_dot_product_attention

    def counted(q, *a, **kw):
        calls.append(tuple(q.shape))
        return real(q, *a, **kw)

    monkeypatch.setattr(attn.F, "scaled_dot_product_attention", counted)
    return calls


@pytest.mark.parametrize("equal", [False, True])
def test_32_image_prompts_are_one_sdpa_call(monkeypatch, equal):
    """A pass of 32 fresh prompts of similar (or equal: no padding, queries read in place)
    length: one call (not 32), the output written in place (no scatter), and equal to the
    per-sequence path."""
    lengths = [300 if equal else 290 + (7 * i) % 23 for i in range(32)]
    meta, query = _pass([(0, n, None) for n in lengths], page_size=16)
    calls = _counting_sdpa(monkeypatch)
    batched = _fresh(meta)
    ours = BATCHED.attend(batched, 0, query, scaling=0.25, sliding_window=None, softcap=None)
    assert calls == [(32, 4, max(lengths), 16)]
    plan = next(v for k, v in batched.cache.items() if k[0] == "torch-prefill")
    assert plan.whole and not plan.singles
    assert (plan.buckets[0].q_index is None) == equal
    calls.clear()
    theirs = PER_SEQUENCE.attend(_fresh(meta), 0, query, scaling=0.25, sliding_window=None, softcap=None)
    assert len(calls) == 32
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL)


def test_tables_are_built_once_per_pass(monkeypatch):
    """Every layer of a pass reuses the plan and the masks built by the first one."""
    meta, query = _pass(MIXED)
    batched = _fresh(meta)
    kw = {"scaling": 0.25, "sliding_window": 8, "softcap": None}
    first = BATCHED.attend(batched, 0, query, **kw)
    made = []
    real = attn._make_bucket
    monkeypatch.setattr(attn, "_make_bucket", lambda *a: made.append(1) or real(*a))
    again = BATCHED.attend(batched, 0, query, **kw)
    assert made == []
    assert torch.equal(first, again)
    plan = next(v for k, v in batched.cache.items() if k[0] == "torch-prefill")
    assert all(len(b.masks) == 1 for b in plan.buckets)


def test_groups_keep_padding_and_scores_bounded(monkeypatch):
    """Very different shapes are not padded to each other, and a group that would span
    more than SCORE_LIMIT scores is split; outputs stay equal either way."""
    shapes = [(0, 200, None), (0, 190, None), (0, 12, None), (0, 10, None), (300, 8, None), (290, 9, None)]
    meta, query = _pass(shapes)
    kw = {"scaling": 0.25, "sliding_window": None, "softcap": None}
    groups = attn._group_by_shape(meta.seqs, heads=4)
    # The long-prefix chunks (8 and 9 rows over ~300 keys) are not padded to 200 query rows.
    assert sorted(sorted(s.q_len for s in g) for g in groups)[0] == [8, 9]
    for g in groups:
        lq = max(s.q_len for s in g)
        lk = max(s.kv_len for s in g)
        assert len(g) * lq * lk <= attn.PAD_WASTE * sum(s.q_len * s.kv_len for s in g)
    ours, theirs = _both(meta, query, **kw)
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL)

    monkeypatch.setattr(attn, "SCORE_LIMIT", 4 * 200 * 200)  # one long sequence's worth
    groups = attn._group_by_shape(meta.seqs, heads=4)
    assert [len(g) for g in groups if g[0].q_len >= 190] == [1, 1]
    calls = _counting_sdpa(monkeypatch)
    ours = BATCHED.attend(_fresh(meta), 0, query, **kw)
    assert len(calls) == 4  # the two long ones alone, the two pairs batched
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL)


def test_int8_pool():
    """A quantized pool: the batched gather dequantizes as the per-sequence one does."""
    meta, query = _pass(MIXED, kv_dtype="int8")
    ours, theirs = _both(meta, query, scaling=0.25, sliding_window=None, softcap=None)
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL)


def test_sequences_out_of_row_order():
    """Sequences listed in another order than their rows (the output is scattered back)."""
    meta, query = _pass(MIXED[3:])
    meta.seqs = meta.seqs[::-1]
    ours, theirs = _both(meta, query, scaling=0.25, sliding_window=None, softcap=None)
    torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL)


# ------------------------------------------------------------------ the real tiny models


def _concurrent(model, prompts: list, n: int) -> list[list[int]]:
    async def go():
        ctxs = [Context(model).user(*p).cue() for p in prompts]
        outs = await asyncio.gather(*(c.generate(Sampler.greedy(), max_tokens(n)) for c in ctxs))
        for c in ctxs:
            c.close()
        return [o.tokens for o in outs]

    return asyncio.run(go())


@pytest.mark.parametrize("which", ["qwen", "gemma"])
def test_image_prompts_prefilled_together_keep_their_tokens(request, which, monkeypatch):
    """Image prompts generated together (their prefills share passes, batched) give the
    greedy tokens the per-sequence path gives (held to transformers by the parity tests);
    Gemma-4 has media blocks and sliding layers, Qwen3-VL neither."""
    model = request.getfixturevalue(which)
    if which == "gemma":
        prompts = [
            (model.prepare(Image.from_bytes(img), max_soft_tokens=70), text)
            for img in (IMG_A, IMG_B)
            for text in ("Describe this image.", "What is it?")
        ]
    else:
        prompts = [(Image.from_bytes(img), text) for img in (IMG_A, IMG_B) for text in ("Describe.", "What?")]
    calls: list[int] = []
    real = attn._attend_bucket

    def counted(meta, layer, rows, bucket, **kw):
        calls.append(len(bucket.seqs))
        return real(meta, layer, rows, bucket, **kw)

    monkeypatch.setattr(attn, "_attend_bucket", counted)
    got = _concurrent(model, prompts, 6)
    assert calls and max(calls) >= 2, "no pass attended two sequences together"
    monkeypatch.setattr(attn.TORCH_BACKEND, "batch_sequences", False)
    calls.clear()
    expected = _concurrent(model, prompts, 6)
    assert not calls
    assert got == expected
