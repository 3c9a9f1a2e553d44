"""pie-media's media helpers for Pie 0.4 Python inferlets (``inferlets/pie_sdk/pie_media.py``):
a Pie project (Pie.toml + main.py on Pie's own SDK, ``inferlet`` 0.4.0) built with the
helpers bundled asks about an image, an audio clip and a video, and speaks.

* Its greedy answer about an image equals the engine's chat path (``engine.complete``,
  what ``/v1/chat/completions`` runs) token for token, with the same prompt rows and the
  same next position (Qwen3-VL's M-RoPE: rows and positions differ after an image), and
  equals ``/v1/chat/completions`` of a real server (the text and the prompt token count).
* An audio clip on the tiny Gemma-4, likewise; a video, frame by frame, equals the engine
  with the same sampled frames as images; an image placed raw (``append_image``) equals the
  engine's raw ``append_image``.
* ``speak`` on the tiny CSM returns the PCM of ``/v1/audio/speech`` for the same text,
  voice and duration (the tiny CSM's generation config is greedy: no seed needed); a voice
  given by number or by name (wasmtime-py lifts Pie's ``voice`` variant untagged: a bare
  int or str, which the host reads as such).
"""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import numpy as np
import pytest

from engine import CompletionParams, Context, Sampler, Turn, complete, stopping
from engine.instruct import InstructFormat
from inferlets import InferletRuntime
from inferlets.host.limits import RunLimits
from tests.api.http.conftest import start_server, stop_server

ROOT = Path(__file__).resolve().parents[2]
SDK = ROOT / "inferlets" / "pie_sdk"
LIMITS = RunLimits(wall_s=300, fuel=200_000_000_000)
QUESTION = "What is in the image?"

PIE_TOML = '[package]\nname = "media-questions"\nversion = "0.1.0"\ndescription = "pie_media test"\n'
MAIN = '''"""Answers a question about an image, an audio clip or a video, or speaks (pie_media)."""

import base64
import json

from inferlet import Distribution, Model, Sampler, chat
from pie_sdk.pie_media import Audio, Image, MediaContext, MediaError, Video, speak


async def main(input: dict) -> str:
    task = input["task"]
    model = Model.load(input["model"])
    try:
        if task == "speak":
            clip = speak(model, input["text"], input["voice"], max_duration_ms=input.get("max_duration_ms"))
            return json.dumps(
                {
                    "sample_rate": clip.sample_rate,
                    "channels": clip.channels,
                    "duration_ms": clip.duration_ms,
                    "pcm": clip.pcm,
                    "pcm16": base64.b64encode(clip.pcm16()).decode(),
                    "wav": base64.b64encode(clip.wav()).decode(),
                }
            )
        items = []
        for kind, b64 in input["media"]:
            data = base64.b64decode(b64)
            if kind == "image":
                items.append(Image.from_bytes(model, data))
            elif kind == "audio":
                items.append(Audio.from_bytes(model, data))
            else:
                items.append(Video.from_bytes(model, data, input["max_frames"]))
    except MediaError as e:
        return json.dumps({"error": str(e)})
    ctx = MediaContext(model)
    if input.get("raw"):
        for item in items:
            getattr(ctx, "append_" + item.kind)(item)
        ctx.user(*input["text"])
    else:
        parts = list(input["text"])
        ctx.user(*[items[p] if isinstance(p, int) else p for p in parts])
    if input.get("reopen"):  # a snapshot reopened: the cursor given back by position=
        await ctx.flush()
        name = ctx.snapshot()
        plain = MediaContext.open(model, name)
        again = MediaContext.open(model, name, position=ctx.position)
        tokens = await again.generate(Sampler.argmax(), max_tokens=input["max_tokens"]).collect_tokens()
        return json.dumps(
            {"tokens": tokens, "rows": plain.seq_len, "plain_position": plain.position, "position": ctx.position}
        )
    if input.get("manual"):  # a hand-driven decode loop (ctx.forward()) and a fork
        await ctx.flush()
        fork = ctx.fork()
        stops, feed, manual = chat.stop_tokens(model), chat.cue(model), []
        while len(manual) < input["max_tokens"]:
            fwd = ctx.forward()
            fwd.input(feed)
            h = fwd.sample([len(feed) - 1], Sampler.argmax())
            token = (await fwd.execute()).token(h)
            if token in stops:
                break
            manual.append(token)
            feed = [token]
        forked = await fork.generate(Sampler.argmax(), max_tokens=input["max_tokens"]).collect_tokens()
        return json.dumps(
            {
                "manual": manual,
                "forked": forked,
                "rows": ctx.seq_len,
                "position": ctx.position,
                "fork_rows": fork.seq_len,
                "fork_position": fork.position,
            }
        )
    dist, probe = None, None
    if input.get("flush"):
        await ctx.flush()  # the media and the turn now; the first step is the cue alone
    gen = ctx.generate(Sampler.argmax(), max_tokens=input["max_tokens"])
    cue = len(ctx.buffer())
    tokens, prompt_rows, prompt_position = [], None, None
    async for step in gen:
        if input.get("flush") and prompt_rows is None:
            probe = step.probe(cue - 1, Distribution(1.0, 5))
        out = await step.execute()
        tokens += out.tokens
        if prompt_rows is None:  # the first step placed the whole prompt
            prompt_rows, prompt_position = ctx.seq_len, ctx.position
            if probe is not None:
                dist = out.distribution(probe)
    layout = [
        {"rows": i.rows}
        if i.kind == "video"
        else {
            "token_count": i.token_count,
            "position_span": i.position_span,
            "prefix": i.prefix_tokens,
            "suffix": i.suffix_tokens,
        }
        for i in items
    ]
    return json.dumps(
        {
            "tokens": tokens,
            "text": model.tokenizer().decode(tokens),
            "prompt_rows": prompt_rows,
            "prompt_position": prompt_position,
            "rows": ctx.seq_len,
            "position": ctx.position,
            "layout": layout,
            "dist": dist,
        }
    )
'''


