"""The KV page pool of one model: fixed-size pages, refcounted, content-addressed.

Storage: for every attention layer that owns K/V, one K and one V tensor of shape
``(num_pages, page_size, kv_heads, head_dim)``; layers may differ in ``kv_heads`` and
``head_dim`` (Gemma-4's full-attention layers are wider than its sliding ones), so each
layer gets its own pair. Layers that reuse another layer's K/V (Gemma-4 KV sharing)
map to that layer's storage and own nothing.

Page states:

* in use: refcount > 0 (held by contexts, forks, saved names);
* cached: refcount 0 but content-hashed: still findable by its key (prefix cache),
  evicted least-recently-used when free pages run out;
* free: refcount 0, no key.

Every operation that can fail checks first and changes nothing when it raises
(``OutOfPagesError``): a context that asked for too much stays as it was.

Tails. Only full pages are content-addressed; a prefill that ends inside a page leaves
a partial last page whose rows a later context with exactly the same history could
reuse too. ``put_tail`` keeps a copy of those rows (outside the pages, so page
accounting is unchanged) with the last row's output (its logits when the pass computed
them, and its final hidden state), under a key that chains the full pages before them
(``engine.context`` builds it); ``take_tail`` writes them into a page of the taker's. So
a prompt prefilled before (the same prefix and image, a repeated request, a saved
preamble) is taken whole, without a forward pass. At most ``tail_entries`` are kept,
least recently used evicted first.

Quantized storage (``kv_dtype``, ``engine.kv_quant``): K/V may be stored as int8 or
float8_e4m3fn with float32 scales beside the pages (per (row, kv head), shape
``(num_pages, page_size, kv_heads)``; or one 0-d scale per layer for K and V).
``write`` quantizes, ``read`` / ``read_pages`` dequantize to the caller's dtype, and
``copy_page``, tails and snapshots carry the scales with the rows. ``bytes_per_page``
counts the scales, so a memory budget buys more pages (``PoolStats.capacity_rows``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from engine.errors import OutOfPagesError
from engine.kv_quant import (
    SCALE_DTYPE,
    KVFormat,
    dequantize,
    float_format,
    quantize_rows,
    quantize_tensor,
    resolve_kv_dtype,
)
from engine.page_hashing import PageKey
from media import check_int


@dataclass
class _Tail:
    rows: int
    k: list[torch.Tensor | None]
    v: list[torch.Tensor | None]
    output: object
    ks: list[torch.Tensor | None]
    vs: list[torch.Tensor | None]


@dataclass(frozen=True)
class LayerLayout:
    """K/V shape of one attention layer, or the layer whose K/V it reads."""

    kv_heads: int
    head_dim: int
    shares_with: int | None = None
    """Index of the layer whose pages this layer reads (it writes none)."""


@dataclass
class PoolStats:
    num_pages: int
    page_size: int
    in_use: int
    """Pages held by at least one context or saved name."""
    shared: int
    """Of those, pages held more than once (prefix sharing, forks)."""
    cached: int
    free: int
    bytes_per_page: int
    tails: int = 0
    """Partial last pages kept with their last row's output (``KVPool.put_tail``)."""
    kv_dtype: str = ""
    """What the pages store (``KVFormat.describe``: "bfloat16", "int8 (per-row scales)")."""

    @property
    def available(self) -> int:
        return self.cached + self.free

    @property
    def capacity_rows(self) -> int:
        """Rows of K/V the whole pool holds (pages x rows per page)."""
        return self.num_pages * self.page_size


