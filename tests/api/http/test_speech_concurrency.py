"""Speech holds a crowd: concurrent requests through the real server (official client) each
equal their solo clip, a client that leaves gives its pages back, past the speech model's
capacity the answer is 429 with Retry-After, and whole WAV/FLAC files carry their length.

Tolerance: the codes must be the same (frames computed in passes shared with other requests
change no code: the speech tests check batched codes equal solo codes); the audio is 16-bit
PCM on the wire, so it equals the in-process clip within two 16-bit steps (2/32767): one for
the rounding, one for Mimi's float32 reordering in a process with another thread count (the
tiny codec's raw output reaches |16| before clipping; measured max 4.5e-5 = 1.5 steps).
"""

from __future__ import annotations

import asyncio
import io
import time

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf

from tests.api.http.conftest import Server, start_server, stop_server

CSM = "tiny-csm"
SECONDS = 0.8
TEXTS = [f"Voice number {i} says hello to the crowd." for i in range(8)]
VOICES = [
    "alloy",
    "ash",
    "ballad",
    "coral",
    "echo",
    "fable",
    "nova",
    "onyx",
]  # speakers 0..7 (api.http.voices)


@pytest.fixture(scope="module")
def local_csm():
    from api.model_ref import load_model

    return load_model("tiny-csm", device="cpu")


@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory):
    """A CSM-only server that runs at most 2 speech streams at once."""
    s = start_server(tmp_path_factory.mktemp("speech2"), "--max-speech-streams", "2", models=("tiny-csm",))
    yield s
    stop_server(s)


def _metric(server: Server, name: str, **labels: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(name + "{") and want in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{{want}}} not in /metrics")


def _pages_used(server: Server) -> float:
    return _metric(server, "pie_media_kv_pages", model=CSM, state="used")


def test_eight_voices_at_once_equal_their_solo_clips(server: Server, local_csm) -> None:
    async def one(client: openai.AsyncOpenAI, text: str, voice: str) -> bytes:
        r = await client.audio.speech.create(
            model=CSM,
            voice=voice,
            input=text,
            response_format="wav",
            extra_body={"max_duration": SECONDS, "temperature": 0},
        )
        return r.content

    async def all_at_once() -> list[bytes]:
        async with openai.AsyncOpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, t, v) for t, v in zip(TEXTS, VOICES, strict=True)))

    passes_before = _metric(server, "pie_media_engine_passes_total", model=CSM)
    steps_before = _metric(server, "pie_media_engine_steps_total", model=CSM)
    bodies = asyncio.run(all_at_once())
    passes = _metric(server, "pie_media_engine_passes_total", model=CSM) - passes_before
    steps = _metric(server, "pie_media_engine_steps_total", model=CSM) - steps_before
    assert steps > 0 and passes < steps  # frames of several requests shared passes
    for i, (text, body) in enumerate(zip(TEXTS, bodies, strict=True)):
        got, rate = sf.read(io.BytesIO(body), dtype="float32")
        want = local_csm.speak(text, i, max_duration=SECONDS, temperature=0).pcm
        assert rate == 24000 and len(got) == len(want)
        np.testing.assert_allclose(got, want, atol=2.0 / 32767)
    assert _metric(server, "pie_media_speech_time_to_first_audio_seconds_count", model=CSM) >= 8


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_whole_files_carry_their_length(client: openai.OpenAI, fmt: str) -> None:
    with client.audio.speech.with_streaming_response.create(
        model=CSM,
        voice="alloy",
        input="Hello there.",
        response_format=fmt,
        extra_body={"max_duration": SECONDS},
    ) as r:
        assert int(r.headers["content-length"]) > 0
        data = r.read()
    info = sf.info(io.BytesIO(data))  # libsndfile refuses a FLAC whose length is unknown
    pcm, rate = sf.read(io.BytesIO(data), dtype="float32")
    assert info.frames == len(pcm) > 0 and rate == 24000
    assert info.duration == pytest.approx(len(pcm) / 24000)
    import av

    with av.open(io.BytesIO(data)) as c:
        decoded = sum(f.samples for f in c.decode(audio=0))
    assert decoded == len(pcm)


def test_past_capacity_429_and_a_client_that_leaves_frees_its_pages(small_server: Server) -> None:
    body = {
        "model": CSM,
        "input": "A long story.",
        "voice": "alloy",
        "response_format": "pcm",
        "max_duration": 300,
        "stream_format": "audio",  # streams: admitted at once or refused, never queued
    }
    start = _pages_used(small_server)
    with httpx.Client(base_url=small_server.url, timeout=60) as http:
        held = []
        try:
            for _ in range(2):
                r = http.send(http.build_request("POST", "/v1/audio/speech", json=body), stream=True)
                assert r.status_code == 200
                chunks = r.iter_bytes()  # kept: dropping the iterator closes the response
                next(chunks)  # audio is flowing
                held.append((r, chunks))
            assert _pages_used(small_server) > start
            refused = http.post("/v1/audio/speech", json=body)
            assert refused.status_code == 429, refused.text
            # when the first of the two streams' frame budgets (300 s of audio) runs out
            assert int(refused.headers["retry-after"]) >= 2
            err = refused.json()["error"]
            assert err["code"] == "queue_full" and "2 streams" in err["message"]
        finally:
            for r, _ in held:
                r.close()  # the client leaves mid-stream
    deadline = time.monotonic() + 30
    while _pages_used(small_server) != start and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _pages_used(small_server) == start
    assert _metric(small_server, "pie_media_running_contexts", model=CSM) == 0
    # and the model serves again
    ok = httpx.post(f"{small_server.url}/v1/audio/speech", json={**body, "max_duration": 0.3}, timeout=60)
    assert ok.status_code == 200 and len(ok.content) > 0
