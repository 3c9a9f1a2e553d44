"""Image, video and audio question answering: place the media in a user turn with the question,
cue, generate. Sends the media's facts (known before any forward pass) first; returns the
greedy answer as JSON (text, tokens, finish_reason)."""

import base64
import json

from pie_sdk import Audio, Context, Image, Video, receive, send


def media_bytes(arg):
    """Base64 bytes from the argument, or from the launcher's next message when it is "-"."""
    text = receive() if arg == "-" else arg
    if text is None:
        raise ValueError("expected the media bytes as a message")
    return base64.b64decode(text)


def _facts(info):
    return {
        "kind": info.kind,
        "token_count": info.token_count,
        "rows": info.rows,
        "grid": list(info.grid),
        "position_span": info.position_span,
        "frame_count": info.frame_count,
        "timestamps": [round(t, 4) for t in info.timestamps],
    }


def _answer(ctx, n):
    """The greedy answer as JSON: text, tokens, finish reason."""
    g = ctx.generate_full(max_tokens=int(n))
    return json.dumps({"text": g.text, "tokens": g.tokens, "finish_reason": g.finish_reason})


def image_qa(model, question, n, data):
    image = Image.from_bytes(media_bytes(data), model)
    send(json.dumps(_facts(image.info(model))))
    ctx = Context(model).user(image, question).cue()
    return _answer(ctx, n)


def image_raw(model, question, n, data):
    """Pie 0.4.0's shape: the image placed raw (``append``), then the question's turn."""
    image = Image.from_bytes(media_bytes(data), model)
    ctx = Context(model).append(image).user(question).cue()
    return _answer(ctx, n)


def video_qa(model, question, n, max_frames, data):
    video = Video.from_bytes(media_bytes(data), model, max_frames=int(max_frames))
    send(json.dumps(_facts(video.info(model))))
    ctx = Context(model).user(video, question).cue()
    return _answer(ctx, n)


def audio_qa(model, question, n, data):
    audio = Audio.from_bytes(media_bytes(data), model)
    send(json.dumps(_facts(audio.info(model))))
    ctx = Context(model).user(audio, question).cue()
    return _answer(ctx, n)
