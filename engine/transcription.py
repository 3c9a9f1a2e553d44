"""Speech to text with an audio-in chat model (Gemma-4): a clip in, its words out.

The model hears the clip in a user turn with an instruction (``instruction``), and its
answer is the transcript (or, for ``translate``, the English translation). A clip longer
than the audio tower takes whole (Gemma-4: 30 s, past which the reference truncates) is
cut at its quietest moments (``media.split_audio``); every piece is transcribed at once,
so their passes batch, and the pieces' texts are joined by a space in order. Each piece is
one segment with its start and end in the clip: the timestamps of ``verbose_json``, SRT
and WebVTT are the pieces', not per word.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal

from engine.completion import ChoiceEvent, Completion, CompletionParams, Turn
from engine.errors import InvalidRequestError
from engine.model import Model
from media import Audio, split_audio

Task = Literal["transcribe", "translate"]
TASKS: tuple[str, ...] = ("transcribe", "translate")


def instruction(task: Task, language: str | None = None, prompt: str | None = None) -> str:
    """The text that goes with each piece of audio (``language``: the speech's, as an
    ISO-639 code, when the caller knows it; ``prompt``: words or earlier text to follow)."""
    if task == "translate":
        text = "Translate the speech in this audio into English. Answer with the translation only."
    else:
        text = "Transcribe the speech in this audio exactly as spoken. Answer with the transcript only."
    if language:
        text += f" The speech is in the language with ISO-639 code {language!r}."
    if prompt:
        text += f" Context (earlier text or expected words): {prompt}"
    return text


@dataclass(frozen=True)
class Segment:
    """One piece of the clip and what the model wrote for it."""

    id: int
    start: float
    end: float
    """Seconds from the start of the clip."""
    text: str
    tokens: tuple[int, ...]
    avg_logprob: float | None
    """Mean log-probability of the tokens (None when there were none)."""


@dataclass(frozen=True)
class TranscriptEvent:
    """A piece of the transcript's text as it is produced, in order; ``segment`` is set on
    the last event of each piece."""

    text: str
    segment: Segment | None = None


@dataclass(frozen=True)
class Transcript:
    text: str
    duration: float
    segments: tuple[Segment, ...]
    prompt_tokens: int
    completion_tokens: int

    def __iter__(self) -> Iterator[Segment]:
        return iter(self.segments)

    def __repr__(self) -> str:
        short = self.text if len(self.text) <= 60 else self.text[:57] + "..."
        return f"Transcript({short!r}, duration={self.duration:.2f}, segments={len(self.segments)})"


class Transcription:
    """A running transcription. ``async for event in t.events()`` yields the text in
    order as it comes; ``t.result()`` (after the events, or instead of them) gives the
    ``Transcript``. Closing it (or leaving ``async with``) cancels what still runs."""

    def __init__(
        self,
        model: Model,
        audio: Any,
        *,
        task: Task = "transcribe",
        language: str | None = None,
        prompt: str | None = None,
        params: CompletionParams | None = None,
    ):
        if task not in TASKS:
            raise InvalidRequestError(f"task must be one of {', '.join(TASKS)}, got {task!r}", param="task")
        if "audio" not in model.media_kinds:
            raise InvalidRequestError(
                f"model {model.name!r} takes no audio; transcription needs an audio-in model (Gemma-4)",
                param="model",
            )
        params = params or CompletionParams()
        if params.n != 1:
            raise InvalidRequestError("a transcription has one answer (n=1)", param="n")
        if not isinstance(audio, Audio):
            raise InvalidRequestError(f"transcription takes a media.Audio, not {type(audio).__name__}")
        limit = model.encoder.max_audio_seconds
        self.model = model
        self.pieces = split_audio(audio, limit) if limit else [audio]
        self.duration = float(audio.duration)
        text = instruction(task, language, prompt)
        self._params = replace(params, logprobs=0 if params.logprobs is None else params.logprobs)
        self._runs = [Completion(model, [Turn("user", (p, text))], self._params) for p in self.pieces]
        self._segments: list[Segment] = []
        self._events_done = False

    def __repr__(self) -> str:
        return f"Transcription(model={self.model.name!r}, duration={self.duration:.2f}, pieces={len(self.pieces)})"

    async def __aenter__(self) -> Transcription:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for run in self._runs:
            await run.aclose()

    async def start(self) -> Transcription:
        """Start every piece (prompt errors are raised here, before any text)."""
        outcomes = await asyncio.gather(*(r.start() for r in self._runs), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return self

    async def events(self) -> AsyncIterator[TranscriptEvent]:
        """The transcript's text in order: the pieces run together, and a later piece's text
        waits until the pieces before it have ended."""
        await self.start()
        queues: list[asyncio.Queue[ChoiceEvent | BaseException | None]] = [
            asyncio.Queue() for _ in self._runs
        ]

        async def pump(run: Completion, queue: asyncio.Queue) -> None:
            try:
                async for ev in run:
                    queue.put_nowait(ev)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait(e)
                if isinstance(e, asyncio.CancelledError):
                    raise
            finally:
                queue.put_nowait(None)

        pumps = [asyncio.create_task(pump(r, q)) for r, q in zip(self._runs, queues, strict=True)]
        join = _Joiner()
        rate = self.pieces[0].sample_rate
        at = 0
        try:
            for i, (piece, queue) in enumerate(zip(self.pieces, queues, strict=True)):
                text, tokens, logprobs = "", [], []
                while (ev := await queue.get()) is not None:
                    if isinstance(ev, BaseException):
                        raise ev
                    text += ev.text
                    tokens.append(ev.token)
                    if ev.logprob is not None:
                        logprobs.append(ev.logprob)
                    out = join.feed(i, ev.text)
                    if out:
                        yield TranscriptEvent(out)
                end = at + piece.frames
                segment = Segment(
                    id=i,
                    start=at / rate,
                    end=end / rate,
                    text=text.strip(),
                    tokens=tuple(tokens),
                    avg_logprob=math.fsum(logprobs) / len(logprobs) if logprobs else None,
                )
                self._segments.append(segment)
                at = end
                join.end_piece()
                yield TranscriptEvent("", segment)
            self._events_done = True
        finally:
            for task in pumps:
                task.cancel()
            for task in pumps:
                with contextlib.suppress(BaseException):
                    await task

    async def result(self) -> Transcript:
        if not self._events_done:
            async for _ in self.events():
                pass
        return Transcript(
            text=" ".join(s.text for s in self._segments if s.text),
            duration=self.duration,
            segments=tuple(self._segments),
            prompt_tokens=sum(r.prompt_tokens for r in self._runs),
            completion_tokens=sum(sum(r.completion_tokens) for r in self._runs),
        )


class _Joiner:
    """Releases streamed text so that it adds up to the pieces' stripped texts joined by
    one space: leading and trailing whitespace of a piece wait, and are dropped at its
    ends."""

    def __init__(self) -> None:
        self.piece = -1
        self.started = False  # the current piece released text
        self.any = False  # some piece released text
        self.held = ""

    def feed(self, piece: int, text: str) -> str:
        if piece != self.piece:
            self.piece, self.started, self.held = piece, False, ""
        self.held += text
        if not self.started:
            self.held = self.held.lstrip()  # a piece's leading whitespace is dropped
        release = self.held.rstrip()  # trailing whitespace waits for more text
        if not release:
            return ""
        self.held = self.held[len(release) :]
        out = (" " if self.any and not self.started else "") + release
        self.started = self.any = True
        return out

    def end_piece(self) -> None:
        """The piece ended: its trailing whitespace is dropped."""
        self.held = ""


async def transcribe_async(model: Model, audio: Any, **kwargs: Any) -> Transcript:
    """The whole transcript of ``audio`` (see ``Transcription`` for the arguments)."""
    async with Transcription(model, audio, **kwargs) as t:
        return await t.result()
