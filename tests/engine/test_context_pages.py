"""Forks, saved contexts, prefix sharing, running out of pages, truncation."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine import (
    Context,
    ContextClosedError,
    InvalidRequestError,
    Model,
    OutOfPagesError,
    Sampler,
    SavedContextExistsError,
    SavedContextNotFoundError,
    SyncContext,
    max_tokens,
)
from tests.engine.conftest import TINY_GEMMA, PassGate, assert_logits_close

LONG = (
    "The harbour master kept a ledger of every boat that came in, with the name, the cargo, the weather "
    "and the mood of the crew, and after forty years the ledger filled a whole shelf of the lighthouse."
)


def _in_use(model) -> int:
    return model.pool.stats().in_use


def _greedy(ctx, n=12):
    return ctx.generate(Sampler.greedy(), max_tokens(n)).tokens


def test_fork_continues_like_an_independent_context(gemma):
    base = SyncContext(gemma).system("You are terse.").user(LONG)
    base.flush()
    child = base.fork()
    child.user("And then?").cue()
    alone = SyncContext(gemma).system("You are terse.").user(LONG).user("And then?").cue()
    assert child.token_ids == alone.token_ids
    assert _greedy(child) == _greedy(alone)
    # the parent is untouched by what the child did
    base.user("Something else.").cue()
    other = SyncContext(gemma).system("You are terse.").user(LONG).user("Something else.").cue()
    assert _greedy(base) == _greedy(other)
    for c in (base, child, alone, other):
        c.close()


def test_fork_logits_match_uninterrupted_context(qwen):
    prefix = SyncContext(qwen).user(LONG)
    prefix.flush()
    child = prefix.fork().fill(" continue")
    ours = child.flush(return_logits=True)
    full = SyncContext(qwen).user(LONG).fill(" continue")
    ref = full.flush(return_logits=True)[-ours.shape[0] :]
    assert_logits_close(ours, ref, "fork vs uninterrupted context (engine vs engine), qwen")
    for c in (prefix, child, full):
        c.close()


def test_forks_share_the_prefix_pages(gemma):
    before = _in_use(gemma)
    base = SyncContext(gemma).user(LONG)
    base.flush()
    ps = gemma.pool.page_size
    prefix_pages = -(-base.committed // ps)
    assert _in_use(gemma) - before == prefix_pages
    forks = [base.fork() for _ in range(5)]
    assert _in_use(gemma) - before == prefix_pages  # nothing copied yet
    assert all(f.pages == base.pages for f in forks)
    for i, f in enumerate(forks):
        f.user(f"Question {i}?").cue()
        f.flush()
    # each fork owns only the pages past the shared full ones (its copy of the tail onwards)
    full = base.committed // ps
    own = [set(f.pages[full:]) for f in forks]
    assert all(not (a & b) for i, a in enumerate(own) for b in own[i + 1 :])
    assert all(f.pages[:full] == base.pages[:full] for f in forks)
    assert _in_use(gemma) - before == prefix_pages + sum(len(o) for o in own)
    for f in forks:
        f.close()
    base.close()
    assert _in_use(gemma) == before


def test_identical_prefixes_share_published_pages(gemma):
    """Two contexts that fill the same text share its full pages (the prefix cache): the
    second computes only the rows after the last full page that ends before its last row
    (whose output a flush needs), and the full page it computed converges on the first's."""
    a = SyncContext(gemma).user(LONG + LONG).cue()
    a.flush()
    ps = gemma.pool.page_size
    rows = a.committed
    full = rows // ps
    assert full >= 2
    reused = (rows - 1) // ps * ps  # whole pages that end before the last row
    rows_before = gemma.runner.rows_computed
    gemma.pool.clear_tails()  # else b takes a's kept last page too and computes nothing (test_tail_cache)
    b = SyncContext(gemma).user(LONG + LONG).cue()
    b.flush()
    assert b.pages[:full] == a.pages[:full]
    assert gemma.runner.rows_computed - rows_before == rows - reused
    assert _greedy(a) == _greedy(b)
    # closed contexts leave their published pages findable
    a.close()
    b.close()
    c = SyncContext(gemma).user(LONG + LONG).cue()
    rows_before = gemma.runner.rows_computed
    gemma.pool.clear_tails()
    c.flush()
    assert gemma.runner.rows_computed - rows_before == rows - reused
    c.close()


def test_save_and_open_equal_an_uninterrupted_context(gemma):
    ctx = SyncContext(gemma).system("You are terse.").user(LONG)
    ctx.flush()
    ctx.save("story")
    assert "story" in gemma.saved_names()
    with pytest.raises(SavedContextExistsError):
        ctx.save("story")
    ctx.close()
    opened = SyncContext.open(gemma, "story")
    opened.user("Go on.").cue()
    plain = SyncContext(gemma).system("You are terse.").user(LONG).user("Go on.").cue()
    assert opened.token_ids == plain.token_ids
    assert _greedy(opened) == _greedy(plain)
    opened.close()
    plain.close()
    again = SyncContext.open(gemma, "story")  # saved state is unaffected by what forks did
    assert again.committed == len(again.token_ids)
    again.close()
    gemma.delete_saved("story")
    with pytest.raises(SavedContextNotFoundError):
        gemma.delete_saved("story")
    with pytest.raises(SavedContextNotFoundError):
        Context.open(gemma, "story")


