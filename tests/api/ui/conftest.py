"""The browser page at ``/ui`` against the real server: ``pie-media serve`` on 127.0.0.1
with an API key, the tiny Qwen3-VL and the tiny CSM (one server for the session, started
with ``tests/api/http``'s helpers), driven by Playwright in a real headless Chromium
(Debian's ``chromium``; Playwright's own browser download is never used)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.api.http.conftest import Server, start_server, stop_server

KEY = "sk-ui-test"
UPLOAD_LIMIT = 1_000_000  # bytes: a larger sample shows the server's 413 message
DESKTOP = {"width": 1280, "height": 860}
PHONE = {"width": 390, "height": 844}
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
NO_BROWSER = (
    "no Chromium for the browser tests: install Debian's package (`apt-get install -y chromium`; "
    ".ci/run does) and `pip install playwright` (the dev extra), or point PIE_MEDIA_CHROMIUM at a "
    "Chromium binary"
)


@dataclass
class UiServer:
    server: Server
    key: str

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@pytest.fixture(scope="session")
def ui_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UiServer]:
    tmp = tmp_path_factory.mktemp("ui-serve")
    keys = tmp / "keys.txt"
    keys.write_text(KEY + "\n")
    server = start_server(
        tmp,
        "--api-key-file",
        str(keys),
        models=("tiny", "tiny-csm"),
        env={"PIE_MEDIA_MAX_UPLOAD_BYTES": str(UPLOAD_LIMIT)},
    )
    yield UiServer(server, KEY)
    stop_server(server)


def chromium_path() -> str | None:
    path = (
        os.environ.get("PIE_MEDIA_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    )
    return path if path and Path(path).exists() else None


@pytest.fixture(scope="module")
def browser():
    """One Chromium per module. Not per session: Playwright's sync API keeps an asyncio
    loop running on the main thread until it stops, and every later ``asyncio.run`` in the
    same pytest process (the engine tests) would fail with "cannot be called from a
    running event loop"."""
    path = chromium_path()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip(NO_BROWSER)
    if path is None:
        pytest.skip(NO_BROWSER)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(scope="session")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the panels' screenshots go: $PIE_MEDIA_SCREENSHOTS (e.g. docs/screenshots) or a tmp dir."""
    target = os.environ.get("PIE_MEDIA_SCREENSHOTS")
    path = Path(target) if target else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


def open_page(browser, ui: UiServer, key: str | None):
    """A fresh tab on /ui (its own sessionStorage), with ``key`` typed in when given."""
    context = browser.new_context(viewport=DESKTOP)
    page = context.new_page()
    page.set_default_timeout(60_000)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.errors = errors
    page.goto(f"{ui.url}/ui")
    if key is not None:
        page.fill("#key-input", key)
        page.click("#key-save")
        page.wait_for_selector("#status:text('connected')")
    return page


@pytest.fixture(scope="module")
def page(browser, ui_server: UiServer):
    p = open_page(browser, ui_server, ui_server.key)
    yield p
    assert p.errors == [], p.errors  # no uncaught script error in any panel
    p.context.close()


@pytest.fixture
def shot(screenshots: Path):
    """shot(page, name): the page at desktop width and at a phone's width (390 px)."""

    def take(page, name: str) -> None:
        page.screenshot(path=screenshots / f"{name}-desktop.png")
        page.set_viewport_size(PHONE)
        try:
            page.screenshot(path=screenshots / f"{name}-phone.png", full_page=True)
        finally:
            page.set_viewport_size(DESKTOP)

    return take
