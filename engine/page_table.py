"""The pages one context holds, over the model's ``KVPool``.

``pages[i]`` holds rows ``[i*P, (i+1)*P)`` of the context (``P`` = the pool's page size).
``keys`` is the chain of content keys (``engine.page_hashing``) of the leading full
committed pages: ``keys[i]`` is the key of ``pages[i]``. Every page in the table carries
one reference of this table.

What a context does with its table, each step a small check and then the act:

* ``reuse``: before computing rows that start at a page boundary, take published pages
  whose key matches them (prefix cache); nothing to check, a miss stops it;
* ``pages_needed`` / ``can_reserve`` / ``reserve``: before writing rows ``[start, end)``,
  make every page they touch one this table may write: a page shared with another holder
  is copied first (copy-on-write, its rows before ``start`` only), a published page held
  only here is withdrawn from the prefix cache, new pages are appended. All or nothing:
  on ``OutOfPagesError`` nothing changed;
* ``publish``: after rows are committed, register each newly full page under its key (a
  page whose content another page already holds is swapped for that one);
* ``truncate`` / ``forget_keys``: keep the pages of the first rows / stop vouching for
  the content of pages from a row on (they will be rewritten);
* ``fork``: a second table holding the same committed pages (one more reference each);
* ``release``: give every page back.

Committed and working pages (Pie's ``pie:core/context``). The first ``committed_rows``
rows (whole pages) are the committed chain: keyed, published in the prefix cache,
shared by forks and saved names. The pages after them are working pages: filled by a
context's forward passes (``engine.forward_pass``) or reserved ahead
(``add_pages``), private, and truncated or released at will until ``commit`` (or a
``publish`` by the engine's own prefills, which commit every full page they fill) makes
them part of the chain. ``drop`` releases pages whose rows are masked out for good
(``engine.masks.HiddenRows``): the pool gets them back and the table points their place
at the pool's zero ``hole`` page.

Writes happen only to pages this table holds alone and that are unpublished, so sharing
(forks, saved contexts, the prefix cache) never corrupts anyone's rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from engine.kv_pool import KVPool
from engine.page_hashing import MediaRow, PageKey, page_key
from media import cache_scope


class KeyedRow(Protocol):
    """What a page's key is made of, per row (``engine.context.Row`` is one)."""

    @property
    def token(self) -> int: ...

    @property
    def pos(self) -> tuple[int, ...]: ...

    @property
    def media(self) -> MediaRow | None: ...


def rows_key(parent: PageKey | None, rows: Sequence[KeyedRow], salt: bytes = b"") -> PageKey:
    """The key of a full page holding ``rows`` after the page keyed ``parent`` (``salt``:
    the adapter stack the rows are computed under)."""
    return page_key(parent, [r.token for r in rows], [r.media for r in rows], [r.pos for r in rows], salt)