def test_saved_contexts_registry(qwen):
    """``model.saved``: the registry behind Context.save/open and saved_names/delete_saved."""
    saved = qwen.saved
    assert "a" not in saved and len(saved) == 0
    before = _in_use(qwen)
    ctx = SyncContext(qwen).user(LONG)
    ctx.flush()
    first = ctx.token_ids
    saved.save("b", ctx.ctx)
    ctx.save("a")
    assert list(saved) == saved.names() == qwen.saved_names() == ["a", "b"]
    assert "a" in saved and len(saved) == 2 and repr(saved) == "SavedContexts('a', 'b')"
    with pytest.raises(InvalidRequestError):
        saved.save("", ctx.ctx)
    ctx.fill(" and more")
    ctx.flush()
    saved.save("a", ctx.ctx, overwrite=True)  # the old snapshot is closed, its pages let go
    opened = saved.open("a")
    assert opened.token_ids == ctx.token_ids and opened.committed == ctx.committed
    older = Context.open(qwen, "b")
    assert older.token_ids == first
    for c in (ctx, opened, older):
        c.close()
    saved.delete("a")
    qwen.delete_saved("b")
    assert len(saved) == 0 and _in_use(qwen) == before
    with pytest.raises(SavedContextNotFoundError):
        saved.open("a")


def test_rewind_and_regenerate(qwen):
    ctx = SyncContext(qwen).user(LONG).cue()
    first = _greedy(ctx, 8)
    ctx.rewind(8)
    assert _greedy(ctx, 8) == first
    n = len(ctx)
    for bad in (True, 1.0, -1):
        with pytest.raises(InvalidRequestError):
            ctx.rewind(bad)
    with pytest.raises(InvalidRequestError):
        ctx.truncate(False)
    assert len(ctx) == n
    ctx.close()


@pytest.mark.parametrize("cut", [40, 64, 70])
def test_truncate_into_published_page_then_continue(gemma, cut):
    ids = SyncContext(gemma).user(LONG + LONG).cue().token_ids
    ctx = SyncContext(gemma).fill_tokens(ids)
    ctx.flush()
    other = ctx.fork()  # shares the pages that truncation will rewrite
    ctx.truncate(cut)
    ctx.fill(" and a brand new ending")
    ours = ctx.flush(return_logits=True)
    fresh = SyncContext(gemma).fill_tokens(ids[:cut]).fill(" and a brand new ending")
    ref = fresh.flush(return_logits=True)[-ours.shape[0] :]
    assert_logits_close(ours, ref, f"truncate into a shared page at row {cut} (engine vs engine), gemma")
    # the fork still reads its own history
    check = SyncContext(gemma).fill_tokens(ids)
    assert _greedy(other, 6) == _greedy(check, 6)
    for c in (ctx, other, fresh, check):
        c.close()


def test_truncate_then_sample_recomputes_the_last_logits(gemma):
    ctx = SyncContext(gemma).user(LONG).cue()
    ctx.flush()
    n = len(ctx)
    ctx.fill(" extra words here")
    ctx.flush()
    ctx.truncate(n)
    fresh = SyncContext(gemma).user(LONG).cue()
    assert _greedy(ctx, 6) == _greedy(fresh, 6)
    for c in (ctx, fresh):
        c.close()


