"""Media for Pie 0.4 Python inferlets: images, videos and audio in, speech out.

Pie's Python SDK 0.4.0 (``inferlet``) has no media helpers, though Pie's world has the
resources (``pie:core/media``, ``pie:core/audio-out``, and the forward pass's
``input-image`` / ``input-audio``). This module adds them on those same bindings, beside
the SDK, without changing it::

    from inferlet import Model, Sampler
    from pie_sdk.pie_media import Image, MediaContext, speak

    async def main(input: dict) -> str:
        model = Model.load("qwen3-vl")
        image = Image.from_bytes(model, png_bytes)
        ctx = MediaContext(model)
        ctx.user(image, "What is in this picture?")   # the image inside the user turn
        return await ctx.generate(Sampler.argmax(), max_tokens=64).collect_text()

What there is:

* ``Image.from_bytes(model, data)``, ``Audio.from_bytes(model, data)``,
  ``Video.from_bytes(model, data, max_frames)``: the host decodes and prepares the media
  for ``model`` (any format pie-media reads: PNG/JPEG/WebP/GIF..., WAV/FLAC/MP3/OGG...,
  MP4/WebM/MKV/GIF video). Its layout is known at once: ``token_count`` (rows it takes),
  ``position_span`` (how far the position cursor moves past it), ``grid`` (images),
  ``prefix_tokens`` / ``suffix_tokens`` (the model's delimiters, which this module places).
* ``MediaContext``: Pie's ``Context`` (a subclass; everything else is Pie's) plus
  ``append_image`` / ``append_audio`` / ``append_video`` (raw, where the context is, as
  Pie's Rust SDK places them) and ``user(*parts)``: a user turn whose parts are text and
  media in order, tokenized as the model's chat template renders that message. So
  ``ctx.user(image, question)`` then greedy ``generate`` is token for token what
  pie-media's ``/v1/chat/completions`` answers for the same image and question (for an
  image or an audio clip; a video is placed frame by frame, see ``append_video``).
* ``speak(model, text, voice, max_duration_ms)``: speech from a CSM model (``Speech``:
  ``sample_rate``, ``channels``, ``duration_ms``, ``pcm``, ``pcm16()``, ``wav()``).

Rows and positions. A media item takes ``token_count`` rows (K/V slots) but moves the
position cursor by ``position_span``: equal on 1-D RoPE models (Gemma-4), not on
Qwen3-VL's M-RoPE (an image of 72 rows may span 12 positions). Pie's SDK counts one
position per row: ``Forward`` / ``GenStep`` / ``Context.flush`` give their tokens
positions ``range(ctx._seq_len, ...)``, and the host's forward pass has no "next
position" of its own. So after media the SDK's positions would be wrong. ``MediaContext``
keeps its own position cursor (``ctx.position``) apart from the row count (``seq_len``,
as Pie's SDK keeps it: rows, which page bookkeeping follows), and its ``flush``,
``forward()`` and ``generate()`` give every token an explicit position from that cursor:
they run Pie's own code with the cursor lent to ``_seq_len`` for the duration of the pass,
then put the row count back (rows placed are counted from the page counters, which the
SDK keeps exactly, and the cursor moves by the same number: one position per text row).

What it does not cover, honestly:

* A stock ``Forward`` or ``Generator`` built directly (``Forward(ctx)``), and positions a
  caller gives itself (``forward.input_at``, a custom ``Speculator``'s drafts), see only
  Pie's row count: use ``ctx.forward()`` / ``ctx.generate()`` / ``ctx.position``.
* Drive one ``MediaContext`` from one coroutine at a time (the cursor is lent to the SDK
  across an ``await``).
* The cursor is the guest's: a snapshot does not keep it. ``MediaContext.open`` /
  ``take`` start it at the row count; pass ``position=`` for a saved context that holds
  media on an M-RoPE model. ``truncate(n)`` moves it back ``n`` (truncate text rows only).
* Speech takes no seed or temperature in Pie's WIT: the clip is determined only where the
  model's own generation config is greedy (pie-media's tiny CSM is; a sampling CSM is not).
"""

from __future__ import annotations

import sys
from array import array
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from componentize_py_types import Err
from inferlet._async import await_future
from inferlet.context import Context
from inferlet.forward import Forward, Output
from inferlet.generation import Generator, GenStep
from wit_world.imports import audio_out as _audio
from wit_world.imports import chat as _wchat
from wit_world.imports import inference as _inf
from wit_world.imports import media as _media

if TYPE_CHECKING:
    from collections.abc import Iterator

    from inferlet.model import Model

