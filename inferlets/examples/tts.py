"""Text to speech: the clip as a WAV (float32 samples), base64-encoded as the result; the
streaming form sends each PCM chunk (base64 float32) as it comes."""

import base64

from pie_sdk import float_wav, send, speak, speak_stream


def _opts(seed, max_duration):
    return {"seed": int(seed), "max_duration": float(max_duration)}


def tts(model, text, speaker, seed, max_duration):
    clip = speak(text, model, speaker=speaker, **_opts(seed, max_duration))
    return base64.b64encode(clip.to_wav()).decode()


def tts_stream(model, text, speaker, seed, max_duration, chunk_frames):
    stream = speak_stream(
        text, model, speaker=speaker, chunk_frames=int(chunk_frames), **_opts(seed, max_duration)
    )
    pcm = []
    for chunk in stream:
        send(base64.b64encode(chunk).decode())
        pcm.append(chunk)
    return base64.b64encode(float_wav(b"".join(pcm), 24000)).decode()
