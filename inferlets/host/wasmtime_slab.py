"""Thread-safe slabs for wasmtime-py (a workaround, written by hand: the library has none).

wasmtime-py keeps every host function and resource destructor of every component linker in
process-wide ``Slab`` objects (``wasmtime._slab.Slab``: a free list in a Python list) whose
``allocate`` / ``deallocate`` are not atomic. Runs link their worlds on their own threads
(hundreds of ``add_func`` each), while finished runs' linkers are freed, by a finalizer, on
whatever thread drops them, even in the middle of another ``allocate`` on the same thread.
Concurrent launches then corrupt the free list (bench/inferlet_tax.py saw a run die in
``Slab.allocate``; eight threads reproduce it in seconds), or could hand two functions one
index.

``install()`` makes ``allocate`` take a lock and makes ``deallocate`` only queue the index
(a deque append, atomic): the next ``allocate`` returns the queued indices to the free list
under the lock, so a finalizer never edits the list in the middle of an ``allocate``."""

from __future__ import annotations

import collections
import threading

_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    from wasmtime import _slab

    lock = threading.Lock()
    freed: collections.deque[tuple[object, int]] = collections.deque()
    allocate = _slab.Slab.allocate
    deallocate = _slab.Slab.deallocate

    def locked_allocate(self, val):  # type: ignore[no-untyped-def]
        with lock:
            while freed:
                slab, idx = freed.popleft()
                deallocate(slab, idx)
            return allocate(self, val)

    def queued_deallocate(self, idx):  # type: ignore[no-untyped-def]
        freed.append((self, idx))

    _slab.Slab.allocate = locked_allocate  # type: ignore[method-assign]
    _slab.Slab.deallocate = queued_deallocate  # type: ignore[method-assign]
    _installed = True
