"""``pie-media serve --ray``: 2 engine replicas of the tiny Qwen3-VL on a local Ray (2 CPUs),
sharing a real PostgreSQL index and one state folder. Answers are compared with the same
requests served in-process (greedy). One Ray session for the module."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'pie-media[ray]'")

from fastapi.testclient import TestClient  # noqa: E402

from api.http.app import create_app  # noqa: E402
from api.http.settings import ServeSettings  # noqa: E402

pytestmark = pytest.mark.timeout(240)
QWEN = "tiny-qwen3-vl"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self, url: str, key: str = ""):
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {key}"})

    def as_key(self, key: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, headers={"Authorization": f"Bearer {key}"})

    def engine_pids(self) -> dict[str, int]:
        """Live engine replicas: unique id -> process id."""
        import ray._private.state as ray_state

        out = {}
        for actor in ray_state.actors().values():
            if "PieMediaEngine" in str(actor.get("ActorClassName")) and actor.get("State") == "ALIVE":
                out[str(actor.get("Name", "")).rsplit("#", 1)[-1]] = int(actor["Pid"])
        return out

    def wait_replicas(self, n: int, timeout: float = 90) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pids = self.engine_pids()
            if len(pids) == n:
                try:
                    if self.http.get("/ready").status_code == 200:
                        return pids
                except httpx.HTTPError:
                    pass
            time.sleep(0.3)
        raise AssertionError(f"{n} replicas not up in {timeout} s: {self.engine_pids()}")


ADMIN, ALICE, BOB = "sk-replica-admin", "sk-replica-alice", "sk-replica-bob"


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory, postgres) -> ServeSettings:
    state = tmp_path_factory.mktemp("shared-state")
    keys = state.parent / "replica-keys.toml"
    keys.write_text(
        "".join(
            f'[[keys]]\nname = "{n}"\nkey = "{k}"\nrole = "{r}"\n\n'
            for n, k, r in (("ops", ADMIN, "admin"), ("alice", ALICE, "user"), ("bob", BOB, "user"))
        )
    )
    return ServeSettings(
        models=["tiny"],
        api_key_file=keys,
        state_dir=state,
        state_db=postgres.fresh_schema_url(),
        job_lease_s=2.0,
        job_poll_s=0.3,
        max_concurrency=16,
    )


@pytest.fixture(scope="module")
def cluster(settings: ServeSettings) -> Iterator[Cluster]:
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    import ray
    from ray import serve

    from api.serve_ray import build_app

    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(settings, replicas=2), name="pie-media", route_prefix="/")
        c = Cluster(f"http://127.0.0.1:{port}", ADMIN)  # the admin sees every tenant's objects
        c.wait_replicas(2)
        yield c
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """The same service in this process (one engine, SQLite): the reference answers."""
    s = ServeSettings(models=["tiny"], state_dir=tmp_path_factory.mktemp("local-state"))
    with TestClient(create_app(s)) as client:
        yield client


def _chat(text: str, image: str | None = None, system: str = "You are terse.", **kw) -> dict:
    content: list[dict] = [{"type": "text", "text": text}]
    if image:
        content.insert(0, {"type": "image_url", "image_url": {"url": image}})
    return {
        "model": QWEN,
        "max_tokens": 5,
        "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": content}],
        **kw,
    }


def _answer(response: httpx.Response | object) -> str:
    body = response.json()  # type: ignore[attr-defined]
    return body["choices"][0]["message"]["content"]


def test_upload_via_one_replica_chat_via_the_other(
    cluster: Cluster, local: TestClient, samples: Path
) -> None:
    data = (samples / "images" / "rgba.png").read_bytes()
    up = cluster.http.post("/v1/media", files={"file": ("rgba.png", data, "image/png")})
    assert up.status_code == 200, up.text
    uploader = up.headers["x-pie-media-replica"]
    media_id = up.json()["data"][0]["media"]["id"]
    ref_up = local.post("/v1/media", files={"file": ("rgba.png", data, "image/png")})
    assert ref_up.json()["data"][0]["media"]["id"] == media_id  # content-addressed ids agree
    served_by = set()
    for i in range(24):  # different system prompts hash to either replica
        body = _chat("What is it?", f"pie-media://{media_id}", system=f"Prompt {i}.")
        r = cluster.http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        served_by.add(r.headers["x-pie-media-replica"])
        if r.headers["x-pie-media-replica"] != uploader:
            assert _answer(r) == _answer(local.post("/v1/chat/completions", json=body))
            break
    else:
        raise AssertionError(f"every chat went to the uploading replica {uploader}: {served_by}")
    # The same prefix goes to the same replica (affinity), whatever the question.
    body = _chat("Another question", f"pie-media://{media_id}", system="Prompt 0.")
    firsts = {
        cluster.http.post("/v1/chat/completions", json=body).headers["x-pie-media-replica"] for _ in range(4)
    }
    assert len(firsts) == 1


def test_each_keys_objects_stay_its_own_on_every_replica(cluster: Cluster, samples: Path) -> None:
    """Issue 35 across replicas: ownership lives in the shared index, so every replica gives
    another tenant the same 404; a second key's chat with the same system prompt is routed
    apart and computes its own prefix (cached_tokens 0)."""
    alice, bob = cluster.as_key(ALICE), cluster.as_key(BOB)
    data = (samples / "images" / "cmyk.jpg").read_bytes()
    media_id = alice.post("/v1/media", files={"file": ("c.jpg", data)}).json()["data"][0]["media"]["id"]
    replicas: set[str] = set()
    for _ in range(6):  # plain GETs spread over both replicas
        theirs, mine = bob.get(f"/v1/media/{media_id}"), alice.get(f"/v1/media/{media_id}")
        assert (theirs.status_code, mine.status_code) == (404, 200)
        replicas |= {theirs.headers.get("x-pie-media-replica"), mine.headers.get("x-pie-media-replica")}
    stored = alice.post("/v1/responses", json={"model": QWEN, "input": "Hi", "max_output_tokens": 2}).json()
    assert bob.get(f"/v1/responses/{stored['id']}").status_code == 404
    assert alice.get(f"/v1/responses/{stored['id']}").status_code == 200
    system = "Secret onboarding memo 4411. " + "Reply with one word. " * 30
    body = _chat("First?", system=system, max_tokens=1)
    assert (
        alice.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens_details"][
            "cached_tokens"
        ]
        == 0
    )
    again = alice.post("/v1/chat/completions", json=_chat("Second?", system=system, max_tokens=1)).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    other = bob.post("/v1/chat/completions", json=_chat("Third?", system=system, max_tokens=1)).json()
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_chats_sharing_only_a_long_system_prompt_reuse_one_replicas_cache(cluster: Cluster) -> None:
    """Issue 34: keyed by system prompt + question these spread over both replicas and each
    computed the prompt once; routed by longest held prefix, all but the first hit the cache."""
    system = "Zebra crossing rules, 7391 edition. " + "Answer in one short sentence, citing the rule. " * 20
    served, cached = [], []
    for q in ("What is 2+2?", "Name a colour.", "Why is the sky blue?", "Hi", "Define entropy.", "Go"):
        r = cluster.http.post("/v1/chat/completions", json=_chat(q, system=system, max_tokens=1))
        assert r.status_code == 200, r.text
        served.append(r.headers["x-pie-media-replica"])
        cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert len(set(served)) == 1, served
    assert cached[0] == 0 and min(cached[1:]) >= 150, cached  # the ~190-token system turn


def _kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def test_batch_across_replicas_one_sigkilled_every_line_once(cluster: Cluster, local: TestClient) -> None:
    bodies = [_chat(f"Line {i} says hello", system=f"System {i % 4}.", max_tokens=4) for i in range(40)]
    lines = [
        {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": b}
        for i, b in enumerate(bodies)
    ]
    data = ("\n".join(json.dumps(x) for x in lines) + "\n").encode()
    f = cluster.http.post("/v1/files", files={"file": ("b.jsonl", data)}, data={"purpose": "batch"})
    assert f.status_code == 200, f.text
    batch = cluster.http.post(
        "/v1/batches",
        json={
            "input_file_id": f.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    ).json()
    pids = cluster.wait_replicas(2)
    killed = False
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        b = cluster.http.get(f"/v1/batches/{batch['id']}").json()
        if not killed and b["request_counts"]["completed"] >= 5:
            _kill(sorted(pids.values())[0])  # one replica dies mid-batch, holding claims
            killed = True
        if b["status"] == "completed" and b.get("output_file_id"):
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"batch not done: {b}")
    assert killed and b["request_counts"] == {"total": 40, "completed": 40, "failed": 0}
    out = [
        json.loads(x) for x in cluster.http.get(f"/v1/files/{b['output_file_id']}/content").text.splitlines()
    ]
    assert sorted(int(o["custom_id"][4:]) for o in out) == list(range(40))  # each line once
    for o in out:
        want = local.post("/v1/chat/completions", json=bodies[int(o["custom_id"][4:])]).json()
        assert (
            o["response"]["body"]["choices"][0]["message"]["content"]
            == want["choices"][0]["message"]["content"]
        )


def test_stream_on_a_killed_replica_ends_with_an_error_event_and_ray_restarts_it(cluster: Cluster) -> None:
    pids = cluster.wait_replicas(2)
    body = _chat("Tell a long story", system="Stream it.", max_tokens=4000, ignore_eos=True, stream=True)
    events: list[str] = []
    with cluster.http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        victim = r.headers["x-pie-media-replica"]
        for line in r.iter_lines():
            if line.startswith("data:") or line.startswith("event:"):
                events.append(line)
            if len(events) == 3:
                _kill(pids[victim])
    assert events[-1].startswith("data:") and '"replica_failed"' in events[-1], events[-3:]
    assert any(e == "event: error" for e in events)
    # The next request is served by the live replica, then Ray brings the second back.
    r = cluster.http.post("/v1/chat/completions", json=_chat("Still there?", system="Stream it."))
    assert r.status_code == 200 and r.headers["x-pie-media-replica"] != victim
    again = cluster.wait_replicas(2, timeout=120)
    assert victim not in again and len(again) == 2
