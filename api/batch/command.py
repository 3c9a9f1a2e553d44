"""``pie-media caption INPUT...``: caption images, videos and audio with a model, batched.

Inputs are files and folders (searched recursively, sorted), WebDataset tar shards
(brace patterns too: ``shards/{00000..00127}.tar``), Parquet files (``--column``) and,
with ``--urls`` (or a ``.urls`` name), text files of URLs.

Without ``--out`` each caption is printed. With ``--out`` it runs as a resumable batch
job (``api.batch.job``): JSONL, Parquet or WebDataset tar shards (``--out-format``,
else from the name), at most ``--concurrency`` samples in flight, a progress bar on
stderr, and a rerun skips what is already recorded. The exit status is 0 when every
sample got a caption, 1 when some failed (their records say why; the count is on
stderr), 2 for bad arguments."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from api.batch.spec import DEFAULT_PROMPT, CaptionSpec


def add_caption_arguments(cap: argparse.ArgumentParser) -> None:
    cap.add_argument(
        "files", nargs="+", help="media files, folders, .tar shards (brace patterns), .parquet, URL lists"
    )
    cap.add_argument(
        "--model", default="tiny", help="checkpoint directory or tiny model name (default: tiny)"
    )
    cap.add_argument(
        "--prompt", action="append", default=None, help="the prompt (repeat for several captions per sample)"
    )
    cap.add_argument("--prompts-file", default=None, help="one prompt per line, each a caption per sample")
    cap.add_argument(
        "--prompt-field", default=None, help="each sample's prompt from this metadata field / column"
    )
    cap.add_argument("--max-tokens", type=int, default=32)
    cap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    cap.add_argument("--top-p", type=float, default=1.0)
    cap.add_argument("--top-k", type=int, default=None)
    cap.add_argument("--seed", type=int, default=None)
    cap.add_argument("--presence-penalty", type=float, default=0.0)
    cap.add_argument("--frequency-penalty", type=float, default=0.0)
    cap.add_argument("--repetition-penalty", type=float, default=1.0)
    cap.add_argument(
        "--json-schema", default=None, metavar="FILE", help="captions must be JSON matching this schema"
    )
    cap.add_argument("--fps", type=float, default=None, help="sample videos at this rate")
    cap.add_argument("--max-frames", type=int, default=None, help="frames per video (or per segment) at most")
    cap.add_argument(
        "--segments", type=int, default=None, help="cut each video into N segments, a caption each"
    )
    cap.add_argument(
        "--scene-cuts", action="store_true", help="cut each video at scene changes, a caption each"
    )
    cap.add_argument(
        "--subtitles", choices=("vtt", "srt"), default=None, help="with segments: subtitle files beside --out"
    )
    cap.add_argument("--json", action="store_true", help="one JSON object per line (without --out)")
    cap.add_argument(
        "--out", default=None, help="batch job output: .jsonl, .parquet or a folder (webdataset); resumable"
    )
    cap.add_argument("--out-format", choices=("jsonl", "parquet", "webdataset"), default=None)
    cap.add_argument(
        "--column", default=None, help="Parquet inputs: the media (binary) or URL (string) column"
    )
    cap.add_argument(
        "--urls", action="store_true", help="read plain file inputs as lists of URLs, one per line"
    )
    cap.add_argument("--allow-http-media", action="store_true", help="URL inputs: also fetch http://")
    cap.add_argument("--url-retries", type=int, default=2)
    cap.add_argument("--per-host", type=int, default=4, help="URL fetches at once per host (default 4)")
    cap.add_argument(
        "--concurrency", type=int, default=8, help="samples in flight at once with --out (default 8)"
    )
    cap.add_argument(
        "--workers",
        type=int,
        default=None,
        help="preparation worker processes with --out (0: a thread; default: cores - 2, at most 4)",
    )
    cap.add_argument("--no-progress", action="store_true", help="no progress bar with --out")
    cap.add_argument(
        "--ray",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDRESS",
        help="run on Ray Data (pip install .[ray]): a local instance, or a cluster ADDRESS; needs --out",
    )
    cap.add_argument(
        "--replicas", type=int, default=2, help="engine replicas (Ray actors) with --ray (default 2)"
    )


def spec_from_args(args: argparse.Namespace) -> CaptionSpec:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        prompts += [
            line.strip()
            for line in Path(args.prompts_file).read_text(encoding="utf-8").splitlines()
            if line.strip()
        ]
    schema = None
    if args.json_schema:
        schema = json.loads(Path(args.json_schema).read_text(encoding="utf-8"))
    return CaptionSpec(
        prompts=tuple(prompts or [DEFAULT_PROMPT]),
        max_tokens=args.max_tokens,
        prompt_field=args.prompt_field,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        json_schema=schema,
        fps=args.fps,
        max_frames=args.max_frames,
        segments=args.segments,
        scene_cuts=args.scene_cuts,
    )


def run_caption_command(args: argparse.Namespace) -> int:
    from api.batch.sources import UrlOptions

    if args.concurrency < 1 or (args.workers is not None and args.workers < 0):
        print("pie-media: --concurrency must be >= 1 and --workers >= 0", file=sys.stderr)
        return 2
    try:
        spec = spec_from_args(args)
    except (OSError, ValueError) as e:
        print(f"pie-media: {e}", file=sys.stderr)
        return 2
    if args.ray is not None:
        if args.out is None:
            print("pie-media: --ray needs --out (FILE.jsonl, FILE.parquet or a folder)", file=sys.stderr)
            return 2
        from api.batch.ray_runner import caption_with_ray

        summary = caption_with_ray(
            args.files,
            args.out,
            model=args.model,
            prompt=spec.prompts[0],
            max_tokens=spec.max_tokens,
            replicas=args.replicas,
            address=None if args.ray == "local" else args.ray,
            column=args.column,
            spec=spec,
            out_format=args.out_format,
        )
        print(f"{args.out}: {summary}", file=sys.stderr)
        return 1 if summary.errors else 0
    from api.model_ref import resolve_model_dir
    from engine import Model, frozen_startup_heap

    loaded = Model.load(resolve_model_dir(args.model))
    with frozen_startup_heap():  # the loaded heap out of the GC's walks (engine/startup_heap.py)
        if args.out is None:
            return _print_captions(args.files, loaded, spec, args.json)
        from api.batch.job import run_caption_job

        s = run_caption_job(
            args.files,
            args.out,
            model=loaded,
            spec=spec,
            out_format=args.out_format,
            concurrency=args.concurrency,
            workers=args.workers,  # None: default_workers()
            progress=not args.no_progress,
            column=args.column,
            urls=args.urls,
            url_options=UrlOptions(
                allow_http=args.allow_http_media, retries=args.url_retries, per_host=args.per_host
            ),
            subtitles=args.subtitles,
        )
    print(
        f"{args.out}: {s.captioned} captioned, {s.reused} reused, {s.skipped} already done, "
        f"{s.errors} errors of {s.total} samples in {s.elapsed_s:.1f}s "
        f"({s.failed} failed; engine waited for input {100 * s.input_wait_fraction:.1f}%, "
        f"idle {100 * s.idle_fraction:.1f}%)",
        file=sys.stderr,
    )
    return 1 if s.failed else 0


def _print_captions(inputs: list[str], model: Any, spec: CaptionSpec, as_json: bool) -> int:
    """Caption every sample of ``inputs`` concurrently and print the results in order."""
    from api.batch.captioner import caption_prompts
    from api.batch.preparation import Preparer
    from api.batch.sources import open_shards

    prep = Preparer(model.prepare, getattr(model.encoder, "family", ""), spec)
    items = [prep(s) for shard in open_shards(inputs) for s in shard.samples()]

    async def one(item: Any) -> list[dict[str, Any]]:
        if item.error is not None:
            return [{"error": item.error}]
        out = []
        for seg in item.segments:
            if seg.error is not None:
                out.append({"error": seg.error})
                continue
            for o in await caption_prompts(model, seg.prepared, item.prompts, spec):
                from api.batch.records import error_dict

                r: dict[str, Any] = {"caption": o.text} if o.error is None else {"error": error_dict(o.error)}
                if seg.start is not None:
                    r.update(start=seg.start, end=seg.end)
                out.append(r)
        return out

    async def all_items() -> list[list[dict[str, Any]]]:
        return list(await asyncio.gather(*(one(i) for i in items)))

    failed = False
    for item, results in zip(items, asyncio.run(all_items()), strict=True):
        for r in results:
            failed = failed or "error" in r
            if as_json:
                print(json.dumps({"file": item.name, **r}))
            elif "error" in r:
                print(f"{item.name}: ERROR {r['error']['code']}: {r['error']['message']}")
            else:
                print(f"{Path(item.name).name}: {r['caption']!r}")
    sys.stdout.flush()
    return 1 if failed else 0
