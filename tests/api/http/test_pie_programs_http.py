"""``/v1/pie/programs`` (api/http/routes/pie_programs.py) against a real ``pie-media serve``
on 127.0.0.1 with the tiny model and two keys: install Pie 0.4.0's py-concurrency-test
from its component and Pie.toml, list it with its manifest facts, the same component under
python-example's typed ``[parameters]``, a launch whose input does not fit them (400
naming the field), a launch that runs to its return with its events streamed, and a
second tenant that sees none of it. Skipped without the reference folder."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.http.conftest import Server, start_server, stop_server

REFERENCE = Path("/work/shared/reference/pie-0.4.0/examples")
CONCURRENCY = REFERENCE / "py-concurrency-test"
TYPED_TOML = REFERENCE / "python-example" / "Pie.toml"
ALICE, BOB = "sk-alice-pie-programs", "sk-bob-pie-programs"
T = 180

pytestmark = pytest.mark.skipif(
    not (CONCURRENCY / "main.py").is_file() or not TYPED_TOML.is_file(),
    reason=f"Pie 0.4.0's examples are not at {REFERENCE}",
)


@pytest.fixture(scope="module")
def wasm() -> Path:
    from fixtures.paths import cache_root
    from inferlets.build import build_pie_component

    return build_pie_component(CONCURRENCY, cache_root() / "pie-build")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("pie-programs-http")
    keys = tmp / "keys.toml"
    keys.write_text(f'[[keys]]\nname = "alice"\nkey = "{ALICE}"\n\n[[keys]]\nname = "bob"\nkey = "{BOB}"\n')
    s = start_server(tmp, "--api-key-file", str(keys), models=("tiny",))
    yield s
    stop_server(s)


def client(server: Server, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=T)


@pytest.fixture(scope="module")
def alice(server: Server) -> Iterator[httpx.Client]:
    with client(server, ALICE) as c:
        yield c


@pytest.fixture(scope="module")
def bob(server: Server) -> Iterator[httpx.Client]:
    with client(server, BOB) as c:
        yield c


def typed_toml() -> str:
    return TYPED_TOML.read_text().replace('name = "python-example"', 'name = "typed-example"')


def install(
    c: httpx.Client, wasm: Path, manifest: str, *, as_file: bool = False, **fields: str
) -> httpx.Response:
    files: list[tuple[str, Any]] = [("file", ("program.wasm", wasm.read_bytes(), "application/wasm"))]
    data = dict(fields)
    if as_file:
        files.append(("file", ("Pie.toml", manifest.encode(), "application/toml")))
    else:
        data["manifest"] = manifest
    return c.post("/v1/pie/programs", files=files, data=data)


@pytest.fixture(scope="module")
def installed(alice: httpx.Client, wasm: Path) -> dict[str, Any]:
    """Alice's two programs: py-concurrency-test (manifest as a field), typed-example (as a file)."""
    assert alice.get("/v1/pie/programs").json()["data"] == []  # nothing before
    r = install(alice, wasm, (CONCURRENCY / "Pie.toml").read_text())
    assert r.status_code == 200, r.text
    typed = install(alice, wasm, typed_toml(), as_file=True)
    assert typed.status_code == 200, typed.text
    return {"concurrency": r.json(), "typed": typed.json()}


def events(c: httpx.Client, run_id: str) -> list[tuple[str, dict[str, Any]]]:
    """Every SSE event of the run until its return or error."""
    out: list[tuple[str, dict[str, Any]]] = []
    with c.stream("GET", f"/v1/pie/runs/{run_id}/events") as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        event = None
        for line in r.iter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                out.append((event or "message", json.loads(line[5:])))
    return out


