"""/ui's Inferlets panel and Pie programs, in a real headless Chromium against the real app
(uvicorn on 127.0.0.1 in this process, the tiny model, an API key): install Pie 0.4.0's
py-concurrency-test from its component and Pie.toml chosen in the page, the same component
under python-example's typed ``[parameters]`` (the form shows each with its type), a
launch whose events stream into the page up to its return value, and pie-media's echo
example running until Stop cancels it, with a file it sends offered as a download.
Skipped without Chromium (as the other /ui tests) or without Pie's reference folder."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.api.ui.conftest import DESKTOP, PHONE, open_page

REFERENCE = Path("/work/shared/reference/pie-0.4.0/examples")
CONCURRENCY = REFERENCE / "py-concurrency-test"
TYPED_TOML = REFERENCE / "python-example" / "Pie.toml"
EXAMPLES = Path(__file__).resolve().parents[3] / "inferlets" / "examples"
KEY = "sk-ui-inferlets-panel"
ECHO_TOML = (
    '[package]\nname = "examples"\nversion = "0.1.0"\ndescription = "pie-media\'s example inferlets"\n'
)
WAIT_MS = 120_000

pytestmark = pytest.mark.skipif(
    not (CONCURRENCY / "main.py").is_file() or not TYPED_TOML.is_file(),
    reason=f"Pie 0.4.0's examples are not at {REFERENCE}",
)


@dataclass
class Ui:
    url: str
    app: object

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {KEY}"}

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=120)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The components and manifests the page installs (builds cached by content)."""
    from fixtures.paths import cache_root
    from inferlets import build_component
    from inferlets.build import build_pie_component

    tmp = tmp_path_factory.mktemp("panel-files")
    typed = tmp / "typed" / "Pie.toml"
    typed.parent.mkdir()
    typed.write_text(TYPED_TOML.read_text().replace('name = "python-example"', 'name = "typed-example"'))
    echo = tmp / "echo" / "Pie.toml"
    echo.parent.mkdir()
    echo.write_text(ECHO_TOML)
    return {
        "pie_wasm": build_pie_component(CONCURRENCY, cache_root() / "pie-build"),
        "pie_toml": CONCURRENCY / "Pie.toml",
        "typed_toml": typed,
        "echo_wasm": build_component(EXAMPLES, cache_root() / "inferlets-build"),
        "echo_toml": echo,
    }


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ui]:
    from tests.api.http.test_pie_protocol_relay import start_app, stop_app

    tmp = tmp_path_factory.mktemp("ui-inferlets")
    keys = tmp / "keys.toml"
    keys.write_text(f'[[keys]]\nname = "panel"\nkey = "{KEY}"\n')
    a = start_app(tmp, models=["tiny"], api_key_file=keys)
    yield Ui(a.url, a)
    stop_app(a)


@pytest.fixture(scope="module")
def page(browser, srv: Ui) -> Iterator:
    p = open_page(browser, srv, KEY)
    p.set_default_timeout(WAIT_MS)
    p.click("#tab-inferlets")
    yield p
    assert p.errors == [], p.errors  # no uncaught script error
    p.context.close()


def ensure(srv: Ui, wasm: Path, toml: Path) -> None:
    """Installed for the key (over HTTP; the same bytes twice change nothing)."""
    with srv.http() as c:
        r = c.post(
            "/v1/pie/programs",
            files=[("file", (wasm.name, wasm.read_bytes()))],
            data={"manifest": toml.read_text()},
        )
        assert r.status_code == 200, r.text


def install_in_page(page, wasm: Path, toml: Path) -> None:
    if not page.is_visible("#pie-install-go"):
        page.click("#pie-install summary")
    page.set_input_files("#pie-install-wasm", str(wasm))
    page.set_input_files("#pie-install-toml", str(toml))
    page.click("#pie-install-go")


def open_program(page, ref: str) -> None:
    page.get_by_role("button", name=f"open {ref}").click()
    page.wait_for_selector(f"#pie-launch-form[data-ref='{ref}']")


