"""Guest SDK: reads like the engine's ``Context`` API and calls the host through the WIT
bindings. A whole inferlet::

    from pie_sdk import Context, Image, inferlet

    @inferlet
    def main(args):
        ctx = Context("tiny")
        ctx.user(Image.from_bytes(data), "What is this?").cue()
        return ctx.generate(max_tokens=64)

    WitWorld = main.world   # componentize-py looks for ``WitWorld`` in the app module

Every failing host call raises ``InferletError`` with the host's stable ``code``.
"""

import struct
from array import array

import wit_world
from componentize_py_types import Err
from wit_world.imports import context as _ctx
from wit_world.imports import media as _media
from wit_world.imports import models as _models
from wit_world.imports import runtime as _rt
from wit_world.imports import speech as _speech
from wit_world.imports import types as _t

# -- errors ----------------------------------------------------------------------------------


class InferletError(Exception):
    """A host call failed; ``code`` is the stable PieMediaError code, ``kind`` its
    ``error-kind`` ("invalid-request", "bad-handle", "limit", "not-found", "media",
    "engine", "speech", "cancelled", "timeout", "host", "guest")."""

    def __init__(self, code, message, kind="guest"):
        self.code = code
        self.message = message
        self.kind = kind
        super().__init__(f"{code}: {message}")


def _kind_name(kind):
    """The WIT case name of a lifted ``error-kind`` value."""
    return getattr(kind, "name", str(kind)).lower().replace("_", "-")


def _kind_value(name):
    return getattr(_t.ErrorKind, name.upper().replace("-", "_"), _t.ErrorKind.GUEST)


def _call(fn, *a):
    try:
        return fn(*a)
    except Err as e:
        v = e.value
        raise InferletError(
            getattr(v, "code", "inferlet_error"), getattr(v, "message", str(v)), _kind_name(v.kind)
        ) from None


# -- the run ---------------------------------------------------------------------------------


def args():
    """The run's arguments."""
    return _rt.args()


def send(text):
    """Stream ``text`` to whoever launched the run."""
    _call(_rt.send, str(text))


def receive():
    """The next message from the launcher, or None once it has closed its side."""
    m = _call(_rt.receive)
    return None if m.closed else m.text


def now():
    """Monotonic clock in seconds (float)."""
    return _rt.now() / 1e9


def inferlet(fn):
    """Decorate the inferlet's ``main(args) -> str``; ``main.world`` is the exported class
    (assign it to ``WitWorld`` in the app module). ``InferletError`` and other exceptions
    end the run with a typed error (code ``guest_exception`` for non-SDK ones); memory
    exhaustion is left to trap."""

    class World(wit_world.WitWorld):
        def run(self):
            try:
                out = fn(args())
            except InferletError as e:
                raise Err(_t.Error(e.code, e.message, _kind_value(e.kind))) from None
            except MemoryError:
                raise
            except Exception as e:  # noqa: BLE001 - reported to the host as the run's error
                raise Err(
                    _t.Error("guest_exception", f"{type(e).__name__}: {e}", _t.ErrorKind.GUEST)
                ) from None
            return "" if out is None else str(out)

    fn.world = World
    return fn


# -- models and tokens -----------------------------------------------------------------------


def models():
    """``ModelInfo`` records (name, kind "text"/"speech", media_kinds, eos_tokens)."""
    return _models.list_models()


def _default(kind):
    for m in _models.list_models():
        if m.kind == kind:
            return m.name
    raise InferletError("model_not_found", f"the host serves no {kind} model")


def _name(model, kind="text"):
    if model is None:
        return _default(kind)
    return model if isinstance(model, str) else model.name


def tokenize(text, model=None):
    return _call(_models.tokenize, _name(model), text)


def detokenize(ids, model=None):
    return _call(_models.detokenize, _name(model), list(ids))


# -- sampling --------------------------------------------------------------------------------


