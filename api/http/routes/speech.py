"""``POST /v1/audio/speech`` (OpenAI's text-to-speech) and ``GET /v1/audio/voices``.

Speech requests run on the speech model's engine, on the server's event loop: every
request's frames share batched passes with the others' (``speech.frames``). The request is
checked and its prompt embedded off the loop, then admitted twice, before any byte is sent:
the served model's concurrency limit and the speech model's own capacity (KV pages, the
measured frame time at the new batch size against real time, an optional stream cap:
``speech.admission``).

- A *stream* the client asked for (SSE, ``stream_format`` given, ``?stream=true``: real
  time promised) is admitted at once or refused at once: 429 with an estimated Retry-After
  and the bound as ``reason`` ("pages", "time", "max_streams"); the time rule keeps every
  running stream in real time. A plain request of a streamable format (no such ask: most
  clients read the body whole) is sent as generated but admitted like a whole answer.
- A *whole* answer (``wav``/``flac``, or any format with ``?stream=false``: the file sent
  once complete, with its length) has no real-time deadline: it joins the batch (the time
  rule only guards streams that are running), and past pages or ``--max-speech-streams``
  it waits in the model's FIFO queue (``speech_queue_size`` waiters, default 32) for up to
  ``speech_queue_timeout_s`` (default 30 s), then 429 with Retry-After; a full queue is
  429 ``reason: queue`` at once. A client that leaves while it waits leaves the queue.

/metrics shows each stream's real-time margin, the admissions by bound, the requests
waiting now and the longest wait (``api.http.metrics``).

``stream_format="audio"`` (the default) streams ``mp3``/``opus``/``aac``/``pcm`` in chunks as
frames are generated (chunked transfer); ``wav`` and ``flac`` are sent whole, once the clip is
complete, with their real length in the header (a streamed FLAC or WAV has no length, and
libsndfile refuses such a FLAC). ``"sse"`` sends ``speech.audio.delta`` events with base64
audio of any format, then ``speech.audio.done`` with usage. ``speed`` other than 1.0
time-stretches the whole clip with librosa's phase vocoder (pitch kept), so that clip is
sent once it is complete. A client that leaves ends its stream: the pages come back at once
(or when the pass writing them ends). Time to first audio is observed per request in
``pie_media_speech_time_to_first_audio_seconds``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response, StreamingResponse

from api.http.deps import Service, get_service
from api.http.disconnect import cancel_on_disconnect
from api.http.schemas.speech import SpeechRequest, VoiceList
from api.http.voices import VOICES, voice_list
from media import InvalidRequestError
from speech import StreamEncoder, UnsupportedVoiceError, encode_pcm

router = APIRouter(tags=["audio"])

MEDIA_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}
WHOLE_FORMATS = ("wav", "flac")
"""Sent whole (with their length) unless the client asks for SSE."""


@router.get("/v1/audio/voices", response_model=VoiceList, responses=Service.error_responses(401))
async def voices() -> VoiceList:
    return voice_list()


@router.post(
    "/v1/audio/speech",
    responses={
        200: {
            "content": {t: {} for t in {*MEDIA_TYPES.values(), "text/event-stream"}},
            "description": "the audio: streamed as it is generated, or whole for wav/flac",
        },
        **Service.error_responses(400, 401, 404, 429),
    },
)
async def speak(
    body: SpeechRequest,
    request: Request,
    service: Service = Depends(get_service),
    stream: bool | None = Query(
        default=None,
        description="false: send the whole file once complete, with its length; true: a stream "
        "that must keep real time (admitted at once or 429, as with stream_format given); "
        "default: wav/flac whole, other formats sent as generated, admitted like whole files "
        "(past capacity they wait in a bounded queue instead of a 429)",
    ),
) -> Response:
    started = time.perf_counter()
    if stream is False and body.stream_format == "sse":
        raise InvalidRequestError(
            "stream=false sends the whole file; stream_format 'sse' sends events as audio comes",
            param="stream",
        )
    served = service.models.get(body.model, kind="speech")
    model = served.model
    speaker = _speaker(body.voice)
    context = [
        (_speaker(t.voice) if t.voice is not None else speaker, t.text, await _context_audio(service, t))
        for t in body.context or []
    ]
    encoder = StreamEncoder(body.response_format, model.sample_rate)  # checks the format now
    whole = body.stream_format != "sse" and (body.response_format in WHOLE_FORMATS or stream is False)
    # Real time is promised (admitted at once or refused) only to a client that asks for a
    # stream: SSE, ``stream_format`` given, or ``?stream=true``. A plain request still gets
    # its audio as it is generated, but it joins the batch or waits in the queue like a
    # whole answer: nothing says it plays as it arrives (an SDK that reads the whole body).
    realtime = not whole and (
        body.stream_format == "sse" or stream is True or "stream_format" in body.model_fields_set
    )
    settings = service.settings
    admission = served.admit()
    try:
        # Checks (text length, voice, durations) run here, so they are a status, not a broken stream.
        job = await model.prepare_async(
            body.input,
            speaker,
            max_duration=body.max_duration,
            temperature=body.temperature,
            top_k=body.top_k,
            seed=body.seed,
            context=context,
        )
        if realtime:
            ticket = model.admit(job, wait=False)  # a stream: at once, or 429 now
        elif not whole:  # queued if need be, as long as the client stays
            ticket = await cancel_on_disconnect(
                request,
                model.admit_async(
                    job,
                    streamed=False,
                    timeout=settings.speech_queue_timeout_s,
                    queue_size=settings.speech_queue_size,
                ),
            )
    except BaseException:
        admission.release()
        raise
    if whole:
        # Queued for admission if need be, then one Mimi decode of the whole clip (``speak``'s
        # audio exactly), sent with its length; a client that leaves stops either.
        async def admitted_clip() -> Any:
            ticket = await model.admit_async(
                job,
                streamed=False,
                timeout=settings.speech_queue_timeout_s,
                queue_size=settings.speech_queue_size,
            )
            return await model.clip_async(job, ticket)  # releases the ticket when the frames end

        try:
            clip = await cancel_on_disconnect(request, admitted_clip())
            if len(clip.pcm):
                service.metrics.speech_ttfa.labels(served.name).observe(time.perf_counter() - started)
        finally:
            admission.release()
        pcm = clip.pcm if body.speed == 1.0 else await asyncio.to_thread(_stretch, clip.pcm, body.speed)
        if body.response_format in WHOLE_FORMATS:
            data = await asyncio.to_thread(encode_pcm, pcm, model.sample_rate, body.response_format)
        else:  # the bytes a stream of this format carries, at once
            data = await asyncio.to_thread(_encode_whole, encoder, pcm)
        return Response(data, media_type=MEDIA_TYPES[body.response_format])
    timed = _Timed(model.stream_async(job, ticket), admission, service, served.name, started)
    chunks: AsyncIterator[np.ndarray] = timed
    if body.speed != 1.0:
        chunks = _stretched(timed, body.speed)
    if body.stream_format == "sse":
        return StreamingResponse(
            _sse(_encoded(chunks, encoder), job.text_tokens, timed, model),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    return StreamingResponse(_encoded(chunks, encoder), media_type=MEDIA_TYPES[body.response_format])


def _encode_whole(encoder: StreamEncoder, pcm: np.ndarray) -> bytes:
    return encoder.push(pcm) + encoder.close()


def _speaker(voice: str | int) -> int:
    if isinstance(voice, int) and not isinstance(voice, bool):
        key: Any = voice
    else:
        key = str(voice).strip().lower()
    if key in VOICES:
        return VOICES[key]
    if isinstance(key, int) and key in VOICES.values():
        return key
    raise UnsupportedVoiceError(
        f"unknown voice {voice!r}; valid voices: {', '.join(VOICES)} (GET /v1/audio/voices)",
        voice=str(voice),
        param="voice",
    )


async def _context_audio(service: Service, turn: Any) -> Any:
    if turn.audio is None:
        return None
    if turn.audio.startswith(("pie-media://", "data:", "https://", "http://", "file://")):
        return await service.media.from_url(turn.audio, "audio")
    return await service.media.from_base64(turn.audio, "audio")


def _stretch(pcm: np.ndarray, speed: float) -> np.ndarray:
    """Faster/slower with the pitch kept: librosa's phase-vocoder time stretch."""
    import librosa

    if len(pcm) < 2048:  # too short for the STFT window: nothing audible to stretch
        return pcm
    return np.clip(librosa.effects.time_stretch(pcm.astype(np.float32), rate=speed), -1.0, 1.0).astype(
        np.float32
    )


