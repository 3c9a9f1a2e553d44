"""Keys that isolate, on the real server: an admin key and two user keys (alice, bob) from
a TOML key file. Every stored object belongs to the key that made it: the other user gets
404 on read, use, list, cancel and delete, as if it did not exist; the admin sees and
manages everything. The prefix cache is shared only within a tenant (and a
``cache_salt``); /metrics is the admin's; creates, deletes and cancels are audited; SIGHUP
re-reads the key file and a removed key stops at once."""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.api.http.conftest import Server, start_server, stop_server

QWEN = "tiny-qwen3-vl"
EXAMPLES = Path(__file__).resolve().parents[3] / "inferlets" / "examples"
KEYS = {
    "admin": "sk-admin-0123456789",
    "alice": "sk-alice-0123456789",
    "bob": "sk-bob-0123456789",
    "carol": "sk-carol-0123456789",
    "dave": "sk-dave-0123456789",
    "erin": "sk-erin-0123456789",
}
SYSTEM = "You are a careful assistant. " * 24  # a few pages of shared prefix


def key_file(path: Path, *, with_bob: bool = True) -> None:
    bob_sha = hashlib.sha256(KEYS["bob"].encode()).hexdigest()
    text = f"""
[[keys]]
name = "ops"
key = "{KEYS["admin"]}"
role = "admin"

[[keys]]
name = "alice"
key = "{KEYS["alice"]}"
"""
    text += f"""
[[keys]]
name = "carol"
key = "{KEYS["carol"]}"
requests_per_minute = 3

[[keys]]
name = "dave"
key = "{KEYS["dave"]}"
max_concurrent_streams = 1
max_stored_bytes = 2000

[[keys]]
name = "erin"
key = "{KEYS["erin"]}"
tokens_per_minute = 30
"""
    if with_bob:  # bob's entry names the key by its sha256 only
        text += f"""
[[keys]]
name = "bob"
sha256 = "{bob_sha}"
role = "user"
"""
    path.write_text(text)


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("tenants")
    keys = tmp / "keys.toml"
    key_file(keys)
    srv = start_server(tmp, "--api-key-file", str(keys), models=(QWEN,))
    srv.keys_path = keys  # type: ignore[attr-defined]
    yield srv
    stop_server(srv)


def http(server: Server, who: str) -> httpx.Client:
    return httpx.Client(base_url=server.v1, headers={"Authorization": f"Bearer {KEYS[who]}"}, timeout=120)


def client(server: Server, who: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=KEYS[who], max_retries=0)


def upload(server: Server, who: str, path: Path) -> str:
    r = http(server, who).post("/media", files={"file": (path.name, path.read_bytes())})
    assert r.status_code == 200, r.text
    return r.json()["data"][0]["media"]["id"]


def test_uploads_belong_to_their_uploader(tenants: Server, samples: Path) -> None:
    image = samples / "images" / "rgba.png"
    media_id = upload(tenants, "alice", image)
    alice, bob, admin = http(tenants, "alice"), http(tenants, "bob"), http(tenants, "admin")
    assert alice.get(f"/media/{media_id}").status_code == 200
    assert bob.get(f"/media/{media_id}").status_code == 404
    assert admin.get(f"/media/{media_id}").status_code == 200
    chat = {
        "model": QWEN,
        "max_tokens": 2,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": f"pie-media://{media_id}"}},
                    {"type": "text", "text": "What is this?"},
                ],
            }
        ],
    }
    assert alice.post("/chat/completions", json=chat).status_code == 200
    refused = bob.post("/chat/completions", json=chat)
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "media_not_found"
    assert bob.delete(f"/media/{media_id}").status_code == 404
    # bob's own upload of the same bytes is his: same id, his record, and alice's delete leaves it
    assert upload(tenants, "bob", image) == media_id
    assert alice.delete(f"/media/{media_id}").status_code == 200
    assert alice.get(f"/media/{media_id}").status_code == 404
    assert bob.get(f"/media/{media_id}").status_code == 200
    assert bob.post("/chat/completions", json=chat).status_code == 200
    # an admin's delete removes it for everyone
    assert admin.delete(f"/media/{media_id}").status_code == 200
    assert bob.get(f"/media/{media_id}").status_code == 404


