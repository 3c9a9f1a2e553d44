"""Speech out (CSM): parity with transformers' generate, stop rules, streaming, formats, errors.

Tolerances:
- greedy codes: identical to ``CsmForConditionalGeneration.generate(do_sample=False)`` with the same
  suppression (ids >= codebook size) at both levels and the same frame budget;
- audio: the same Mimi decode of the same codes, so equal to 1e-6 (measured: 0.0);
- streaming: chunks decoded with the whole prefix as left context join to the one-shot clip within
  STREAM_ATOL (measured ~9e-6 on the tiny codec, whose raw output reaches |16| before clipping);
- formats: every encoding decodes back at 24 kHz mono with the clip's duration within
  FORMAT_DURATION_TOL (codec padding; measured 0 for all five here); wav/flac samples within 1/32767.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from media import InvalidRequestError, PieMediaError
from speech import (
    MAX_SPEECH_TEXT_TOKENS,
    EmptyTextError,
    InvalidDurationError,
    NoSpeechHeadError,
    Speech,
    SpeechError,
    SpeechModel,
    TextTooLongError,
    UnsupportedAudioFormatError,
    UnsupportedVoiceError,
    audio_cutoff,
    is_end_frame,
)

FRAMES = 10
MAX_DURATION = FRAMES / 12.5  # 0.8 s
STREAM_ATOL = 1e-4
FORMAT_DURATION_TOL = 0.05  # seconds


@pytest.fixture(scope="module")
def csm_ref(csm):
    from transformers import AutoProcessor, CsmForConditionalGeneration

    return CsmForConditionalGeneration.from_pretrained(csm.path).eval(), AutoProcessor.from_pretrained(
        csm.path
    )


@pytest.fixture(scope="module")
def greedy(csm) -> Speech:
    return csm.speak("Hello there.", 1, max_duration=MAX_DURATION, temperature=0)


def _reference(csm, csm_ref, conversation, frames=FRAMES):
    model, processor = csm_ref
    inputs = processor.apply_chat_template(conversation, tokenize=True, return_dict=True)
    non_codec = list(range(csm.codebook_size, csm.vocab_size))
    out = model.generate(
        **inputs,
        do_sample=False,
        depth_decoder_do_sample=False,
        max_new_tokens=frames,
        suppress_tokens=non_codec,
        depth_decoder_suppress_tokens=non_codec,
        output_audio=True,
        return_dict_in_generate=True,
    )
    return out.sequences[0].numpy(), np.clip(out.audio[0].numpy(), -1.0, 1.0)


def _turn(speaker, text, audio=None):
    content = [{"type": "text", "text": text}]
    if audio is not None:
        content.append({"type": "audio", "path": audio})
    return {"role": str(speaker), "content": content}


# -- loading -------------------------------------------------------------------------------------


def test_load_csm_checkpoint(csm):
    assert isinstance(csm, SpeechModel)
    assert csm.architecture == "CsmForConditionalGeneration"
    assert (csm.sample_rate, csm.frame_rate, csm.num_codebooks, csm.codebook_size) == (24000, 12.5, 4, 64)
    assert csm.samples_per_frame == 1920


# -- parity --------------------------------------------------------------------------------------


def test_greedy_matches_reference_generate(csm, csm_ref, greedy):
    codes, audio = _reference(csm, csm_ref, [_turn(1, "Hello there.")])
    np.testing.assert_array_equal(greedy.codes, codes)
    assert greedy.pcm.dtype == np.float32 and greedy.pcm.ndim == 1
    assert greedy.pcm.shape == audio.shape
    np.testing.assert_allclose(greedy.pcm, audio, atol=1e-6, rtol=0)
    assert greedy.sample_rate == 24000 and greedy.channels == 1
    assert greedy.duration == pytest.approx(MAX_DURATION)
    assert greedy.stop_reason == "max_duration"
    assert np.abs(greedy.pcm).max() <= 1.0


def test_context_conditions_and_matches_reference(csm, csm_ref, greedy):
    from media import Audio

    rng = np.random.default_rng(0)
    earlier = Audio.from_array((0.1 * rng.standard_normal(12000)).astype(np.float32), 24000)
    context = [(0, "How are you?", earlier), (1, "Fine.", greedy)]
    ours = csm.speak("Hello there.", 1, max_duration=MAX_DURATION, temperature=0, context=context)
    assert not np.array_equal(ours.codes, greedy.codes)
    conversation = [
        _turn(0, "How are you?", earlier.mono_at(24000)),
        _turn(1, "Fine.", greedy.pcm),
        _turn(1, "Hello there."),
    ]
    codes, audio = _reference(csm, csm_ref, conversation)
    np.testing.assert_array_equal(ours.codes, codes)
    np.testing.assert_allclose(ours.pcm, audio, atol=1e-6, rtol=0)


class _ForceEos:
    """Forward hooks that make lm_head pick code 0 from its ``after``-th call on, and the depth decoder
    pick 0 from then: an all-eos frame after ``after`` normal frames (same hooks on both sides)."""

    def __init__(self, model, after: int):
        self.after, self.calls, self.on = after, 0, False
        self.handles = [
            model.lm_head.register_forward_hook(self._backbone),
            model.depth_decoder.codebooks_head.register_forward_hook(self._depth),
        ]

    def _backbone(self, module, args, out):
        self.calls += 1
        if self.calls > self.after:
            self.on = True
            out = out.clone()
            out[..., 0] = 1e4
        return out

    def _depth(self, module, args, out):
        if self.on:
            out = out.clone()
            out[..., 0] = 1e4
        return out

    def remove(self):
        for h in self.handles:
            h.remove()


def test_stops_at_eos_frame_like_reference(csm, csm_ref):
    hooks = _ForceEos(csm.hf, after=3)
    try:
        ours = csm.speak("Hello there.", 1, max_duration=MAX_DURATION, temperature=0)
    finally:
        hooks.remove()
    assert ours.stop_reason == "eos"
    assert len(ours.codes) == 4 and (ours.codes[-1] == 0).all()
    assert len(ours.pcm) == 3 * csm.samples_per_frame  # the eos frame is not voiced
    hooks = _ForceEos(csm_ref[0], after=3)  # one lm_head call per frame on both sides
    try:
        codes, audio = _reference(csm, csm_ref, [_turn(1, "Hello there.")])
    finally:
        hooks.remove()
    np.testing.assert_array_equal(ours.codes, codes)
    np.testing.assert_allclose(ours.pcm, audio, atol=1e-6, rtol=0)


def test_stop_rule_units():
    assert is_end_frame([0, 0, 0, 5], 0)  # the reference checks codebooks 0..n-2
    assert not is_end_frame([0, 1, 0, 0], 0)
    codes = np.array([[1, 2, 3, 4], [0, 0, 0, 5], [0, 0, 0, 0], [7, 7, 7, 7]])
    assert audio_cutoff(codes, 0) == 2  # audio ends before the first ALL-eos frame
    assert audio_cutoff(codes[:2], 0) == 2
    assert audio_cutoff(np.zeros((0, 4), dtype=int), 0) == 0


@pytest.mark.parametrize("seconds", [0.08, 0.3, 0.4])
def test_max_duration_respected(csm, seconds):
    s = csm.speak("Hi.", max_duration=seconds, temperature=0)
    frames = math.ceil(seconds * 12.5)
    assert len(s.codes) <= frames
    assert s.duration <= frames / 12.5 + 1e-9
    if s.stop_reason == "max_duration":
        assert len(s.codes) == frames


def test_sampling_is_seeded_and_stays_in_codebook(csm, greedy):
    a = csm.speak("Hello there.", 1, max_duration=MAX_DURATION, temperature=0.9, top_k=20, seed=7)
    b = csm.speak("Hello there.", 1, max_duration=MAX_DURATION, temperature=0.9, top_k=20, seed=7)
    np.testing.assert_array_equal(a.codes, b.codes)
    assert not np.array_equal(a.codes, greedy.codes)
    assert a.codes.max() < csm.codebook_size


def test_a_vanishing_temperature_speaks_greedily(csm, greedy):
    """5e-324 made the frame head's softmax NaN (the fuzzer's HTTP 500); under the text
    engine's ``GREEDY_BELOW`` it is greedy, as there."""
    tiny = csm.speak("Hello there.", 1, max_duration=MAX_DURATION, temperature=5e-324, seed=1)
    np.testing.assert_array_equal(tiny.codes, greedy.codes)


