"""``POST /v1/audio/speech`` (OpenAI's text-to-speech) and ``GET /v1/audio/voices``.

The audio is always sent as it is generated: ``stream_format="audio"`` (the default)
streams the encoded file in chunks (chunked transfer), ``"sse"`` sends
``speech.audio.delta`` events with base64 audio, then ``speech.audio.done`` with usage.
Generation runs on a worker thread (CSM's frame loop is synchronous); a client that
leaves stops it between chunks. ``speed`` other than 1.0 time-stretches the whole clip
with librosa's phase vocoder (pitch kept), so that clip is sent once it is complete.
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
from fastapi import APIRouter, Depends
from fastapi.responses import StreamingResponse

from api.http.deps import Service, get_service
from api.http.speech_schemas import SpeechRequest, VoiceList
from api.http.voices import VOICES, voice_list
from media import InvalidRequestError
from speech import StreamEncoder, UnsupportedVoiceError

router = APIRouter(tags=["audio"])

MEDIA_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}
_DONE = object()


@router.get("/v1/audio/voices", response_model=VoiceList, responses=Service.error_responses(401))
async def voices() -> VoiceList:
    return voice_list()


@router.post(
    "/v1/audio/speech",
    responses={
        200: {
            "content": {t: {} for t in {*MEDIA_TYPES.values(), "text/event-stream"}},
            "description": "the audio, streamed as it is generated",
        },
        **Service.error_responses(400, 401, 404, 429),
    },
)
async def speak(body: SpeechRequest, service: Service = Depends(get_service)) -> StreamingResponse:
    served = service.models.get(body.model, kind="speech")
    model = served.model
    speaker = _speaker(body.voice)
    context = [
        (_speaker(t.voice) if t.voice is not None else speaker, t.text, await _context_audio(service, t))
        for t in body.context or []
    ]
    kwargs = {
        "max_duration": body.max_duration,
        "temperature": body.temperature,
        "top_k": body.top_k,
        "seed": body.seed,
        "context": context,
    }
    encoder = StreamEncoder(body.response_format, model.sample_rate)  # checks the format now
    admission = served.admit()
    try:
        # Checks (text length, voice, durations) run here, so they are a status, not a broken stream.
        chunks = await asyncio.to_thread(_chunks, model, body, speaker, kwargs)
    except BaseException:
        admission.release()
        raise
    input_tokens = len(model.tokenizer.encode(body.input, add_special_tokens=False))
    counted = _Counted(chunks)
    pieces = _encoded(counted, encoder, admission)
    if body.stream_format == "sse":
        return StreamingResponse(
            _sse(pieces, input_tokens, counted, model),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    return StreamingResponse(pieces, media_type=MEDIA_TYPES[body.response_format])


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


def _chunks(model: Any, body: SpeechRequest, speaker: int, kwargs: dict[str, Any]) -> Iterator[np.ndarray]:
    """PCM chunks as CSM generates them (or the whole stretched clip when speed != 1)."""
    if body.speed != 1.0:
        clip = model.speak(body.input, speaker, **kwargs)
        return iter([_stretch(clip.pcm, body.speed)])
    return model.speak_stream(body.input, speaker, **kwargs)


def _stretch(pcm: np.ndarray, speed: float) -> np.ndarray:
    """Faster/slower with the pitch kept: librosa's phase-vocoder time stretch."""
    import librosa

    if len(pcm) < 2048:  # too short for the STFT window: nothing audible to stretch
        return pcm
    return np.clip(librosa.effects.time_stretch(pcm.astype(np.float32), rate=speed), -1.0, 1.0).astype(
        np.float32
    )


async def _encoded(chunks: Any, encoder: StreamEncoder, admission: Any) -> AsyncIterator[bytes]:
    """Encoded pieces as the worker thread produces PCM; leaving early stops the thread."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=8)
    stop = threading.Event()

    def produce() -> None:
        try:
            for pcm in iter(chunks):
                if stop.is_set():
                    break
                piece = encoder.push(pcm)
                asyncio.run_coroutine_threadsafe(queue.put(piece), loop).result()
            if not stop.is_set():
                asyncio.run_coroutine_threadsafe(queue.put(encoder.close()), loop).result()
        except BaseException as e:  # noqa: BLE001 - handed to the response side
            if not stop.is_set():
                asyncio.run_coroutine_threadsafe(queue.put(e), loop).result()
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:
                close()
            if not stop.is_set():
                asyncio.run_coroutine_threadsafe(queue.put(_DONE), loop).result()

    worker = loop.run_in_executor(None, produce)
    try:
        while True:
            item = await queue.get()
            if item is _DONE:
                break
            if isinstance(item, BaseException):
                raise item
            if item:
                yield item
    finally:
        stop.set()
        while not queue.empty():  # unblock a producer waiting on a full queue
            queue.get_nowait()
        admission.release()
        try:
            await asyncio.wait_for(asyncio.shield(worker), timeout=30)
        except (TimeoutError, Exception):  # noqa: BLE001 - the client is gone; nothing to report to
            pass


class _Counted:
    """Passes PCM chunks through, counting samples (for usage: codec frames generated)."""

    def __init__(self, chunks: Iterator[np.ndarray]):
        self.chunks = chunks
        self.samples = 0

    def __iter__(self) -> Iterator[np.ndarray]:
        for pcm in self.chunks:
            self.samples += len(pcm)
            yield pcm

    def close(self) -> None:
        close = getattr(self.chunks, "close", None)
        if close is not None:
            close()


async def _sse(
    pieces: AsyncIterator[bytes], input_tokens: int, counted: _Counted, model: Any
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
