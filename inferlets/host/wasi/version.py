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
    linker = wc.Linker(engine)  # one linker: a new instance name does not disturb the probe
    linker.add_wasip2()
    with linker.root() as root:
        for patch in range(0, 64):
            try:
                with root.add_instance(f"wasi:io/poll@0.2.{patch}") as inst:
                    inst.add_func("poll", lambda store, ps: [0])
            except wasmtime.WasmtimeError:
                return f"0.2.{patch}"
    raise RuntimeError("could not find which wasi:io/poll version wasmtime registered")
