"""``speech``: CSM text-to-speech, whole clips or a stream of PCM chunks, through the speech
model's blocking calls on the run's worker thread: the same engine path (pages, scheduler,
admission; a full model makes the call wait for a slot) as the HTTP endpoint and the CLI."""

from __future__ import annotations

from typing import Any

import numpy as np

from inferlets.host.errors import InferletLimitError
from inferlets.host.state import RunState
from inferlets.host.wit_values import field, record
from media import InvalidRequestError


def _pcm_bytes(pcm: np.ndarray) -> bytes:
    return np.ascontiguousarray(pcm, dtype="<f4").tobytes()


class SpeechCalls:
    FUNCS = {
        "speak": ("speak", True, True),
        "speak-stream": ("speak_stream", False, True),
        "next-chunk": ("next_chunk", False, True),
        "close-stream": ("close_stream", False, True),
    }

    def __init__(self, run: RunState):
        self.run = run
        self._streaming: set[int] = set()  # streams started (they hold the model's lock)

    def _model(self, name: str) -> Any:
        from speech import SpeechModel

        return self.run.model(name, SpeechModel)

    def _options(self, text: str, o: Any) -> dict[str, Any]:
        self.run.text(text)
        if self._streaming:
            # A started stream holds the speech model until it ends or is closed.
            raise InvalidRequestError("close this run's running speech stream before speaking again")
        cap = self.run.limits.max_speech_s
        duration = field(o, "max-duration")
        if duration is not None and duration > cap:
            raise InferletLimitError(f"max-duration {duration:g} s is over the limit of {cap:g} s", limit=cap)
        top_k = field(o, "top-k")
        speaker = field(o, "speaker") or "0"
        return {
            "speaker": int(speaker) if speaker.isdigit() else speaker,
            "temperature": field(o, "temperature"),
            "top_k": top_k,
            "seed": field(o, "seed"),
            "max_duration": cap if duration is None else duration,
        }

    def speak(self, model: str, text: str, options: Any) -> Any:
        m = self._model(model)
        clip = m.speak(text, **self._options(text, options))
        self.run.check()
        return record(
            sample_rate=int(clip.sample_rate),
            channels=int(clip.channels),
            duration=float(clip.duration),
            pcm=_pcm_bytes(clip.pcm),
            stop_reason=clip.stop_reason,
        )

    def speak_stream(self, model: str, text: str, options: Any, chunk_frames: int) -> int:
        m = self._model(model)
        kw = self._options(text, options)
        if chunk_frames:
            kw["chunk_frames"] = chunk_frames
        self.run.handles.ensure_room()  # refuse before the costly part
        return self.run.handles.add("speech-stream", m.speak_stream(text, **kw))

    def next_chunk(self, h: int) -> bytes:
        gen = self.run.handles.get(h, "speech-stream")
        if self._streaming - {h}:
            raise InvalidRequestError(
                "another speech stream of this run is running; finish or close it first"
            )
        self._streaming.add(h)
        chunk = next(gen, None)
        if chunk is None:
            self._streaming.discard(h)
            return b""
        self.run.check()
        return _pcm_bytes(chunk)

    def close_stream(self, h: int) -> None:
        self._streaming.discard(h)
        self.run.handles.drop(h, "speech-stream")
