"""``pie-media speak TEXT --out FILE``: text to speech with a CSM checkpoint.

The format comes from ``fmt`` or else the file extension (.wav .flac .mp3 .opus/.ogg .pcm; ``pcm`` is
raw little-endian float32, ``s16le`` raw 16-bit). Prints the duration and sample rate; a typed error
(a model that cannot speak, a bad request, a checkpoint that does not load) is printed with its code
and the exit status is 2.
"""

from __future__ import annotations

import sys
from pathlib import Path


def run_speak(
    text: str,
    out_path: str,
    *,
    model: str = "tiny-csm",
    speaker: int | str = 0,
    fmt: str | None = None,
    max_duration: float | None = None,
    temperature: float | None = None,
    seed: int | None = None,
) -> int:
    from api.model_ref import resolve_model_dir
    from media import PieMediaError
    from speech import SpeechModel, format_from_extension, normalize_format

    try:
        fmt = normalize_format(fmt) if fmt is not None else format_from_extension(str(out_path))
        loaded = SpeechModel.load(resolve_model_dir(model))
        speech = loaded.speak(text, speaker, max_duration=max_duration, temperature=temperature, seed=seed)
        data = speech.encode(fmt)
    except PieMediaError as e:
        print(f"pie-media: {e.code}: {e.message}", file=sys.stderr)
        return 2
    try:
        Path(out_path).write_bytes(data)
    except OSError as e:
        print(f"pie-media: write_failed: cannot write {out_path}: {e}", file=sys.stderr)
        return 2
    print(
        f"{out_path}: {speech.duration:.3f} s, {speech.sample_rate} Hz, {speech.channels} channel, "
        f"{fmt}, {len(data)} bytes, stop={speech.stop_reason}"
    )
    return 0