class Sampler:
    """Sampling parameters (temperature 0 = greedy; top_k 0 / top_p 1 / min_p 0 = off)."""

    def __init__(self, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=None):
        self.temperature, self.top_k, self.top_p, self.min_p, self.seed = (
            temperature,
            top_k,
            top_p,
            min_p,
            seed,
        )

    @classmethod
    def greedy(cls):
        return cls()

    @classmethod
    def multinomial(cls, temperature=1.0, seed=None):
        return cls(temperature, seed=seed)

    @classmethod
    def top_p(cls, temperature, top_p, seed=None):
        return cls(temperature, top_p=top_p, seed=seed)

    @classmethod
    def top_k(cls, temperature, top_k, seed=None):
        return cls(temperature, top_k=top_k, seed=seed)

    def _wit(self):
        return _t.Sampler(
            float(self.temperature), int(self.top_k), float(self.top_p), float(self.min_p), self.seed
        )


# -- media -----------------------------------------------------------------------------------


class _Media:
    """Media bytes, prepared for a model on first use (``info(model)``, or placed in a
    context); one host handle per model, released by ``drop()``."""

    kind = ""

    def __init__(self, data, model=None, **params):
        self.data = bytes(data)
        self.params = params
        self._handles = {}
        if model is not None:
            self.handle(model)

    @classmethod
    def from_bytes(cls, data, model=None, **params):
        return cls(data, model, **params)

    def _make(self, model):
        raise NotImplementedError

    def handle(self, model=None):
        name = _name(model)
        if name not in self._handles:
            self._handles[name] = self._make(name)
        return self._handles[name]

    def info(self, model=None):
        """``MediaInfo``: kind, token_count, rows, grid, position_span, frame_count, timestamps."""
        return _call(_media.info, self.handle(model))

    def token_count(self, model=None):
        return self.info(model).token_count

    def drop(self):
        for h in self._handles.values():
            _call(_media.drop, h)
        self._handles = {}


class Image(_Media):
    kind = "image"

    def _make(self, model):
        return _call(_media.image_from_bytes, model, self.data)


class Video(_Media):
    """``Video.from_bytes(data, max_frames=8)``."""

    kind = "video"

    def _make(self, model):
        return _call(_media.video_from_bytes, model, self.data, int(self.params.get("max_frames") or 0))


class Audio(_Media):
    kind = "audio"

    def _make(self, model):
        return _call(_media.audio_from_bytes, model, self.data)


# -- contexts --------------------------------------------------------------------------------


class Generation:
    def __init__(self, g):
        self.text, self.tokens, self.finish_reason = g.text, list(g.tokens), g.finish_reason

    def __repr__(self):
        return f"Generation({self.text!r}, {len(self.tokens)} tokens, {self.finish_reason})"


class Distribution:
    """The next token's distribution: ``ids`` most probable first, ``probs``."""

    def __init__(self, d):
        self.ids, self.probs = list(d.ids), list(d.probs)

    def __iter__(self):
        return iter(zip(self.ids, self.probs, strict=True))


def _first_stop(text, stops):
    hits = [text.find(x) for x in stops if x and x in text]
    return min(hits) if hits else None


class Drafter:
    """Speculative decoding's guesser (Pie's ``Drafter`` trait): ``update(accepted)`` hears
    the tokens that joined the context (the whole history first, then each step's),
    ``draft()`` proposes the tokens expected next. Subclass it; use it with
    ``Context.generate_with_drafter``."""

    def update(self, accepted):
        pass

    def draft(self):
        return []


class NgramDrafter(Drafter):
    """Prompt lookup in the guest: the latest earlier occurrence of the last ``n`` tokens
    (``max_ngram`` down to 1) proposes the ``num_draft`` tokens that followed it."""

    def __init__(self, max_ngram=3, num_draft=4):
        self.max_ngram, self.num_draft = max_ngram, num_draft
        self.tokens = []
        self.follow = {}

    def update(self, accepted):
        for t in accepted:
            at = len(self.tokens)
            for n in range(1, min(self.max_ngram, at) + 1):
                self.follow[tuple(self.tokens[at - n : at])] = at
            self.tokens.append(int(t))

    def draft(self):
        toks = self.tokens
        for n in range(min(self.max_ngram, len(toks)), 0, -1):
            at = self.follow.get(tuple(toks[-n:]))
            if at is not None:
                out = toks[at : at + self.num_draft]
                while len(out) < self.num_draft:
                    out.append(out[len(out) - (len(toks) - at)])
                return out
        return []


