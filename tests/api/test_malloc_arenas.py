"""``limit_malloc_arenas``: a serving process keeps to two glibc malloc arenas, however
many of its threads allocate at once; an explicit ``MALLOC_ARENA_MAX`` stands."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Eight threads allocate at once (4 KiB blocks, past pymalloc, from malloc), then glibc's
# malloc_info reports one <heap> per arena.
PROBE = """
import ctypes, ctypes.util, sys, tempfile, threading
from api.malloc_arenas import limit_malloc_arenas
print("set", limit_malloc_arenas(2) if sys.argv[1] == "limit" else None)
start = threading.Barrier(8)
held = []
def work():
    start.wait()
    held.append([bytearray(4096) for _ in range(20000)])
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = (ctypes.c_char_p, ctypes.c_char_p)
libc.malloc_info.argtypes = (ctypes.c_int, ctypes.c_void_p)
libc.fclose.argtypes = (ctypes.c_void_p,)
path = tempfile.mktemp()
fp = libc.fopen(path.encode(), b"w")
libc.malloc_info(0, fp)
libc.fclose(fp)
print("arenas", open(path).read().count("<heap nr="))
"""

glibc_only = pytest.mark.skipif(
    not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
    reason="glibc's mallopt and malloc_info",
)


def _probe(mode: str, env_max: str | None = None) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    if env_max is not None:
        env["MALLOC_ARENA_MAX"] = env_max
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    return lines["set"], int(lines["arenas"])


@glibc_only
def test_threads_allocating_at_once_share_two_arenas() -> None:
    assert _probe("limit") == ("True", 2)
    _, unlimited = _probe("none")
    assert unlimited > 2  # the probe does see the arenas glibc adds under contention


@glibc_only
def test_an_explicit_malloc_arena_max_stands() -> None:
    assert _probe("limit", env_max="4")[0] == "False"
