"""``/ui`` itself (no browser needed): served without a key on a keyed server, only its
own files, nothing that would be fetched from another origin."""

from __future__ import annotations

import re

import httpx

from api.http.routes.ui import UI_DIR
from tests.api.ui.conftest import UiServer


def test_page_is_open_and_the_api_still_needs_the_key(ui_server: UiServer) -> None:
    r = httpx.get(f"{ui_server.url}/ui")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in r.headers["content-security-policy"]
    assert httpx.get(f"{ui_server.url}/v1/models").status_code == 401
    assert httpx.get(f"{ui_server.url}/v1/models", headers=ui_server.headers).status_code == 200
    root = httpx.get(f"{ui_server.url}/", follow_redirects=False)
    assert root.status_code in (302, 307) and root.headers["location"] == "/ui"
    for name in ("app.js", "chat.js", "style.css"):
        asset = httpx.get(f"{ui_server.url}/ui/{name}")
        assert asset.status_code == 200 and asset.text == (UI_DIR / name).read_text()
    assert httpx.get(f"{ui_server.url}/ui/app.js").headers["content-type"].startswith("text/javascript")


def test_only_the_page_files_are_reachable(ui_server: UiServer) -> None:
    for bad in ("__init__.py", "..%2F..%2Fsettings.py", ".hidden.js", "nope.js", "..%2Froutes%2Fui.py"):
        r = httpx.get(f"{ui_server.url}/ui/{bad}")
        assert r.status_code == 404, (bad, r.status_code)
        assert "error" in r.json()


def test_nothing_is_fetched_from_another_origin() -> None:
    files = [p for p in UI_DIR.iterdir() if p.suffix in (".html", ".js", ".css")]
    assert {p.name for p in files} >= {"index.html", "app.js", "api.js", "style.css"}
    for p in files:
        text = p.read_text().replace('"http://www.w3.org/2000/svg"', "")  # a namespace name
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}/", text, re.I), p.name
        assert "@import" not in text and "@font-face" not in text, p.name
