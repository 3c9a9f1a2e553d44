"""Pie's own example inferlets through Pie's own client: a real ``pie-media serve`` app with
the tiny model on 127.0.0.1, the real ``pie-client`` 0.4.0 installing programs (each with
its Pie.toml) and launching them with JSON input checked against ``[parameters]``;
mcp-example-py calls a stdio MCP server the client runs; a child launched with
``runtime.launch`` stays in its parent's tenant. Skipped without the reference folder."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.api.http.test_pie_protocol_relay import MCP_SERVER, App, start_app, stop_app
from tests.inferlets.pie_examples import EXAMPLES, NAMES, write_bundle

pie_client = pytest.importorskip("pie_client")
from pie_client import PieClient  # noqa: E402

from tests.api.http.pie_events import recv_all  # noqa: E402

pytestmark = pytest.mark.skipif(
    not all((EXAMPLES / n / "main.py").is_file() for n in NAMES),
    reason=f"Pie 0.4.0's examples are not at {EXAMPLES} (set PIE_REFERENCE to the reference folder)",
)
T = 120
BUNDLE = "pie-examples@0.4.0"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The examples bundle and py-concurrency-test alone (both cached by content)."""
    from fixtures.paths import cache_root
    from inferlets.build import build_pie_component

    bundle_dir = write_bundle(tmp_path_factory.mktemp("pie-ex") / "pie-examples")
    return {
        "bundle": build_pie_component(bundle_dir, cache_root() / "pie-build"),
        "bundle_toml": bundle_dir / "Pie.toml",
        "alone": build_pie_component(EXAMPLES / "py-concurrency-test", cache_root() / "pie-build"),
        "alone_toml": EXAMPLES / "py-concurrency-test" / "Pie.toml",
    }


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, built: dict[str, Path]) -> Iterator[App]:
    a = start_app(tmp_path_factory.mktemp("pie-examples-srv"), models=["tiny"])

    async def install() -> None:
        async with PieClient(a.ws) as c:
            await c.authenticate("tester")
            await c.install_program(built["bundle"], built["bundle_toml"])
            await c.install_program(built["alone"], built["alone_toml"])

    asyncio.run(asyncio.wait_for(install(), T))
    yield a
    stop_app(a)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 300))


def test_examples_run_through_the_client(srv: App) -> None:
    async def go() -> None:
        async with PieClient(srv.ws) as c:
            await c.authenticate("tester")
            conc = await c.launch_process("py-concurrency-test@0.1.0", {})
            cache = await c.launch_process(BUNDLE, {"__example__": "modular-cache-python", "max_tokens": 6})
            hier = await c.launch_process(
                BUNDLE, {"__example__": "hierarchical-attention-python", "max_tokens": 4}
            )
            got = await asyncio.gather(recv_all(conc, T), recv_all(cache, T), recv_all(hier, T))
        conc_ev, cache_ev, hier_ev = got
        assert conc_ev[-1] == ("return", "done")
        assert ("message", "[test] verdict: CONCURRENT") in conc_ev
        assert cache_ev[-1][0] == "return" and any("cache_" in str(v) for k, v in cache_ev if k == "stdout")
        assert hier_ev[-1][0] == "return"

    run(go())


def test_typed_parameters_refuse_a_wrong_type(srv: App, built: dict[str, Path], tmp_path: Path) -> None:
    toml = tmp_path / "Pie.toml"
    toml.write_text(
        (EXAMPLES / "python-example" / "Pie.toml").read_text().replace("python-example", "typed-example")
    )

    async def go() -> None:
        async with PieClient(srv.ws) as c:
            await c.authenticate("tester")
            await c.install_program(built["alone"], toml)
            with pytest.raises(Exception, match="prompt"):
                await c.launch_process("typed-example@0.1.0", {"prompt": 3})
            with pytest.raises(Exception, match="prompt"):
                await c.launch_process("typed-example@0.1.0", {})
            p = await c.launch_process("typed-example@0.1.0", {"prompt": "hi", "max_tokens": 4})
            assert (await recv_all(p, T))[-1] == ("return", "done")

    run(go())


def test_mcp_example_calls_the_clients_stdio_server(srv: App, tmp_path: Path) -> None:
    script = tmp_path / "mcp_server.py"
    script.write_text(
        MCP_SERVER.replace(
            'if p["name"] == "add":',
            'if p["name"] == "echo":\n'
            '            return {"content": [{"type": "text", "text": "echo: " + p["arguments"]["text"]}]}\n'
            '        if p["name"] == "add":',
        )
    )

    async def go() -> list[tuple[str, Any]]:
        async with PieClient(srv.ws) as c:
            await c.authenticate("tester")
            await c.register_mcp_server("demo", "stdio", sys.executable, [str(script)])
            p = await c.launch_process(BUNDLE, {"__example__": "mcp-example-py", "text": "hi there"})
            return await recv_all(p, T)

    ev = run(go())
    assert ev[-1][0] == "return", ev
    out = json.loads(ev[-1][1])
    assert out["servers"] == ["demo"] and out["result"] == "echo: hi there"
    assert [t["name"] for t in json.loads(out["tools_json"])["tools"]] == ["add", "slow"]


PARENT = """
import json

from inferlet._async import await_future
from wit_world.imports import runtime as _rt


async def main(input: dict) -> str:
    child = _rt.launch(input["program"], json.dumps(input.get("input", {})))
    pid = child.pid()
    result = await await_future(child, "the child did not finish")
    return json.dumps({"pid": pid, "ok": type(result).__name__ == "Ok", "value": result.value})
"""


def test_a_child_runs_in_its_parents_tenant(srv: App, tmp_path: Path) -> None:
    """Pie's runtime.launch: the child is a program installed for the parent's tenant, its
    result comes back to the parent, and it is a run of that tenant in the run table."""
    from fixtures.paths import cache_root
    from inferlets.build import build_pie_component

    project = tmp_path / "parent"
    project.mkdir()
    (project / "Pie.toml").write_text('[package]\nname = "parent"\nversion = "0.1.0"\n')
    (project / "main.py").write_text(PARENT)
    wasm = build_pie_component(project, cache_root() / "pie-build")

    async def go() -> list[tuple[str, Any]]:
        async with PieClient(srv.ws) as c:
            await c.authenticate("tester")
            await c.install_program(wasm, project / "Pie.toml")
            p = await c.launch_process("parent@0.1.0", {"program": "py-concurrency-test@0.1.0"})
            ok = await recv_all(p, T)
            q = await c.launch_process("parent@0.1.0", {"program": "nope@9.9.9"})
            return ok + [("second", await recv_all(q, T))]

    ev = run(go())
    second = ev.pop()[1]
    assert ev[-1][0] == "return", ev
    out = json.loads(ev[-1][1])
    assert out["ok"] and out["value"] == "done"
    child = srv.rec(out["pid"])
    parent_tenant = next(r.tenant for r in srv.service.inferlet_runs.list(scope=None) if r.id != out["pid"])
    assert child is not None and child.tenant == parent_tenant and child.status == "succeeded"
    assert second[-1][0] == "error" and "not installed" in str(second[-1][1])
