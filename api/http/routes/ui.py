"""``GET /ui``: a page to try the server in a browser (chat, speech, caption jobs,
inferlets, server charts). The page is static and served without a key; every call it
makes goes through the public API with the key the user types."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, RedirectResponse

from api.http.errors import ServiceError

router = APIRouter(tags=["ui"], include_in_schema=False)

UI_DIR = Path(__file__).resolve().parent.parent / "ui"
_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
# Only the page's own origin: no script, style, font or image from elsewhere.
_CSP = (
    "default-src 'self'; img-src 'self' blob: data:; media-src 'self' blob:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
)
_HEADERS = {"Content-Security-Policy": _CSP, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


def _asset(name: str) -> Path:
    """A file of the page by its plain name (no folders: nothing outside UI_DIR is reachable)."""
    path = UI_DIR / name
    if "/" in name or "\\" in name or name.startswith(".") or path.suffix not in _TYPES or not path.is_file():
        raise ServiceError("not_found", f"no UI file {name!r}", param="path")
    return path


@router.get("/ui")
async def page() -> FileResponse:
    return FileResponse(UI_DIR / "index.html", media_type="text/html", headers=_HEADERS)


@router.get("/ui/")
async def page_slash() -> RedirectResponse:
    return RedirectResponse("/ui")


@router.get("/ui/{name}")
async def asset(name: str) -> FileResponse:
    path = _asset(name)
    return FileResponse(path, media_type=_TYPES[path.suffix], headers=_HEADERS)


@router.get("/")
async def root() -> RedirectResponse:
    """A person opening the server's address in a browser lands on the page."""
    return RedirectResponse("/ui")
