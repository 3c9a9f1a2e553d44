"""Transcription on the tiny Gemma-4: a clip over the tower's 30 s is cut into pieces, each
piece's text is what a chat turn of that piece and the instruction generates, the pieces
join in order, and the streamed text adds up to the whole."""

from __future__ import annotations

import pytest

from engine import Completion, CompletionParams, InvalidRequestError, Turn, run_sync
from engine.transcription import Transcription, instruction, transcribe_async
from media import Audio, split_audio


def _chat_text(model, piece, text, max_tokens):
    async def go():
        async with Completion(
            model, [Turn("user", (piece, text))], CompletionParams(max_tokens=max_tokens)
        ) as c:
            return "".join([ev.text async for ev in c])

    return run_sync(go())


def test_a_long_clip_is_transcribed_piece_by_piece(gemma, samples):
    clip = Audio.from_path(samples / "audio" / "speechlike_35s_16k.wav")
    params = CompletionParams(max_tokens=6)
    out = run_sync(transcribe_async(gemma, clip, language="en", params=params))
    pieces = split_audio(clip, gemma.encoder.max_audio_seconds)
    assert len(pieces) == 2 and len(out.segments) == 2
    assert out.duration == pytest.approx(clip.duration)
    assert out.segments[0].start == 0 and out.segments[-1].end == pytest.approx(clip.duration)
    assert out.segments[0].end == pytest.approx(out.segments[1].start)
    text = instruction("transcribe", "en")
    for seg, piece in zip(out.segments, pieces, strict=True):
        assert seg.text == _chat_text(gemma, piece, text, 6).strip()
        assert len(seg.tokens) == 6 and seg.avg_logprob is not None and seg.avg_logprob < 0
    assert out.text == " ".join(s.text for s in out.segments if s.text)
    # 750 audio tokens for the 30 s piece, 125 for the 5 s one (one per 40 ms), and the text
    assert out.completion_tokens == 12 and out.prompt_tokens > 750 + 125

    async def streamed():
        async with Transcription(gemma, clip, language="en", params=params) as t:
            text = "".join([ev.text async for ev in t.events()])
            return text, await t.result()

    text, again = run_sync(streamed())
    assert text == again.text == out.text


def test_translation_asks_for_english(gemma, samples):
    clip = Audio.from_path(samples / "audio" / "tone_16k_mono.wav")
    params = CompletionParams(max_tokens=4)
    out = run_sync(transcribe_async(gemma, clip, task="translate", params=params))
    assert "into English" in instruction("translate")
    assert out.text == _chat_text(gemma, clip, instruction("translate"), 4).strip()


def test_a_model_without_audio_is_a_typed_error(qwen, samples):
    clip = Audio.from_path(samples / "audio" / "tone_16k_mono.wav")
    with pytest.raises(InvalidRequestError, match="takes no audio"):
        Transcription(qwen, clip)
