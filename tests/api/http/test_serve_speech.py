"""Text to speech over the real server with the official client: every format decodes
at 24 kHz, streamed and whole responses agree, and the audio equals ``model.speak``."""

from __future__ import annotations

import base64
import io
import json

import av
import httpx
import numpy as np
import openai
import pytest
import soundfile as sf

from tests.api.http.conftest import Server

CSM = "tiny-csm"
SECONDS = 0.5
EXTRA = {"max_duration": SECONDS, "seed": 3}


@pytest.fixture(scope="module")
def local_csm():
    from api.model_ref import load_model

    return load_model("tiny-csm", device="cpu")


def decode(data: bytes, fmt: str) -> tuple[np.ndarray, int]:
    if fmt == "pcm":
        return np.frombuffer(data, "<i2").astype(np.float32) / 32767.0, 24000
    # A streamed FLAC's STREAMINFO says "length unknown" (valid FLAC; libsndfile refuses it): PyAV.
    if fmt == "wav":
        pcm, rate = sf.read(io.BytesIO(data), dtype="float32")
        return pcm, rate
    with av.open(io.BytesIO(data)) as c:
        rate = c.streams.audio[0].rate
        frames = [f.to_ndarray().reshape(-1) for f in c.decode(audio=0)]
    pcm = np.concatenate(frames)
    if pcm.dtype == np.int16:
        pcm = pcm.astype(np.float32) / 32768.0
    return pcm.astype(np.float32), rate


@pytest.mark.parametrize("fmt", ["wav", "pcm", "flac", "mp3", "aac", "opus"])
def test_every_format_decodes(client: openai.OpenAI, fmt: str) -> None:
    r = client.audio.speech.create(
        model=CSM, voice="alloy", input="Hello there.", response_format=fmt, extra_body=EXTRA
    )
    pcm, rate = decode(r.content, fmt)
    assert rate in (24000, 48000)  # Opus decoders may hand back 48 kHz
    assert 0 < len(pcm) / rate <= SECONDS + 0.2  # codec padding


@pytest.mark.parametrize("fmt", ["wav", "pcm", "flac"])
def test_streamed_equals_whole_and_in_process(client: openai.OpenAI, local_csm, fmt: str) -> None:
    whole = client.audio.speech.create(
        model=CSM, voice="coral", input="Good morning.", response_format=fmt, extra_body=EXTRA
    ).content
    with client.audio.speech.with_streaming_response.create(
        model=CSM, voice="coral", input="Good morning.", response_format=fmt, extra_body=EXTRA
    ) as r:
        pieces = list(r.iter_bytes())
    assert b"".join(pieces) == whole
    got, _ = decode(whole, fmt)
    clip = local_csm.speak("Good morning.", 3, max_duration=SECONDS, seed=3)  # coral = speaker 3
    want = np.round(np.clip(clip.pcm, -1, 1) * 32767) / 32767  # 16-bit on the wire
    assert len(got) == len(want)
    # The stream decodes each chunk with 64 frames of left context (speech.model docs): equal
    # to the whole-clip decode within float32 rounding, far below one 16-bit step (3e-5).
    np.testing.assert_allclose(got, want, atol=2.0 / 32767)


def test_sse_events(server: Server) -> None:
    body = {
        "model": CSM,
        "input": "Hi.",
        "voice": "echo",
        "response_format": "wav",
        "stream_format": "sse",
        **EXTRA,
    }
    events = []
    with httpx.stream("POST", f"{server.v1}/audio/speech", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    assert events[-1]["type"] == "speech.audio.done"
    usage = events[-1]["usage"]
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0
    wav = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    pcm, rate = decode(wav, "wav")
    assert rate == 24000 and len(pcm) > 0


def test_speed_keeps_pitch_and_changes_length(client: openai.OpenAI) -> None:
    args = {
        "model": CSM,
        "voice": "alloy",
        "input": "Hello there.",
        "response_format": "wav",
        "extra_body": EXTRA,
    }
    normal, _ = decode(client.audio.speech.create(**args).content, "wav")
    fast, _ = decode(client.audio.speech.create(speed=2.0, **args).content, "wav")
    assert len(normal) >= 2048  # long enough for the STFT the stretch uses (seeded: deterministic)
    assert abs(len(fast) - len(normal) / 2) <= 0.05 * len(normal)


def test_voices_and_typed_errors(server: Server, client: openai.OpenAI) -> None:
    voices = httpx.get(f"{server.v1}/audio/voices").json()["data"]
    assert {"alloy", "shimmer", "default", "0"} <= {v["id"] for v in voices}
    cases = [
        ({"voice": "nobody"}, "unsupported_voice"),
        ({"input": "x" * 4097}, "invalid_request"),
        ({"input": "x " * 2000}, "text_too_long"),  # 4000 characters, ~2000 tokens
        ({"response_format": "ogg"}, "invalid_request"),
        ({"speed": 5.0}, "invalid_request"),
        ({"model": "tiny-qwen3-vl"}, "model_not_found"),
    ]
    for change, code in cases:
        body = {"model": CSM, "input": "Hello.", "voice": "alloy", **EXTRA, **change}
        r = httpx.post(f"{server.v1}/audio/speech", json=body, timeout=60)
        assert 400 <= r.status_code < 500, (change, r.status_code)
        assert r.json()["error"]["code"] == code, (change, r.json())
    listed = httpx.post(
        f"{server.v1}/audio/speech", json={"model": CSM, "input": "Hi", "voice": "nobody"}
    ).json()
    assert "alloy" in listed["error"]["message"]


def test_context_conditions_the_voice(client: openai.OpenAI, local_csm, samples) -> None:
    wav = (samples / "audio" / "tone_16k_mono.wav").read_bytes()
    ctx = [{"text": "Earlier words.", "audio": base64.b64encode(wav).decode(), "voice": "alloy"}]
    r = client.audio.speech.create(
        model=CSM,
        voice="alloy",
        input="And now this.",
        response_format="wav",
        extra_body={**EXTRA, "context": ctx},
    )
    got, _ = decode(r.content, "wav")
    from media import Audio

    clip = local_csm.speak(
        "And now this.",
        0,
        max_duration=SECONDS,
        seed=3,
        context=[(0, "Earlier words.", Audio.from_bytes(wav))],
    )
    assert len(got) == len(clip.pcm)
    np.testing.assert_allclose(got, np.round(np.clip(clip.pcm, -1, 1) * 32767) / 32767, atol=2.0 / 32767)


def test_time_stretch_keeps_pitch() -> None:
    from api.http.routes.speech import _stretch

    rate = 24000
    t = np.arange(rate) / rate
    tone = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    for speed in (0.5, 2.0):
        out = _stretch(tone, speed)
        assert abs(len(out) - len(tone) / speed) <= 0.02 * len(tone) / speed
        spectrum = np.abs(np.fft.rfft(out * np.hanning(len(out))))
        peak = np.argmax(spectrum) * rate / len(out)
        assert abs(peak - 440) < 5, (speed, peak)  # same pitch, other length