__all__ = [
    "Audio",
    "Image",
    "MediaContext",
    "MediaError",
    "Speech",
    "Video",
    "speak",
]

_PROBE = "PIEMEDIA"
"""The message of the probe turn ``user`` cuts the template's turn from (plain ASCII)."""


class MediaError(RuntimeError):
    """A media call the host refused (the message is the host's)."""


def _call(what: str, fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Err as e:
        raise MediaError(f"{what}: {e.value}") from None


def _model_handle(model: Any) -> Any:
    """The WIT model of an ``inferlet.Model`` (or a raw one)."""
    return getattr(model, "_handle", model)


# -- media -----------------------------------------------------------------------------------
class _Span:
    """A prepared media item: its host handle and layout, read once."""

    kind = ""

    def __init__(self, raw: Any) -> None:
        self._handle = raw
        self.token_count: int = int(raw.token_count())
        """Rows (K/V slots) the item's placeholder span takes."""
        self.position_span: int = int(raw.position_span())
        """How far the position cursor moves past the span (``token_count`` on 1-D RoPE)."""
        self.prefix_tokens: list[int] = list(raw.prefix_tokens())
        """The model's delimiter tokens before the span (placed by ``MediaContext``)."""
        self.suffix_tokens: list[int] = list(raw.suffix_tokens())
        """The model's delimiter tokens after the span."""

    @property
    def rows(self) -> int:
        """Every row placing the item takes: delimiters and span."""
        return len(self.prefix_tokens) + self.token_count + len(self.suffix_tokens)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.token_count} rows, span {self.position_span})"


class Image(_Span):
    """A still image prepared by the host for one model."""

    kind = "image"

    def __init__(self, raw: Any) -> None:
        super().__init__(raw)
        t, h, w = raw.grid()
        self.grid: tuple[int, int, int] = (int(t), int(h), int(w))
        """(t, h, w) in merged-token units."""

    @classmethod
    def from_bytes(cls, model: Model, data: bytes) -> Image:
        """Decode ``data`` (PNG, JPEG, WebP, GIF's first frame, ...) and prepare it for
        ``model`` (``MediaError`` if the model takes no images or the bytes do not decode)."""
        return cls(_call("Image.from_bytes", _media.Image.from_bytes, _model_handle(model), bytes(data)))


class Audio(_Span):
    """An audio clip prepared by the host for one model (its log-mel features)."""

    kind = "audio"

    @classmethod
    def from_bytes(cls, model: Model, data: bytes) -> Audio:
        """Decode ``data`` (WAV, FLAC, MP3, OGG, ...) and prepare it for ``model``
        (``MediaError`` if the model takes no audio or the bytes do not decode)."""
        return cls(_call("Audio.from_bytes", _media.Audio.from_bytes, _model_handle(model), bytes(data)))


class Video:
    """A clip decoded and sampled by the host: up to ``max_frames`` frames, each an
    ``Image`` prepared on its own, with its timestamp."""

    kind = "video"

    def __init__(self, raw: Any) -> None:
        self._handle = raw
        self.frame_count: int = int(raw.frame_count())
        self._frames: dict[int, Image] = {}

    @classmethod
    def from_bytes(cls, model: Model, data: bytes, max_frames: int = 32) -> Video:
        """Decode ``data`` (MP4, WebM, MKV, animated GIF/WebP, ...) and sample up to
        ``max_frames`` frames uniformly (``MediaError`` if the model takes no images or
        the bytes do not decode as a video)."""
        raw = _call(
            "Video.from_bytes", _media.Video.from_bytes, _model_handle(model), bytes(data), max_frames
        )
        return cls(raw)

    def frame(self, index: int) -> Image:
        """The ``index``-th sampled frame, prepared as an image (once)."""
        if index not in self._frames:
            self._frames[index] = Image(_call("Video.frame", self._handle.frame, index))
        return self._frames[index]

    def frames(self) -> list[Image]:
        return [self.frame(i) for i in range(self.frame_count)]

    def timestamp(self, index: int) -> float:
        """The ``index``-th sampled frame's time in the clip, in seconds."""
        return float(self._handle.timestamp(index))

    @property
    def rows(self) -> int:
        return sum(f.rows for f in self.frames())

    def __repr__(self) -> str:
        return f"Video({self.frame_count} frames)"


