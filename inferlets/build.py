"""Build a Python inferlet directory (module ``app``) into a component with componentize-py."""

from __future__ import annotations

import hashlib
import os
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
    _componentize(WIT_DIR, "inferlet", [SDK_DIR, src], module, out)
    return out


def _componentize(wit: Path, world: str, paths: list[Path], module: str, out: Path) -> None:
    """Stock componentize-py: ``module`` (found on ``paths``) as a component of ``world``
    into ``out`` (written whole or not at all)."""
    tool = Path(sys.executable).parent / "componentize-py"
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [str(tool), "-d", str(wit), "-w", world, "componentize"]
    for p in paths:
        cmd += ["-p", str(p)]
    r = subprocess.run([*cmd, module, "-o", str(tmp)], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise InferletError(f"componentize-py failed on {paths[-1]}", stderr=r.stderr[-3000:])
    tmp.replace(out)


# -- Pie 0.4 projects (Pie.toml + main.py, Pie's own SDK) -------------------------------------
PIE_WIT_DIR = HERE / "pie_wit"
PIE_ENTRY = HERE / "pie_guest" / "pie_entry.py"
PIE_EXEC_WIT = """package pie:app;

interface run {
    run: func(input: string) -> result<string, string>;
}

world exec {
    include pie:core/imports;
    include pie:instruct/imports;
    include pie:mcp/imports;
    include pie:zo/imports;
    import wasi:filesystem/types@0.2.4;
    import wasi:filesystem/preopens@0.2.4;
    import wasi:random/random@0.2.4;
    import wasi:random/insecure@0.2.4;
    import wasi:random/insecure-seed@0.2.4;
    export run;
}
"""


PIE_DAEMON_WIT = PIE_EXEC_WIT.replace("world exec {", "world daemon {").replace(
    "    export run;", "    export wasi:http/incoming-handler@0.2.4;"
)
"""A Pie daemon: Pie's imports, and ``wasi:http/incoming-handler`` exported instead of
``run`` (served by the protocol's ``launch_daemon``)."""
WASI_HTTP_WIT_DIR = HERE / "wasi_http_wit"


def is_daemon_project(project: Path) -> bool:
    """Whether a Pie project's ``main.py`` defines ``IncomingHandler`` at its top level (a
    daemon: it serves HTTP) rather than ``async def main(input)`` (a run)."""
    import ast

    tree = ast.parse((Path(project) / "main.py").read_text(encoding="utf-8"))
    return any(isinstance(n, ast.ClassDef) and n.name == "IncomingHandler" for n in tree.body)


def pie_sdk_dir() -> Path:
    """The installed ``inferlet`` package (Pie's Python SDK, 0.4.0), bundled into the guest."""
    import importlib.util

    spec = importlib.util.find_spec("inferlet")
    if spec is None or not spec.submodule_search_locations:
        raise InferletError(
            "Pie's Python SDK is not installed: pip install inferlet==0.4.0 (pie-media[inferlets])"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def build_pie_component(project: Path, out_dir: Path, *, extra: list[Path] = ()) -> Path:
    """Build a Pie 0.4 project (``Pie.toml`` + ``main.py``) with stock componentize-py and the
    installed ``inferlet`` SDK into a component of Pie's world (exports ``pie:app/run``).
    A daemon project (``is_daemon_project``: ``main.py`` defines ``IncomingHandler``, a
    ``wasi:http/incoming-handler``, and may run Pie's SDK with ``pie_loop.run(coro)``)
    exports that handler instead. Cached by the content of the project, the SDK, the WIT and
    the guest modules; a build takes ~20 s and ~0.45 GB. ``extra``: more package folders to
    bundle (e.g. pie-media's media helpers, ``inferlets/pie_sdk``)."""
    import shutil
    import tempfile

    from inferlets.pie_project import PieManifest

    project = Path(project)
    manifest = PieManifest.load(project)
    sdk = pie_sdk_dir()
    entry_dir = PIE_ENTRY.parent
    daemon = is_daemon_project(project)
    digest = _digest([project, sdk, PIE_WIT_DIR, entry_dir, *([WASI_HTTP_WIT_DIR] if daemon else []), *extra])
    out = Path(out_dir) / f"{manifest.name}-{manifest.version}-{digest}.wasm"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pie-build-") as tmp:
        work = Path(tmp)
        app = work / "app"
        app.mkdir()
        for p in project.iterdir():
            if p.suffix == ".py" and p.is_file():
                shutil.copy2(p, app / p.name)
            elif p.is_dir() and (p / "__init__.py").is_file() and p.name != "__pycache__":
                shutil.copytree(p, app / p.name, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copytree(sdk, app / "inferlet", ignore=shutil.ignore_patterns("__pycache__", "bindings"))
        for pkg in extra:
            shutil.copytree(pkg, app / Path(pkg).name, ignore=shutil.ignore_patterns("__pycache__"))
        for guest in entry_dir.glob("*.py"):
            shutil.copy2(guest, app / guest.name)
        wit = work / "wit"
        shutil.copytree(PIE_WIT_DIR / "deps", wit / "deps")
        if daemon:
            shutil.copytree(WASI_HTTP_WIT_DIR / "http", wit / "deps" / "http")
            shutil.copy2(WASI_HTTP_WIT_DIR / "clocks" / "monotonic-clock.wit", wit / "deps" / "clocks")
            (wit / "daemon.wit").write_text(PIE_DAEMON_WIT)
            _componentize(wit, "daemon", [app], "main", out)
        else:
            (wit / "exec.wit").write_text(PIE_EXEC_WIT)
            _componentize(wit, "exec", [app], "pie_entry", out)
    return out
