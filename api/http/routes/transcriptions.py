"""``POST /v1/audio/transcriptions`` and ``POST /v1/audio/translations``: OpenAI's
speech-to-text API over an audio-in chat model (``engine.transcription``).

A multipart upload (``file`` plus the form fields) is decoded by the media layer (any
audio file, or a video container's audio track), cut into pieces the audio tower takes
whole, and every piece transcribed at once. ``response_format`` json, text, verbose_json
(segments: the pieces, with their times), srt or vtt (a cue per piece); ``stream=true``
sends OpenAI's ``transcript.text.delta`` events and one ``transcript.text.done``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request, Response

from api.http.deps import Service, get_service, multipart_body, receive_upload
from api.http.disconnect import cancel_on_disconnect
from api.http.schemas.transcriptions import (
    DEFAULT_MAX_TOKENS,
    TranscriptionForm,
    TranscriptionJson,
    TranscriptionSegment,
    TranscriptionUsage,
    TranscriptionVerbose,
)
from api.http.sse import EventStream, Last, error_event
from engine import CompletionParams, InvalidRequestError, Sampler
from engine.transcription import Task, Transcript, Transcription
from media import open_media

router = APIRouter(tags=["audio"])
FORM = multipart_body(
    model="string",
    language="string",
    prompt="string",
    response_format="string",
    temperature="number",
    stream="boolean",
    seed="integer",
    max_tokens="integer",
)
RESPONSES = {
    200: {
        "content": {"application/json": {}, "text/plain": {}, "text/event-stream": {}},
        "description": "JSON, text (text, srt, vtt) or SSE events when stream=true",
    },
    **Service.error_responses(400, 401, 404, 413, 415, 429),
}


@router.post("/v1/audio/transcriptions", responses=RESPONSES, openapi_extra=FORM)
async def transcriptions(request: Request, service: Service = Depends(get_service)) -> Response:
    return await _handle(request, service, "transcribe")


@router.post("/v1/audio/translations", responses=RESPONSES, openapi_extra=FORM)
async def translations(request: Request, service: Service = Depends(get_service)) -> Response:
    return await _handle(request, service, "translate")


async def _handle(request: Request, service: Service, task: Task) -> Response:
    form = await receive_upload(request, service)
    try:
        fields = TranscriptionForm.of(form.fields)
        if len(form.files) != 1:
            raise InvalidRequestError(f"send one audio file, got {len(form.files)}", param="file")
        served = service.models.get(fields.model or _default_model(service), kind="chat")
        limit = service.settings.max_tokens_limit
        max_tokens = fields.max_tokens if fields.max_tokens is not None else min(DEFAULT_MAX_TOKENS, limit)
        if not 1 <= max_tokens <= limit:
            raise InvalidRequestError(f"max_tokens must be in 1..{limit}", param="max_tokens", limit=limit)
        data = await asyncio.to_thread(form.files[0].path.read_bytes)
    finally:
        form.cleanup()
    audio = await asyncio.to_thread(open_media, data, service.media.limits, "audio")
    params = CompletionParams(
        sampler=Sampler.greedy() if fields.temperature == 0 else Sampler(temperature=fields.temperature),
        max_tokens=max_tokens,
        seed=fields.seed,
        adapters=((served.adapter, 1.0),) if served.adapter is not None else (),
    )
    run = Transcription(
        served.model, audio, task=task, language=fields.language, prompt=fields.prompt, params=params
    )
    admission = served.admit()
    try:
        if fields.stream:
            await run.start()  # prompt errors become a status, not a broken stream
            return EventStream(_sse(run, admission), headers={"Cache-Control": "no-cache"})
        try:
            transcript = await cancel_on_disconnect(request, run.result())
        finally:
            await run.aclose()
            admission.release()
        return _answer(transcript, fields, task)
    except BaseException:
        await run.aclose()
        admission.release()
        raise


def _default_model(service: Service) -> str:
    """The first served chat model that takes audio (the form's ``model`` overrides it)."""
    for m in service.models.of_kind("chat"):
        if "audio" in m.model.media_kinds:
            return m.name
    raise InvalidRequestError("no served model takes audio; name one in the model field", param="model")


def _usage(t: Transcript) -> TranscriptionUsage:
    return TranscriptionUsage(
        input_tokens=t.prompt_tokens,
        output_tokens=t.completion_tokens,
        total_tokens=t.prompt_tokens + t.completion_tokens,
    )


def _answer(t: Transcript, fields: TranscriptionForm, task: Task) -> Response:
    fmt = fields.response_format
    if fmt == "text":
        return Response(t.text, media_type="text/plain; charset=utf-8")
    if fmt in ("srt", "vtt"):
        return Response(_cues(t, fmt), media_type="text/plain; charset=utf-8")
    if fmt == "json":
        body: Any = TranscriptionJson(text=t.text, usage=_usage(t))
    else:
        body = TranscriptionVerbose(
            task=task,
            language=fields.language or "unknown",
            duration=t.duration,
            text=t.text,
            segments=[
                TranscriptionSegment(
                    id=s.id,
                    seek=round(s.start * 100),
                    start=s.start,
                    end=s.end,
                    text=s.text,
                    tokens=list(s.tokens),
                    temperature=fields.temperature,
                    avg_logprob=s.avg_logprob,
                )
                for s in t.segments
            ],
            usage=_usage(t),
        )
    return Response(body.model_dump_json(), media_type="application/json")


def _clock(seconds: float, sep: str) -> str:
    ms = round(seconds * 1000)
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, ms = divmod(rest, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def _cues(t: Transcript, fmt: str) -> str:
    """SubRip or WebVTT: one cue per piece that has text."""
    sep = "," if fmt == "srt" else "."
    cues = []
    for n, s in enumerate((s for s in t.segments if s.text), start=1):
        head = f"{n}\n" if fmt == "srt" else ""
        cues.append(f"{head}{_clock(s.start, sep)} --> {_clock(s.end, sep)}\n{s.text}\n")
    body = "\n".join(cues)
    return f"WEBVTT\n\n{body}" if fmt == "vtt" else body


async def _sse(run: Transcription, admission: Any) -> AsyncIterator[str]:
    try:
        async for ev in run.events():
            if ev.text:
                yield "data: " + json.dumps({"type": "transcript.text.delta", "delta": ev.text}) + "\n\n"
        t = await run.result()
        done = {"type": "transcript.text.done", "text": t.text, "usage": _usage(t).model_dump()}
        yield Last("data: " + json.dumps(done) + "\n\n")
    except asyncio.CancelledError:
        raise
    except Exception as e:  # the status line is gone; tell the client in the stream
        yield Last(error_event(e))
    finally:
        await run.aclose()
        admission.release()