def test_default_sampling_follows_generation_config(csm):
    backbone, depth = csm._sampling(None, None)  # the tiny checkpoint says nothing: greedy as generate
    assert not backbone.do_sample and not depth.do_sample
    backbone, depth = csm._sampling(0.7, None)
    assert backbone.do_sample and backbone.temperature == 0.7 and backbone.top_k == 50


# -- streaming -----------------------------------------------------------------------------------


def test_stream_joins_to_clip_and_starts_early(csm, greedy):
    before = csm.frames_generated  # model-wide: every request's frames
    stream = csm.speak_stream("Hello there.", 1, max_duration=MAX_DURATION, temperature=0, chunk_frames=2)
    first = next(stream)
    frames_at_first_chunk = csm.frames_generated - before
    rest = list(stream)
    # the first chunk (2 frames) comes before the clip is done; frames run ahead of the
    # chunk decode, so a few more may be made by then
    assert 2 <= frames_at_first_chunk < FRAMES and csm.frames_generated - before == FRAMES
    chunks = [first, *rest]
    assert all(c.dtype == np.float32 and len(c) == 2 * csm.samples_per_frame for c in chunks)
    joined = np.concatenate(chunks)
    assert joined.shape == greedy.pcm.shape
    np.testing.assert_allclose(joined, greedy.pcm, atol=STREAM_ATOL, rtol=0)