def test_install_lists_the_program_with_its_manifest(alice: httpx.Client, installed, wasm: Path) -> None:
    conc = installed["concurrency"]
    assert conc["id"] == "py-concurrency-test@0.1.0" and conc["object"] == "pie.program"
    assert conc["installed"] is True and conc["description"] == "Concurrency test for Python inferlet"
    assert conc["parameters"] == [] and conc["inferlet_id"].startswith("inferlet-")

    again = install(alice, wasm, (CONCURRENCY / "Pie.toml").read_text())
    assert again.status_code == 200 and again.json()["installed"] is False  # same bytes: kept
    assert "already" in again.json()["message"]

    listed = {p["id"]: p for p in alice.get("/v1/pie/programs").json()["data"]}
    assert set(listed) == {"py-concurrency-test@0.1.0", "typed-example@0.1.0"}
    typed = listed["typed-example@0.1.0"]
    assert typed["description"] == "Simple text completion example in Python"
    assert [(p["name"], p["type"], p["optional"]) for p in typed["parameters"]] == [
        ("prompt", "string", False),
        ("system", "string", True),
        ("max_tokens", "int", True),
        ("temperature", "float", True),
        ("top_p", "float", True),
    ]
    assert typed["parameters"][0]["description"] == "The user message to complete"
    # both share the one stored component, which /v1/inferlets lists too
    assert typed["inferlet_id"] == conc["inferlet_id"]
    assert conc["inferlet_id"] in {i["id"] for i in alice.get("/v1/inferlets").json()["data"]}


def test_install_refuses_what_is_not_a_program(alice: httpx.Client, wasm: Path) -> None:
    bad_toml = install(alice, wasm, "this is [not toml")
    assert bad_toml.status_code == 400 and "TOML" in bad_toml.json()["error"]["message"]
    no_manifest = alice.post("/v1/pie/programs", files=[("file", ("p.wasm", wasm.read_bytes()))])
    assert no_manifest.status_code == 400 and "manifest" in no_manifest.json()["error"]["message"]
    junk = install(alice, Path(__file__), '[package]\nname = "junk"\nversion = "1.0"\n')
    assert junk.status_code == 400, junk.text
    assert "junk@1.0" not in {p["id"] for p in alice.get("/v1/pie/programs").json()["data"]}
    other = install(alice, Path(__file__), (CONCURRENCY / "Pie.toml").read_text())  # other bytes
    assert other.status_code == 400 and "force_overwrite" in other.json()["error"]["message"]


def test_launch_checks_the_input_against_the_parameters(alice: httpx.Client, installed) -> None:
    url = "/v1/pie/programs/typed-example@0.1.0/launch"
    runs_before = len(alice.get("/v1/inferlets/runs").json()["data"])
    wrong = alice.post(url, json={"input": {"prompt": 3}})
    assert wrong.status_code == 400, wrong.text
    assert "prompt" in wrong.json()["error"]["message"] and wrong.json()["error"]["code"]
    missing = alice.post(url, json={"input": {}})
    assert missing.status_code == 400 and "prompt" in missing.json()["error"]["message"]
    not_json = alice.post(url, json={"input": "{not json"})
    assert not_json.status_code == 400 and "JSON" in not_json.json()["error"]["message"]
    assert alice.post("/v1/pie/programs/nothing@1.0/launch", json={}).status_code == 404
    assert alice.post("/v1/pie/programs/no-version/launch", json={}).status_code == 400
    assert len(alice.get("/v1/inferlets/runs").json()["data"]) == runs_before  # nothing was started


def test_launch_streams_messages_and_the_return(alice: httpx.Client, installed) -> None:
    r = alice.post(
        "/v1/pie/programs/typed-example@0.1.0/launch", json={"input": {"prompt": "hi", "max_tokens": 4}}
    )
    assert r.status_code == 200, r.text
    run = r.json()
    assert run["object"] == "inferlet.run" and run["origin"] == "pie"
    assert run["inferlet_id"] == installed["typed"]["inferlet_id"]
    assert json.loads(run["args"][0]) == {"prompt": "hi", "max_tokens": 4}  # the input JSON itself
    got = events(alice, run["id"])
    kinds = [k for k, _ in got]
    assert kinds[0] == "run" and kinds[-1] == "return", kinds
    assert got[-1][1]["result"] == "done"
    messages = [d["text"] for k, d in got if k == "message"]
    assert messages[0] == "[test] starting asyncio.gather" and "[test] verdict: CONCURRENT" in messages
    # listed with HTTP's runs; a second look at the finished run gives the same messages and end
    listed = {x["id"]: x for x in alice.get("/v1/inferlets/runs").json()["data"]}
    assert listed[run["id"]]["status"] == "succeeded" and listed[run["id"]]["sends"] == messages
    again = events(alice, run["id"])
    assert [d["text"] for k, d in again if k == "message"] == messages and again[-1][0] == "return"


