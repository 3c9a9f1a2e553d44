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
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from engine.errors import OutOfPagesError
from engine.page_hashing import PageKey
from media import check_int


@dataclass
class _Tail:
    rows: int
    k: list[torch.Tensor | None]
    v: list[torch.Tensor | None]
    output: object


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

    @property
    def available(self) -> int:
        return self.cached + self.free


def bytes_per_page(layers: Sequence[LayerLayout], page_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(
        2 * page_size * lay.kv_heads * lay.head_dim * elem for lay in layers if lay.shares_with is None
    )


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
    ):
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
        self.dtype = dtype
        self.device = torch.device(device)
        self.k: list[torch.Tensor | None] = []
        self.v: list[torch.Tensor | None] = []
        for i, lay in enumerate(self.layers):
            if lay.shares_with is not None:
                src = lay.shares_with
                if not (0 <= src < i) or self.layers[src].shares_with is not None:
                    raise ValueError(f"layer {i} shares K/V with layer {src}, which owns none")
                self.k.append(None)
                self.v.append(None)
                continue
            shape = (num_pages, page_size, lay.kv_heads, lay.head_dim)
            # Uninitialised: only rows a context wrote are ever read (attention slices each
            # gathered sequence to its length), and untouched memory is not committed.
            self.k.append(torch.empty(shape, dtype=dtype, device=self.device))
            self.v.append(torch.empty(shape, dtype=dtype, device=self.device))
        self.bytes_per_page = bytes_per_page(self.layers, page_size, dtype)

        self._lock = threading.RLock()
        self._ref = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._cached: OrderedDict[int, None] = OrderedDict()  # refcount-0 pages with a key, LRU first
        self._key_of: dict[int, PageKey] = {}
        self._page_of: dict[PageKey, int] = {}
        self._tails: OrderedDict[PageKey, _Tail] = OrderedDict()  # LRU first

    # -- storage --------------------------------------------------------------------------
    def storage_layer(self, layer: int) -> int:
        src = self.layers[layer].shares_with
        return layer if src is None else src

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.storage_layer(layer)
        return self.k[s], self.v[s]  # type: ignore[return-value]

    def copy_page(self, src: int, dst: int, rows: int | None = None) -> None:
        n = self.page_size if rows is None else rows
        for k, v in zip(self.k, self.v, strict=True):
            if k is None or v is None:
                continue
            k[dst, :n] = k[src, :n]
            v[dst, :n] = v[src, :n]

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
                    page = self._free.popleft()
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
            k = [None if t is None else t[page, :rows].clone() for t in self.k]
            v = [None if t is None else t[page, :rows].clone() for t in self.v]
            self._tails[key] = _Tail(rows, k, v, output)
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
            for dst, src in zip(self.k, tail.k, strict=True):
                if dst is not None and src is not None:
                    dst[page, : tail.rows] = src
            for dst, src in zip(self.v, tail.v, strict=True):
                if dst is not None and src is not None:
                    dst[page, : tail.rows] = src
            return tail.rows, tail.output

    def clear_tails(self) -> None:
        with self._lock:
            self._tails.clear()
