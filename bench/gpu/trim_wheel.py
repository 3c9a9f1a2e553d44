"""Repack the flashinfer JIT wheel without the CUDA sources of kernels we never compile.

    python bench/gpu/trim_wheel.py WHEEL

The JIT wheel ships the C++/CUDA sources of every kernel family (MoE, KDA, GDN, the
"cake" families, Blackwell-only kernels, CUTLASS examples...); the GPU check compiles only
paged attention (``BatchPrefill/DecodeWithPagedKVCacheWrapper``: ``csrc/batch_*.cu``,
``csrc/*_jit_binding.cu``, ``include/flashinfer``, ``cutlass/include``, ``cccl``). The
folders below are dropped from ``flashinfer/data`` (and their lines from RECORD); every
Python module stays, so ``import flashinfer`` is unchanged. Rewrites WHEEL in place and
prints the size before and after.
"""

from __future__ import annotations

import fnmatch
import os
import sys
import zipfile
from pathlib import Path

DROP = [
    "flashinfer/data/csrc/cake_*",
    "flashinfer/data/csrc/kda/*",
    "flashinfer/data/csrc/fused_moe/*",
    "flashinfer/data/csrc/gdn/*",
    "flashinfer/data/csrc/experimental/*",
    "flashinfer/data/csrc/blackwell_*",
    "flashinfer/data/csrc/alphamoe*",
    "flashinfer/data/cutlass/examples/*",
    "flashinfer/data/cutlass/python/*",
    "flashinfer/data/cccl/python/*",
]


def dropped(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in DROP)


def trim(wheel: Path) -> tuple[int, int, int]:
    """Rewrite ``wheel`` without the dropped files -> (bytes before, after, files dropped)."""
    before = wheel.stat().st_size
    out = wheel.with_suffix(".trimmed")
    n = 0
    with (
        zipfile.ZipFile(wheel) as src,
        zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst,
    ):
        for info in src.infolist():
            if dropped(info.filename):
                n += 1
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = ("\n".join(line for line in lines if not dropped(line.split(",")[0])) + "\n").encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    os.replace(out, wheel)
    return before, wheel.stat().st_size, n


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    before, after, n = trim(Path(argv[0]))
    print(f"trimmed {argv[0]}: {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB ({n} files dropped)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
