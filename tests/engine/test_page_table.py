"""The page table on its own: a real KVPool with tiny shapes, no model."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from engine import OutOfPagesError
from engine.kv_pool import KVPool, LayerLayout
from engine.page_hashing import MediaRow
from engine.page_table import PageTable, rows_key

PS = 4  # rows per page


@dataclass(frozen=True)
class R:
    token: int
    pos: tuple[int, ...]
    media: MediaRow | None = None


def _rows(tokens: list[int]) -> list[R]:
    return [R(t, (i,)) for i, t in enumerate(tokens)]


def _pool(n: int = 8) -> KVPool:
    return KVPool([LayerLayout(1, 2)], num_pages=n, page_size=PS)


def _state(pool: KVPool, *tables: PageTable) -> tuple:
    """Everything reserve may change: every page's refcount and key, the stats, the tables."""
    pages = range(pool.num_pages)
    return (
        [pool.refcount(p) for p in pages],
        [pool.key_of(p) for p in pages],
        pool.stats(),
        [(t.pages, t.keys) for t in tables],
    )


def _committed(pool: KVPool, rows: list[R]) -> PageTable:
    """A table that computed and committed ``rows`` (K rows hold the token ids)."""
    t = PageTable(pool)
    t.reserve(0, len(rows))
    k, _ = pool.kv(0)
    for i, r in enumerate(rows):
        k[t.pages[i // PS], i % PS] = float(r.token)
    t.publish(rows, len(rows))
    return t


def _k_rows(pool: KVPool, page: int, n: int) -> list[float]:
    return pool.kv(0)[0][page, :n, 0, 0].tolist()


def test_reserve_allocates_and_publish_keys_full_pages():
    pool = _pool()
    rows = _rows([1, 2, 3, 4, 5, 6])
    t = PageTable(pool)
    assert t.pages_needed(0, 6) == 2 and t.can_reserve(0, 6)
    t.reserve(0, 6)
    assert len(t) == 2 and [pool.refcount(p) for p in t.pages] == [1, 1]
    t.publish(rows, 6)  # one full page, one partial
    assert t.keys == (rows_key(None, rows[:4]),)
    assert pool.key_of(t.pages[0]) == t.keys[0] and pool.key_of(t.pages[1]) is None
    t.publish(rows, 6)
    assert len(t.keys) == 1  # nothing new to publish
    assert t.covering(5) == t.pages and t.covering(4) == t.pages[:1] and t.pages_for(9) == 3


def test_reuse_takes_matching_published_pages_and_never_the_limit_row():
    pool = _pool()
    a = _committed(pool, _rows(list(range(10, 19))))  # 9 rows: two full pages published
    b = PageTable(pool)
    rows = _rows(list(range(10, 19)))
    assert b.reuse(rows, 0, limit=8) == 8  # both full pages, row 8 left to compute
    assert b.pages == a.pages[:2] and b.keys == a.keys
    assert [pool.refcount(p) for p in a.pages] == [2, 2, 1]
    c = PageTable(pool)
    assert c.reuse(rows, 0, limit=7) == 4  # the second page would cover row 7
    d = PageTable(pool)
    assert d.reuse(_rows([10, 11, 12, 99, 14]), 0, limit=4) == 0  # no match: nothing taken
    assert d.pages == [] and d.keys == ()
    e = PageTable(pool)  # a different parent: the second page does not match either
    assert e.reuse(_rows([9, 11, 12, 13, 14, 15, 16, 17, 18]), 0, limit=8) == 0
    for t in (a, b, c, d, e):
        t.release()
    assert pool.stats().in_use == 0


def test_reserve_copies_a_shared_page_before_writing():
    pool = _pool()
    rows = _rows([1, 2, 3, 4, 5, 6])
    a = _committed(pool, rows)
    child = a.fork(6)
    assert child.pages == a.pages and [pool.refcount(p) for p in a.pages] == [2, 2]
    # child writes rows 6..7: only the partly filled, shared second page is copied
    assert child.pages_needed(6, 8) == 1
    child.reserve(6, 8)
    assert child.pages[0] == a.pages[0] and child.pages[1] != a.pages[1]
    assert [pool.refcount(p) for p in a.pages] == [2, 1] and pool.refcount(child.pages[1]) == 1
    assert _k_rows(pool, child.pages[1], 2) == [5.0, 6.0]  # the rows before the write, copied
    # growing past the end appends fresh pages; nothing is shared there
    child.reserve(8, 10)
    assert len(child) == 3 and pool.refcount(child.pages[2]) == 1


def test_truncate_into_a_shared_published_page_then_write():
    pool = _pool()
    rows = _rows([1, 2, 3, 4, 5, 6, 7, 8, 9])
    a = _committed(pool, rows)
    other = a.fork(9)
    published = a.pages[0]
    a.truncate(2)  # into page 0, which `other` holds too and is published
    assert a.pages == [published] and a.keys == ()
    assert [pool.refcount(p) for p in other.pages] == [2, 1, 1]
    a.reserve(2, 4)  # copy-on-write: the shared page keeps its rows and its key
    assert a.pages[0] != published
    assert _k_rows(pool, a.pages[0], 2) == [1.0, 2.0]
    assert pool.key_of(published) == other.keys[0] and pool.refcount(published) == 1
    assert pool.key_of(a.pages[0]) is None


def test_writing_into_a_published_page_held_alone_withdraws_it():
    pool = _pool()
    rows = _rows([1, 2, 3, 4, 5])
    a = _committed(pool, rows)
    page = a.pages[0]
    a.forget_keys(2)  # rows 2.. will be rewritten (e.g. their logits must be recomputed)
    assert a.keys == ()
    a.reserve(2, 4)
    assert a.pages[0] == page and pool.key_of(page) is None  # written in place, unpublished
    fresh = PageTable(pool)
    assert fresh.reuse(rows, 0, limit=4) == 0  # no longer in the prefix cache


def test_fork_and_release_count_references():
    pool = _pool()
    a = _committed(pool, _rows([1, 2, 3, 4, 5, 6]))
    b = a.fork(4)  # only the pages of the first 4 rows
    assert b.pages == a.pages[:1] and b.keys == a.keys
    assert [pool.refcount(p) for p in a.pages] == [2, 1]
    b.release()
    b.release()  # idempotent
    assert b.pages == [] and [pool.refcount(p) for p in a.pages] == [1, 1]
    a.release()
    s = pool.stats()
    assert (s.in_use, s.cached, s.free) == (0, 1, 7)  # the published page stays findable


@pytest.mark.parametrize("shared", [False, True])
def test_out_of_pages_changes_nothing(shared):
    pool = _pool(3)
    a = _committed(pool, _rows([1, 2, 3, 4, 5, 6]))  # 2 of 3 pages
    t = a.fork(6) if shared else a
    # shared: one copy of page 1 + 2 new pages; alone: 2 new pages; 1 page is available
    assert t.pages_needed(6, 16) == (3 if shared else 2)
    assert not t.can_reserve(6, 16)
    before = _state(pool, a, t)
    with pytest.raises(OutOfPagesError) as e:
        t.reserve(6, 16)
    assert (e.value.needed, e.value.available) == (t.pages_needed(6, 16), 1)
    assert _state(pool, a, t) == before
    assert t.pages_needed(6, 8) == (1 if shared else 0) and t.can_reserve(6, 8)
    t.reserve(6, 8)  # what fits still works afterwards
    assert torch.equal(pool.kv(0)[0][t.pages[1], :2, 0, 0], torch.tensor([5.0, 6.0]))
