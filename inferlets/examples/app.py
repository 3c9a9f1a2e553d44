"""One guest component holding the example inferlets; the first argument picks one.

    pie-media inferlet run app.wasm --model tiny -- chat tiny "Describe a cat." 12

Media bytes are passed base64-encoded as an argument, or as ``-`` to read them from the
launcher's first message (``receive``)."""

import best_of
import echo
import hostile
import media_qa
import search
import session
import speculative
import tour
import tts
from pie_sdk import Context, inferlet, now


def chat(model, prompt, n):
    ctx = Context(model).user(prompt).cue()
    return ctx.generate(max_tokens=int(n))


def ping(n):
    """n cheap host calls (``now``): what one host-call round trip costs (bench/inferlets.py)."""
    for _ in range(int(n)):
        now()
    return n


EXAMPLES = {
    "chat": chat,
    "ping": ping,
    "image-qa": media_qa.image_qa,
    "image-raw": media_qa.image_raw,
    "video-qa": media_qa.video_qa,
    "audio-qa": media_qa.audio_qa,
    "tts": tts.tts,
    "tts-stream": tts.tts_stream,
    "best-of": best_of.best_of,
    "beam": search.beam,
    "tour": tour.tour,
    "save-prefix": session.save_prefix,
    "continue": session.resume,
    "forget": session.forget,
    "speculative": speculative.speculative,
    "echo": echo.echo,
    **hostile.CASES,
}


@inferlet
def main(args):
    if not args or args[0] not in EXAMPLES:
        raise ValueError(f"first argument: one of {', '.join(sorted(EXAMPLES))}")
    return EXAMPLES[args[0]](*args[1:])


WitWorld = main.world
