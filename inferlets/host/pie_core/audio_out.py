"""``pie:core/audio-out``: speech from a CSM model (``speech.SpeechModel.speak``: the same
engine path, admission and pages as ``/v1/audio/speech``), as Pie's ``speech`` resource:
sample-rate, channels, duration-ms and the PCM as f32 samples. ``voice``: ``speaker(n)``,
or ``named(s)`` (a digit string is that speaker). Clips are capped by the run's
``max_speech_s``."""

from __future__ import annotations

from typing import Any

import numpy as np
from wasmtime import component as wc

from inferlets.host.binding import Interface, Resource, wit
from inferlets.host.errors import InferletLimitError
from inferlets.host.pie_core.model import ModelRes
from media import InvalidRequestError


class SpeechRes(Resource):
    WIT = ("pie:core/audio-out", "speech")

    def __init__(self, clip: Any):
        self.clip = clip


class AudioOut(Interface):
    NAME = "pie:core/audio-out"
    RESOURCES = (SpeechRes,)

    @wit("[static]speech.generate")
    def generate(self, m: ModelRes, req: Any) -> SpeechRes:
        from speech import SpeechModel

        st = self.host.state
        if not isinstance(m.model, SpeechModel):
            raise InvalidRequestError(f"model {m.name!r} does not speak; load a speech model (CSM)")
        text = st.text(req.text, "the text to speak")
        # wasmtime-py tags a variant only when two cases share a payload type: voice's
        # speaker(u32) / named(string) arrive as a bare int or str.
        voice = req.voice
        if isinstance(voice, wc.Variant):
            voice = voice.payload if voice.tag == "speaker" else str(voice.payload)
        if isinstance(voice, int):
            speaker: Any = int(voice)
        else:
            name = str(voice)
            speaker = int(name) if name.isdigit() else name
        cap = st.limits.max_speech_s
        ms = getattr(req, "max-duration-ms")
        if ms is not None and ms / 1000 > cap:
            raise InferletLimitError(
                f"max-duration-ms {ms} is over the limit of {int(cap * 1000)}", limit=cap
            )
        clip = m.model.speak(text, speaker=speaker, max_duration=cap if ms is None else ms / 1000)
        st.check()
        return SpeechRes(clip)

    @wit("[method]speech.sample-rate")
    def sample_rate(self, s: SpeechRes) -> int:
        return int(s.clip.sample_rate)

    @wit("[method]speech.channels")
    def channels(self, s: SpeechRes) -> int:
        return int(s.clip.channels)

    @wit("[method]speech.duration-ms")
    def duration_ms(self, s: SpeechRes) -> int:
        return int(round(float(s.clip.duration) * 1000))

    @wit("[method]speech.pcm")
    def pcm(self, s: SpeechRes) -> list[float]:
        return np.ascontiguousarray(s.clip.pcm, dtype=np.float32).reshape(-1).tolist()
