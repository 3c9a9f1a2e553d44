"""The partial last page of a flushed prefill is kept (``KVPool.put_tail``) and a later
context with exactly the same rows takes it without a forward pass; anything else
computes as before."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import Sampler, SyncContext, max_tokens
from engine.kv_pool import KVPool, LayerLayout
from media import Image
from tests.engine.conftest import assert_logits_close

PREFIX = "Same question prefix for every request: "


def _image(seed: int) -> Image:
    rng = np.random.default_rng(seed)
    return Image.from_array(rng.integers(0, 256, (96, 128, 3), dtype=np.uint8))


def _flushed(model, image: Image, prefix: str = PREFIX, suffix: str = "") -> SyncContext:
    ctx = SyncContext(model).fill(prefix)
    ctx.append_image(image)
    if suffix:
        ctx.fill(suffix)
    ctx.flush()
    return ctx


def _tail_rows(model, ctx) -> tuple[int, int]:
    """(page, rows) of the context's partial last page."""
    ps = model.pool.page_size
    n = ctx.committed
    return ctx.pages[(n - 1) // ps], n - (n - 1) // ps * ps


def _same_rows(model, a, b) -> bool:
    (pa, ra), (pb, rb) = _tail_rows(model, a), _tail_rows(model, b)
    assert ra == rb
    pool = model.pool
    return all(
        torch.equal(k[pa, :ra], k[pb, :rb]) and torch.equal(v[pa, :ra], v[pb, :rb])
        for k, v in zip(pool.k, pool.v, strict=True)
        if k is not None and v is not None
    )


def test_repeat_after_same_prefix_runs_no_pass_and_continues_exactly(qwen):
    qwen.pool.clear_tails()
    image = _image(1)
    first = _flushed(qwen, image)
    assert first.committed % qwen.pool.page_size, "the test wants a partial last page"
    passes = qwen.runner.passes
    again = _flushed(qwen, image)
    assert qwen.runner.passes == passes  # no forward pass: full pages + the kept tail
    assert again.committed == len(again) == len(first)
    assert again.pages[:-1] == first.pages[:-1]  # full pages shared through the prefix cache
    assert again.pages[-1] != first.pages[-1]  # the tail is this context's own copy
    assert _same_rows(qwen, first, again)
    assert torch.equal(again.next_token_logits(), first.next_token_logits())

    # the same as computing it all without the tail (within the parity tolerance)
    qwen.pool.clear_tails()
    computed = _flushed(qwen, image)
    assert qwen.runner.passes == passes + 1
    assert_logits_close(again.next_token_logits(), computed.next_token_logits(), "tail cache: repeat")
    want = computed.generate(Sampler.greedy(), max_tokens(6)).tokens
    assert again.generate(Sampler.greedy(), max_tokens(6)).tokens == want
    for c in (first, again, computed):
        c.close()


def test_different_image_or_prefix_computes(qwen):
    qwen.pool.clear_tails()
    image = _image(2)
    first = _flushed(qwen, image)
    passes = qwen.runner.passes
    other_image = _flushed(qwen, _image(3))
    assert qwen.runner.passes == passes + 1
    other_prefix = _flushed(qwen, image, prefix="A different prefix, as long as the other: ")
    assert qwen.runner.passes == passes + 2
    assert other_image.next_token_logits().sub(first.next_token_logits()).abs().max() > 1e-3
    for c in (first, other_image, other_prefix):
        c.close()


def test_more_rows_after_the_tail_compute_only_those(qwen):
    qwen.pool.clear_tails()
    image = _image(4)
    first = _flushed(qwen, image)
    passes, rows = qwen.runner.passes, qwen.runner.rows_computed
    longer = SyncContext(qwen).fill(PREFIX)
    longer.append_image(image)
    longer.fill(" and a question after it")
    longer.flush()
    assert qwen.runner.passes == passes + 1
    ps = qwen.pool.page_size
    assert qwen.runner.rows_computed - rows == len(longer) - (len(first) // ps) * ps  # past the full pages
    for c in (first, longer):
        c.close()


def test_kept_tail_survives_the_takers_rewrites(qwen):
    qwen.pool.clear_tails()
    image = _image(5)
    suffix = " What is in this picture?"
    first = _flushed(qwen, image, suffix=suffix)
    assert _tail_rows(qwen, first)[1] > 3
    want = first.next_token_logits()
    taker = _flushed(qwen, image, suffix=suffix)
    taker.truncate(len(taker) - 3).fill(" rewritten rows here").flush()  # writes into its tail page
    passes = qwen.runner.passes
    third = _flushed(qwen, image, suffix=suffix)
    assert qwen.runner.passes == passes
    assert _same_rows(qwen, first, third)
    assert torch.equal(third.next_token_logits(), want)
    for c in (first, taker, third):
        c.close()


def test_closing_the_publisher_keeps_the_tail(qwen):
    qwen.pool.clear_tails()
    image = _image(6)
    first = _flushed(qwen, image)
    want = first.next_token_logits()
    first.close()
    passes = qwen.runner.passes
    again = _flushed(qwen, image)
    # its full pages were cached (refcount 0, keyed) and its tail kept apart
    assert qwen.runner.passes == passes
    assert torch.equal(again.next_token_logits(), want)
    again.close()


def test_generate_keeps_its_prompt_tail_and_a_repeat_skips_the_prefill(qwen):
    qwen.pool.clear_tails()
    image = _image(7)

    def prompt():
        return SyncContext(qwen).user(image, "What is in this picture?").cue()

    first = prompt()
    want = first.generate(Sampler.greedy(), max_tokens(5)).tokens
    assert qwen.pool.stats().tails == 1  # the prompt's last page; its decode steps keep none
    passes, rows = qwen.runner.passes, qwen.runner.rows_computed
    again = prompt()
    assert again.generate(Sampler.greedy(), max_tokens(5)).tokens == want
    assert qwen.runner.passes - passes == 4  # decode steps only: the prompt was not computed
    assert qwen.runner.rows_computed - rows == 4
    qwen.pool.clear_tails()
    computed = prompt()
    assert computed.generate(Sampler.greedy(), max_tokens(5)).tokens == want
    assert_logits_close(again.next_token_logits(), computed.next_token_logits(), "tail cache: after generate")
    for c in (first, again, computed):
        c.close()


# -- the pool's side ---------------------------------------------------------------------


def _pool(tails: int | None = None) -> KVPool:
    pool = KVPool(
        [LayerLayout(2, 4), LayerLayout(2, 4, shares_with=0)], num_pages=6, page_size=4, tail_entries=tails
    )
    for t in pool.k + pool.v:
        if t is not None:
            t.copy_(torch.arange(t.numel(), dtype=t.dtype).view_as(t))
    return pool


def test_pool_put_take_copies_rows_and_output():
    pool = _pool()
    src, dst = pool.allocate(2)
    pool.put_tail(b"k1", src, 3, "out")
    pool.k[0][src].fill_(-1)  # the source page is rewritten: the kept copy is not
    assert pool.take_tail(b"k1", dst) == (3, "out")
    assert torch.equal(
        pool.k[0][dst, :3], torch.arange(src * 32, src * 32 + 24, dtype=torch.float32).view(3, 2, 4)
    )
    assert pool.take_tail(b"missing", dst) is None
    assert pool.stats().tails == 1 and pool.stats().in_use == 2


def test_pool_tails_lru_bounded_and_checked():
    pool = _pool(tails=2)
    (page,) = pool.allocate(1)
    for key in (b"a", b"b", b"c"):
        pool.put_tail(key, page, 1, key)
    assert not pool.has_tail(b"a") and pool.has_tail(b"b") and pool.has_tail(b"c")
    pool.take_tail(b"b", page)  # touched: now most recent
    pool.put_tail(b"d", page, 1, None)
    assert pool.has_tail(b"b") and not pool.has_tail(b"c")
    with pytest.raises(ValueError):
        pool.put_tail(b"e", page, 5, None)
    (free,) = pool.allocate(1)
    pool.decref([free])
    with pytest.raises(RuntimeError):
        pool.put_tail(b"e", free, 1, None)
    off = _pool(tails=0)
    (p,) = off.allocate(1)
    off.put_tail(b"a", p, 1, None)
    assert off.stats().tails == 0