class PageTable:
    """The pages of one context (see the module doc); released by ``release``."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.namespace = cache_scope().encode()
        """The cache scope the table was made under (``encoders.cache_scope``): part of every
        page key, so pages are shared only within one scope (a tenant, a ``cache_salt``)."""
        self._salts: list[tuple[int, bytes]] = [(0, b"")]
        """(first row, identity of the LoRA adapter stack) segments: which stack each row's
        K/V was computed under. A page's key names every stack its rows saw, so a page
        whose rows straddle a push/pop is never taken for one computed under one stack."""
        self._pages: list[int] = []
        self._keys: list[PageKey] = []
        self.committed_rows = 0
        """Rows in the committed chain (whole pages; see the module doc)."""

    # -- facts ------------------------------------------------------------------------------
    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def pages(self) -> list[int]:
        """Page ids in row order (a copy)."""
        return list(self._pages)

    @property
    def keys(self) -> tuple[PageKey, ...]:
        """Keys of the leading full committed pages, in order."""
        return tuple(self._keys)

    def __len__(self) -> int:
        return len(self._pages)

    def pages_for(self, rows: int) -> int:
        """How many pages ``rows`` rows fill (the last one maybe partly)."""
        return -(-rows // self.pool.page_size)

    def covering(self, rows: int) -> list[int]:
        """The pages holding the first ``rows`` rows."""
        return self._pages[: self.pages_for(rows)]

    @property
    def salt(self) -> bytes:
        """Identity of the adapter stack rows are computed under from now on."""
        return self._salts[-1][1]

    def set_salt(self, salt: bytes, from_row: int) -> None:
        """Rows from ``from_row`` on are (re)computed under the adapter stack ``salt``."""
        while self._salts and self._salts[-1][0] >= from_row:
            self._salts.pop()
        if not self._salts or self._salts[-1][1] != salt:
            self._salts.append((from_row, salt))

    def _page_salt(self, idx: int) -> bytes:
        salt = self._stack_salt(idx)
        return b"S" + self.namespace + b"|" + salt if self.namespace else salt

    def _stack_salt(self, idx: int) -> bytes:
        """The salt of page ``idx``'s key: its stack, or each stack with its first row in
        the page when its rows straddle a change."""
        if len(self._salts) == 1:
            return self._salts[0][1]
        ps = self.pool.page_size
        lo, hi = idx * ps, (idx + 1) * ps
        seen: list[tuple[int, bytes]] = []
        for i, (start, salt) in enumerate(self._salts):
            end = self._salts[i + 1][0] if i + 1 < len(self._salts) else hi
            if start < hi and end > lo:
                seen.append((max(start, lo) - lo, salt))
        if len(seen) == 1:
            return seen[0][1]
        return b"|".join(b"%d=" % off + salt for off, salt in seen)

    # -- prefix cache -----------------------------------------------------------------------
    def reuse(self, rows: Sequence[KeyedRow], committed: int, *, limit: int) -> int:
        """Take published pages for ``rows[committed:]`` (whole pages starting at a page
        boundary, while they match) without covering row ``limit`` (a row whose output is
        needed must be computed). Returns the committed row count after it."""
        ps = self.pool.page_size
        n = committed
        while n % ps == 0 and n + ps <= limit:
            if len(self._keys) != n // ps:
                break
            key = rows_key(self._keys[-1] if self._keys else None, rows[n : n + ps], self._page_salt(n // ps))
            page = self.pool.lookup(key)
            if page is None:
                break
            idx = n // ps
            if idx < len(self._pages):
                self.pool.decref([self._pages[idx]])
                self._pages[idx] = page
            else:
                self._pages.append(page)
            self._keys.append(key)
            n += ps
        return n

    def publish(self, rows: Sequence[KeyedRow], committed: int) -> None:
        """Register every full page among the first ``committed`` rows that has no key yet
        (``rows`` holds at least those rows)."""
        ps = self.pool.page_size
        hole = self.pool.hole_page
        for idx in range(len(self._keys), committed // ps):
            if self._pages[idx] == hole:
                break  # a released page's rows are gone: nothing from here on can be keyed
            key = rows_key(
                self._keys[-1] if self._keys else None, rows[idx * ps : (idx + 1) * ps], self._page_salt(idx)
            )
            self._pages[idx] = self.pool.register(self._pages[idx], key)
            self._keys.append(key)
        self.committed_rows = max(self.committed_rows, committed // ps * ps)

    # -- writing ----------------------------------------------------------------------------
    def shares(self, start: int, end: int) -> bool:
        """Whether rows [start, end) touch a held page someone else holds too (reserving
        them copies it)."""
        return bool(self._shared(start, end))

    def _shared(self, start: int, end: int) -> list[int]:
        """Indices of the held pages that rows [start, end) touch and someone else holds."""
        first, last = start // self.pool.page_size, min(self.pages_for(end), len(self._pages))
        return [i for i in range(first, last) if self.pool.refcount(self._pages[i]) > 1]

    def pages_needed(self, start: int, end: int) -> int:
        """Fresh pages ``reserve(start, end)`` takes from the pool: new ones past the table's
        end plus one copy of each shared page the rows touch."""
        return max(0, self.pages_for(end) - len(self._pages)) + len(self._shared(start, end))

    def can_reserve(self, start: int, end: int) -> bool:
        return self.pages_needed(start, end) <= self.pool.available()

    def reserve(self, start: int, end: int) -> None:
        """Make the table cover rows [start, end) with pages this table may write (see the
        module doc). All or nothing: on ``OutOfPagesError`` nothing changed."""
        pool, pages, ps = self.pool, self._pages, self.pool.page_size
        first, last = start // ps, self.pages_for(end)
        if last - first == 1 and last <= len(pages):  # rows inside one held page (a decode step)
            page = pages[first]
            if pool.refcount(page) == 1 and pool.key_of(page) is None:
                return
        shared = self._shared(start, end)
        fresh = pool.allocate(max(0, last - len(pages)) + len(shared))
        for i in shared:
            dst = fresh.pop()
            keep = start - i * ps
            if keep > 0:
                pool.copy_page(pages[i], dst, rows=keep)
            pool.decref([pages[i]])
            pages[i] = dst
        for i in range(first, min(last, len(pages))):
            if pool.key_of(pages[i]) is not None:
                pool.unregister(pages[i])
        pages.extend(fresh)

    # -- shrinking, sharing, releasing -------------------------------------------------------
    def forget_keys(self, rows: int) -> None:
        """Drop the keys of pages from the one holding row ``rows`` on: their rows will be
        rewritten (the pages stay held)."""
        del self._keys[rows // self.pool.page_size :]
        self.committed_rows = min(self.committed_rows, rows // self.pool.page_size * self.pool.page_size)

    def truncate(self, rows: int) -> None:
        """Keep only the pages holding the first ``rows`` rows (and their keys)."""
        keep = self.pages_for(rows)
        drop = self._pages[keep:]
        if drop:
            self.pool.decref(drop)
        del self._pages[keep:]
        self.forget_keys(rows)

    def fork(self, rows: int) -> PageTable:
        """A new table holding the pages of the first ``rows`` rows by reference."""
        child = PageTable(self.pool)
        child.namespace = self.namespace
        held = self.covering(rows)
        self.pool.incref(held)
        child._pages = list(held)
        child._keys = list(self._keys)
        child.committed_rows = min(self.committed_rows, rows // self.pool.page_size * self.pool.page_size)
        child._salts = [seg for seg in self._salts if seg[0] < rows] or [(0, b"")]
        return child

    def release(self) -> None:
        """Give every page back (idempotent)."""
        if self._pages:
            self.pool.decref(self._pages)
        self._pages = []
        self._keys = []
        self.committed_rows = 0

    # -- working pages (Pie's context) -------------------------------------------------------
    @property
    def committed_pages(self) -> int:
        return self.committed_rows // self.pool.page_size

    @property
    def working_pages(self) -> int:
        """Pages held past the committed chain (filled or only reserved)."""
        return len(self._pages) - self.committed_pages

    def add_pages(self, n: int) -> None:
        """Reserve ``n`` more pages at the end (all or nothing: ``OutOfPagesError``)."""
        self._pages.extend(self.pool.allocate(n))

    def drop_tail(self, n: int) -> None:
        """Give back the last ``n`` pages (the caller forgets the rows they held)."""
        if n > 0:
            drop = self._pages[-n:]
            self.pool.decref(drop)
            del self._pages[-n:]
            del self._keys[len(self._pages) :]

    def commit(self, rows: Sequence[KeyedRow], upto: int) -> None:
        """Make rows ``[0, upto)`` (whole pages) the committed chain: key and publish them."""
        self.publish(rows, upto)
        self.committed_rows = max(self.committed_rows, upto)

    def drop(self, indices: Sequence[int]) -> int:
        """Release the pages at ``indices`` (their rows masked out for good): each place then
        holds the pool's hole page. Returns how many pages went back."""
        places = sorted(set(indices))
        hole = self.pool.hole_page
        if hole is None:  # the first drop: one of these pages may become the hole itself
            hole = self.pool.hole(self._pages[places[0]] if places else None)
        gone = [i for i in places if self._pages[i] != hole]
        if not gone:
            return 0
        self.pool.decref([self._pages[i] for i in gone])
        self.pool.incref([hole] * len(gone))
        for i in gone:
            self._pages[i] = hole
        return len(gone)

    def holes(self) -> int:
        """How many places hold the hole page (released pages)."""
        hole = self.pool.hole_page
        return 0 if hole is None else self._pages.count(hole)

    def __repr__(self) -> str:
        return f"PageTable({len(self._pages)} pages, {len(self._keys)} published)"