# -- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wasm(tmp_path_factory) -> Path:
    from fixtures.paths import cache_root
    from inferlets.build import build_pie_component

    project = tmp_path_factory.mktemp("pie-media-sdk") / "media-questions"
    project.mkdir()
    (project / "Pie.toml").write_text(PIE_TOML)
    (project / "main.py").write_text(MAIN)
    return build_pie_component(project, cache_root() / "pie-build", extra=[SDK])


@pytest.fixture(scope="module")
def gemma():
    from api.model_ref import load_model

    return load_model("tiny-gemma4")


@pytest.fixture(scope="module")
def media_rt(model, gemma, csm):
    from fixtures.paths import cache_root

    return InferletRuntime(
        {"tiny": model, "tiny-gemma4": gemma, "tiny-csm": csm}, cache_root(), limits=LIMITS
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(
        tmp_path_factory.mktemp("serve-pie-media"),
        "--speech-realtime-safety",
        "off",
        models=("tiny", "tiny-gemma4", "tiny-csm"),
    )
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.v1, api_key="unused-on-loopback", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def samples() -> Path:
    from fixtures.samples import ensure_samples

    return ensure_samples()


# -- helpers -----------------------------------------------------------------------------------
def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def run(rt, wasm, **params) -> dict:
    out = asyncio.run(rt.run_async(wasm, [json.dumps(params)]))
    return json.loads(out)


def ask(rt, wasm, model: str, media: list[tuple[str, Path]], text: list, max_tokens: int, **kw) -> dict:
    return run(
        rt,
        wasm,
        task="ask",
        model=model,
        media=[(kind, b64(p.read_bytes())) for kind, p in media],
        text=text,
        max_tokens=max_tokens,
        **kw,
    )


def engine_chat(model, parts: tuple, max_tokens: int) -> tuple[list[int], str, int]:
    """(tokens, text, prompt tokens): the engine's chat path (what /v1/chat/completions
    runs), greedy."""
    results, prompt = asyncio.run(
        complete(model, [Turn("user", parts)], CompletionParams(max_tokens=max_tokens))
    )
    stops = set(model.eos_token_ids or ())
    return [t for t in results[0].tokens if t not in stops], results[0].text, prompt


def engine_position(model, parts: tuple) -> tuple[int, int]:
    """(rows, next position) of the engine's context after the chat prompt of ``parts``."""

    async def go():
        ctx = Context(model)
        try:
            ctx.turns([("user", parts)])
            ctx.cue()
            await ctx.flush()
            return ctx.committed, ctx.position
        finally:
            ctx.close()

    return asyncio.run(go())


def data_url(path: Path, mime: str) -> str:
    return f"data:{mime};base64,{b64(path.read_bytes())}"


# -- tests -------------------------------------------------------------------------------------
def test_image_question_equals_the_engine_chat_path(media_rt, wasm, model, samples) -> None:
    """Qwen3-VL: the image inside the user turn, then greedy: the engine's tokens, and the
    prompt's rows and next position (72 image rows span 12 M-RoPE positions here)."""
    from media import Image

    path = samples / "images" / "rgba.png"
    got = ask(media_rt, wasm, "tiny", [("image", path)], [0, QUESTION], 8)
    parts = (Image.from_path(path), QUESTION)
    tokens, text, prompt = engine_chat(model, parts, 8)
    assert got["tokens"] == tokens and got["text"] == text
    rows, position = engine_position(model, parts)
    assert got["prompt_rows"] == prompt == rows
    assert got["prompt_position"] == position
    (item,) = got["layout"]
    assert item["token_count"] > item["position_span"]  # M-RoPE: rows and positions diverge
    assert position == rows - item["token_count"] + item["position_span"]
    assert got["rows"] == rows + len(tokens) - 1  # the last token stays buffered
    assert got["position"] == position + len(tokens) - 1


def test_next_token_distribution_equals_the_engines(media_rt, wasm, model, samples) -> None:
    """Stronger than greedy tokens (a tiny model repeats itself): after ``flush`` placed the
    image and the turn, the first step's top-5 distribution is the engine's for the same
    prompt, to float32 rounding (the prompt went in two passes here, one there)."""
    from media import Image

    path = samples / "images" / "rgba.png"
    got = ask(media_rt, wasm, "tiny", [("image", path)], [0, QUESTION], 3, flush=True)

    async def go():
        ctx = Context(model)
        try:
            ctx.turns([("user", (Image.from_path(path), QUESTION))])
            ctx.cue()
            return await ctx.decode_step_dist(top_n=5)
        finally:
            ctx.close()

    want = asyncio.run(go())
    ids, probs = got["dist"]
    assert ids == want.ids.tolist()
    np.testing.assert_allclose(probs, want.probs.tolist(), rtol=0, atol=2e-5)
    assert got["tokens"] == engine_chat(model, (Image.from_path(path), QUESTION), 3)[0]


def test_a_hand_driven_loop_and_a_fork_keep_the_cursor(media_rt, wasm, model, samples) -> None:
    """``ctx.forward()`` (Pie's ``Forward`` at the cursor), driven one token a pass as Pie's
    examples do, and a ``fork`` taken after the image, both answer as the engine does."""
    from media import Image

    path = samples / "images" / "rgba.png"
    got = ask(media_rt, wasm, "tiny", [("image", path)], [0, QUESTION], 6, manual=True)
    tokens, _, prompt = engine_chat(model, (Image.from_path(path), QUESTION), 6)
    assert got["manual"] == tokens and got["forked"] == tokens
    _, position = engine_position(model, (Image.from_path(path), QUESTION))
    # the loop fed the cue and every token but the last
    assert got["rows"] == prompt + len(tokens) - 1
    assert got["position"] == position + len(tokens) - 1
    assert got["fork_position"] - got["fork_rows"] == got["position"] - got["rows"] < 0


def test_a_reopened_snapshot_takes_its_cursor_back(media_rt, wasm, model, samples) -> None:
    """A snapshot keeps rows, not the guest's cursor: ``open`` starts it at the row count
    unless ``position=`` gives it back; given back, the answer is the engine's."""
    from media import Image

    path = samples / "images" / "rgba.png"
    got = ask(media_rt, wasm, "tiny", [("image", path)], [0, QUESTION], 6, reopen=True)
    assert got["plain_position"] == got["rows"] > got["position"]
    assert got["tokens"] == engine_chat(model, (Image.from_path(path), QUESTION), 6)[0]


def test_two_images_and_text_in_one_turn(media_rt, wasm, model, samples) -> None:
    """Several items in one pass, each at its own anchor, text between them."""
    from media import Image

    a, b = samples / "images" / "rgba.png", samples / "images" / "odd_7x13.png"
    got = ask(media_rt, wasm, "tiny", [("image", a), ("image", b)], ["First ", 0, " then ", 1, "?"], 6)
    parts = ("First ", Image.from_path(a), " then ", Image.from_path(b), "?")
    tokens, _, prompt = engine_chat(model, parts, 6)
    assert got["tokens"] == tokens and got["prompt_rows"] == prompt
    assert got["prompt_position"] == engine_position(model, parts)[1]


def test_raw_append_image_equals_the_engines(media_rt, wasm, model, samples) -> None:
    """``append_image`` places the image raw (delimiters and span, outside a turn), as the
    engine's ``Context.append_image``; the user turn follows at the right position."""
    from media import Image

    path = samples / "images" / "rgba.png"
    got = ask(media_rt, wasm, "tiny", [("image", path)], [QUESTION], 8, raw=True)
    fmt = InstructFormat.for_model(model)
    stops = fmt.stop_tokens()

    async def go():
        ctx = Context(model)
        try:
            ctx.append_image(Image.from_path(path))
            ctx.fill_tokens(fmt.user(QUESTION) + fmt.cue())
            g = await ctx.generate(Sampler.greedy(), stopping.max_tokens(8) | stopping.eos(stops))
            return [t for t in g.tokens if t not in stops]
        finally:
            ctx.close()

    assert got["tokens"] == asyncio.run(go())


def test_audio_question_on_gemma4_equals_the_engine_chat_path(media_rt, wasm, gemma, samples) -> None:
    from media import Audio

    assert "audio" in gemma.media_kinds
    path = samples / "audio" / "tone_16k_mono.wav"
    got = ask(media_rt, wasm, "tiny-gemma4", [("audio", path)], [0, "What do you hear?"], 8)
    parts = (Audio.from_path(path), "What do you hear?")
    tokens, text, prompt = engine_chat(gemma, parts, 8)
    assert got["tokens"] == tokens and got["text"] == text and got["prompt_rows"] == prompt
    assert got["prompt_position"] == engine_position(gemma, parts)[1]
    (item,) = got["layout"]
    assert item["token_count"] == item["position_span"]  # 1-D RoPE


def test_video_frame_by_frame_equals_the_engine_with_the_same_frames(media_rt, wasm, model, samples) -> None:
    """A video goes in as its sampled frames, each an image (media.wit's video); the engine
    given the same frames as images answers the same."""
    from media import Image, Video

    path = samples / "video" / "h264_320x240_30fps_3s.mp4"
    got = ask(media_rt, wasm, "tiny", [("video", path)], [0, "What happens?"], 6, max_frames=3)
    sampled = Video.from_bytes(path.read_bytes()).sample(max_frames=3)
    frames = tuple(Image.from_array(f) for f in sampled.frames)
    assert len(frames) == 3
    parts = (*frames, "What happens?")
    tokens, _, prompt = engine_chat(model, parts, 6)
    assert got["tokens"] == tokens and got["prompt_rows"] == prompt
    assert got["prompt_position"] == engine_position(model, parts)[1]


def test_a_model_without_the_media_kind_is_a_media_error(media_rt, wasm, samples) -> None:
    got = ask(media_rt, wasm, "tiny", [("audio", samples / "audio" / "tone_16k_mono.wav")], ["?"], 2)
    assert got["error"].startswith("Audio.from_bytes:") and "takes no audio" in got["error"]


def test_speak_takes_a_voice_by_number_or_name(media_rt, wasm) -> None:
    for voice in (0, "0"):
        got = run(
            media_rt, wasm, task="speak", model="tiny-csm", text="Hi.", voice=voice, max_duration_ms=300
        )
        assert "error" not in got, got["error"]


def test_speak_pcm_equals_in_process(media_rt, wasm, csm) -> None:
    """``speak`` on the tiny CSM (greedy by its generation config) is ``model.speak``'s clip.
    A voice is a speaker id, or a name the speech model knows (its presets, a digit
    string); OpenAI's names are the HTTP layer's (``alloy`` is speaker 0 there), not the
    model's, so Pie's world refuses them with the host's message."""
    got = run(
        media_rt, wasm, task="speak", model="tiny-csm", text="Good morning.", voice=3, max_duration_ms=500
    )
    assert "error" not in got, got["error"]
    clip = csm.speak("Good morning.", 3, max_duration=0.5)
    assert got["sample_rate"] == clip.sample_rate == 24000 and got["channels"] == 1
    np.testing.assert_array_equal(np.asarray(got["pcm"], dtype=np.float32), clip.pcm.reshape(-1))
    assert got["duration_ms"] == round(len(clip.pcm) / clip.sample_rate * 1000)
    by_name = run(
        media_rt, wasm, task="speak", model="tiny-csm", text="Good morning.", voice="3", max_duration_ms=500
    )
    assert by_name["pcm"] == got["pcm"]
    preset = run(
        media_rt, wasm, task="speak", model="tiny-csm", text="Hi.", voice="default", max_duration_ms=300
    )
    np.testing.assert_array_equal(
        np.asarray(preset["pcm"], dtype=np.float32), csm.speak("Hi.", 0, max_duration=0.3).pcm.reshape(-1)
    )
    refused = run(media_rt, wasm, task="speak", model="tiny-csm", text="Hi.", voice="alloy")
    assert refused["error"].startswith("speak:") and "alloy" in refused["error"]


# -- over HTTP ---------------------------------------------------------------------------------
def test_image_answer_equals_chat_completions(media_rt, wasm, client, samples) -> None:
    path = samples / "images" / "rgba.png"
    got = ask(media_rt, wasm, "tiny", [("image", path)], [0, QUESTION], 8)
    r = client.chat.completions.create(
        model="tiny-qwen3-vl",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url(path, "image/png")}},
                    {"type": "text", "text": QUESTION},
                ],
            }
        ],
        max_tokens=8,
        temperature=0,
    )
    assert r.choices[0].message.content == got["text"]
    assert r.usage.prompt_tokens == got["prompt_rows"]
    assert r.usage.completion_tokens == len(got["tokens"]) or r.choices[0].finish_reason == "stop"