class Context:
    """A context on the host's model; ``handle`` is this run's table index."""

    def __init__(self, model=None, _handle=None):
        self.model = _name(model)
        self.handle = _call(_ctx.create, self.model) if _handle is None else _handle

    # filling (buffers only)
    def fill(self, text):
        _call(_ctx.fill, self.handle, text)
        return self

    def fill_tokens(self, ids):
        _call(_ctx.fill_tokens, self.handle, [int(i) for i in ids])
        return self

    def _turn(self, role, parts):
        wit_parts = []
        for p in parts:
            if isinstance(p, str):
                wit_parts.append(_t.Part_Text(p))
            else:
                wit_parts.append(_t.Part_Media(p.handle(self.model)))
        _call(_ctx.turn, self.handle, role, wit_parts)
        return self

    def system(self, *parts):
        return self._turn("system", parts)

    def user(self, *parts):
        """A user turn: text and media (``Image``/``Video``/``Audio``) parts in order."""
        return self._turn("user", parts)

    def assistant(self, *parts):
        return self._turn("assistant", parts)

    def append(self, media):
        """Place a media item raw, outside any turn."""
        _call(_ctx.append_media, self.handle, media.handle(self.model))
        return self

    append_image = append_video = append_audio = append

    def cue(self):
        _call(_ctx.cue, self.handle)
        return self

    # forward passes
    def flush(self):
        _call(_ctx.flush, self.handle)
        return self

    def generate_full(self, max_tokens=64, sampler=None, stop=(), eos=True):
        """A ``Generation`` (text, tokens, finish_reason)."""
        s = (sampler or Sampler.greedy())._wit()
        st = _t.Stop(int(max_tokens), [str(x) for x in stop], bool(eos))
        return Generation(_call(_ctx.generate, self.handle, s, st))

    def generate(self, max_tokens=64, sampler=None, stop=(), eos=True):
        """The generated text (greedy unless ``sampler``); stops at ``max_tokens``, any of
        ``stop`` (excluded from the text) or the model's EOS (``eos=False``: not)."""
        return self.generate_full(max_tokens, sampler, stop, eos).text

    def decode_step(self, top_k=20):
        """The next token's distribution (top-k ids and probabilities); nothing appended."""
        return Distribution(_call(_ctx.decode_step, self.handle, int(top_k)))

    def verify_draft(self, draft, sampler=None):
        """One speculative step: the host checks ``draft`` (up to 32 ids) in one pass and
        appends the longest prefix the sampler agrees with plus one more token; returns
        those tokens. A seeded sampler reseeds first (give the seed once)."""
        s = (sampler or Sampler.greedy())._wit()
        return list(_call(_ctx.verify_draft, self.handle, [int(t) for t in draft], s))

    def generate_with_drafter(self, drafter, max_tokens=64, sampler=None, stop=(), eos=True):
        """``generate_full`` with speculative decoding: each step verifies what ``drafter``
        (a ``Drafter``) proposes. Same tokens and text as ``generate_full`` (greedy, or the
        same seed); stops at ``max_tokens``, any of ``stop`` or the model's EOS tokens, and
        tokens a step gave past the stop are taken back out of the context."""
        info = _call(_models.get, self.model)
        eos_ids = set(info.eos_tokens) if eos else set()
        drafter.update(self.token_ids)
        out, text, reason = [], "", "length"
        first = True
        while len(out) < max_tokens:
            s = sampler
            if sampler is not None and sampler.seed is not None and not first:
                s = Sampler(sampler.temperature, sampler.top_k, sampler.top_p, sampler.min_p)
            first = False
            draft = list(drafter.draft())[: max(0, min(32, max_tokens - len(out) - 1))]
            got = self.verify_draft(draft, s)
            taken = 0
            for t in got:
                out.append(t)
                taken += 1
                text = detokenize(out, self.model)
                hit = _first_stop(text, stop)
                if hit is not None:
                    text, reason = text[:hit], "stop_string"
                    break
                if t in eos_ids:
                    reason = "eos"
                    break
                if len(out) >= max_tokens:
                    break
            if taken < len(got):
                self.truncate(len(self) - (len(got) - taken))
            drafter.update(got[:taken])
            if reason != "length":
                break
        return Generation(_t.Generation(text, out, reason))

    @staticmethod
    def generate_all(contexts, max_tokens=64, samplers=None, stop=(), eos=True):
        """``Generation`` of each context, generated together (their decode steps share
        batched passes); ``samplers``: one ``Sampler`` for all, or one per context."""
        ss = samplers if isinstance(samplers, (list, tuple)) else [samplers or Sampler.greedy()]
        st = _t.Stop(int(max_tokens), [str(x) for x in stop], bool(eos))
        out = _call(_ctx.generate_all, [c.handle for c in contexts], [s._wit() for s in ss], st)
        return [Generation(g) for g in out]

    @staticmethod
    def decode_step_all(contexts, top_k=20):
        """``decode_step`` of each context, in one batched pass."""
        return [
            Distribution(d) for d in _call(_ctx.decode_step_all, [c.handle for c in contexts], int(top_k))
        ]

    # branching and persistence
    def fork(self):
        return Context(self.model, _call(_ctx.fork, self.handle))

    def save(self, name, overwrite=False):
        _call(_ctx.save, self.handle, name, bool(overwrite))
        return self

    @classmethod
    def open(cls, name, model=None):
        m = _name(model)
        return cls(m, _call(_ctx.open, m, name))

    @staticmethod
    def delete_saved(name, model=None):
        _call(_ctx.delete_saved, _name(model), name)

    def truncate(self, n):
        _call(_ctx.truncate, self.handle, int(n))
        return self

    @property
    def token_ids(self):
        return _call(_ctx.token_ids, self.handle)

    def __len__(self):
        return len(self.token_ids)

    def drop(self):
        _call(_ctx.drop, self.handle)

    close = drop

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.drop()

    def __repr__(self):
        return f"Context(model={self.model!r}, handle={self.handle})"


