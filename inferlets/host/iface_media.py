"""``media``: decode bytes and prepare them for a model (on the run's worker thread, off
the event loop); a handle keeps the ``Prepared`` item, which contexts then place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inferlets.host.state import RunState
from inferlets.host.wit_values import record


@dataclass(frozen=True)
class MediaItem:
    model_name: str
    model: Any
    prepared: Any


class MediaCalls:
    FUNCS = {
        "image-from-bytes": ("image_from_bytes", False, True),
        "video-from-bytes": ("video_from_bytes", False, True),
        "audio-from-bytes": ("audio_from_bytes", False, True),
        "info": ("info", True, True),
        "drop": ("drop", False, True),
    }

    def __init__(self, run: RunState):
        self.run = run

    def _add(self, model: str, data: bytes, decode: Any, **params: Any) -> int:
        from engine import Model

        self.run.buffer(data, "media bytes")
        m = self.run.model(model, Model)
        self.run.handles.ensure_room()  # refuse before the costly part
        prepared = m.prepare(decode(bytes(data)), **params)
        self.run.check()
        return self.run.handles.add("media", MediaItem(model, m, prepared))

    def image_from_bytes(self, model: str, data: bytes) -> int:
        from media import Image

        return self._add(model, data, Image.from_bytes)

    def video_from_bytes(self, model: str, data: bytes, max_frames: int) -> int:
        from media import Video

        params = {"max_frames": max_frames} if max_frames else {}
        return self._add(model, data, Video.from_bytes, **params)

    def audio_from_bytes(self, model: str, data: bytes) -> int:
        from media import Audio

        return self._add(model, data, Audio.from_bytes)

    def info(self, h: int) -> Any:
        p = self.run.handles.get(h, "media").prepared
        frames = 0
        if p.kind == "video":
            frames = len(p.meta.get("frame_indices", ())) or int(p.grid[0])
        return record(
            kind=p.kind,
            token_count=int(p.token_count),
            rows=int(p.num_rows),
            grid=tuple(int(x) for x in p.grid),
            position_span=int(p.position_span),
            frame_count=frames,
            timestamps=[float(t) for t in p.timestamps or ()],
        )

    def drop(self, h: int) -> None:
        self.run.handles.drop(h, "media")
