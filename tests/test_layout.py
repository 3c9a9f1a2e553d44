"""The rooms' import rules, checked over the source (every import, lazy ones included).

media <- encoders <- engine <- {api, inferlets}; speech beside engine (it may use the
engine's door for the checkpoint loader) and below {api, inferlets}; fixtures use media
only. No room imports another room's private (underscore) names or modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

ALLOWED: dict[str, set[str]] = {
    "media": set(),
    "encoders": {"media"},
    "engine": {"media", "encoders"},
    "speech": {"media", "engine"},
    "inferlets": {"media", "encoders", "engine", "speech"},
    "api": {"media", "encoders", "engine", "speech", "inferlets", "fixtures"},
    "fixtures": {"media"},
}
ROOMS = set(ALLOWED)


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module, imported names, line) for every import statement in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((alias.name, [], node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module, [a.name for a in node.names], node.lineno))
    return out


def _room_files() -> list[tuple[str, Path]]:
    files = []
    for room in sorted(ROOMS):
        folder = ROOT / room
        if folder.is_dir():
            files.extend((room, p) for p in sorted(folder.rglob("*.py")))
    return files


def test_rooms_import_only_what_the_layout_allows() -> None:
    wrong = []
    for room, path in _room_files():
        for module, _names, line in _imports(path):
            target = module.split(".")[0]
            if target in ROOMS and target != room and target not in ALLOWED[room]:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {room} imports {module}")
    assert wrong == []


def test_the_room_graph_has_no_circle() -> None:
    edges: dict[str, set[str]] = {room: set() for room in ROOMS}
    for room, path in _room_files():
        for module, _names, _line in _imports(path):
            target = module.split(".")[0]
            if target in ROOMS and target != room:
                edges[room].add(target)
    seen: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> None:
        if seen.get(node) == 1:
            pytest.fail("import circle: " + " -> ".join([*path, node]))
        if seen.get(node) == 2:
            return
        seen[node] = 1
        for nxt in sorted(edges[node]):
            visit(nxt, [*path, node])
        seen[node] = 2

    for room in sorted(ROOMS):
        visit(room, [])


def test_no_room_imports_another_rooms_private_names() -> None:
    wrong = []
    for room, path in _room_files():
        for module, names, line in _imports(path):
            parts = module.split(".")
            if parts[0] not in ROOMS or parts[0] == room:
                continue
            private = [p for p in parts[1:] if p.startswith("_") and p != "__init__"]
            private += [n for n in names if n.startswith("_")]
            if private:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: from {module} import {private}")
    assert wrong == []


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    """The parser above finds lazy imports inside functions (the ones that hide circles)."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from engine._x import _y\n    import speech\n")
    found = _imports(f)
    assert ("engine._x", ["_y"], 2) in found
    assert ("speech", [], 3) in found


def _file_graph(room: str) -> dict[str, set[str]]:
    """module -> modules of the same room it imports (lazy and TYPE_CHECKING imports count;
    the door, ``__init__``, is not a node: every file's package imports it first)."""
    folder = ROOT / room
    modules = {p.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".") for p in folder.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in folder.rglob("*.py"):
        if path.name == "__init__.py":
            continue
        me = path.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
        deps = graph.setdefault(me, set())
        for module, names, _line in _imports(path):
            candidates = [module] + [f"{module}.{n}" for n in names]
            deps.update(c for c in candidates if c in modules and c != me and not c.endswith("__init__"))
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [node, nxt] if nxt in path else path + [node, nxt]
            if nxt not in state:
                found = visit(nxt, path + [node])
                if found:
                    return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [])
            if found:
                return found
    return None


@pytest.mark.parametrize("room", ["engine", "speech"])
def test_files_inside_a_room_form_no_circle(room: str) -> None:
    """``engine.model`` imports nothing that imports it back (conveniences such as
    ``model.embed`` and ``ctx.snapshot`` are attached by ``engine.conveniences``)."""
    assert _cycle(_file_graph(room)) is None


def test_the_file_circle_check_sees_a_circle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) is not None
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