# -- formats -------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus"])
def test_formats_decode_back(greedy, fmt):
    from media import Audio

    data = greedy.encode(fmt)
    back = Audio.from_bytes(data)
    assert back.sample_rate == 24000 and back.channels == 1
    assert abs(back.duration - greedy.duration) <= FORMAT_DURATION_TOL
    if fmt in ("wav", "flac"):
        np.testing.assert_allclose(back.mono_at(24000), greedy.pcm, atol=1.5 / 32767)


def test_pcm_and_wav(greedy):
    raw = np.frombuffer(greedy.encode("pcm"), dtype="<f4")
    np.testing.assert_array_equal(raw, greedy.pcm)
    assert greedy.num_samples == len(greedy.pcm) == len(raw)  # samples, not codec frames
    assert greedy.num_samples == len(greedy.codes) * 1920
    assert len(greedy.encode("s16le")) == 2 * len(greedy.pcm)
    assert greedy.to_wav() == greedy.encode("wav") and greedy.to_wav()[:4] == b"RIFF"


# -- errors --------------------------------------------------------------------------------------


def test_typed_errors(csm, greedy):
    with pytest.raises(EmptyTextError) as e:
        csm.speak("   ")
    assert e.value.code == "empty_text"
    with pytest.raises(TextTooLongError) as e:
        csm.speak("word " * (MAX_SPEECH_TEXT_TOKENS + 10))
    assert e.value.code == "text_too_long" and e.value.details["limit"] == MAX_SPEECH_TEXT_TOKENS
    for bad in (-1, 10, 1.5, True, "narrator", None):
        with pytest.raises(UnsupportedVoiceError) as e:
            csm.speak("Hi.", bad)
        assert e.value.code == "unsupported_voice"
    assert csm.speaker_id("alternate") == 1 and csm.speaker_id("3") == 3
    for bad in (0, -1.0, float("nan"), "1"):
        with pytest.raises(InvalidDurationError) as e:
            csm.speak("Hi.", max_duration=bad)
        assert e.value.code == "invalid_max_duration"
    with pytest.raises(UnsupportedAudioFormatError) as e:
        greedy.encode("aiff")
    assert e.value.code == "unsupported_audio_format"
    with pytest.raises(InvalidDurationError):  # stream checks run at the call, not at first next()
        csm.speak_stream("Hi.", max_duration=0)


def test_load_of_a_model_without_speech_head(tiny_dir):
    qwen = tiny_dir("tiny-qwen3-vl")
    with pytest.raises(NoSpeechHeadError) as e:
        SpeechModel.load(qwen)
    assert e.value.code == "no_speech_head" and qwen.name in str(e.value)


def test_speech_errors_share_one_base_and_stay_invalid_requests():
    for cls in (
        EmptyTextError,
        TextTooLongError,
        UnsupportedVoiceError,
        UnsupportedAudioFormatError,
        InvalidDurationError,
        NoSpeechHeadError,
    ):
        assert issubclass(cls, SpeechError) and issubclass(cls, PieMediaError)
        assert issubclass(cls, InvalidRequestError)


def test_stream_arguments_are_checked(csm):
    for bad in (0, 1.5, True, "2"):
        with pytest.raises(InvalidRequestError, match="chunk_frames"):
            csm.speak_stream("Hi.", chunk_frames=bad)
    with pytest.raises(InvalidRequestError, match="context_frames"):
        csm.speak_stream("Hi.", context_frames=-1)
    with pytest.raises(InvalidRequestError, match="temperature"):
        csm.speak("Hi.", temperature=-0.5)
    with pytest.raises(InvalidRequestError, match="top_k"):
        csm.speak("Hi.", temperature=0.5, top_k=0)
