"""A prepared sample's records: one per prompt (and per video segment), a caption or a
typed error, made the same way by the single-process job and by the Ray caption actors
(so their outputs are equal)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from api.batch.captioner import Outcome, structured
from api.batch.records import error_dict, make_record
from api.batch.samples import WorkItem
from api.batch.spec import CaptionSpec

Outcomes = Callable[[WorkItem, int, Any], Awaitable[tuple[list[Outcome], bool]]]
"""(item, segment index, prepared) -> the prompts' outcomes and whether they were reused."""


@dataclass
class ItemRecords:
    records: list[dict[str, Any]] = field(default_factory=list)
    ran: bool = False
    """The model ran for this sample (not only reused earlier captions)."""
    reused: bool = False
    tokens: int = 0

    @property
    def failed(self) -> bool:
        return any("error" in r for r in self.records)


async def item_records(
    item: WorkItem, spec: CaptionSpec, settings: dict[str, Any], outcomes: Outcomes
) -> ItemRecords:
    t0 = time.perf_counter()
    segmented = bool(spec.segments or spec.scene_cuts)
    out = ItemRecords()

    def record(prompt: str, seg: Any, seg_index: int | None, **what: Any) -> dict[str, Any]:
        extra: dict[str, Any] = {"key": item.key, "shard": item.shard}
        if seg_index is not None:
            extra.update(segment=seg_index, start=seg.start, end=seg.end)
        return make_record(
            item.name, {**settings, "prompt": prompt}, content_hash=item.content_hash, extra=extra, **what
        )

    if item.error is not None or not item.segments:
        err = item.error or {"code": "no_segments", "message": "the video gave no segment to caption"}
        out.records = [record(p, None, None, error=err) for p in item.prompts]
        return out
    for i, seg in enumerate(item.segments):
        idx = i if segmented else None
        if seg.error is not None:
            out.records += [record(p, seg, idx, error=seg.error) for p in item.prompts]
            continue
        outs, was_reused = await outcomes(item, i, seg.prepared)
        out.ran, out.reused = out.ran or not was_reused, out.reused or was_reused
        for o in outs:
            if o.error is not None:
                out.records.append(record(o.prompt, seg, idx, error=error_dict(o.error)))
                continue
            out.tokens += o.tokens if not was_reused else 0
            rec = record(o.prompt, seg, idx, caption=o.text, elapsed_s=time.perf_counter() - t0)
            parsed = structured(o.text, spec)
            if parsed is not None:
                rec["structured"] = parsed
            out.records.append(rec)
    return out
