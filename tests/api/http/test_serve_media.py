"""Uploads, captions, hostile media, limits and metrics against the real server."""

from __future__ import annotations

import base64
import socket
from pathlib import Path

import httpx
import openai
import pytest

from tests.api.http.conftest import Server

QWEN = "tiny-qwen3-vl"
KIND_OF_PREFIX = {"image": "image", "audio": "audio", "video": "video"}


def test_upload_get_delete(server: Server, samples: Path) -> None:
    files = [
        ("file", ("photo.jpg", (samples / "images" / "photo_640x480.jpg").read_bytes(), "image/jpeg")),
        ("file", ("tone.wav", (samples / "audio" / "tone_16k_mono.wav").read_bytes(), "audio/wav")),
        ("file", ("clip.mp4", (samples / "video" / "h264_320x240_30fps_3s.mp4").read_bytes(), "video/mp4")),
    ]
    r = httpx.post(f"{server.v1}/media", files=files, timeout=60)
    assert r.status_code == 200, r.text
    items = [d["media"] for d in r.json()["data"]]
    assert [i["kind"] for i in items] == ["image", "audio", "video"]
    assert items[0]["metadata"]["width"] == 640 and items[0]["metadata"]["height"] == 480
    assert items[1]["metadata"]["duration"] > 0
    assert items[1]["token_counts"][QWEN] is None  # Qwen3-VL takes no audio
    assert items[1]["token_counts"]["tiny-gemma4"] > 0
    assert items[2]["metadata"]["frame_count"] > 0
    for item in items:
        got = httpx.get(f"{server.v1}/media/{item['id']}")
        assert got.status_code == 200 and got.json() == item
    gone = httpx.delete(f"{server.v1}/media/{items[1]['id']}")
    assert gone.status_code == 200 and gone.json()["deleted"] is True
    assert httpx.get(f"{server.v1}/media/{items[1]['id']}").status_code == 404
    assert httpx.delete(f"{server.v1}/media/{items[1]['id']}").status_code == 404
    assert httpx.get(f"{server.v1}/media/..%2F..%2Fetc%2Fpasswd").status_code == 404


def _hostile(samples: Path) -> list[Path]:
    return sorted(p for p in (samples / "hostile").iterdir() if p.is_file())


def _in_process(data: bytes, kind: str | None) -> str | None:
    """The typed error code the media layer gives these bytes in-process (None: valid)."""
    from media import PieMediaError, open_media

    try:
        open_media(data, kind=kind)
    except PieMediaError as e:
        return e.code
    return None


def test_every_hostile_file_is_a_typed_4xx(server: Server, client: openai.OpenAI, samples: Path) -> None:
    """Uploaded, then referenced as the kind it was made to attack: each refused with a typed
    4xx carrying the same code the media layer gives in-process (the few that are valid
    media, such as a streamed WAV of unknown size, are accepted the same way)."""
    refused = 0
    for path in _hostile(samples):
        data = path.read_bytes()
        up = httpx.post(
            f"{server.v1}/media", files=[("file", (path.name, data, "application/octet-stream"))], timeout=60
        )
        expected = _in_process(data, None)
        if expected is None:
            assert up.status_code == 200, (path.name, up.text)
        else:
            assert 400 <= up.status_code < 500, (path.name, up.status_code, up.text)
            assert up.json()["error"]["code"] == expected, path.name
        named = path.name.split("_")[0]
        kind = named if named in ("image", "audio", "video") else "image"
        b64 = base64.b64encode(data).decode()
        model = "tiny-gemma4" if kind == "audio" else QWEN
        part = {
            "image": {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64}"}},
            "video": {"type": "video_url", "video_url": {"url": f"data:video/mp4;base64,{b64}"}},
            "audio": {"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}},
        }[kind]
        expected = _in_process(data, kind)
        messages = [{"role": "user", "content": [part, {"type": "text", "text": "?"}]}]
        if expected is None:
            r = client.chat.completions.create(model=model, messages=messages, max_tokens=2)
            assert r.choices[0].message.content is not None
            continue
        refused += 1
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(model=model, messages=messages, max_tokens=2)
        assert 400 <= e.value.status_code < 500, (path.name, e.value.status_code, e.value.body)
        assert e.value.body["code"] == expected, path.name
    assert refused >= 30
    assert httpx.get(f"{server.url}/ready").status_code == 200


@pytest.fixture(scope="module")
def small_cap_server(tmp_path_factory: pytest.TempPathFactory):
    from tests.api.http.conftest import start_server, stop_server

    srv = start_server(
        tmp_path_factory.mktemp("small"), models=("tiny",), env={"PIE_MEDIA_MAX_UPLOAD_BYTES": str(1 << 20)}
    )
    yield srv
    stop_server(srv)


def test_upload_over_the_cap_is_refused_while_streaming(small_cap_server: Server) -> None:
    srv = small_cap_server
    size = 40 << 20

    def body():
        yield b'--b\r\nContent-Disposition: form-data; name="file"; filename="big.bin"\r\n\r\n'
        for _ in range(size >> 20):
            yield b"\0" * (1 << 20)
        yield b"\r\n--b--\r\n"

    before = srv.rss_bytes()
    r = httpx.post(
        f"{srv.v1}/media",
        content=body(),
        headers={"content-type": "multipart/form-data; boundary=b"},
        timeout=60,
    )
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "too_large"
    assert srv.rss_bytes() - before < size // 4  # the upload never sat in memory
    assert not [p for p in (srv.state_dir / "media" / "spool").iterdir()]


def test_declared_length_over_the_cap_is_refused_before_reading(small_cap_server: Server) -> None:
    host, port = small_cap_server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(
            b"POST /v1/media HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"
            + f"Content-Length: {1 << 30}\r\n\r\n".encode()
        )
        reply = s.recv(65536).decode(errors="replace")  # no body sent: the answer must not wait for it
    assert reply.startswith("HTTP/1.1 413"), reply[:200]


def test_captions_batch(server: Server, samples: Path) -> None:
    files = [
        ("file", ("a.jpg", (samples / "images" / "photo_640x480.jpg").read_bytes(), "image/jpeg")),
        ("file", ("broken.jpg", (samples / "hostile" / "image_truncated.jpg").read_bytes(), "image/jpeg")),
        ("file", ("b.png", (samples / "images" / "rgba.png").read_bytes(), "image/png")),
    ]
    r = httpx.post(
        f"{server.v1}/captions", files=files, data={"prompt": "Describe.", "max_tokens": "6"}, timeout=60
    )
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["filename"] for d in data] == ["a.jpg", "broken.jpg", "b.png"]
    assert data[0]["caption"] is not None and data[2]["caption"] is not None
    assert data[1]["error"]["code"] == "corrupt" and data[1]["caption"] is None
    bad = httpx.post(f"{server.v1}/captions", files=files[:1], data={"max_tokens": "zero"})
    assert bad.status_code == 400