def run_of(srv: Ui, run_id: str) -> dict:
    with srv.http() as c:
        runs = {r["id"]: r for r in c.get("/v1/inferlets/runs").json()["data"]}
    return runs[run_id]


def test_install_from_files_lists_the_program(page, srv: Ui, files: dict[str, Path], shot) -> None:
    page.wait_for_selector("#pie-programs-empty:not([hidden])")  # the panel says why it is empty
    assert "No programs installed" in page.inner_text("#pie-programs-empty")

    install_in_page(page, files["pie_wasm"], files["pie_toml"])
    item = page.locator("#pie-programs li[data-ref='py-concurrency-test@0.1.0']")
    item.wait_for()
    assert "Concurrency test for Python inferlet" in item.inner_text()
    assert "installed py-concurrency-test@0.1.0" in page.inner_text("#pie-install-state")
    assert page.is_hidden("#pie-programs-empty")
    # the form of the program just installed is open: it declares no parameters, so JSON
    page.wait_for_selector("#pie-launch-form[data-ref='py-concurrency-test@0.1.0']")
    assert page.input_value("#pie-input-json") == "{}"

    install_in_page(page, files["pie_wasm"], files["typed_toml"])  # the same bytes, typed
    page.locator("#pie-programs li[data-ref='typed-example@0.1.0']").wait_for()
    install_in_page(page, files["pie_wasm"], files["pie_toml"])  # again: nothing changes
    page.wait_for_selector("#pie-install-state:has-text('installed already')")
    assert page.locator("#pie-programs li").count() == 2

    # a file that is not a component: the server's reason, nothing listed
    bad = files["typed_toml"].parent / "junk.wasm"
    bad.write_bytes(b"\0asm not really")
    junk_toml = files["typed_toml"].parent / "junk.toml"
    junk_toml.write_text('[package]\nname = "junk"\nversion = "1.0"\n')
    install_in_page(page, bad, junk_toml)
    page.wait_for_selector("#pie-error:not([hidden])")
    assert page.inner_text("#pie-error").startswith("400:")
    assert page.locator("#pie-programs li").count() == 2
    with srv.http() as c:
        listed = {p["id"] for p in c.get("/v1/pie/programs").json()["data"]}
    assert listed == {"py-concurrency-test@0.1.0", "typed-example@0.1.0"}
    shot(page, "inferlets-programs")


def test_the_form_shows_the_parameters_and_a_launch_streams_to_its_return(
    page, srv: Ui, files: dict[str, Path]
) -> None:
    ensure(srv, files["pie_wasm"], files["typed_toml"])
    page.click("#pie-refresh")
    open_program(page, "typed-example@0.1.0")
    params = page.locator("#pie-params .param")
    shown = params.evaluate_all(
        "(ps) => ps.map((p) => [p.dataset.param, p.dataset.type, p.dataset.optional,"
        " p.querySelector('input,select,textarea').type, p.querySelector('input,select,textarea').step || '',"
        " p.querySelector('.type').textContent])"
    )
    assert shown == [
        ["prompt", "string", "false", "text", "", "string, required"],
        ["system", "string", "true", "text", "", "string, optional"],
        ["max_tokens", "int", "true", "number", "1", "int, optional"],
        ["temperature", "float", "true", "number", "any", "float, optional"],
        ["top_p", "float", "true", "number", "any", "float, optional"],
    ], shown
    assert "The user message to complete" in page.inner_text("[data-param='prompt']")
    assert page.locator("#pie-params").get_by_label("prompt").count() == 1  # each field has its label

    # a required field left out: the server's reason, nothing launched
    page.fill("#pie-param-max_tokens", "4")
    page.click("#pie-launch")
    page.wait_for_selector("#pie-error:not([hidden])")
    assert "prompt" in page.inner_text("#pie-error") and page.inner_text("#pie-error").startswith("400:")

    page.fill("#pie-param-prompt", "hi")
    page.click("#pie-launch")
    page.wait_for_selector("#pie-events[data-state='succeeded']")
    assert page.is_hidden("#pie-error")
    run_id = page.get_attribute("#pie-events", "data-run")
    kinds = page.locator("#pie-events li").evaluate_all("(ls) => ls.map((l) => l.dataset.kind)")
    assert kinds[-1] == "return" and set(kinds[:-1]) == {"message"}, kinds
    assert page.inner_text("#pie-events li.return .text") == "done"
    messages = page.locator("#pie-events li.message .text").all_inner_texts()
    run = run_of(srv, run_id)
    assert messages == run["sends"] and "[test] verdict: CONCURRENT" in messages
    assert run["args"] == ['{"prompt": "hi", "max_tokens": 4}'] and run["origin"] == "pie"
    row = page.locator(f"#pie-runs tr[data-run='{run_id}']")
    row.wait_for()
    assert "typed-example@0.1.0" in row.inner_text()
    page.wait_for_selector(f"#pie-runs tr[data-run='{run_id}'][data-status='succeeded']")
    assert row.get_by_role("button", name=f"stop {run_id}").count() == 0


