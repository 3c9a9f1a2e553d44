"""API keys: Bearer checked by the real server; no keys off loopback refuses to start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from tests.api.http.conftest import ROOT, start_server, stop_server


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("keyed")
    keys = tmp / "keys.txt"
    keys.write_text("# team keys\nsk-first\n\nsk-second\n")
    srv = start_server(tmp, "--api-key-file", str(keys), models=("tiny",))
    yield srv
    stop_server(srv)


def test_requests_need_a_valid_bearer_key(keyed) -> None:
    for key in ("sk-first", "sk-second"):
        client = openai.OpenAI(base_url=keyed.v1, api_key=key, max_retries=0)
        assert [m.id for m in client.models.list()] == ["tiny-qwen3-vl"]
    bad = openai.OpenAI(base_url=keyed.v1, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.chat.completions.create(model="tiny-qwen3-vl", messages=[{"role": "user", "content": "Hi"}])
    assert e.value.status_code == 401
    r = httpx.get(f"{keyed.v1}/models")
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert r.json()["error"]["code"] == "invalid_api_key"
    # health and readiness stay open for probes; /metrics takes a key (any key: a plain key file
    # names no admin), so a scraper sends one
    assert httpx.get(f"{keyed.url}/ready").status_code == 200
    assert httpx.get(f"{keyed.url}/metrics").status_code == 401
    assert httpx.get(f"{keyed.url}/metrics", headers={"Authorization": "Bearer sk-first"}).status_code == 200


def test_plain_keys_each_keep_their_uploads(keyed, samples: Path) -> None:
    """Two plain keys are two tenants: one's upload is a 404 to the other."""
    data = (samples / "images" / "rgba.png").read_bytes()
    first = {"Authorization": "Bearer sk-first"}
    r = httpx.post(f"{keyed.v1}/media", files={"file": ("a.png", data)}, headers=first, timeout=60)
    media_id = r.json()["data"][0]["media"]["id"]
    assert httpx.get(f"{keyed.v1}/media/{media_id}", headers=first).status_code == 200
    assert (
        httpx.get(f"{keyed.v1}/media/{media_id}", headers={"Authorization": "Bearer sk-second"}).status_code
        == 404
    )


def test_no_keys_off_loopback_refuses_to_start(tmp_path: Path) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "api.cli",
            "serve",
            "--host",
            "0.0.0.0",
            "--port",
            "9",
            "--media-dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert r.returncode == 2
    assert "key" in r.stderr.lower()
