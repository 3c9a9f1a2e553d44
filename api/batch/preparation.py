"""The CPU stage of a batch job: a ``Sample``'s bytes -> decoded media -> the model's
prepared inputs, per caption target (the whole media, or each video segment). Runs in
the pipeline's worker processes (or inline); knows no engine, only the encoder's
``prepare``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from api.batch.records import error_dict
from api.batch.samples import Sample, Segment, WorkItem
from api.batch.spec import CaptionSpec, MissingPromptFieldError
from media import PieMediaError, content_hash, open_media

DoneLookup = Callable[[str, str | None], int | None]
"""(key, content hash) -> None when the sample still needs work, else how many of its
recorded outcomes were errors."""


class Preparer:
    """``prepare(media, **params)`` is the model's (``Model.prepare``) or a weightless
    encoder's (``encoders.encoder_for(dir, load_weights=False)``): the same inputs."""

    def __init__(self, prepare: Callable[..., Any], family: str, spec: CaptionSpec):
        self.prepare = prepare
        self.family = family
        self.spec = spec
        self.video_params = spec.video_params(family)

    @classmethod
    def for_model_dir(cls, model_dir: str, spec: CaptionSpec) -> Preparer:
        """A weightless encoder of its own whose caches hold nothing: a batch job
        prepares each sample once (repeated content is reused by the job, by hash), so
        the encoder's content cache (1 GiB of prepared inputs by default) would only
        grow the process by that much as distinct samples go by."""
        from encoders import EncoderCache, encoder_for

        enc = encoder_for(model_dir, load_weights=False, cache=EncoderCache(0, 0))
        return cls(enc.prepare, enc.family, spec)

    def __call__(self, sample: Sample, done: DoneLookup | None = None) -> WorkItem:
        item = WorkItem(
            key=sample.key,
            shard=sample.shard,
            name=sample.name,
            content_hash=None,
            prompts=[],
            metadata=sample.metadata,
        )
        try:
            item.prompts = self.spec.prompts_for(sample.metadata)
        except MissingPromptFieldError as e:
            item.prompts = [""]
            item.error = {"code": e.code, "message": str(e)}
        if sample.error is not None or sample.data is None:
            item.error = item.error or sample.error or {"code": "missing_media", "message": "no media bytes"}
            if sample.data is not None:
                item.content_hash = content_hash(sample.data)
            return self._skip_if_done(item, done)
        data = sample.data
        try:
            media = open_media(data)
        except PieMediaError as e:
            item.content_hash = content_hash(data)
            item.error = item.error or e.to_dict()
            return self._skip_if_done(item, done)
        item.content_hash = media.content_hash
        item.kind = media.kind
        if item.error is not None:
            return self._skip_if_done(item, done)
        item = self._skip_if_done(item, done)
        if item.skip:
            return item
        try:
            if media.kind == "video" and (self.spec.segments or self.spec.scene_cuts):
                item.segments = self._segments(media)
            elif media.kind == "video":
                item.segments = [Segment(self.prepare(media, **self.video_params))]
            else:
                item.segments = [Segment(self.prepare(media))]
        except PieMediaError as e:
            item.error = e.to_dict()
        except Exception as e:  # an encoder's unexpected failure is this sample's record
            item.error = error_dict(e)
        return item

    def _segments(self, video: Any) -> list[Segment]:
        from api.batch.video_segments import VideoSegment, even_bounds, scene_bounds, segment_times

        frames = video.info.frame_count
        bounds = even_bounds(frames, self.spec.segments or 1) if self.spec.segments else scene_bounds(video)
        out = []
        for b in bounds:
            start, end = segment_times(video, b)
            try:
                out.append(Segment(self.prepare(VideoSegment(video, *b), **self.video_params), start, end))
            except PieMediaError as e:
                out.append(Segment(None, start, end, e.to_dict()))
        return out

    @staticmethod
    def _skip_if_done(item: WorkItem, done: DoneLookup | None) -> WorkItem:
        if done is not None:
            errors = done(item.key, item.content_hash)
            if errors is not None:
                item.skip, item.skip_errors = True, errors
                item.segments = []
        return item
