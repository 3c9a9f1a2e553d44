"""Every example inferlet's output equals the same program run directly on the engine
(greedy: token for token; seeded sampling: the same draws)."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import numpy as np
import pytest

from engine import Context
from inferlets import InferletRun
from media import Audio, Image, Video
from tests.inferlets import direct


def _run(rt, wasm, args, **kw):
    sends: list[str] = []

    async def main():
        return await rt.run_async(wasm, args, on_send=sends.append, **kw)

    return asyncio.run(main()), sends


def test_image_qa_equals_engine(rt, wasm, model) -> None:
    data = direct.png()
    out, sends = _run(rt, wasm, ["image-qa", "tiny", "What is this?", "10", base64.b64encode(data).decode()])
    want_facts, want = asyncio.run(direct.media_qa(model, Image.from_bytes(data), "What is this?", 10))
    assert json.loads(sends[0]) == want_facts
    assert want_facts["token_count"] > 0
    assert json.loads(out) == want


def test_image_appended_raw_equals_engine(rt, wasm, model) -> None:
    data = direct.png(32, 32, seed=3)
    out, _ = _run(rt, wasm, ["image-raw", "tiny", "Describe it.", "6", base64.b64encode(data).decode()])
    ctx = Context(model)
    ctx.append_image(Image.from_bytes(data))
    want = asyncio.run(direct.answer(ctx.user("Describe it.").cue(), 6))
    assert json.loads(out) == want


def test_video_qa_equals_engine_bytes_by_message(rt, wasm, model) -> None:
    """The video arrives as the launcher's message (``receive``), not an argument."""
    data = direct.mp4()
    control = InferletRun([base64.b64encode(data).decode()], close=True)
    out, sends = _run(rt, wasm, ["video-qa", "tiny", "What happens?", "8", "4", "-"], control=control)
    want_facts, want = asyncio.run(
        direct.media_qa(model, Video.from_bytes(data), "What happens?", 8, max_frames=4)
    )
    got = json.loads(sends[0])
    assert got == want_facts
    assert got["kind"] == "video" and got["frame_count"] == 4 and len(got["timestamps"]) >= 1
    assert json.loads(out) == want


def test_audio_qa_on_gemma_equals_engine(wasm) -> None:
    """Audio input (Gemma-4): facts and greedy answer as the engine's."""
    from api.model_ref import load_model
    from fixtures.paths import cache_root
    from inferlets import InferletRuntime

    gemma = load_model("tiny-gemma4")
    rt = InferletRuntime({"gemma": gemma}, cache_root())
    data = direct.wav()
    out, sends = _run(
        rt, wasm, ["audio-qa", "gemma", "What do you hear?", "8", base64.b64encode(data).decode()]
    )
    want_facts, want = asyncio.run(direct.media_qa(gemma, Audio.from_bytes(data), "What do you hear?", 8))
    assert json.loads(sends[0]) == want_facts
    assert want_facts["kind"] == "audio" and want_facts["grid"] == [1, 1, want_facts["token_count"]]
    assert json.loads(out) == want
    assert gemma.pool.stats().in_use == 0


def _wav_floats(b64: str) -> tuple[int, int, np.ndarray]:
    import soundfile as sf

    pcm, rate = sf.read(io.BytesIO(base64.b64decode(b64)), dtype="float32", always_2d=True)
    info = sf.info(io.BytesIO(base64.b64decode(b64)))
    assert info.subtype == "FLOAT"
    return rate, pcm.shape[1], pcm[:, 0]


def test_tts_wav_equals_engine(rt, wasm, csm) -> None:
    out, _ = _run(rt, wasm, ["tts", "tiny-csm", "Hello there.", "0", "5", "0.5"])
    rate, channels, pcm = _wav_floats(out)
    want = csm.speak("Hello there.", 0, seed=5, max_duration=0.5)
    assert (rate, channels) == (want.sample_rate, 1)
    assert len(pcm) > 0
    np.testing.assert_array_equal(pcm, want.pcm)


def test_tts_stream_chunks_equal_engine(rt, wasm, csm) -> None:
    out, sends = _run(rt, wasm, ["tts-stream", "tiny-csm", "Hello there.", "0", "5", "0.5", "2"])
    want = list(csm.speak_stream("Hello there.", 0, seed=5, max_duration=0.5, chunk_frames=2))
    got = [np.frombuffer(base64.b64decode(s), dtype="<f4") for s in sends]
    assert len(got) == len(want) >= 2
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    _, _, pcm = _wav_floats(out)
    np.testing.assert_array_equal(pcm, np.concatenate(want))


@pytest.mark.parametrize(("temperature", "seed"), [("0", "0"), ("0.9", "11")])
def test_best_of_equals_engine(rt, wasm, model, temperature, seed) -> None:
    out, sends = _run(rt, wasm, ["best-of", "tiny", "Hi", "6", "3", temperature, seed])
    texts, best = asyncio.run(direct.best_of(model, "Hi", 6, 3, float(temperature), int(seed)))
    assert sends == texts
    assert out == best
    if temperature != "0":
        assert len(set(texts)) > 1  # seeded branches really differ


def test_beam_search_equals_engine(rt, wasm, model) -> None:
    out, sends = _run(rt, wasm, ["beam", "tiny", "Tell me a story.", "3", "6", "2"])
    want = asyncio.run(direct.beam(model, "Tell me a story.", 3, 6, num_return=2))
    assert [s.split("\t", 1) for s in sends] == [[f"{sc:.6f}", t] for sc, t in want]
    assert out == want[0][1]


def test_tour_of_the_context_api_equals_engine(rt, wasm, model) -> None:
    out, _ = _run(rt, wasm, ["tour", "tiny", "Name three colours.", "6"])
    got = json.loads(out)
    want = asyncio.run(direct.tour(model, "Name three colours.", 6))
    assert got == want
    assert got["reopened"] == got["greedy"][1]
    assert "tour:Name three colours." not in model.saved_names()


def test_prefix_saved_by_one_run_continues_in_others(rt, wasm, model) -> None:
    in_use = model.pool.stats().in_use
    rows, _ = _run(rt, wasm, ["save-prefix", "tiny", "Write a haiku.", "haiku"])
    assert model.pool.stats().in_use > in_use  # the saved prefix keeps its pages after the run
    outs = []
    for _ in range(2):
        computed = model.runner.rows_computed
        outs.append(_run(rt, wasm, ["continue", "tiny", "haiku", "6"])[0])
        assert model.runner.rows_computed - computed <= 6  # decode rows only: the prefix is reused
    ctx = Context(model).user("Write a haiku.").cue()
    assert len(ctx) == int(rows)
    want = asyncio.run(direct.answer(ctx, 6))["text"]
    assert outs == [want, want]
    assert _run(rt, wasm, ["forget", "tiny", "haiku"])[0] == "ok"
    assert "haiku" not in model.saved_names()
    assert model.pool.stats().in_use == in_use