def bytes_per_page(layers: Sequence[LayerLayout], page_size: int, dtype: torch.dtype | KVFormat) -> int:
    """Bytes one page takes over every storing layer: K and V values plus their scales."""
    fmt = dtype if isinstance(dtype, KVFormat) else float_format(dtype)
    elem, scale = fmt.element_bytes(), fmt.scale_bytes_per_row_head()
    return sum(
        2 * page_size * lay.kv_heads * (lay.head_dim * elem + scale)
        for lay in layers
        if lay.shares_with is None
    )


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as uint8 (CPU torch has no index_copy_ for float8); others as they are."""
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t


class KVPool:
    def __init__(
        self,
        layers: Sequence[LayerLayout],
        *,
        num_pages: int,
        page_size: int = 32,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        tail_entries: int | None = None,
        kv_dtype: str | torch.dtype | KVFormat | None = None,
    ):
        """``dtype``: the model's dtype (what ``read`` gives back by default); ``kv_dtype``:
        what the pages store (``engine.kv_quant.KV_DTYPES`` or a ``KVFormat``; None: ``dtype``)."""
        page_size = check_int("page_size", page_size, min=1)
        num_pages = check_int("num_pages", num_pages, min=1)
        self.tail_entries = (
            max(8, min(64, num_pages // 32))
            if tail_entries is None
            else check_int("tail_entries", tail_entries, min=0)
        )
        """How many partial last pages ``put_tail`` keeps (each at most one page of K/V, held
        outside the pool's pages: by default 1/32 of the pool's pages, 8 to 64)."""
        self.layers = list(layers)
        self.page_size = page_size
        self.num_pages = num_pages
        fmt = resolve_kv_dtype(kv_dtype, dtype)
        self.kv_format = fmt
        self.compute_dtype = dtype
        self.dtype = fmt.storage
        """The pages' storage dtype (int8 / float8_e4m3fn when quantized)."""
        self.device = torch.device(device)
        self.k: list[torch.Tensor | None] = []
        self.v: list[torch.Tensor | None] = []
        self.k_scale: list[torch.Tensor | None] = []
        """Per storing layer: (num_pages, page_size, kv_heads) float32 scales ("row"), a 0-d
        scale ("tensor"), or None (a float format); ``v_scale`` likewise."""
        self.v_scale: list[torch.Tensor | None] = []
        for i, lay in enumerate(self.layers):
            if lay.shares_with is not None:
                src = lay.shares_with
                if not (0 <= src < i) or self.layers[src].shares_with is not None:
                    raise ValueError(f"layer {i} shares K/V with layer {src}, which owns none")
                self.k.append(None)
                self.v.append(None)
                self.k_scale.append(None)
                self.v_scale.append(None)
                continue
            shape = (num_pages, page_size, lay.kv_heads, lay.head_dim)
            # Uninitialised: only rows a context wrote are ever read (attention slices each
            # gathered sequence to its length), and untouched memory is not committed.
            self.k.append(torch.empty(shape, dtype=fmt.storage, device=self.device))
            self.v.append(torch.empty(shape, dtype=fmt.storage, device=self.device))
            for scales in (self.k_scale, self.v_scale):
                if fmt.scales == "row":
                    scales.append(torch.ones(shape[:3], dtype=SCALE_DTYPE, device=self.device))
                elif fmt.scales == "tensor":
                    scales.append(torch.tensor(fmt.tensor_scale, dtype=SCALE_DTYPE, device=self.device))
                else:
                    scales.append(None)
        self.bytes_per_page = bytes_per_page(self.layers, page_size, fmt)

        self._lock = threading.RLock()
        self._ref = [0] * num_pages
        # A stack, page 0 on top: a freed page is the next handed out, so the pool's memory
        # becomes resident only as far as its use ever reaches (a FIFO walked every page)
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._cached: OrderedDict[int, None] = OrderedDict()  # refcount-0 pages with a key, LRU first
        self._key_of: dict[int, PageKey] = {}
        self._page_of: dict[PageKey, int] = {}
        self._tails: OrderedDict[PageKey, _Tail] = OrderedDict()  # LRU first
        self._cache_limit: int | None = None
        self._hole: int | None = None

    # -- storage --------------------------------------------------------------------------
    def storage_layer(self, layer: int) -> int:
        src = self.layers[layer].shares_with
        return layer if src is None else src

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.storage_layer(layer)
        return self.k[s], self.v[s]  # type: ignore[return-value]

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The K and V scales of ``layer``'s storage (None, None for a float format)."""
        s = self.storage_layer(layer)
        return self.k_scale[s], self.v_scale[s]

    def _row_scales(self) -> list[torch.Tensor | None]:
        """Every per-row scale tensor (K and V of each storing layer), or nothing."""
        if self.kv_format.scales != "row":
            return []
        return [*self.k_scale, *self.v_scale]

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store rows ``key`` / ``value`` (N, kv_heads, head_dim) at flat ``slots`` (N,)
        (page * page_size + offset), quantized when the format is."""
        s = self.storage_layer(layer)
        fmt = self.kv_format
        for cache, scale, x in ((self.k[s], self.k_scale[s], key), (self.v[s], self.v_scale[s], value)):
            assert cache is not None
            kvh, hd = cache.shape[2], cache.shape[3]
            flat = _bytes_view(cache).view(-1, kvh, hd)
            if fmt.scales is None:
                flat.index_copy_(0, slots, x.to(cache.dtype))
            elif fmt.scales == "row":
                assert scale is not None
                q, sc = quantize_rows(x, fmt)
                flat.index_copy_(0, slots, _bytes_view(q))
                scale.view(-1, kvh).index_copy_(0, slots, sc)
            else:
                assert scale is not None
                flat.index_copy_(0, slots, _bytes_view(quantize_tensor(x, scale, fmt)))

    def read(self, layer: int, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at flat ``slots`` (N,) as (N, kv_heads, head_dim) in ``dtype`` (dequantized)."""
        s = self.storage_layer(layer)
        out = []
        for cache, scale in ((self.k[s], self.k_scale[s]), (self.v[s], self.v_scale[s])):
            assert cache is not None
            kvh, hd = cache.shape[2], cache.shape[3]
            q = cache.view(-1, kvh, hd).index_select(0, slots)
            sc = scale.view(-1, kvh).index_select(0, slots) if scale is not None and scale.dim() else scale
            out.append(dequantize(q, sc, dtype))
        return out[0], out[1]

    def read_pages(
        self,
        layer: int,
        pages: torch.Tensor,
        rows: int,
        dtype: torch.dtype,
        first_page: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``rows`` rows held by ``pages`` (in order) as (rows, kv_heads, head_dim)
        K and V in ``dtype`` (dequantized). ``first_page``: the caller knows ``pages`` are
        ``first_page, first_page + 1, ...``; a float pool then returns views of the pool, no
        copy (the gather cost ~100 us per layer and side at 2B decode on the CPU)."""
        s = self.storage_layer(layer)
        out = []
        n = pages.shape[0]
        for cache, scale in ((self.k[s], self.k_scale[s]), (self.v[s], self.v_scale[s])):
            assert cache is not None
            kvh, hd = cache.shape[2], cache.shape[3]
            per_row = scale is not None and scale.dim()
            if first_page is not None:
                q = cache[first_page : first_page + n].reshape(-1, kvh, hd)[:rows]
                sc = scale[first_page : first_page + n].reshape(-1, kvh)[:rows] if per_row else scale
            else:  # index_select: ~3x faster than advanced indexing (cache[pages]) on the CPU
                q = cache.index_select(0, pages).reshape(-1, kvh, hd)[:rows]
                sc = scale.index_select(0, pages).reshape(-1, kvh)[:rows] if per_row else scale
            out.append(dequantize(q, sc, dtype))
        return out[0], out[1]

    def copy_page(self, src: int, dst: int, rows: int | None = None) -> None:
        n = self.page_size if rows is None else rows
        for t in [*self.k, *self.v, *self._row_scales()]:
            if t is not None:
                t[dst, :n] = t[src, :n]

    @property
    def hole_page(self) -> int | None:
        """The hole page if one was made (``hole``), else None."""
        return self._hole

    def hole(self, donor: int | None = None) -> int:
        """The pool's hole page: zero K/V, held by the pool for good (made on first use, one
        page). A context's table points a released page's place at it (``PageTable.drop``):
        its rows are masked out of every later pass, and a gather that reads them anyway
        reads finite zeros, never another context's rows. ``donor``: a page its only holder
        is giving up, made the hole instead of taking a fresh one (a full pool still drops)."""
        with self._lock:
            if self._hole is None:
                if donor is not None and self._ref[donor] == 1 and donor not in self._key_of:
                    page = donor
                    self._ref[page] += 1  # the pool's own reference, beside the giver's place
                else:
                    (page,) = self.allocate(1)
                for t in [*self.k, *self.v]:
                    if t is not None:
                        t[page].zero_()
                for t in self._row_scales():
                    if t is not None:
                        t[page].fill_(1.0)
                self._hole = page
            return self._hole

    # -- accounting ------------------------------------------------------------------------
    def stats(self) -> PoolStats:
        with self._lock:
            in_use = sum(1 for r in self._ref if r > 0)
            return PoolStats(
                num_pages=self.num_pages,
                page_size=self.page_size,
                in_use=in_use,
                shared=sum(1 for r in self._ref if r > 1),
                cached=len(self._cached),
                free=len(self._free),
                bytes_per_page=self.bytes_per_page,
                tails=len(self._tails),
                kv_dtype=self.kv_format.describe(),
            )

    def available(self) -> int:
        with self._lock:
            return len(self._free) + len(self._cached)

    def refcount(self, page: int) -> int:
        return self._ref[page]

    def key_of(self, page: int) -> PageKey | None:
        return self._key_of.get(page)

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh pages (refcount 1), evicting cached pages if needed; all or nothing."""
        if n <= 0:
            return []
        with self._lock:
            have = len(self._free) + len(self._cached)
            if n > have:
                raise OutOfPagesError(
                    f"KV pool exhausted: {n} page(s) of {self.page_size} rows needed, {have} available "
                    f"of {self.num_pages} (close or truncate contexts, delete saved ones, or load the "
                    "model with more kv_pages)",
                    needed=n,
                    available=have,
                )
            out = []
            for _ in range(n):
                if self._free:
                    page = self._free.pop()
                else:
                    page, _ = self._cached.popitem(last=False)
                    self._forget(page)
                self._ref[page] = 1
                out.append(page)
            return out

    def incref(self, pages: Iterable[int]) -> None:
        with self._lock:
            for p in pages:
                if self._ref[p] == 0:
                    if p not in self._cached:
                        raise RuntimeError(f"incref of free page {p}")
                    del self._cached[p]
                self._ref[p] += 1

    def decref(self, pages: Iterable[int]) -> None:
        with self._lock:
            for p in pages:
                if self._ref[p] <= 0:
                    raise RuntimeError(f"decref of page {p} with refcount {self._ref[p]}")
                self._ref[p] -= 1
                if self._ref[p] == 0:
                    if p in self._key_of:
                        self._cached[p] = None
                    else:
                        self._free.append(p)
            self._trim_cached()

    def set_cache_limit(self, pages: int | None) -> int | None:
        """Keep at most ``pages`` cached pages (refcount 0, still findable), the least
        recently used going back to the free pages now and as more are released; None: as
        many as the pool holds (the default). Returns the limit it replaces. A batch job of
        distinct media sets a small one while it runs: its pages would never be found
        again, and kept they would make the whole pool resident page by page."""
        with self._lock:
            old = self._cache_limit
            self._cache_limit = None if pages is None else check_int("pages", pages, min=0)
            self._trim_cached()
            return old

    def _trim_cached(self) -> None:
        while self._cache_limit is not None and len(self._cached) > self._cache_limit:
            page, _ = self._cached.popitem(last=False)
            self._forget(page)
            self._free.append(page)

    # -- content addressing -----------------------------------------------------------------
    def lookup(self, key: PageKey) -> int | None:
        """The page holding ``key`` with one more reference, or None."""
        with self._lock:
            page = self._page_of.get(key)
            if page is not None:
                self.incref([page])
            return page

    def register(self, page: int, key: PageKey) -> int:
        """Publish a full, held page under ``key``. When another page already holds the
        same content, that page is returned with a reference taken and ``page`` loses the
        caller's reference (identical prefixes computed apart converge on one page)."""
        with self._lock:
            if self._ref[page] <= 0:
                raise RuntimeError(f"register of unheld page {page}")
            existing = self._page_of.get(key)
            if existing is not None and existing != page:
                self.incref([existing])
                self.decref([page])
                return existing
            old = self._key_of.get(page)
            if old is not None and old != key:
                del self._page_of[old]
            self._key_of[page] = key
            self._page_of[key] = page
            return page

    def unregister(self, page: int) -> None:
        """Withdraw a page's key (it is about to be written to)."""
        with self._lock:
            self._forget(page)

    def _forget(self, page: int) -> None:
        key = self._key_of.pop(page, None)
        if key is not None and self._page_of.get(key) == page:
            del self._page_of[key]

    # -- partial last pages -------------------------------------------------------------------
    def has_tail(self, key: PageKey) -> bool:
        with self._lock:
            return key in self._tails

    def put_tail(self, key: PageKey, page: int, rows: int, output: object) -> None:
        """Keep a copy of rows ``[0, rows)`` of ``page`` (held by the caller) and ``output``
        (what the last of them produced) under ``key``; a key already kept is only touched."""
        if not 0 < rows <= self.page_size:
            raise ValueError(f"a tail holds 1..{self.page_size} rows, got {rows}")
        with self._lock:
            if self.tail_entries == 0:
                return
            if key in self._tails:
                self._tails.move_to_end(key)
                return
            if self._ref[page] <= 0:
                raise RuntimeError(f"put_tail of unheld page {page}")

            def kept(ts: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
                return [None if t is None else t[page, :rows].clone() for t in ts]

            row = self.kv_format.scales == "row"
            self._tails[key] = _Tail(
                rows,
                kept(self.k),
                kept(self.v),
                output,
                kept(self.k_scale) if row else [],
                kept(self.v_scale) if row else [],
            )
            while len(self._tails) > self.tail_entries:
                self._tails.popitem(last=False)

    def take_tail(self, key: PageKey, page: int) -> tuple[int, object] | None:
        """Write the rows kept under ``key`` into rows ``[0, rows)`` of ``page`` (held by the
        caller, who may write it); returns (rows, output), or None when nothing is kept."""
        with self._lock:
            tail = self._tails.get(key)
            if tail is None:
                return None
            if self._ref[page] <= 0:
                raise RuntimeError(f"take_tail into unheld page {page}")
            self._tails.move_to_end(key)
            dsts = [*self.k, *self.v, *self._row_scales()]
            for dst, src in zip(dsts, [*tail.k, *tail.v, *tail.ks, *tail.vs], strict=True):
                if dst is not None and src is not None:
                    dst[page, : tail.rows] = src
            return tail.rows, tail.output

    def clear_tails(self) -> None:
        with self._lock:
            self._tails.clear()
