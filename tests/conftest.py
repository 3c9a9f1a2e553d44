from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _generous_http_timeouts() -> None:
    """Every httpx call and client the tests make waits up to ``HTTP_TIMEOUT`` unless it says
    otherwise. httpx's default (5 s) turned a slow first request on a loaded 2-core runner
    into a red suite (a ReadTimeout in a test that passes alone in seconds); a test that
    means a short wait (a client that gives up) passes its own ``timeout``."""
    import functools

    import httpx

    for name in ("request", "get", "post", "put", "patch", "delete", "head", "options", "stream"):
        fn = getattr(httpx, name)

        @functools.wraps(fn)
        def call(*args, _fn=fn, **kwargs):
            kwargs.setdefault("timeout", HTTP_TIMEOUT)
            return _fn(*args, **kwargs)

        setattr(httpx, name, call)
    for cls in (httpx.Client, httpx.AsyncClient):
        init = cls.__init__

        @functools.wraps(init)
        def construct(self, *args, _init=init, **kwargs):
            kwargs.setdefault("timeout", HTTP_TIMEOUT)
            _init(self, *args, **kwargs)

        cls.__init__ = construct


HTTP_TIMEOUT = None  # set below, once httpx is importable
try:
    import httpx as _httpx

    HTTP_TIMEOUT = _httpx.Timeout(120.0, connect=15.0)
    _generous_http_timeouts()
except ImportError:  # the suite's lower rooms run without the HTTP extras
    pass


@pytest.fixture(scope="session")
def samples() -> Path:
    """Root of the generated sample media: images/, audio/, video/, hostile/."""
    from fixtures.samples import ensure_samples

    return ensure_samples()


@pytest.fixture(scope="session")
def tiny_dir():
    """name -> folder of a tiny fixture checkpoint (``tiny-qwen3-vl``, ``tiny-gemma4``,
    ``tiny-csm``), built on first use: what ``Model.load`` / ``SpeechModel.load`` take."""
    from fixtures.tiny_models import ensure_tiny_model

    return ensure_tiny_model


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    """Ray Serve's in-process driver (tests/api/replicas/test_ray_serve.py) leaves C-level
    fault-signal handlers behind after shutdown that break wasmtime's trap handling: a guest
    that traps later in the same process kills it with SIGILL (seen with test_hostile). Those
    tests run last, together, so nothing after them runs wasm in this process."""
    last = [item for item in items if "replicas/test_ray_serve.py" in item.nodeid]
    if last:
        items[:] = [item for item in items if item not in last] + last