# -- speech ----------------------------------------------------------------------------------
class Speech:
    """A spoken clip: ``sample_rate`` (Hz), ``channels``, ``duration_ms`` and ``pcm`` (float
    samples in [-1, 1], interleaved by channel)."""

    def __init__(self, raw: Any) -> None:
        self._handle = raw
        self.sample_rate: int = int(raw.sample_rate())
        self.channels: int = int(raw.channels())
        self.duration_ms: int = int(raw.duration_ms())
        self._pcm: list[float] | None = None

    @property
    def pcm(self) -> list[float]:
        if self._pcm is None:
            self._pcm = list(self._handle.pcm())
        return self._pcm

    def pcm16(self) -> bytes:
        """The samples as 16-bit little-endian integers, as ``/v1/audio/speech`` sends them
        (``pcm``, and inside ``wav``): clipped to [-1, 1], scaled by 32767 in float32 (the
        exact product rounded to float32, as numpy multiplies a float32 array), rounded
        half to even."""
        scaled = array("f", (min(1.0, max(-1.0, x)) * 32767.0 for x in self.pcm))
        out = array("h", (round(v) for v in scaled))
        if sys.byteorder == "big":  # pragma: no cover - wasm32 is little-endian
            out.byteswap()
        return out.tobytes()

    def wav(self) -> bytes:
        """A 16-bit PCM WAV file of the clip."""
        data = self.pcm16()
        block = 2 * self.channels
        head = b"".join(
            [
                b"RIFF",
                (36 + len(data)).to_bytes(4, "little"),
                b"WAVEfmt ",
                (16).to_bytes(4, "little"),
                (1).to_bytes(2, "little"),
                self.channels.to_bytes(2, "little"),
                self.sample_rate.to_bytes(4, "little"),
                (self.sample_rate * block).to_bytes(4, "little"),
                block.to_bytes(2, "little"),
                (16).to_bytes(2, "little"),
                b"data",
                len(data).to_bytes(4, "little"),
            ]
        )
        return head + data

    def __repr__(self) -> str:
        return f"Speech({self.duration_ms} ms, {self.sample_rate} Hz, {self.channels} ch)"


def speak(model: Model, text: str, voice: int | str = 0, *, max_duration_ms: int | None = None) -> Speech:
    """Speak ``text`` on a speech model (CSM): ``voice`` a speaker id (int) or a name the
    speech model knows (str: a digit string, or a preset of the model such as
    ``"default"``; OpenAI's voice names are the HTTP layer's: ``/v1/audio/speech``'s
    ``alloy``, ``ash``, ... are speakers 0, 1, ...); ``max_duration_ms`` caps the clip
    (None: the model's default cap, within the run's speech limit). The host frames the
    prompt as the model needs and runs the whole generation in this call."""
    if isinstance(voice, bool) or not isinstance(voice, int | str):
        raise TypeError(f"voice is a speaker id (int) or a voice name (str), got {voice!r}")
    v = _audio.Voice_Speaker(voice) if isinstance(voice, int) else _audio.Voice_Named(voice)
    req = _audio.SpeechRequest(text=text, voice=v, max_duration_ms=max_duration_ms)
    return Speech(_call("speak", _audio.Speech.generate, _model_handle(model), req))


# -- the context -----------------------------------------------------------------------------
def _find(seq: list[int], part: list[int]) -> list[int]:
    n = len(part)
    return [i for i in range(len(seq) - n + 1) if seq[i : i + n] == part]