def test_out_of_pages_is_typed_and_recoverable(tiny_dir):
    probe = Model.load(tiny_dir(TINY_GEMMA), kv_pages=1, page_size=16, device="cpu")
    rows_a = len(SyncContext(probe).user(LONG))
    rows_b = len(SyncContext(probe).user("Unrelated: " + LONG + LONG))
    pages_a, pages_b = -(-rows_a // 16), -(-rows_b // 16)
    small = Model.load(tiny_dir(TINY_GEMMA), kv_pages=pages_b + 1, page_size=16, device="cpu")
    assert pages_a + pages_b > pages_b + 1
    a = SyncContext(small).user(LONG)
    a.flush()
    b = SyncContext(small).user("Unrelated: " + LONG + LONG)
    stats = small.pool.stats()
    with pytest.raises(OutOfPagesError) as e:
        b.flush()
    assert (e.value.needed, e.value.available) == (pages_b, pages_b + 1 - pages_a)
    # nothing half-done: no row committed, no page taken
    assert (b.committed, b.pending, b.pages) == (0, rows_b, [])
    assert small.pool.stats() == stats
    a.close()
    b.flush()  # fits now
    assert b.pending == 0
    out = _greedy(b, 3)
    ref = SyncContext(small).user("Unrelated: " + LONG + LONG)
    assert _greedy(ref, 3) == out
    b.close()
    ref.close()
    s = small.pool.stats()
    assert s.in_use == 0 and s.free + s.cached == s.num_pages


def test_out_of_pages_during_decode_keeps_the_context(tiny_dir):
    small = Model.load(tiny_dir(TINY_GEMMA), kv_pages=2, page_size=16, device="cpu")
    ctx = SyncContext(small).fill_tokens([2] + [100] * 30)
    with pytest.raises(OutOfPagesError):
        ctx.generate(Sampler.greedy(), max_tokens(10))
    # 31 rows + 2 sampled tokens fill both pages; the pass for row 32 found no page
    assert (len(ctx), ctx.committed) == (33, 32)
    ctx.truncate(10)
    assert len(_greedy(ctx, 3)) == 3
    ctx.close()


def test_closed_contexts_refuse_work_and_free_pages(gemma):
    before = _in_use(gemma)
    ctx = SyncContext(gemma).user(LONG)
    ctx.flush()
    ctx.close()
    ctx.close()
    assert _in_use(gemma) == before
    with pytest.raises(ContextClosedError):
        ctx.fill("x")
    with pytest.raises(ContextClosedError):
        ctx.flush()


def test_garbage_collected_contexts_release_pages(gemma):
    import gc

    before = _in_use(gemma)
    ctx = Context(gemma).user(LONG)
    asyncio.run(ctx.flush())
    assert _in_use(gemma) > before
    del ctx
    gc.collect()
    assert _in_use(gemma) == before


def test_busy_context_refuses_a_second_pass(gemma, monkeypatch):
    gate = PassGate(gemma, monkeypatch)
    gemma.pool.clear_tails()  # an earlier test's kept tail would spare this flush its pass

    async def go():
        ctx = Context(gemma).user(LONG)
        first = asyncio.ensure_future(ctx.flush())
        try:
            await gate.running()  # the first flush's pass is held
            assert ctx.busy
            with pytest.raises(InvalidRequestError):
                await ctx.flush()
        finally:
            gate.open()
        await first
        assert not ctx.busy and ctx.pending == 0
        ctx.close()

    asyncio.run(go())


def test_fill_tokens_validates_ids(gemma):
    ctx = SyncContext(gemma)
    with pytest.raises(InvalidRequestError):
        ctx.fill_tokens([gemma.arch.vocab_size])
    assert len(ctx) == 0  # the bad ids were not appended
    with pytest.raises(InvalidRequestError):
        ctx.generate()  # empty context
    ctx.close()


def test_refused_media_leaves_no_rows(qwen, samples):
    import dataclasses

    from media import Image

    prepared = qwen.prepare(Image.from_path(samples / "images" / "gray.png"))
    ctx = SyncContext(qwen).user("Look:")
    before = ctx.token_ids
    bad = dataclasses.replace(prepared, token_count=prepared.token_count + 1)
    with pytest.raises(InvalidRequestError, match="placeholder rows but token_count"):
        ctx.ctx._append_span(bad)
    assert ctx.token_ids == before  # nothing of the refused item stayed
    ctx.ctx._append_span(prepared)
    assert ctx.token_ids == before + [int(t) for t in prepared.input_ids]
    ctx.close()


def test_close_during_a_pass_releases_after_it(gemma, monkeypatch):
    before = _in_use(gemma)
    gate = PassGate(gemma, monkeypatch)

    async def go():
        ctx = Context(gemma).user(LONG + LONG)
        task = asyncio.ensure_future(ctx.flush())
        try:
            await gate.running()  # its rows are being written
            ctx.close()
            assert ctx.closed and ctx.busy
            assert _in_use(gemma) > before  # so its pages are still held
        finally:
            gate.open()
        assert await task is None  # one chunk: the pass it was in completes
        assert not ctx.busy

    asyncio.run(go())
    assert _in_use(gemma) == before


def test_flush_defers_the_lm_head_until_something_needs_logits(qwen, monkeypatch):
    """flush() keeps the last row's hidden state; the head runs once, when logits are
    needed, and gives what an immediate head gives. A flushed prefix that is only forked
    (and whose forks go on) never pays the head for its own last row."""
    calls = []
    head = qwen.runner.arch.logits

    def counting(hidden):
        calls.append(hidden.shape[0])
        return head(hidden)

    monkeypatch.setattr(qwen.runner.arch, "logits", counting)
    ctx = SyncContext(qwen).user(LONG)
    ctx.flush()
    assert calls == []  # no head yet
    child = ctx.fork().fill(" and then")
    child.flush()
    assert calls == []
    lazy = ctx.next_token_logits()
    assert calls == [1]
    assert torch.equal(ctx.next_token_logits(), lazy)  # computed once, kept
    assert calls == [1]
    eager = SyncContext(qwen).user(LONG).flush(return_logits=True)[-1]
    assert_logits_close(lazy, eager, "lazy head after flush vs logits of the pass")
    # sampling right after a flush uses the kept state: same tokens as without the flush
    assert _greedy(child) == _greedy(SyncContext(qwen).user(LONG).fill(" and then"))
    # truncating drops the kept state; the next sample recomputes the last row
    ctx.fill(" more").flush()
    ctx.rewind(1)
    assert_logits_close(ctx.next_token_logits(), lazy, "after rewind to the flushed prefix")
    for c in (ctx, child):
        c.close()
