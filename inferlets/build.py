"""Build a Python inferlet directory (module ``app``) into a component with componentize-py."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

from inferlets.host.errors import InferletError

HERE = Path(__file__).parent
WIT_DIR = HERE / "wit"
SDK_DIR = HERE / "sdk"


def _digest(dirs: list[Path]) -> str:
    h = hashlib.sha256()
    for d in dirs:
        for p in sorted(d.rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts:
                h.update(str(p.relative_to(d)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:24]


def build_component(src: Path, out_dir: Path, *, module: str = "app") -> Path:
    """Component for ``src``; rebuilt only when the sources, SDK or WIT change."""
    src = Path(src)
    out = Path(out_dir) / f"{src.name}-{_digest([src, SDK_DIR, WIT_DIR])}.wasm"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tool = Path(sys.executable).parent / "componentize-py"
    tmp = out.with_suffix(".tmp")
    r = subprocess.run(
        [
            str(tool),
            "-d",
            str(WIT_DIR),
            "-w",
            "inferlet",
            "componentize",
            "-p",
            str(SDK_DIR),
            "-p",
            str(src),
            module,
            "-o",
            str(tmp),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if r.returncode != 0:
        raise InferletError("componentize-py failed", stderr=r.stderr[-2000:])
    tmp.replace(out)
    return out
