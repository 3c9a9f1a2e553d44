"""``/v1/audio/transcriptions`` and ``/translations`` on the real server with the official
client: every response format carries the engine's own transcript (json, text,
verbose_json segments, SRT and WebVTT cues), a stream adds up to the whole, and what
cannot be served is a typed 4xx."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from tests.api.http.conftest import Server

GEMMA = "tiny-gemma4"
QWEN = "tiny-qwen3-vl"


@pytest.fixture(scope="module")
def local_gemma():
    from api.model_ref import load_model

    return load_model("tiny-gemma4", device="cpu")


@pytest.fixture(scope="module")
def clip(samples: Path) -> bytes:
    return (samples / "audio" / "speechlike_35s_16k.wav").read_bytes()


def engine_transcript(model, data: bytes, **kwargs):
    from engine import CompletionParams, run_sync
    from engine.transcription import transcribe_async
    from media import Audio

    return run_sync(
        transcribe_async(model, Audio.from_bytes(data), params=CompletionParams(max_tokens=5), **kwargs)
    )


def test_json_text_and_verbose_json_carry_the_engines_transcript(
    client: openai.OpenAI, local_gemma, clip
) -> None:
    want = engine_transcript(local_gemma, clip, language="en")
    extra = {"max_tokens": 5}
    r = client.audio.transcriptions.create(model=GEMMA, file=("a.wav", clip), language="en", extra_body=extra)
    assert r.text == want.text
    assert r.usage.input_tokens == want.prompt_tokens and r.usage.output_tokens == want.completion_tokens
    text = client.audio.transcriptions.create(
        model=GEMMA, file=("a.wav", clip), language="en", response_format="text", extra_body=extra
    )
    assert text == want.text
    v = client.audio.transcriptions.create(
        model=GEMMA, file=("a.wav", clip), language="en", response_format="verbose_json", extra_body=extra
    )
    assert (v.text, v.language, v.task) == (want.text, "en", "transcribe")
    assert v.duration == pytest.approx(35.0)
    assert [(s.start, s.end, s.text) for s in v.segments] == [(s.start, s.end, s.text) for s in want.segments]
    assert [s.tokens for s in v.segments] == [list(s.tokens) for s in want.segments]


def test_srt_and_vtt_have_a_cue_per_piece(server: Server, local_gemma, clip) -> None:
    want = engine_transcript(local_gemma, clip)
    cues = [s for s in want.segments if s.text]
    for fmt, sep in (("srt", ","), ("vtt", ".")):
        r = httpx.post(
            f"{server.v1}/audio/transcriptions",
            files={"file": ("a.wav", clip)},
            data={"model": GEMMA, "response_format": fmt, "max_tokens": "5"},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        body = r.text
        if fmt == "vtt":
            assert body.startswith("WEBVTT\n\n")
        ms = round(cues[0].end * 1000)  # the first piece ends under a minute in
        assert f"00:00:00{sep}000 --> 00:00:{ms // 1000:02d}{sep}{ms % 1000:03d}" in body
        assert all(c.text in body for c in cues)


def test_a_stream_adds_up_to_the_whole(server: Server, local_gemma, clip) -> None:
    want = engine_transcript(local_gemma, clip)
    deltas, done = [], None
    with httpx.stream(
        "POST",
        f"{server.v1}/audio/transcriptions",
        files={"file": ("a.wav", clip)},
        data={"model": GEMMA, "stream": "true", "max_tokens": "5"},
        timeout=120,
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if event["type"] == "transcript.text.delta":
                    deltas.append(event["delta"])
                else:
                    done = event
    assert done is not None and done["type"] == "transcript.text.done"
    assert "".join(deltas) == done["text"] == want.text
    assert done["usage"]["output_tokens"] == want.completion_tokens


@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")  # the client marks translations so
def test_translation_and_the_default_model(client: openai.OpenAI, local_gemma, samples) -> None:
    data = (samples / "audio" / "tone_44k1_stereo.mp3").read_bytes()
    want = engine_transcript(local_gemma, data, task="translate")
    r = client.audio.translations.create(model=GEMMA, file=("t.mp3", data), extra_body={"max_tokens": 5})
    assert r.text == want.text
    # No model named: the first served model that takes audio.
    r = httpx.post(
        f"{client.base_url}audio/translations",
        files={"file": ("t.mp3", data)},
        data={"max_tokens": "5"},
        timeout=120,
    )
    assert r.status_code == 200 and r.json()["text"] == want.text


@pytest.mark.parametrize(
    "data, files, status, words",
    [
        ({"model": QWEN}, None, 400, "takes no audio"),
        ({"response_format": "xml"}, None, 400, "response_format must be one of"),
        ({"stream": "true", "response_format": "srt"}, None, 400, "stream takes response_format"),
        ({"language": "English"}, None, 400, "ISO-639-1"),
        ({"temperature": "9"}, None, 400, "temperature must be in"),
        ({}, [("file", ("a.wav", b"RIFF....WAVEfmt "))], 400, ""),
        ({}, [("file", ("a.wav", b"x")), ("file", ("b.wav", b"y"))], 400, "one audio file"),
        ({"model": "nope"}, None, 404, ""),
    ],
)
def test_bad_requests_are_typed_4xx(server: Server, clip, data, files, status, words) -> None:
    files = files or [("file", ("a.wav", clip))]
    r = httpx.post(
        f"{server.v1}/audio/transcriptions", files=files, data={"max_tokens": "2", **data}, timeout=120
    )
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]