def test_audio_answer_equals_chat_completions(media_rt, wasm, client, samples) -> None:
    path = samples / "audio" / "tone_16k_mono.wav"
    got = ask(media_rt, wasm, "tiny-gemma4", [("audio", path)], [0, "What do you hear?"], 8)
    r = client.chat.completions.create(
        model="tiny-gemma4",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "input_audio", "input_audio": {"data": b64(path.read_bytes()), "format": "wav"}},
                    {"type": "text", "text": "What do you hear?"},
                ],
            }
        ],
        max_tokens=8,
        temperature=0,
    )
    assert r.choices[0].message.content == got["text"]
    assert r.usage.prompt_tokens == got["prompt_rows"]


def test_speak_pcm_equals_audio_speech(media_rt, wasm, client) -> None:
    """``Speech.pcm16()`` is byte for byte ``/v1/audio/speech``'s ``pcm`` for the same text,
    voice (``alloy`` is speaker 0) and duration, sent whole (``?stream=false``: one Mimi
    decode, as ``speak``; a streamed ``pcm`` decodes chunk by chunk, within float32 rounding
    of it). ``wav()`` holds those samples. The route's whole ``wav`` is written by
    libsndfile (soundfile, subtype PCM_16), which converts the floats its own way (on this
    clip up to two steps from ``pcm``'s 32767-scaled samples)."""
    import io

    import soundfile as sf

    got = run(
        media_rt, wasm, task="speak", model="tiny-csm", text="Hello there.", voice=0, max_duration_ms=500
    )
    assert "error" not in got, got["error"]
    args = {
        "model": "tiny-csm",
        "voice": "alloy",
        "input": "Hello there.",
        "extra_body": {"max_duration": 0.5},
    }
    pcm = client.audio.speech.create(response_format="pcm", extra_query={"stream": "false"}, **args)
    pcm16 = base64.b64decode(got["pcm16"])
    assert len(pcm16) > 0 and pcm16 == pcm.content
    mine, rate = sf.read(io.BytesIO(base64.b64decode(got["wav"])), dtype="int16")
    assert rate == got["sample_rate"] == 24000 and mine.tobytes() == pcm16
    wav = client.audio.speech.create(response_format="wav", **args)
    theirs, rate = sf.read(io.BytesIO(wav.content), dtype="int16")
    assert rate == 24000 and len(theirs) == len(mine)
    assert np.abs(mine.astype(np.int32) - theirs).max() <= 2
