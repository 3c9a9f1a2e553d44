"""``pie-media inspect FILE...``: what the media layer (and optionally a model's
preparer) makes of each file, or the typed error."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from media import Audio, Image, MediaLimits, PieMediaError, Video
from media.detect import open_media

_PRINTED = (
    "kind",
    "format",
    "subtype",
    "codec",
    "width",
    "height",
    "mode",
    "sample_rate",
    "channels",
    "duration",
    "fps",
    "frame_count",
    "has_audio",
    "content_hash",
)


def describe_media(media: Image | Audio | Video, max_frames: int, fps: float | None) -> dict[str, Any]:
    """The media object's own metadata (the fields this command has always printed); for a
    video also the frames a sampler would pick."""
    info = {k: v for k, v in media.to_dict().items() if k in _PRINTED}
    if "duration" in info:
        info["duration"] = round(info["duration"], 3)
    if not isinstance(media, Video):
        return info
    sampled = media.sample(max_frames=max_frames, fps=fps)
    return {
        **info,
        "fps": round(media.info.fps, 3),
        "duration": round(media.info.duration, 3),
        "sampled_frames": len(sampled),
        "sampled_indices": list(sampled.indices),
        "sampled_timestamps": [round(t, 3) for t in sampled.timestamps],
        "skipped_frames": [s.to_dict() for s in sampled.skipped],
    }


def describe_for_model(encoder: Any, media: Image | Audio | Video) -> dict[str, Any]:
    prepared = encoder.prepare(media)
    out: dict[str, Any] = {
        "model": encoder.name,
        "token_count": prepared.token_count,
        "kv_rows": prepared.num_rows,
        "grid": list(prepared.grid),
        "position_span": prepared.position_span,
    }
    if prepared.timestamps is not None:
        out["timestamps"] = [round(t, 3) for t in prepared.timestamps]
    return out


def _line(path: str, info: dict[str, Any]) -> str:
    if "error" in info:
        e = info["error"]
        return f"{path}: ERROR {e['code']}: {e['message']}"
    parts = [f"{k}={v}" for k, v in info.items() if k not in ("content_hash", "model_view")]
    text = f"{path}: " + " ".join(parts) + f" hash={info['content_hash']}"
    mv = info.get("model_view")
    if mv:
        if "error" in mv:
            text += f"\n  model: ERROR {mv['error']['code']}: {mv['error']['message']}"
        else:
            text += "\n  model: " + " ".join(f"{k}={v}" for k, v in mv.items())
    return text


def run_inspect(
    files: list[str],
    *,
    model: str | None = None,
    max_frames: int = 8,
    fps: float | None = None,
    as_json: bool = False,
    limits: MediaLimits | None = None,
) -> int:
    """Print one record per file; returns 0 if every file (and model view) was fine, else 1."""
    encoder = None
    if model is not None:
        from api.model_ref import resolve_model_dir
        from encoders import encoder_for

        encoder = encoder_for(resolve_model_dir(model))
    failed = False
    for f in files:
        path = Path(f)
        info: dict[str, Any]
        try:
            if not path.is_file():
                raise FileNotFoundError(f"no such file: {f}")
            media = open_media(path.read_bytes(), limits)
            info = describe_media(media, max_frames, fps)
            if encoder is not None:
                try:
                    info["model_view"] = describe_for_model(encoder, media)
                except PieMediaError as e:
                    failed = True
                    info["model_view"] = {"error": e.to_dict()}
        except PieMediaError as e:
            failed = True
            info = {"error": e.to_dict()}
        except OSError as e:
            failed = True
            info = {"error": {"code": "not_found", "message": str(e)}}
        if as_json:
            print(json.dumps({"file": f, **info}))
        else:
            print(_line(f, info))
        sys.stdout.flush()
    return 1 if failed else 0