def test_stop_cancels_a_running_process_and_files_download(
    page, srv: Ui, files: dict[str, Path], shot
) -> None:
    ensure(srv, files["echo_wasm"], files["echo_toml"])
    page.click("#pie-refresh")
    open_program(page, "examples@0.1.0")
    page.fill("#pie-input-json", '["echo", "hello", "world"]')
    page.click("#pie-launch")
    # live: the messages and the output are in the page while the process still runs
    page.locator("#pie-events li.message", has_text="world").wait_for()
    page.locator("#pie-events li.stdout", has_text="out: hello world").wait_for()
    page.locator("#pie-events li.stderr", has_text="err: hello world").wait_for()
    assert page.get_attribute("#pie-events", "data-state") == "running"
    run_id = page.get_attribute("#pie-events", "data-run")
    assert run_of(srv, run_id)["status"] == "running"

    # a file the process sends (Pie's session.send-file, handed to the run as the host does)
    app = srv.app
    rec = app.call(app.service.inferlet_runs.get, run_id)
    app.call(app.service.inferlet_runs.deliver_file, rec, b"a file from the process\n")
    link = page.locator("#pie-events li.file a")
    link.wait_for()
    with page.expect_download() as download:
        link.click()
    assert Path(download.value.path()).read_bytes() == b"a file from the process\n"
    assert download.value.suggested_filename == f"{run_id}-file-1.bin"

    stop = page.get_by_role("button", name=f"stop {run_id}")
    stop.wait_for()
    shot(page, "inferlets-running")
    page.set_viewport_size(PHONE)
    try:
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= PHONE["width"], width  # the panel, full, fits a phone
    finally:
        page.set_viewport_size(DESKTOP)
    stop.click()
    page.wait_for_selector("#pie-events[data-state='cancelled']")
    assert page.inner_text("#pie-events li.error .text") == "stopped (Signal)"
    page.wait_for_selector(f"#pie-runs tr[data-run='{run_id}'][data-status='cancelled']")
    assert stop.count() == 0
    assert run_of(srv, run_id)["status"] == "cancelled"


def test_show_attaches_to_a_process_launched_elsewhere(page, srv: Ui, files: dict[str, Path]) -> None:
    """A process launched by another client (here over HTTP) is listed; Show attaches to it
    (what it sent so far, then what comes), and its Stop works the same."""
    ensure(srv, files["echo_wasm"], files["echo_toml"])
    with srv.http() as c:
        run = c.post("/v1/pie/programs/examples@0.1.0/launch", json={"input": ["echo", "elsewhere"]}).json()
    page.click("#tab-chat")
    page.click("#tab-inferlets")  # the tab refreshes the processes
    page.get_by_role("button", name=f"show {run['id']}").click()
    page.locator("#pie-events li.message", has_text="elsewhere").wait_for()
    deadline = time.monotonic() + 10
    while run_of(srv, run["id"])["status"] != "running":
        assert time.monotonic() < deadline
    page.get_by_role("button", name=f"stop {run['id']}").click()
    page.wait_for_selector(f"#pie-events[data-run='{run['id']}'][data-state='cancelled']")
