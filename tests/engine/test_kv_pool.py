"""The page pool and page keys on their own."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import OutOfPagesError
from engine.kv_pool import KVPool, LayerLayout
from engine.page_hashing import MediaRow, page_key


def _pool(n=4, ps=4):
    return KVPool(
        [LayerLayout(2, 8), LayerLayout(2, 16), LayerLayout(0, 16, shares_with=1)], num_pages=n, page_size=ps
    )


def test_layers_have_their_own_shapes_and_shared_layers_own_nothing():
    pool = _pool()
    assert pool.k[0].shape == (4, 4, 2, 8) and pool.k[1].shape == (4, 4, 2, 16)
    assert pool.k[2] is None and pool.kv(2)[0] is pool.k[1]
    assert pool.bytes_per_page == 2 * 4 * 2 * (8 + 16) * 4
    with pytest.raises(ValueError):
        KVPool([LayerLayout(0, 8, shares_with=0)], num_pages=1)


def test_allocate_is_all_or_nothing():
    pool = _pool()
    a = pool.allocate(3)
    with pytest.raises(OutOfPagesError) as e:
        pool.allocate(2)
    assert e.value.needed == 2 and e.value.available == 1
    assert pool.stats().free == 1 and pool.stats().in_use == 3
    pool.decref(a)
    assert pool.stats().free == 4


def test_refcounts_and_published_pages_stay_findable_until_evicted():
    pool = _pool()
    (p,) = pool.allocate(1)
    key = page_key(None, [1, 2, 3, 4], [None] * 4, [(0,), (1,), (2,), (3,)])
    assert pool.register(p, key) == p
    pool.incref([p])
    pool.decref([p])
    pool.decref([p])  # refcount 0: cached, not free
    s = pool.stats()
    assert (s.in_use, s.cached, s.free) == (0, 1, 3)
    assert pool.lookup(key) == p and pool.refcount(p) == 1
    pool.decref([p])
    pool.allocate(4)  # needs the cached page too: evicts it
    assert pool.lookup(key) is None
    with pytest.raises(RuntimeError):
        pool.decref([p, p])


def test_a_cache_limit_frees_the_least_recently_used_cached_pages_first():
    pool = _pool()
    pages = pool.allocate(3)
    keys = [page_key(None, [i] * 4, [None] * 4, [(0,), (1,), (2,), (3,)]) for i in range(3)]
    for p, k in zip(pages, keys, strict=True):
        pool.register(p, k)
    pool.decref(pages)
    assert pool.stats().cached == 3
    assert pool.set_cache_limit(2) is None  # the oldest cached page is freed now
    assert pool.lookup(keys[0]) is None and pool.stats().cached == 2
    assert pool.allocate(1) == [pages[0]]  # and is the next page handed out
    assert pool.set_cache_limit(0) == 2 and pool.stats().cached == 0 and pool.lookup(keys[2]) is None
    pool.set_cache_limit(None)
    (p,) = pool.allocate(1)
    pool.register(p, keys[1])
    pool.decref([p])
    assert pool.stats().cached == 1  # no limit: cached until evicted


def test_register_converges_on_one_page():
    pool = _pool()
    a, b = pool.allocate(2)
    key = page_key(None, [5], [None], [(0,)])
    assert pool.register(a, key) == a
    assert pool.register(b, key) == a  # b computed the same content: it is dropped for a
    assert pool.refcount(a) == 2 and pool.refcount(b) == 0


def test_copy_page_copies_every_owning_layer():
    pool = _pool()
    a, b = pool.allocate(2)
    pool.k[0][a] = 1.0
    pool.v[1][a] = 2.0
    pool.k[0][b] = 0.0
    pool.copy_page(a, b, rows=2)
    assert torch.all(pool.k[0][b, :2] == 1) and torch.all(pool.k[0][b, 2:] == 0)
    assert torch.all(pool.v[1][b, :2] == 2)


def test_page_keys_cover_tokens_media_positions_and_parent():
    rows = dict(tokens=[1, 2], media=[None, None], positions=[(0,), (1,)])
    base = page_key(None, **rows)
    assert base == page_key(None, **rows)
    assert base != page_key(b"x" * 16, **rows)
    assert base != page_key(None, tokens=[1, 3], media=[None, None], positions=[(0,), (1,)])
    assert base != page_key(None, tokens=[1, 2], media=[None, None], positions=[(0,), (2,)])
    img_a = page_key(None, tokens=[1, 2], media=[None, MediaRow("imgA", 0)], positions=[(0,), (1,)])
    img_b = page_key(None, tokens=[1, 2], media=[None, MediaRow("imgB", 0)], positions=[(0,), (1,)])
    shifted = page_key(None, tokens=[1, 2], media=[None, MediaRow("imgA", 1)], positions=[(0,), (1,)])
    assert len({base, img_a, img_b, shifted}) == 4
    m3 = page_key(None, tokens=[1], media=[None], positions=[(0, 0, 0)])
    assert m3 != page_key(None, tokens=[1], media=[None], positions=[(0, 0, 1)])


def _streamed_key(parent, tokens, media, positions, salt=b""):
    """The byte layout page_key documents, fed to the hash piece by piece (page keys are
    compared across processes and replicas, so the layout must not drift)."""
    import hashlib
    import struct

    h = hashlib.blake2b(digest_size=16)
    h.update(b"P" + (parent if parent is not None else b"\x00" * 16))
    h.update(struct.pack("<I", len(tokens)))
    if salt:
        h.update(b"A" + struct.pack("<I", len(salt)) + salt)
    for tok, m, pos in zip(tokens, media, positions, strict=True):
        h.update(struct.pack("<q", tok) + struct.pack("<B", len(pos)) + struct.pack(f"<{len(pos)}q", *pos))
        if m is None:
            h.update(b"t")
        else:
            key = m.key.encode()
            h.update(b"m" + struct.pack("<Iq", len(key), m.offset) + key)
    return h.digest()


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(st.none(), st.binary(min_size=16, max_size=16)),
    st.binary(max_size=24),
    st.integers(1, 3),
    st.lists(
        st.tuples(
            st.integers(-(2**63), 2**63 - 1),
            st.one_of(
                st.none(), st.builds(MediaRow, st.sampled_from(["a", "bé", "k" * 70]), st.integers(0, 9999))
            ),
            st.integers(0, 2**40),
        ),
        max_size=20,
    ),
)
def test_page_key_hashes_the_documented_layout(parent, salt, axes, rows):
    tokens = [t for t, _, _ in rows]
    media = [m for _, m, _ in rows]
    positions = [(p,) * axes for _, _, p in rows]
    assert page_key(parent, tokens, media, positions, salt) == _streamed_key(
        parent, tokens, media, positions, salt
    )


def test_sizes_are_ints():
    from engine import InvalidRequestError

    layers = [LayerLayout(1, 2)]
    for bad in ({"num_pages": 0}, {"num_pages": True}, {"num_pages": 2.0}, {"num_pages": 2, "page_size": 0}):
        with pytest.raises(InvalidRequestError):  # a ValueError too
            KVPool(layers, **bad)
    assert KVPool(layers, num_pages=2, page_size=3).page_size == 3


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_reading_consecutive_pages_as_a_view_equals_the_gather(kv_dtype):
    """``first_page`` (the runner's note that a table is consecutive) reads K/V as views of
    the pool; the values equal the gather of the same pages, rows cut at ``rows``."""
    pool = KVPool([LayerLayout(2, 8)], num_pages=6, page_size=4, kv_dtype=kv_dtype)
    torch.manual_seed(0)
    key, value = torch.randn(24, 2, 8), torch.randn(24, 2, 8)
    pool.write(0, torch.arange(24), key, value)
    for pages, rows in (([2, 3, 4], 10), ([0, 1], 8), ([5], 1)):
        table = torch.tensor(pages)
        gathered = pool.read_pages(0, table, rows, torch.float32)
        viewed = pool.read_pages(0, table, rows, torch.float32, first_page=pages[0])
        for g, v in zip(gathered, viewed, strict=True):
            assert g.shape == v.shape == (rows, 2, 8) and torch.equal(g, v)
        if kv_dtype is None:  # no copy: the pool's own storage
            assert viewed[0].untyped_storage().data_ptr() == pool.k[0].untyped_storage().data_ptr()
            want = key.view(6, 4, 2, 8)[pages].reshape(-1, 2, 8)[:rows]
            assert torch.equal(viewed[0], want)
