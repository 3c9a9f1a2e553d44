"""``pie:core/media``: images, videos and audio decoded from bytes and prepared for a model
(on the run's worker thread, off the event loop), with Pie's facts: token-count (the
placeholder rows a pass places), position-span (how far the position cursor moves),
grid, and the model's prefix / suffix delimiter tokens (the caller places those itself).

Beyond Pie: any format pie-media's media layer reads (PNG/JPEG/WebP/GIF/AVIF..., MP4 /
WebM / MKV / animated images as video, WAV/FLAC/MP3/OGG/AAC/M4A... as audio). A video's
frames are images with their timestamps; ``frame(i)`` is frame i prepared alone."""

from __future__ import annotations

from typing import Any

from inferlets.host.binding import Interface, Resource, wit
from inferlets.host.pie_core.model import ModelRes
from media import InvalidRequestError


class PreparedMedia(Resource):
    """A media item prepared for one model (an image, an audio clip, or, for pie-media's own
    world, a whole video)."""

    def __init__(self, model: Any, prepared: Any):
        self.model = model
        self.prepared = prepared

    def placed(self, model: Any) -> Any:
        if model is not self.model:
            raise InvalidRequestError(
                f"this {self.prepared.kind} was prepared for another model; prepare it on this one"
            )
        return self.prepared

    def span(self) -> Any:
        from engine.forward_pass import placeholder_span

        return placeholder_span(self.prepared)


class ImageRes(PreparedMedia):
    WIT = ("pie:core/media", "image")


class AudioRes(PreparedMedia):
    WIT = ("pie:core/media", "audio")


class VideoRes(Resource):
    WIT = ("pie:core/media", "video")

    def __init__(self, model: Any, video: Any, frames: list[Any], timestamps: list[float]):
        self.model = model
        self.video = video
        self.frames = frames  # decoded frames (media.Image), prepared on demand
        self.timestamps = timestamps


class Media(Interface):
    NAME = "pie:core/media"
    RESOURCES = (ImageRes, VideoRes, AudioRes)

    def model_for(self, m: ModelRes, kind: str) -> Any:
        """The text model behind ``m``, if it takes ``kind`` (a video: as frames of images)."""
        model = self.host.text_model(m)
        if kind not in model.media_kinds and not (kind == "video" and "image" in model.media_kinds):
            raise InvalidRequestError(
                f"model {m.name!r} takes no {kind} (it takes: {sorted(model.media_kinds) or 'text only'})"
            )
        return model

    @wit("[static]image.from-bytes")
    def image_from_bytes(self, m: ModelRes, data: bytes) -> ImageRes:
        from media import Image

        model = self.model_for(m, "image")
        self.host.state.buffer(data, "image bytes")
        return ImageRes(model, model.prepare(Image.from_bytes(bytes(data))))

    @wit("[method]image.token-count")
    def image_token_count(self, i: ImageRes) -> int:
        return int(i.span().num_rows)

    @wit("[method]image.position-span")
    def image_position_span(self, i: ImageRes) -> int:
        return int(i.span().position_span)

    @wit("[method]image.grid")
    def image_grid(self, i: ImageRes) -> tuple[int, int, int]:
        t, h, w = (int(x) for x in i.prepared.grid)
        return (t, h, w)

    @wit("[method]image.prefix-tokens")
    def image_prefix(self, i: ImageRes) -> list[int]:
        return [int(x) for x in i.prepared.prefix_tokens]

    @wit("[method]image.suffix-tokens")
    def image_suffix(self, i: ImageRes) -> list[int]:
        return [int(x) for x in i.prepared.suffix_tokens]

    @wit("[static]video.from-bytes")
    def video_from_bytes(self, m: ModelRes, data: bytes, max_frames: int) -> VideoRes:
        from media import Image, Video

        model = self.model_for(m, "image")
        self.host.state.buffer(data, "video bytes")
        video = Video.from_bytes(bytes(data))
        sampled = video.sample(max_frames=int(max_frames) or 32)
        frames = [Image.from_array(f) for f in sampled.frames]
        stamps = [float(t) for t in sampled.timestamps]
        if not frames:
            raise InvalidRequestError("the video has no frames")
        return VideoRes(model, video, frames, stamps)

    @wit("[method]video.frame-count")
    def video_frame_count(self, v: VideoRes) -> int:
        return len(v.frames)

    @wit("[method]video.frame")
    def video_frame(self, v: VideoRes, index: int) -> ImageRes:
        if not 0 <= index < len(v.frames):
            raise InvalidRequestError(f"frame {index} is outside 0..{len(v.frames) - 1}")
        return ImageRes(v.model, v.model.prepare(v.frames[index]))

    @wit("[method]video.timestamp")
    def video_timestamp(self, v: VideoRes, index: int) -> float:
        if not 0 <= index < len(v.frames):
            raise InvalidRequestError(f"frame {index} is outside 0..{len(v.frames) - 1}")
        return float(v.timestamps[index])

    @wit("[static]audio.from-bytes")
    def audio_from_bytes(self, m: ModelRes, data: bytes) -> AudioRes:
        from media import Audio

        model = self.model_for(m, "audio")
        self.host.state.buffer(data, "audio bytes")
        return AudioRes(model, model.prepare(Audio.from_bytes(bytes(data))))

    @wit("[method]audio.token-count")
    def audio_token_count(self, a: AudioRes) -> int:
        return int(a.span().num_rows)

    @wit("[method]audio.position-span")
    def audio_position_span(self, a: AudioRes) -> int:
        return int(a.span().position_span)

    @wit("[method]audio.prefix-tokens")
    def audio_prefix(self, a: AudioRes) -> list[int]:
        return [int(x) for x in a.prepared.prefix_tokens]

    @wit("[method]audio.suffix-tokens")
    def audio_suffix(self, a: AudioRes) -> list[int]:
        return [int(x) for x in a.prepared.suffix_tokens]