async def _joined(chunks: AsyncIterator[np.ndarray]) -> np.ndarray:
    return np.concatenate([c async for c in chunks] or [np.zeros(0, np.float32)])


async def _stretched(chunks: AsyncIterator[np.ndarray], speed: float) -> AsyncIterator[np.ndarray]:
    yield await asyncio.to_thread(_stretch, await _joined(chunks), speed)


async def _encoded(chunks: AsyncIterator[np.ndarray], encoder: StreamEncoder) -> AsyncIterator[bytes]:
    """Encoded pieces as PCM comes (encoding off the loop, except raw PCM)."""
    async for pcm in chunks:
        piece = encoder.push(pcm) if encoder.fmt == "pcm" else await asyncio.to_thread(encoder.push, pcm)
        if piece:
            yield piece
    tail = await asyncio.to_thread(encoder.close)
    if tail:
        yield tail


class _Timed:
    """The PCM stream of one request: counts samples (usage), observes the time to first
    audio, and gives the admission slot back however the stream ends."""

    def __init__(self, chunks: Any, admission: Any, service: Service, model: str, started: float):
        self.chunks = chunks
        self.admission = admission
        self.metrics = service.metrics
        self.model = model
        self.started = started
        self.samples = 0

    def __aiter__(self) -> AsyncIterator[np.ndarray]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[np.ndarray]:
        try:
            async for pcm in self.chunks:
                if self.samples == 0 and len(pcm):
                    self.metrics.speech_ttfa.labels(self.model).observe(time.perf_counter() - self.started)
                self.samples += len(pcm)
                yield pcm
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        try:
            await self.chunks.aclose()
        finally:
            self.admission.release()


async def _sse(
    pieces: AsyncIterator[bytes], input_tokens: int, counted: _Timed, model: Any
) -> AsyncIterator[str]:
    try:
        async for piece in pieces:
            event = {"type": "speech.audio.delta", "audio": base64.b64encode(piece).decode()}
            yield f"data: {json.dumps(event)}\n\n"
    except InvalidRequestError as e:
        yield f"data: {json.dumps({'type': 'error', 'error': e.to_dict()})}\n\n"
        return
    frames = -(-counted.samples // model.samples_per_frame)
    usage = {"input_tokens": input_tokens, "output_tokens": frames, "total_tokens": input_tokens + frames}
    yield f"data: {json.dumps({'type': 'speech.audio.done', 'usage': usage})}\n\n"
