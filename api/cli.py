"""The ``pie-media`` command line."""

from __future__ import annotations

import argparse
import sys

from api.batch.command import add_caption_arguments, run_caption_command
from api.inferlet_cmd import add_inferlet_parser, run_inferlet
from api.serve_cmd import add_serve_parser, run_serve


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pie-media", description="Multimodal media pipeline for LLM serving.")
    sub = p.add_subparsers(dest="command", required=True)

    ins = sub.add_parser("inspect", help="show what the media layer (and a model) makes of files")
    ins.add_argument("files", nargs="+", help="image, audio or video files")
    ins.add_argument(
        "--model", help="checkpoint directory or tiny model name (tiny, tiny-qwen3-vl, tiny-gemma4)"
    )
    ins.add_argument("--max-frames", type=int, default=8, help="video frames to sample (default 8)")
    ins.add_argument(
        "--fps", type=float, default=None, help="sample video at this rate instead (capped by --max-frames)"
    )
    ins.add_argument("--json", action="store_true", help="one JSON object per line")

    cap = sub.add_parser(
        "caption",
        help="caption images, videos and audio with a model, or a dataset as a batch job "
        "(tiny random models write meaningless words)",
    )
    add_caption_arguments(cap)

    sp = sub.add_parser("speak", help="text to speech with a CSM model (tiny random weights make noise)")
    sp.add_argument("text")
    sp.add_argument("-o", "--out", required=True, help="output file (.wav .flac .mp3 .opus .ogg .pcm)")
    sp.add_argument("--model", default="tiny-csm", help="CSM checkpoint directory or tiny-csm (default)")
    sp.add_argument("--speaker", default="0", help="speaker id (0-9) or preset (default, alternate)")
    sp.add_argument("--format", dest="fmt", default=None, help="wav, flac, mp3, opus, pcm (default: from -o)")
    sp.add_argument("--max-duration", type=float, default=None, help="seconds of audio at most")
    sp.add_argument("--temperature", type=float, default=None, help="0 = greedy; default: the checkpoint's")
    sp.add_argument("--seed", type=int, default=None)

    models = sub.add_parser("models", help="model checkpoints")
    msub = models.add_subparsers(dest="models_command", required=True)
    bt = msub.add_parser("build-tiny", help="build the tiny random-weight checkpoints (no downloads)")
    bt.add_argument("--out", default=None, help="folder to build into (default: the fixture cache)")

    add_serve_parser(sub)
    add_inferlet_parser(sub)

    samples = sub.add_parser("samples", help="generate the sample media set and print where it is")
    samples.add_argument("--bench", action="store_true", help="also build the large benchmark clips")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "inspect":
        from api.inspect_cmd import run_inspect
        from media import PieMediaError

        if args.max_frames < 1:
            print("pie-media: --max-frames must be >= 1", file=sys.stderr)
            return 2
        if args.fps is not None and not args.fps > 0:
            print("pie-media: --fps must be > 0", file=sys.stderr)
            return 2
        try:
            return run_inspect(
                args.files, model=args.model, max_frames=args.max_frames, fps=args.fps, as_json=args.json
            )
        except FileNotFoundError as e:
            print(f"pie-media: {e}", file=sys.stderr)
            return 2
        except PieMediaError as e:  # unsupported model, bad arguments, ...
            print(f"pie-media: {e}", file=sys.stderr)
            return 2
    if args.command == "caption":
        from media import PieMediaError

        if args.max_tokens < 1:
            print("pie-media: --max-tokens must be >= 1", file=sys.stderr)
            return 2
        try:
            return run_caption_command(args)
        except (FileNotFoundError, ValueError, PieMediaError) as e:  # unknown model, bad checkpoint, ...
            print(f"pie-media: {e}", file=sys.stderr)
            return 2
    if args.command == "inferlet":
        return run_inferlet(args)
    if args.command == "speak":
        from api.speak_cmd import run_speak

        speaker: int | str = int(args.speaker) if args.speaker.lstrip("-").isdigit() else args.speaker
        return run_speak(
            args.text,
            args.out,
            model=args.model,
            speaker=speaker,
            fmt=args.fmt,
            max_duration=args.max_duration,
            temperature=args.temperature,
            seed=args.seed,
        )
    if args.command == "models":
        from pathlib import Path

        from fixtures.tiny_models import build_tiny_models

        built = build_tiny_models(Path(args.out) if args.out else None)
        for name, path in built.items():
            print(f"{name}\t{path}")
        return 0
    if args.command == "serve":
        return run_serve(args)
    if args.command == "samples":
        from fixtures.samples import ensure_bench_media, ensure_samples

        print(ensure_samples())
        if args.bench:
            print(ensure_bench_media())
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
