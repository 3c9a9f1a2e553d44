"""A context's committed and working pages, as Pie's ``pie:core/context`` exposes them.

The bookkeeping is the page table's (``engine.page_table``: ``committed_rows``,
``add_pages``, ``drop_tail``, ``commit``, ``drop``); this mixin gives ``engine.Context``
Pie's calls over it, each checked first so a refused call changes nothing:

* ``committed_page_count`` / ``working_page_count`` / ``working_page_token_count`` /
  ``tokens_per_page``;
* ``reserve_working_pages(n)``: n more pages now (``OutOfPagesError`` if the pool has not
  got them);
* ``release_working_pages(n)``: give back the last n working pages and the rows in them;
* ``commit_working_pages(n)``: the first n working pages (full) join the committed chain:
  published in the prefix cache, shared by forks and saved names;
* ``truncate_working_page_tokens(n)``: forget the last n working rows (a rejected
  speculation); their pages stay reserved;
* ``mask_token_range(start, end)`` / ``drop_masked_kv_pages()`` (Pie 0.3's calls): rows
  hidden from every later pass, and the pages whose rows are all hidden given back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.errors import InvalidRequestError
from engine.masks import HiddenRows
from media import check_int

if TYPE_CHECKING:
    from engine.page_table import PageTable


class WorkingPageError(InvalidRequestError):
    """A working-page call that asks for more than the context has (``details``: what it
    asked, what there is)."""

    code = "invalid_working_pages"


class WorkingPages:
    """Mixin of ``engine.Context`` (see the module doc)."""

    _table: PageTable
    _n: int
    _rows: list[Any]
    _hidden: HiddenRows

    if TYPE_CHECKING:  # Context's own

        def _check_open(self) -> None: ...

        def _check_idle(self, what: str) -> None: ...

        def truncate(self, n: int) -> Any: ...

    @property
    def tokens_per_page(self) -> int:
        return self._table.page_size

    @property
    def committed_page_count(self) -> int:
        """Pages of the committed chain."""
        return self._table.committed_pages

    @property
    def working_page_count(self) -> int:
        """Pages held past the committed chain, filled or only reserved."""
        return self._table.working_pages

    @property
    def working_page_token_count(self) -> int:
        """Rows with K/V in working pages (computed, not committed)."""
        return self._n - self._table.committed_rows

    def fits_reserved(self, rows: int) -> bool:
        """Whether ``rows`` more rows fit in pages the context holds and no one else does:
        a pass of them then takes nothing from the pool, so nothing another context does
        meanwhile can refuse it (Pie's SDK reserves its working pages before each pass)."""
        start = len(self._rows)
        return self._table.pages_needed(start, start + rows) == 0

    def reserve_working_pages(self, n: int) -> None:
        self._check_idle("reserve working pages")
        n = check_int("pages to reserve", n, min=0)
        self._table.add_pages(n)

    def release_working_pages(self, n: int) -> None:
        """Give back the last ``n`` working pages; rows they held are forgotten."""
        self._check_idle("release working pages")
        n = check_int("pages to release", n, min=0)
        have = self.working_page_count
        if n > have:
            raise WorkingPageError(
                f"cannot release {n} working pages: the context has {have}", asked=n, working=have
            )
        keep_pages = len(self._table) - n
        keep_rows = min(len(self._rows), keep_pages * self._table.page_size)
        if self._n > keep_rows or len(self._rows) > keep_rows:
            self.truncate(keep_rows)  # forgets those rows (and pages past them)
        self._table.drop_tail(len(self._table) - keep_pages)

    def commit_working_pages(self, n: int) -> None:
        """The first ``n`` working pages, each full of computed rows, join the committed chain."""
        self._check_idle("commit working pages")
        n = check_int("pages to commit", n, min=0)
        ps = self._table.page_size
        full = self.working_page_token_count // ps
        if n > full:
            raise WorkingPageError(
                f"cannot commit {n} working pages: {full} are full of computed rows "
                f"({self.working_page_token_count} working rows, {ps} per page)",
                asked=n,
                full=full,
            )
        if n:
            self._table.commit(self._rows, self._table.committed_rows + n * ps)

    def truncate_working_page_tokens(self, n: int) -> None:
        """Forget the last ``n`` working rows (their pages stay reserved)."""
        self._check_idle("truncate working rows")
        n = check_int("working rows to truncate", n, min=0)
        have = self.working_page_token_count
        if n > have:
            raise WorkingPageError(
                f"cannot truncate {n} working rows: the context has {have}", asked=n, working=have
            )
        if n:
            pages = len(self._table)
            self.truncate(self._n - n)
            if len(self._table) < pages:  # keep the reservation
                self._table.add_pages(pages - len(self._table))

    def mask_token_range(self, start: int, end: int, masked: bool = True) -> None:
        """Hide rows ``[start, end)`` from every later pass of this context (``masked=False``
        shows them again, unless their page was dropped)."""
        self._check_idle("mask rows")
        start = check_int("start row", start, min=0)
        end = check_int("end row", end, min=start)
        if end > len(self._rows):
            raise InvalidRequestError(f"rows [{start}, {end}) run past the context's {len(self._rows)} rows")
        if not masked:
            ps, hole = self._table.page_size, self._table.pool.hole_page
            pages = self._table.pages
            gone = [i for i in range(start // ps, -(-end // ps)) if i < len(pages) and pages[i] == hole]
            if gone:
                raise InvalidRequestError(
                    f"rows [{start}, {end}) include released pages {gone}; they cannot be shown"
                )
        self._hidden.set(start, end, masked)

    def drop_masked_kv_pages(self) -> int:
        """Give back every page whose rows are all hidden (``mask_token_range``); returns how
        many went back to the pool."""
        self._check_idle("drop masked pages")
        pages = self._hidden.whole_pages(self._table.page_size, self._n)
        return self._table.drop(pages) if pages else 0
