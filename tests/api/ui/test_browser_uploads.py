"""/ui's chat when Send comes before an attachment's upload has finished, in a real headless
Chromium against the real server (tiny models): the upload request is held by a Playwright
route (not answered for it: the server's own answer comes once the test lets the request
go on), Send is pressed at once, and the question must leave with its image or not at all.
A failed upload stays listed, marked failed, and Send does not go without it. Also the
Server panel's window: the last 5 minutes once the server has run that long."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path

import httpx
import pytest

from tests.api.ui.conftest import UPLOAD_LIMIT, UiServer, open_page

QWEN = "tiny-qwen3-vl"
WAIT_MS = 5_000  # every wait in this file is bounded: the tiny model answers 4 tokens in well under that


@pytest.fixture
def page(browser, ui_server: UiServer) -> Iterator:
    """A fresh tab per test (its own routes and conversation), short answers."""
    p = open_page(browser, ui_server, ui_server.key)
    p.set_default_timeout(WAIT_MS)
    p.click(".sampling summary")
    p.fill("#chat-temperature", "0")
    p.fill("#chat-max-tokens", "4")
    yield p
    assert p.errors == [], p.errors  # no uncaught script error
    p.context.close()


class Held:
    """Uploads (POST /v1/media) held in the network until the test lets each go on: the
    request reaches the server, unchanged, only on ``release``; ``fail`` aborts it instead."""

    def __init__(self, page) -> None:
        self.page = page
        self.routes: list = []
        self.holding = True
        page.route("**/v1/media", self._hold)

    def _hold(self, route) -> None:
        if self.holding and route.request.method == "POST":
            self.routes.append(route)
        else:
            route.continue_()

    def wait(self, n: int = 1) -> None:
        """Until n uploads are held (route handlers run while the test waits on the page)."""
        deadline = time.monotonic() + WAIT_MS / 1000
        while len(self.routes) < n:
            assert time.monotonic() < deadline, f"{len(self.routes)} upload(s) reached the network, not {n}"
            self.page.wait_for_timeout(20)

    def release(self) -> dict:
        """Let the oldest held upload go on to the server; its media object as the server answered."""
        with self.page.expect_response(lambda r: r.url.endswith("/v1/media")) as answer:
            self.routes.pop(0).continue_()
        assert answer.value.ok, answer.value.text()
        return answer.value.json()["data"][0]["media"]

    def fail(self) -> None:
        """The oldest held upload dies in the network (a dropped connection)."""
        self.routes.pop(0).abort("connectionreset")


def chat_requests(page) -> list:
    """Every POST /v1/chat/completions the page makes from now on (as it left the browser)."""
    seen: list = []
    page.on("request", lambda r: seen.append(r) if r.url.endswith("/v1/chat/completions") else None)
    return seen


def image_parts(request) -> list[str]:
    """The pie-media:// URLs of the last user message's image parts in a chat request body."""
    last = request.post_data_json["messages"][-1]
    content = last["content"] if isinstance(last["content"], list) else []
    return [p["image_url"]["url"] for p in content if p["type"] == "image_url"]


def answered(page, n: int = 0) -> None:
    page.locator(".msg.assistant").nth(n).and_(page.locator("[data-done='done']")).wait_for()


def test_send_during_a_slow_upload_waits_and_sends_the_image(page, samples: Path) -> None:
    png = samples / "images" / "rgba.png"
    held = Held(page)
    chats = chat_requests(page)
    page.set_input_files("#chat-files", str(png))
    held.wait()
    page.fill("#chat-input", "What is in this picture?")
    page.click("#chat-send")  # at once: the upload is still in the network
    page.wait_for_timeout(1_500)  # a slow upload
    assert chats == [], "Send did not wait for the upload: the question went out without its image"
    assert page.locator(".msg.user").count() == 0
    assert "uploading" in page.inner_text("#chat-send").lower()
    assert "rgba.png" in page.inner_text("#chat-attachments")
    assert "1 upload" in page.inner_text("#chat-note")  # the page says what it waits for
    media = held.release()
    answered(page)

    assert len(chats) == 1
    assert image_parts(chats[0]) == [f"pie-media://{media['id']}"]
    assert chats[0].post_data_json["messages"][-1]["content"][-1] == {
        "type": "text",
        "text": "What is in this picture?",
    }
    thumbnail = page.locator(".msg.user figure.attached img")
    assert thumbnail.count() == 1 and thumbnail.get_attribute("alt") == png.name
    thumbnail.scroll_into_view_if_needed()
    assert thumbnail.evaluate("(i) => i.complete && i.naturalWidth") == 96  # the photo itself, decoded
    assert page.locator("#chat-attachments li").count() == 0  # sent, so no longer waiting to be
    assert page.inner_text("#chat-send") == "Send" and page.is_hidden("#chat-note")
    assert page.input_value("#chat-input") == ""