def test_malformed_multipart_is_400(server: Server) -> None:
    for headers, content in [
        ({"content-type": "multipart/form-data; boundary=b"}, b"garbage without a boundary"),
        ({"content-type": "multipart/form-data"}, b"--b\r\n"),
        ({"content-type": "application/json"}, b"{}"),
        (
            {"content-type": "multipart/form-data; boundary=b"},
            b'--b\r\nContent-Disposition: form-data; name="file"',
        ),
    ]:
        r = httpx.post(f"{server.v1}/media", content=content, headers=headers)
        assert r.status_code == 400, (content, r.status_code, r.text)


def test_metrics(server: Server, client: openai.OpenAI) -> None:
    client.chat.completions.create(
        model=QWEN,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "pie_media_http_requests_total",
        "pie_media_kv_pages",
        "pie_media_running_contexts",
        "pie_media_encoder_cache_total",
        "pie_media_prompt_tokens_total",
        "pie_media_generated_tokens_total",
        "pie_media_time_to_first_token_seconds_bucket",
        "pie_media_inter_token_latency_seconds_bucket",
        "pie_media_errors_total",
        "pie_media_requests_in_flight",
        "pie_media_engine_passes_total",
        "pie_media_engine_tokens_total",
        'python_gc_collections_total{generation="2"}',
    ):
        assert name in text, name


def test_cache_sizes_are_in_metrics(server: Server, client: openai.OpenAI) -> None:
    """What the encoder caches and the decoded-media cache hold, in bytes: a new image
    raises all three."""
    import base64
    import io

    import numpy as np
    from PIL import Image as PILImage

    def held() -> dict[str, float]:
        out = {}
        for line in httpx.get(f"{server.url}/metrics").text.splitlines():
            for key in ('kind="embeddings"', 'kind="prepared"', "pie_media_decoded_media_cache_bytes "):
                if f'model="{QWEN}"' in line and key in line or line.startswith(key):
                    out[key] = float(line.split()[-1])
        return out

    before = held()
    pixels = np.random.default_rng(11).integers(0, 255, (48, 64, 3), dtype=np.uint8)  # new content
    png = io.BytesIO()
    PILImage.fromarray(pixels).save(png, "PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    client.chat.completions.create(
        model=QWEN,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
        max_tokens=1,
    )
    after = held()
    assert len(after) == 3, after
    for key, value in after.items():
        assert value > before.get(key, 0), (key, before, after)


def test_the_loaded_heap_is_frozen_out_of_gc(server: Server) -> None:
    """The server froze its startup heap (torch, transformers, the models, the framework:
    hundreds of thousands of objects) so that oldest-generation collections under load do
    not walk it (engine/startup_heap.py)."""
    text = httpx.get(f"{server.url}/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("pie_media_gc_frozen_objects "))
    assert float(line.split()[1]) > 100_000, line


def test_uploads_survive_a_restart(tmp_path: Path, samples: Path) -> None:
    from tests.api.http.conftest import start_server, stop_server

    data = (samples / "images" / "gray.png").read_bytes()
    first = start_server(tmp_path, models=("tiny",))
    try:
        item = httpx.post(
            f"{first.v1}/media", files=[("file", ("g.png", data, "image/png"))], timeout=60
        ).json()["data"][0]
    finally:
        stop_server(first)
    second = start_server(tmp_path, models=("tiny",))  # same --media-dir
    try:
        again = httpx.get(f"{second.v1}/media/{item['media']['id']}", timeout=60)
        assert again.status_code == 200 and again.json() == item["media"]
        r = httpx.post(
            f"{second.v1}/chat/completions",
            json={
                "model": QWEN,
                "max_tokens": 3,
                "temperature": 0,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": f"pie-media://{item['media']['id']}"}}
                        ],
                    }
                ],
            },
            timeout=60,  # the first request of a fresh server (httpx's default of 5 s is too tight under load)
        )
        assert r.status_code == 200, r.text
    finally:
        stop_server(second)
