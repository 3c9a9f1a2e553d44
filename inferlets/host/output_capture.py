"""A pie:media-world guest's WASI stdout and stderr, captured at native speed.

That world runs on wasmtime's own WASI. Its ways to hand a guest's output to Python cost:
- ``WasiConfig.stdout_custom`` ~50 us a guest write (wasmtime-py's callback, from wasmtime's
  async stream);
- this host's own ``wasi:cli`` streams, as Pie's world uses, three Python host calls a
  write (check-write, write, blocking-flush: ~26 us).

A componentize-py guest writes each part of a ``print`` on its own, so the example that
echoes 255 words made ~1000 writes: 6 ms a run without capture became 43 ms with it.

Here wasmtime writes to two in-memory files (``memfd``, opened by their /proc path), a plain
``write`` in native code. This module reads them back (by hand: no library does this):
- when the guest sends (``RunState.flush_output``);
- when the run ends;
- every ``DRAIN_S`` on one shared thread, so a guest that prints and computes is seen live.

Each read is decoded as UTF-8 and handed to ``RunState.output``. The read part of each file
is then punched out, so memory holds only what waits.

Order: a stream's text keeps its order, and everything written before a send arrives before
the sent message. Between stdout and stderr, order holds only across reads: one read takes
stdout first. Pie's client gets them as separate streams.

Linux only (``available``); elsewhere the runtime falls back to ``stdout_custom``."""

from __future__ import annotations

import codecs
import ctypes
import ctypes.util
import logging
import os
import threading
import time
from collections.abc import Callable

import wasmtime

log = logging.getLogger(__name__)

DRAIN_S = 0.05
READ_BYTES = 1 << 20
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


def _fallocate() -> Callable[[int, int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


_FALLOCATE = _fallocate() if hasattr(os, "memfd_create") else None


def available() -> bool:
    """Whether this system has what the capture needs (memfd and /proc/self/fd)."""
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


class _Stream:
    __slots__ = ("name", "fd", "offset", "punched", "decoder")

    def __init__(self, name: str):
        self.name = name
        self.fd = os.memfd_create(f"inferlet-{name}", os.MFD_CLOEXEC)
        self.offset = 0
        self.punched = 0
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")


class OutputCapture:
    """One run's stdout and stderr: ``configure`` a ``WasiConfig`` with them, ``drain`` to
    hand on what was written since, ``close`` at the run's end (a last drain)."""

    def __init__(self, on_text: Callable[[str, str], None]):
        self._on_text = on_text
        self._lock = threading.Lock()
        self._streams = [_Stream("stdout"), _Stream("stderr")]
        self._closed = False

    def __repr__(self) -> str:
        read = ", ".join(f"{s.name} {s.offset} B read" for s in self._streams)
        return f"OutputCapture({read}{', closed' if self._closed else ''})"

    @property
    def paths(self) -> dict[str, str]:
        """Stream name -> the path that opens its file for writing (as wasmtime does)."""
        return {s.name: f"/proc/self/fd/{s.fd}" for s in self._streams}

    def configure(self, wasi: wasmtime.WasiConfig) -> None:
        """Point ``wasi``'s stdout and stderr at this capture's files, and start draining
        them every ``DRAIN_S`` until ``close``."""
        paths = self.paths
        wasi.stdout_file = paths["stdout"]
        wasi.stderr_file = paths["stderr"]
        self.start()

    def start(self) -> None:
        """Drain every ``DRAIN_S`` on the shared thread until ``close``."""
        _DRAINER.add(self)

    def drain(self) -> None:
        """Hand on everything written so far (any thread; one drain at a time)."""
        with self._lock:
            if not self._closed:
                self._drain(final=False)

    def close(self) -> None:
        """A last drain (an unfinished character comes out as U+FFFD), then the files go."""
        _DRAINER.remove(self)
        with self._lock:
            if self._closed:
                return
            try:
                self._drain(final=True)
            finally:
                self._closed = True
                for s in self._streams:
                    os.close(s.fd)

    def _drain(self, *, final: bool) -> None:
        for s in self._streams:
            while True:
                data = os.pread(s.fd, READ_BYTES, s.offset)
                if not data:
                    break
                s.offset += len(data)
                self._hand_on(s.name, s.decoder.decode(data))
            if final:
                self._hand_on(s.name, s.decoder.decode(b"", final=True))
            cut = s.offset - s.offset % _PAGE
            if _FALLOCATE is not None and cut > s.punched:
                # what was read leaves memory; the file keeps its size, so wasmtime's offset holds
                if _FALLOCATE(s.fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0, cut) == 0:
                    s.punched = cut

    def _hand_on(self, name: str, text: str) -> None:
        if not text:
            return
        try:
            self._on_text(name, text)
        except Exception:  # noqa: BLE001 - the guest's output goes on whatever the listener does
            log.exception("inferlet %s listener failed", name)


class _Drainer:
    """One daemon thread draining every live capture each ``DRAIN_S``; it sleeps on a
    condition while there is none (no wake-ups in a server whose runs do not capture)."""

    def __init__(self) -> None:
        self._live: set[OutputCapture] = set()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def add(self, c: OutputCapture) -> None:
        with self._cond:
            self._live.add(c)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="inferlet-output")
                self._thread.start()
            self._cond.notify()

    def remove(self, c: OutputCapture) -> None:
        with self._cond:
            self._live.discard(c)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._live))
                live = list(self._live)
            for c in live:
                try:
                    c.drain()
                except Exception:  # noqa: BLE001 - one run's failed read must not stop the others'
                    log.exception("draining %r failed", c)
            time.sleep(DRAIN_S)


_DRAINER = _Drainer()
