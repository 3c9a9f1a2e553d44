"""Which ``wasi:*@0.2.V`` names wasmtime's own WASI registered: the host's replacements
must reopen exactly those instances (a guest importing @0.2.9 resolves to wasmtime's
newest 0.2 by semver; a replacement under another patch version is silently ignored)."""

from __future__ import annotations

import functools

import wasmtime
from wasmtime import component as wc


@functools.lru_cache(maxsize=1)
def wasmtime_wasi_version() -> str:
    """Probe: with shadowing off, defining ``poll`` again fails only inside wasmtime's own
    ``wasi:io/poll`` instance."""
    engine = wasmtime.Engine()
    for patch in range(60, -1, -1):
        linker = wc.Linker(engine)
        linker.add_wasip2()
        try:
            with linker.root() as root, root.add_instance(f"wasi:io/poll@0.2.{patch}") as inst:
                inst.add_func("poll", lambda store, ps: [0])
        except wasmtime.WasmtimeError:
            return f"0.2.{patch}"
    raise RuntimeError("could not find which wasi:io/poll version wasmtime registered")
