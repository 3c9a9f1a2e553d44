"""``media``: decode bytes and prepare them for a model (on the run's worker thread, off
the event loop); a handle keeps the prepared item, which contexts then place. A thin layer
over Pie's ``pie:core/media`` host calls (``pie_core/media.py``)."""

from __future__ import annotations

from typing import Any

from inferlets.host.pie_core.media import Media, PreparedMedia
from inferlets.host.state import RunState
from inferlets.host.wit_values import record


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
        self.pie = Media(run.pie)

    def _add(self, make: Any, model: str, data: bytes) -> int:
        self.run.handles.ensure_room()  # refuse before the costly part
        item = make(self.run.pie.model_res(model), data)
        self.run.check()
        return self.run.handles.add("media", item)

    def image_from_bytes(self, model: str, data: bytes) -> int:
        return self._add(self.pie.image_from_bytes, model, data)

    def audio_from_bytes(self, model: str, data: bytes) -> int:
        return self._add(self.pie.audio_from_bytes, model, data)

    def video_from_bytes(self, model: str, data: bytes, max_frames: int) -> int:
        """A whole video prepared as one item (Pie's world gives frames instead)."""
        from media import Video

        def make(m: Any, data: bytes) -> PreparedMedia:
            model = self.pie.model_for(m, "video")
            self.run.buffer(data, "video bytes")
            params = {"max_frames": max_frames} if max_frames else {}
            return PreparedMedia(model, model.prepare(Video.from_bytes(bytes(data)), **params))

        return self._add(make, model, data)

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