def test_a_failed_upload_stays_listed_and_send_never_goes_without_it(page, samples: Path) -> None:
    png = samples / "images" / "rgba.png"
    held = Held(page)
    chats = chat_requests(page)
    page.set_input_files("#chat-files", str(png))
    held.wait()
    page.fill("#chat-input", "Describe it.")
    page.click("#chat-send")  # waits for the upload...
    held.fail()  # ...which dies in the network
    item = page.locator("#chat-attachments li.bad", has_text="rgba.png")
    item.wait_for()
    assert "upload failed" in item.inner_text() and "not sent" in item.inner_text().lower()
    page.wait_for_selector("#chat-error:not([hidden])")
    error = page.inner_text("#chat-error")
    assert (
        "Not sent" in error and "rgba.png" in error and "retry" in error.lower() and "remove" in error.lower()
    )
    assert page.input_value("#chat-input") == "Describe it."  # the question is kept, not half sent
    page.click("#chat-send")  # again: still refused while the failed one is listed
    page.wait_for_timeout(300)
    assert chats == [] and page.locator(".msg.user").count() == 0
    assert page.is_enabled("#chat-send") and page.inner_text("#chat-send") == "Send"

    # retry: this time the upload reaches the server, and the question goes with it
    held.holding = False
    item.get_by_role("button", name="retry rgba.png").click()
    page.wait_for_selector(f"#chat-attachments li:not(.bad):has-text('tokens for {QWEN}')")
    page.click("#chat-send")
    answered(page)
    assert len(chats) == 1 and len(image_parts(chats[0])) == 1
    assert page.locator(".msg.user figure.attached img").count() == 1
    assert page.is_hidden("#chat-error")

    # a file the server refuses (413): listed as failed with the server's message, nothing
    # to retry; Send refuses until it is removed, then the question goes alone (the user's choice)
    big = samples / "images" / "photo_4032x3024.jpg"
    assert big.stat().st_size > UPLOAD_LIMIT
    page.set_input_files("#chat-files", str(big))
    bad = page.locator("#chat-attachments li.bad", has_text=big.name)
    bad.wait_for()
    assert "413" in bad.inner_text() and str(UPLOAD_LIMIT) in bad.inner_text()
    assert bad.get_by_role("button", name=f"retry {big.name}").count() == 0
    page.fill("#chat-input", "And now?")
    page.click("#chat-send")
    page.wait_for_selector("#chat-error:not([hidden]):has-text('Not sent')")
    page.wait_for_timeout(300)
    assert len(chats) == 1 and page.locator(".msg.user").count() == 1
    bad.get_by_role("button", name=f"remove {big.name}").click()
    page.click("#chat-send")
    answered(page, 1)
    assert len(chats) == 2 and image_parts(chats[1]) == []
    assert page.is_hidden("#chat-error")


def test_stop_cancels_a_send_that_waits_for_its_upload(page, samples: Path) -> None:
    held = Held(page)
    chats = chat_requests(page)
    page.set_input_files("#chat-files", str(samples / "images" / "rgba.png"))
    held.wait()
    page.fill("#chat-input", "Wait for me.")
    page.click("#chat-send")
    page.wait_for_selector("#chat-stop:not([disabled])")
    page.click("#chat-stop")
    page.wait_for_selector("#chat-send:text('Send')")
    held.release()
    page.wait_for_selector(f"#chat-attachments li:has-text('tokens for {QWEN}')")
    page.wait_for_timeout(300)
    assert chats == [] and page.input_value("#chat-input") == "Wait for me."  # nothing went
    page.click("#chat-send")
    answered(page)
    assert len(chats) == 1 and len(image_parts(chats[0])) == 1


def span_minutes(page) -> set[int]:
    page.click("#tab-server")
    page.wait_for_selector(
        f".chart[data-chart='kv'][data-model='{QWEN}'] polyline[data-series='free']", state="attached"
    )
    spans = page.locator(".chart figcaption .span").all_inner_texts()
    assert spans and all(s.startswith("last ") and s.endswith(" min") for s in spans), spans
    return {int(s.removeprefix("last ").removesuffix(" min")) for s in spans}


def test_server_charts_show_five_minutes_once_the_server_has_run_that_long(page, ui_server: UiServer) -> None:
    """The window is the server's life so far in whole minutes (from its models' load time,
    GET /v1/models' ``created``), 5 at most: a page opened on a server that has run for an
    hour shows the last 5 minutes at once, not "last 1 min" that grows while it watches."""
    models = httpx.get(f"{ui_server.url}/v1/models", headers=ui_server.headers).json()["data"]
    started = min(m["created"] for m in models)
    (shown,) = span_minutes(page)
    ran = math.ceil((time.time() - started) / 60)  # minutes begun since the models loaded
    assert shown in {max(1, min(5, m)) for m in (ran - 1, ran, ran + 1)}, (shown, ran)  # a scrape ago

    # the same server, seen from a browser whose clock is 6 minutes later: it has run that long
    page.clock.install(time=datetime.now() + timedelta(minutes=6))
    page.reload()  # the key stays in this tab's sessionStorage
    page.wait_for_selector("#status:text('connected')")
    assert span_minutes(page) == {5}
    kv = page.locator(f".chart[data-chart='kv'][data-model='{QWEN}'] svg.timechart")
    ticks = kv.evaluate("(s) => [...s.querySelectorAll('text.xtick')].map((t) => Number(t.dataset.t))")
    assert len(ticks) >= 4 and all(b - a == 60_000 for a, b in itertools.pairwise(ticks)), ticks
