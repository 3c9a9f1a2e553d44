"""Pie 0.4.0's seven Python example inferlets (../shared/reference/pie-0.4.0/examples), built
for the tests as one component: each example's own ``main.py``, unchanged, as a module of
its own (``ex_<name>``), behind a dispatching ``main`` that picks one by the input's
``__example__`` key. One stock componentize-py build and one wasmtime compile (~20 s)
instead of seven; ``test_pie_examples.py::test_a_project_builds_alone`` builds one example
exactly as a user would (its own Pie.toml, ``pie-media inferlet build``)."""

from __future__ import annotations

import os
from pathlib import Path

REFERENCE = Path(
    os.environ.get(
        "PIE_REFERENCE", Path(__file__).resolve().parents[3] / "shared" / "reference" / "pie-0.4.0"
    )
)
EXAMPLES = REFERENCE / "examples"
NAMES = (
    "python-example",
    "python-constrained-decoding",
    "hierarchical-attention-python",
    "mcts-python",
    "modular-cache-python",
    "py-concurrency-test",
    "mcp-example-py",
)

DISPATCH = '''"""Runs one of Pie's example inferlets, unchanged, by the input's __example__ key."""
{imports}

MAINS = {{{table}}}


async def main(input: dict):
    input = dict(input)
    name = input.pop("__example__")
    return await MAINS[name](input)
'''


def module_name(example: str) -> str:
    return "ex_" + example.replace("-", "_")


def write_bundle(dest: Path) -> Path:
    """The bundle project (Pie.toml, main.py, the seven examples' main.py as modules) in
    ``dest`` (rewritten byte-identically each time, so the build cache keys stay)."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "Pie.toml").write_text(
        '[package]\nname = "pie-examples"\nversion = "0.4.0"\ndescription = "Pie 0.4.0 examples"\n'
    )
    imports, table = [], []
    for name in NAMES:
        mod = module_name(name)
        (dest / f"{mod}.py").write_bytes((EXAMPLES / name / "main.py").read_bytes())
        imports.append(f"from {mod} import main as {mod}")
        table.append(f"{name!r}: {mod}")
    (dest / "main.py").write_text(DISPATCH.format(imports="\n".join(imports), table=", ".join(table)))
    return dest