def test_cancel_through_the_run_routes_ends_the_stream(alice: httpx.Client, installed) -> None:
    run = alice.post("/v1/pie/programs/py-concurrency-test@0.1.0/launch", json={}).json()
    cancelled = alice.post(f"/v1/inferlets/{run['inferlet_id']}/runs/{run['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] in ("cancelled", "succeeded")
    got = events(alice, run["id"])
    if cancelled.json()["status"] == "cancelled":
        assert got[-1] == (
            "error",
            {"message": "Signal", "status": "cancelled", "error": got[-1][1]["error"]},
        )


def test_another_tenant_sees_nothing(alice: httpx.Client, bob: httpx.Client, installed) -> None:
    run = alice.post("/v1/pie/programs/py-concurrency-test@0.1.0/launch", json={}).json()
    try:
        assert bob.get("/v1/pie/programs").json()["data"] == []
        assert bob.post("/v1/pie/programs/py-concurrency-test@0.1.0/launch", json={}).status_code == 404
        assert bob.get(f"/v1/pie/runs/{run['id']}/events").status_code == 404
        assert run["id"] not in {x["id"] for x in bob.get("/v1/inferlets/runs").json()["data"]}
        assert bob.post(f"/v1/inferlets/{run['inferlet_id']}/runs/{run['id']}/cancel").status_code == 404
    finally:
        alice.post(f"/v1/inferlets/{run['inferlet_id']}/runs/{run['id']}/cancel")
    assert httpx.get(str(alice.base_url.join("/v1/pie/programs"))).status_code == 401


def test_one_program_index_and_one_process_model_with_pie_client(
    server: Server, alice: httpx.Client, installed
) -> None:
    """What is installed over HTTP is what ``pie-client`` sees and launches; a process it
    launches is shown by the events route, one launched here is one it attaches to."""
    import asyncio

    pie_client = pytest.importorskip("pie_client")

    async def go() -> tuple[str, list[tuple[str, object]]]:
        async with pie_client.PieClient(server.url.replace("http://", "ws://")) as c:
            await c.auth_by_token(ALICE)
            assert await c.check_program("typed-example@0.1.0")
            p = await c.launch_process("py-concurrency-test@0.1.0", {}, capture_outputs=False)
            here = alice.post(
                "/v1/pie/programs/typed-example@0.1.0/launch",
                json={"input": {"prompt": "hi", "max_tokens": 2}},
            ).json()
            attached = await c.attach_process(here["id"])
            seen = []
            while True:
                ev, value = await asyncio.wait_for(attached.recv(), T)
                seen.append((ev.value, value))
                if ev.value in ("return", "error"):
                    return p.process_id, seen

    theirs, seen = asyncio.run(asyncio.wait_for(go(), T))
    assert seen[-1] == ("return", "done") and ("message", "[test] verdict: CONCURRENT") in seen
    got = events(alice, theirs)
    assert got[-1][0] == "return" and got[-1][1]["result"] == "done"


def test_delete_forgets_a_program_for_its_tenant_only(
    alice: httpx.Client, bob: httpx.Client, wasm: Path
) -> None:
    toml = (
        (CONCURRENCY / "Pie.toml").read_text().replace('name = "py-concurrency-test"', 'name = "short-lived"')
    )
    assert install(alice, wasm, toml).status_code == 200
    assert install(bob, wasm, toml).status_code == 200
    gone = alice.delete("/v1/pie/programs/short-lived@0.1.0")
    assert gone.status_code == 200 and gone.json() == {
        "id": "short-lived@0.1.0",
        "object": "pie.program",
        "deleted": True,
    }
    assert "short-lived@0.1.0" not in {p["id"] for p in alice.get("/v1/pie/programs").json()["data"]}
    assert alice.post("/v1/pie/programs/short-lived@0.1.0/launch", json={}).status_code == 404
    assert alice.delete("/v1/pie/programs/short-lived@0.1.0").status_code == 404  # once
    assert alice.delete("/v1/pie/programs/not a ref").status_code == 400
    assert "short-lived@0.1.0" in {p["id"] for p in bob.get("/v1/pie/programs").json()["data"]}  # bob's stays
    assert bob.delete("/v1/pie/programs/short-lived@0.1.0").status_code == 200