def test_files_and_batches_belong_to_their_maker(tenants: Server) -> None:
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions"}
    line["body"] = {"model": QWEN, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    data = (json.dumps(line) + "\n").encode()
    alice, bob, admin = client(tenants, "alice"), client(tenants, "bob"), client(tenants, "admin")
    f = alice.files.create(file=("batch.jsonl", io.BytesIO(data)), purpose="batch")
    assert f.id not in [x.id for x in bob.files.list()]
    assert f.id in [x.id for x in alice.files.list()] and f.id in [x.id for x in admin.files.list()]
    for call in (
        lambda: bob.files.retrieve(f.id),
        lambda: bob.files.content(f.id),
        lambda: bob.files.delete(f.id),
        lambda: bob.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    batch = alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.id not in [b.id for b in bob.batches.list()]
    assert batch.id in [b.id for b in admin.batches.list()]
    for call in (lambda: bob.batches.retrieve(batch.id), lambda: bob.batches.cancel(batch.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    deadline = time.monotonic() + 120
    while (b := alice.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert b.status == "completed" and b.output_file_id
    # the output file is the batch's maker's
    assert json.loads(alice.files.content(b.output_file_id).text)["custom_id"] == "a"
    with pytest.raises(openai.NotFoundError):
        bob.files.content(b.output_file_id)
    assert admin.files.retrieve(b.output_file_id).id == b.output_file_id
    alice.files.delete(f.id)


def test_stored_responses_belong_to_their_maker(tenants: Server) -> None:
    alice, bob, admin = client(tenants, "alice"), client(tenants, "bob"), client(tenants, "admin")
    r = alice.responses.create(model=QWEN, input="Say hi.", max_output_tokens=2)
    for call in (
        lambda: bob.responses.retrieve(r.id),
        lambda: bob.responses.create(
            model=QWEN, input="More.", previous_response_id=r.id, max_output_tokens=2
        ),
        lambda: bob.responses.delete(r.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert alice.responses.create(model=QWEN, input="More.", previous_response_id=r.id, max_output_tokens=2)
    assert admin.responses.retrieve(r.id).id == r.id
    alice.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        admin.responses.retrieve(r.id)


def test_caption_jobs_belong_to_their_maker(tenants: Server, samples: Path) -> None:
    media_id = upload(tenants, "alice", samples / "images" / "rgba.png")
    alice, bob, admin = http(tenants, "alice"), http(tenants, "bob"), http(tenants, "admin")
    job = alice.post("/jobs/captions", json={"media_ids": [media_id], "max_tokens": 2}).json()
    assert job["id"] not in [j["id"] for j in bob.get("/jobs").json()["data"]]
    assert job["id"] in [j["id"] for j in admin.get("/jobs").json()["data"]]
    assert bob.get(f"/jobs/{job['id']}").status_code == 404
    assert bob.get(f"/jobs/{job['id']}/results", params={"follow": False}).status_code == 404
    assert bob.post(f"/jobs/{job['id']}/cancel").status_code == 404
    results = alice.get(f"/jobs/{job['id']}/results", params={"timeout": 60}).text.splitlines()
    assert len(results) == 1 and "caption" in json.loads(results[0])
    # bob naming alice's upload gets the record of a missing upload, not a caption of it
    theirs = bob.post("/jobs/captions", json={"media_ids": [media_id], "max_tokens": 2}).json()
    record = json.loads(bob.get(f"/jobs/{theirs['id']}/results", params={"timeout": 60}).text.splitlines()[0])
    assert record["error"]["code"] == "media_not_found"


@pytest.fixture(scope="module")
def wasm() -> bytes:
    from fixtures.paths import cache_root
    from inferlets import build_component

    return build_component(EXAMPLES, cache_root() / "inferlets-build").read_bytes()


def test_inferlets_runs_and_saved_contexts_belong_to_their_caller(tenants: Server, wasm: bytes) -> None:
    alice, bob, admin = http(tenants, "alice"), http(tenants, "bob"), http(tenants, "admin")
    headers = {"content-type": "application/wasm"}
    r = alice.post("/inferlets", content=wasm, headers=headers, timeout=300)
    assert r.status_code == 200, r.text
    iid = r.json()["id"]
    assert iid not in [x["id"] for x in bob.get("/inferlets").json()["data"]]
    assert iid in [x["id"] for x in admin.get("/inferlets").json()["data"]]
    assert bob.get(f"/inferlets/{iid}").status_code == 404
    assert bob.post(f"/inferlets/{iid}/runs", json={"args": ["chat", QWEN, "Hi", "2"]}).status_code == 404
    assert bob.delete(f"/inferlets/{iid}").status_code == 404
    run = alice.post(f"/inferlets/{iid}/runs", json={"args": ["save-prefix", QWEN, "Write a haiku.", "p"]})
    assert run.status_code == 200, run.text
    assert bob.get(f"/inferlets/{iid}/runs/{run.json()['id']}").status_code == 404
    assert bob.post(f"/inferlets/{iid}/runs/{run.json()['id']}/cancel").status_code == 404
    assert alice.get(f"/inferlets/{iid}/runs/{run.json()['id']}").status_code == 200
    # bob's own upload of the same component; his run cannot open alice's saved context
    assert bob.post("/inferlets", content=wasm, headers=headers, timeout=300).json()["id"] == iid
    theirs = bob.post(f"/inferlets/{iid}/runs", json={"args": ["continue", QWEN, "p", "2"]})
    assert theirs.status_code == 422 and "saved_context_not_found" in theirs.text, theirs.text
    mine = alice.post(f"/inferlets/{iid}/runs", json={"args": ["continue", QWEN, "p", "2"]})
    assert mine.status_code == 200, mine.text
    assert alice.delete(f"/inferlets/{iid}").status_code == 200
    assert bob.get(f"/inferlets/{iid}").status_code == 200  # still his


def _cached(c: openai.OpenAI, question: str, **extra) -> int:
    r = c.chat.completions.create(
        model=QWEN,
        max_tokens=1,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        extra_body=extra or None,
    )
    return r.usage.prompt_tokens_details.cached_tokens


def test_the_prefix_cache_is_shared_only_within_a_tenant_and_salt(tenants: Server) -> None:
    alice, bob = client(tenants, "alice"), client(tenants, "bob")
    assert _cached(alice, "First question?") == 0
    assert _cached(alice, "Second question?") > 0  # alice's own prefix
    assert _cached(bob, "Third question?") == 0  # not alice's pages
    assert _cached(bob, "Fourth question?") > 0
    assert _cached(alice, "Fifth question?", cache_salt="team-x") == 0  # vLLM's cache_salt
    assert _cached(alice, "Sixth question?", cache_salt="team-x") > 0


def test_metrics_need_an_admin_key_and_name_keys_not_secrets(tenants: Server) -> None:
    assert httpx.get(f"{tenants.url}/metrics").status_code == 401
    r = httpx.get(f"{tenants.url}/metrics", headers={"Authorization": f"Bearer {KEYS['alice']}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
    r = httpx.get(f"{tenants.url}/metrics", headers={"Authorization": f"Bearer {KEYS['admin']}"})
    assert r.status_code == 200
    assert not any(k in r.text for k in KEYS.values())


def test_creates_deletes_and_cancels_are_audited(tenants: Server, samples: Path) -> None:
    media_id = upload(tenants, "bob", samples / "images" / "cmyk.jpg")
    assert http(tenants, "bob").delete(f"/media/{media_id}").status_code == 200
    deadline = time.monotonic() + 10
    while True:
        lines = [
            json.loads(ln[ln.index("{") :]) for ln in tenants.log_text().splitlines() if '"action":' in ln
        ]
        seen = {(x["action"], x["object"], x["key"]) for x in lines if x["id"] == media_id}
        if {("create", "media", "bob"), ("delete", "media", "bob")} <= seen or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {("create", "media", "bob"), ("delete", "media", "bob")} <= seen
    assert all(k not in tenants.log_text() for k in KEYS.values())


def test_sighup_reloads_keys_and_a_removed_key_stops_at_once(tenants: Server) -> None:
    bob = http(tenants, "bob")
    assert bob.get("/models").status_code == 200
    key_file(tenants.keys_path, with_bob=False)  # type: ignore[attr-defined]
    os.kill(tenants.process.pid, signal.SIGHUP)
    deadline = time.monotonic() + 10
    while bob.get("/models").status_code != 401:
        assert time.monotonic() < deadline, "bob's key still works after SIGHUP"
        time.sleep(0.1)
    assert http(tenants, "alice").get("/models").status_code == 200
    key_file(tenants.keys_path)  # type: ignore[attr-defined]
    os.kill(tenants.process.pid, signal.SIGHUP)
    deadline = time.monotonic() + 10
    while bob.get("/models").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def _limited(r: httpx.Response, code: str) -> None:
    assert r.status_code == 429, r.text
    assert int(r.headers["retry-after"]) >= 1
    err = r.json()["error"]
    assert err["code"] == code and err["type"] == "rate_limit_error"


def test_requests_per_minute(tenants: Server) -> None:
    carol = http(tenants, "carol")
    assert [carol.get("/models").status_code for _ in range(3)] == [200, 200, 200]
    _limited(carol.get("/models"), "rate_limit_exceeded")
    assert http(tenants, "alice").get("/models").status_code == 200  # one key's limit is its own


def test_concurrent_streams_and_stored_bytes(tenants: Server, samples: Path) -> None:
    dave = http(tenants, "dave")
    chat = {"model": QWEN, "messages": [{"role": "user", "content": "Tell a story."}], "max_tokens": 48}
    with dave.stream("POST", "/chat/completions", json={**chat, "stream": True}) as first:
        assert first.status_code == 200
        lines = first.iter_lines()
        next(lines)  # admitted and running
        _limited(dave.post("/chat/completions", json=chat), "too_many_streams")
        for _ in lines:
            pass
    assert dave.post("/chat/completions", json=chat).status_code == 200  # the slot came back
    small = samples / "images" / "cmyk.jpg"  # 1251 bytes of a 2000-byte allowance
    assert dave.post("/media", files={"file": (small.name, small.read_bytes())}).status_code == 200
    big = samples / "images" / "exif_rotated_6.jpg"
    _limited(dave.post("/media", files={"file": (big.name, big.read_bytes())}), "storage_limit_exceeded")
    _limited(
        dave.post("/files", files={"file": ("b.jsonl", b"{}" * 500)}, data={"purpose": "batch"}),
        "storage_limit_exceeded",
    )


def test_tokens_per_minute(tenants: Server) -> None:
    erin = client(tenants, "erin")
    assert _cached(erin, "One?") == 0  # admitted with a full bucket; its ~150 tokens overdraw it
    with pytest.raises(openai.RateLimitError) as e:
        _cached(erin, "Two?")
    assert e.value.response.headers["retry-after"] and e.value.code == "rate_limit_exceeded"
    r = httpx.get(f"{tenants.url}/metrics", headers={"Authorization": f"Bearer {KEYS['admin']}"}).text
    assert 'pie_media_key_limited_total{key="erin",limit="rate_limit_exceeded"} 1.0' in r
    assert 'pie_media_key_tokens_total{key="erin"}' in r