# -- speech ----------------------------------------------------------------------------------


def _speech_options(speaker, temperature, top_k, seed, max_duration):
    return _t.SpeechOptions(
        str(speaker),
        None if temperature is None else float(temperature),
        None if top_k is None else int(top_k),
        seed,
        None if max_duration is None else float(max_duration),
    )


def float_wav(pcm, sample_rate, channels=1):
    """A WAV file (IEEE float32 samples, format 3) around little-endian float32 PCM bytes."""
    pcm = bytes(pcm)
    fmt = struct.pack("<HHIIHH", 3, channels, sample_rate, sample_rate * channels * 4, channels * 4, 32)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(pcm)) + pcm
    return b"RIFF" + struct.pack("<I", len(body)) + body


class Clip:
    """A spoken clip: ``sample_rate``, ``channels``, ``duration`` (s), ``pcm`` (float32 LE
    bytes), ``stop_reason``."""

    def __init__(self, c):
        self.sample_rate, self.channels, self.duration = c.sample_rate, c.channels, c.duration
        self.pcm, self.stop_reason = bytes(c.pcm), c.stop_reason

    def samples(self):
        """The PCM as floats."""
        a = array("f")
        a.frombytes(self.pcm)
        return a

    def to_wav(self):
        return float_wav(self.pcm, self.sample_rate, self.channels)


def speak(text, model=None, speaker="0", temperature=None, top_k=None, seed=None, max_duration=None):
    """Text to speech on a speech model: a ``Clip``."""
    opts = _speech_options(speaker, temperature, top_k, seed, max_duration)
    return Clip(_call(_speech.speak, _name(model, "speech"), text, opts))


class SpeechStream:
    """Iterate for PCM chunks (float32 LE bytes) as they are generated; ``close()`` stops."""

    def __init__(self, handle, sample_rate=None):
        self.handle = handle
        self.done = False

    def __iter__(self):
        return self

    def __next__(self):
        if self.done:
            raise StopIteration
        chunk = _call(_speech.next_chunk, self.handle)
        if not chunk:
            self.close()
            raise StopIteration
        return bytes(chunk)

    def close(self):
        if not self.done:
            self.done = True
            _call(_speech.close_stream, self.handle)


def speak_stream(
    text, model=None, speaker="0", temperature=None, top_k=None, seed=None, max_duration=None, chunk_frames=0
):
    opts = _speech_options(speaker, temperature, top_k, seed, max_duration)
    return SpeechStream(_call(_speech.speak_stream, _name(model, "speech"), text, opts, int(chunk_frames)))
