"""Misbehaving inferlets for the host's tests. Each first holds KV pages (a filled and
flushed context), so the tests can check that they come back."""

from media_qa import media_bytes
from pie_sdk import Context, Image, InferletError, send, speak, speak_stream


def _hold(model):
    return Context(model).user("Some text that takes a page or two of the pool.").cue().flush()


def loop(model="tiny"):
    _hold(model)
    while True:
        pass


def bomb(model="tiny"):
    _hold(model)
    xs = []
    while True:
        xs.append(bytearray(1 << 20))


def handles(model="tiny"):
    _hold(model)
    while True:
        Context(model)


def media_handles(model, data):
    """Opens image handles without limit (the image is the base64 argument)."""
    _hold(model)
    raw = media_bytes(data)
    while True:
        Image.from_bytes(raw, model)


def forged(model="tiny"):
    _hold(model)
    return Context(model, _handle=12345).generate(4)


def closed(model="tiny"):
    ctx = _hold(model)
    ctx.drop()
    return ctx.generate(4)


def oversized(model="tiny", n_bytes="2000000"):
    ctx = _hold(model)
    return ctx.fill("x" * int(n_bytes)).generate(4)


def oversized_media(model="tiny", n_bytes="2000000"):
    _hold(model)
    return Image.from_bytes(bytes(int(n_bytes)), model)


def ignore_errors(model="tiny"):
    """Swallows every error and keeps calling the host: the deadline still ends it."""
    ctx = _hold(model)
    while True:
        try:
            ctx.generate(2)
        except InferletError as e:
            send(e.code)


def speech_overlap(model):
    """A started speech stream holds the speech model: a second stream or a speak in the
    same run is refused (not a deadlock) until it is closed."""
    a = speak_stream("Hello there.", model, max_duration=0.5, chunk_frames=1)
    b = speak_stream("Again.", model, max_duration=0.5, chunk_frames=1)
    next(a)
    codes = []
    for attempt in (lambda: next(b), lambda: speak("No.", model)):
        try:
            attempt()
        except InferletError as e:
            codes.append(e.code)
    a.close()
    clip = speak("Fine now.", model, max_duration=0.2)
    return " ".join([*codes, str(clip.duration > 0)])


CASES = {
    "speech-overlap": speech_overlap,
    "loop": loop,
    "bomb": bomb,
    "handles": handles,
    "media-handles": media_handles,
    "forged": forged,
    "closed": closed,
    "oversized": oversized,
    "oversized-media": oversized_media,
    "ignore-errors": ignore_errors,
}
