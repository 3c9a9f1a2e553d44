"""The frame loop of one speech request over the engine's pages and scheduler.

The prompt is prefilled in chunks (``max_prefill_rows``) after taking whatever leading
pages the prefix cache holds for it; its last chunk asks for a frame (a "head" step:
``speech.frame_head``). Every further frame is one backbone row (the previous frame's
embedding) plus the head, submitted to the model's scheduler, so all streams' steps share
passes (continuous batching) and their depth-decoder steps run batched. Only the prompt's
full pages are published for reuse; generated frames are one request's own.

Pages come back when the generator ends, is closed (``aclose``) or its task is cancelled:
at once when no step is in flight, else once the pass writing them is over.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

import torch

from engine import KVPool, PageTable, Scheduler, StepInput
from speech.frame_head import FrameResult
from speech.job import SpeechJob


class FrameModel(Protocol):
    """What the loop needs of ``speech.model.SpeechModel`` (not imported: it builds on this)."""

    pool: KVPool
    scheduler: Scheduler
    max_prefill_rows: int
    stats: Any
    eos_id: int
    frame_token_id: int


def is_end_frame(frame: list[int], eos_id: int) -> bool:
    """The reference's stop rule: codebooks 0..n-2 all equal the codebook eos id."""
    return all(int(c) == eos_id for c in list(frame)[:-1])


async def frames(model: FrameModel, job: SpeechJob) -> AsyncIterator[list[int]]:
    """Yield the frames of ``job``; the last is the end frame or the ``max_frames``-th."""
    table = PageTable(model.pool)
    scheduler = model.scheduler
    rows, n = job.rows, len(job.rows)
    ids = [r.token for r in rows]
    in_flight = False
    try:
        done = table.reuse(rows, 0, limit=n - 1)
        model.stats.prompt_rows += n
        model.stats.reused_rows += done
        result: FrameResult | None = None
        while done < n:
            end = min(n, done + model.max_prefill_rows)
            last = end == n
            table.reserve(done, end)
            step = StepInput(
                tokens=ids[done:end],
                positions=torch.arange(done, end)[None],
                kv_start=done,
                pages=table.covering(end),
                embeds=job.embeds[done:end],
                logits="head" if last else "none",
                head=job.request if last else None,
            )
            in_flight = True
            result = await scheduler.submit(step)
            in_flight = False
            done = end
            table.publish(rows, end)
        for i in range(job.max_frames):
            assert result is not None
            codes = result.codes
            model.stats.frames += 1
            yield codes
            if i == job.max_frames - 1 or is_end_frame(codes, model.eos_id):
                return
            row = n + i
            table.reserve(row, row + 1)
            step = StepInput(
                tokens=[model.frame_token_id],
                positions=torch.tensor([[row]]),
                kv_start=row,
                pages=table.covering(row + 1),
                embeds=result.embeds[None],
                logits="head",
                head=job.request,
            )
            in_flight = True
            result = await scheduler.submit(step)
            in_flight = False
    finally:
        if in_flight:  # cancelled while its pass runs: the pass still writes these pages
            try:
                await scheduler.pass_over()
            except BaseException:  # cancelled again: release when that pass is over
                scheduler.after_pass(table.release)
                raise
        table.release()