class MediaContext(Context):
    """Pie's ``Context`` with media and a position cursor of its own (see the module doc).

    ``append_image`` / ``append_audio`` / ``append_video`` and ``user(*parts)`` buffer, as
    Pie's ``append`` / ``user`` do; the media go in when the buffer is drained (``flush``,
    the first step of ``generate``): one forward pass places the text before and between
    them, each item's delimiters, and each item's span with its first position at the
    cursor (``input-image`` / ``input-audio`` at that anchor). What follows the last item
    (its suffix and later text) stays buffered for the next pass, so ``generate`` samples
    from it as usual.

    ``seq_len`` counts rows, as in Pie's SDK; ``position`` is where the next token goes.
    """

    __slots__ = ("_position", "_pending_media")

    def __init__(self, model: Model) -> None:
        super().__init__(model)
        self._position: int = self._seq_len
        self._pending_media: list[tuple[int, Image | Audio]] = []

    def _init_media(self, position: int | None) -> MediaContext:
        self._position = self._seq_len if position is None else int(position)
        self._pending_media = []
        return self

    # -- lifecycle: Pie's, with the cursor and the buffered media carried -------------------------
    @classmethod
    def open(cls, model: Model, name: str, *, position: int | None = None) -> MediaContext | None:
        """Pie's ``open``; the cursor starts at the row count unless ``position`` says where
        (a snapshot does not keep it)."""
        obj = super().open(model, name)
        return None if obj is None else obj._init_media(position)

    @classmethod
    def take(cls, model: Model, name: str, *, position: int | None = None) -> MediaContext | None:
        obj = super().take(model, name)
        return None if obj is None else obj._init_media(position)

    def fork(self) -> MediaContext:
        raw = self._handle.fork()
        obj = object.__new__(MediaContext)
        obj._handle = raw
        obj._model = self._model
        obj._pending_tokens = list(self._pending_tokens)
        obj._sync_from_host()
        obj._position = self._position
        obj._pending_media = list(self._pending_media)
        return obj

    def truncate(self, n: int) -> None:
        """Pie's ``truncate`` (working-page text rows only); the cursor moves back ``n``."""
        super().truncate(n)
        self._position -= n

    # -- facts -----------------------------------------------------------------------------------
    @property
    def position(self) -> int:
        """The position the next token takes (after every row placed; the buffer excluded)."""
        return self._position

    def _rows(self) -> int:
        return self._committed_pages * self._page_size + self._working_tokens

    # -- fillers ---------------------------------------------------------------------------------
    def append_image(self, image: Image) -> MediaContext:
        """Buffer ``image`` here, raw (outside any chat turn): its prefix tokens, its span,
        its suffix tokens."""
        if not isinstance(image, Image):
            raise TypeError(f"append_image takes an Image, got {type(image).__name__}")
        self._pending_media.append((len(self._pending_tokens), image))
        return self

    def append_audio(self, audio: Audio) -> MediaContext:
        """Buffer ``audio`` here, raw, as ``append_image``."""
        if not isinstance(audio, Audio):
            raise TypeError(f"append_audio takes an Audio, got {type(audio).__name__}")
        self._pending_media.append((len(self._pending_tokens), audio))
        return self

    def append_video(self, video: Video) -> MediaContext:
        """Buffer ``video``'s sampled frames here in order, each an image with its own
        delimiters (as ``media.wit`` describes a video). Not the per-frame layout a model's
        own processor writes for a video (Qwen3-VL's: video tokens and timestamp text), so a
        video answer here need not equal ``/v1/chat/completions``' for the same clip."""
        if not isinstance(video, Video):
            raise TypeError(f"append_video takes a Video, got {type(video).__name__}")
        for frame in video.frames():
            self.append_image(frame)
        return self

    def _append_part(self, part: Image | Audio | Video) -> None:
        if isinstance(part, Image):
            self.append_image(part)
        elif isinstance(part, Audio):
            self.append_audio(part)
        else:
            self.append_video(part)

    def _empty(self) -> bool:
        return self._seq_len == 0 and not self._pending_tokens and not self._pending_media

    def user(self, *parts: str | Image | Audio | Video) -> MediaContext:
        """A user turn of text and media parts, in order: ``ctx.user(image, "What is
        this?")``. Tokenized as the model's chat template renders that message (its turn
        opening, each text part, each item with its delimiters, its turn closing), which is
        what pie-media's chat route places for the same message.

        On an empty context the turn opens the conversation (``pie:instruct/chat``'s
        ``first-user``: Gemma-4's ``<bos>`` included, as the chat route has it); Pie's own
        ``user`` always continues one. A single text part is Pie's ``user``/``first-user``."""
        if not parts:
            raise ValueError("user() takes at least one part")
        for part in parts:
            if not isinstance(part, str | Image | Audio | Video):
                raise TypeError(
                    f"a turn's part is text, an Image, an Audio or a Video, got {type(part).__name__}"
                )
        first = self._empty()
        filler = _wchat.first_user if first else _wchat.user
        if len(parts) == 1 and isinstance(parts[0], str):
            self._pending_tokens.extend(filler(self._model._handle, parts[0]))
            return self
        head, tail = self._turn_frame(filler)
        encode = self._model.tokenizer().encode
        self._pending_tokens.extend(head)
        text: list[str] = []
        for part in parts:
            if isinstance(part, str):
                text.append(part)  # adjacent text parts render as one string
                continue
            if text:
                self._pending_tokens.extend(encode("".join(text)))
                text = []
            self._append_part(part)
        if text:
            self._pending_tokens.extend(encode("".join(text)))
        self._pending_tokens.extend(tail)
        return self

    def _turn_frame(self, filler: Any) -> tuple[list[int], list[int]]:
        """The template's user turn around its message: a probe turn, cut where the probe
        message's own tokens are."""
        turn = list(filler(self._model._handle, _PROBE))
        probe = self._model.tokenizer().encode(_PROBE)
        at = _find(turn, probe)
        if len(at) != 1:
            raise MediaError(
                "the chat template's user turn does not hold its message as the message's own "
                "tokens, so media cannot be placed inside it; use append_image/append_audio"
            )
        return turn[: at[0]], turn[at[0] + len(probe) :]

    # -- placing the media ----------------------------------------------------------------------
    async def _place_media(self) -> None:
        """One pass: the buffer up to the last buffered item, each item at the cursor; what
        follows the last item stays buffered."""
        if not self._pending_media:
            return
        tokens, media = self._pending_tokens, self._pending_media
        fwd = _inf.ForwardPass(self._model._handle)
        fwd.context(self._handle)
        pos, rows, start = self._position, 0, 0
        carry: list[int] = []  # delimiters after the previous item
        for at, item in media:
            run = carry + tokens[start:at] + item.prefix_tokens
            if run:
                fwd.input_tokens(run, list(range(pos, pos + len(run))))
                pos += len(run)
                rows += len(run)
            if isinstance(item, Image):
                fwd.input_image(item._handle, pos)
            else:
                fwd.input_audio(item._handle, pos)
            pos += item.position_span
            rows += item.token_count
            carry, start = list(item.suffix_tokens), at
        self._reserve(rows)
        await await_future(_call("placing media", fwd.execute), "placing media: the pass gave no output")
        self._pending_tokens = carry + tokens[start:]  # the buffer is kept until the pass is done
        self._pending_media = []
        self._commit(rows)
        self._position = pos

    def _reserve(self, n: int) -> None:
        pages = (self._working_tokens + n + self._page_size - 1) // self._page_size
        more = pages - self._working_pages
        if more > 0:
            _call("reserve_working_pages", self._handle.reserve_working_pages, more)
            self._working_pages = pages

    def _commit(self, n: int) -> None:
        filled = self._working_tokens + n
        full = filled // self._page_size
        if full:
            _call("commit_working_pages", self._handle.commit_working_pages, full)
        self._committed_pages += full
        self._working_pages -= full
        self._working_tokens = filled % self._page_size
        self._seq_len += n

    @contextmanager
    def _cursor(self) -> Iterator[None]:
        """Lend the position cursor to Pie's code, which derives positions from ``_seq_len``;
        then count the rows it placed from the page counters and move the cursor as far."""
        rows = self._rows()
        self._seq_len = self._position
        try:
            yield
        finally:
            now = self._rows()
            self._position += now - rows
            self._seq_len = now

    # -- draining: Pie's, at the cursor ---------------------------------------------------------
    async def flush(self) -> None:
        """Place the buffered media, then Pie's ``flush`` of the rest at the cursor."""
        await self._place_media()
        with self._cursor():
            await super().flush()

    def forward(self) -> MediaForward:
        """Pie's ``Forward`` whose auto-inputs take positions from the cursor. Like Pie's, it
        does not drain the buffer (``flush`` first)."""
        return MediaForward(self)

    def generate(self, sampler: Any, **kwargs: Any) -> MediaGenerator:
        """Pie's ``generate`` (same keywords); its first step places the buffered media, and
        every step's tokens take positions from the cursor. System speculation is off unless
        asked for (``system_speculation=True``): drafts a step accepts past ``max_tokens``
        stay in the context's rows, which the cursor would then count as the answer's."""
        kwargs.setdefault("system_speculation", False)
        gen = super().generate(sampler, **kwargs)
        gen.__class__ = MediaGenerator
        return gen  # type: ignore[return-value]


class MediaForward(Forward):
    """Pie's ``Forward`` on a ``MediaContext``: auto-inputs at the position cursor."""

    __slots__ = ()

    def start_position(self) -> int:
        return self._ctx._position

    async def execute(self) -> Output:
        with self._ctx._cursor():
            return await super().execute()


class MediaGenerator(Generator):
    """Pie's ``Generator`` on a ``MediaContext``: buffered media placed before the first
    step, each step's tokens at the position cursor."""

    __slots__ = ()

    async def __anext__(self) -> GenStep:
        if self._ctx._pending_media and not self.is_done:
            await self._ctx._place_media()
        step = await super().__anext__()
        step.__class__ = MediaGenStep
        return step


class MediaGenStep(GenStep):
    __slots__ = ()

    async def execute(self) -> Output:
        with self._gen._ctx._cursor():
            return await super().execute()
