"""The GPU machine's Python, rehearsed here: imports of what its image lacks fail.

The device machine runs its own image (``/work/.library/device/KINDS.md``, package list
read 2026-11-17): torch, transformers, Pillow, numpy, peft, httpx... but none of the
packages below, and nothing can be installed there except carried wheels (check.sh carries
flashinfer and a newer transformers only). ``block()`` makes them unfindable in this process
(importing one raises ``ModuleNotFoundError``), so the dry run finds an import the GPU check would
trip on (it did: ``import engine`` needed soundfile and PyAV through ``media``).

Use: ``python -m bench.gpu.gpu_image SCRIPT ARGS...`` (runs a script so), ``import
bench.gpu.gpu_image`` with ``PIE_GPU_IMAGE=1`` set (blocks on import), or the same as a
pytest plugin, ``pytest -p bench.gpu.gpu_image``. ``check.sh --dry-run`` uses all three.
"""

from __future__ import annotations

import importlib.abc
import os
import sys

ABSENT = frozenset(
    {
        "av",
        "soundfile",
        "soxr",
        "librosa",
        "llguidance",
        "xgrammar",
        "outlines_core",
        "pydantic",
        "pydantic_settings",
        "fastapi",
        "starlette",
        "uvicorn",
        "python_multipart",
        "multipart",
        "openai",
        "wasmtime",
        "ray",
        "jsonschema",
        "isal",
    }
)


class _Hiding(importlib.abc.MetaPathFinder):
    """Wraps a finder: the absent packages are not found (``find_spec`` gives None, as on a
    machine without them, so ``importlib.util.find_spec`` availability checks such as
    transformers' say "not installed" instead of failing)."""

    def __init__(self, inner: object):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):  # noqa: ANN001 - importlib's signature
        if name.partition(".")[0] in ABSENT:
            return None
        find = getattr(self.inner, "find_spec", None)
        return find(name, path, target) if find is not None else None

    def invalidate_caches(self) -> None:
        getattr(self.inner, "invalidate_caches", lambda: None)()

    def find_distributions(self, context=None):  # noqa: ANN001 - importlib.metadata's hook
        find = getattr(self.inner, "find_distributions", None)
        if find is None:
            return iter(())
        name = getattr(context, "name", None) if context is not None else None
        if name is not None and name.replace("-", "_").lower() in ABSENT:
            return iter(())
        return find(context) if context is not None else find()


def block() -> None:
    """From now on, the packages the GPU image lacks cannot be found (idempotent). Already
    imported ones are left alone: call this before anything imports them."""
    sys.meta_path[:] = [f if isinstance(f, _Hiding) else _Hiding(f) for f in sys.meta_path]


if os.environ.get("PIE_GPU_IMAGE") == "1":  # loaded as a pytest plugin (-p bench.gpu.gpu_image)
    block()


def main(argv: list[str]) -> None:
    """``python -m bench.gpu.gpu_image SCRIPT ARGS...``: run SCRIPT as ``__main__`` with the
    absent packages blocked."""
    import runpy

    if not argv:
        raise SystemExit("usage: python -m bench.gpu.gpu_image SCRIPT [ARGS...]")
    block()
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
