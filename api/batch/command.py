"""``pie-media caption IMAGE_OR_DIR...``: caption images with a served model, batched.

Directories are searched recursively (sorted). Images are decoded first (a bad file is
reported with its typed error and the rest go on); the good ones are captioned
concurrently so their decode steps share forward passes.

With ``--out captions.jsonl`` it runs as a resumable batch job (``api.batch.job``): at most
``--concurrency`` captions in flight, a progress bar on stderr, one fsync'ed record per
file appended as it completes, and a rerun skips what is already recorded."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from media import Image, PieMediaError


def run_caption(
    files: list[str],
    *,
    model: str = "tiny",
    prompt: str = "Describe this image.",
    max_tokens: int = 32,
    as_json: bool = False,
    out: str | None = None,
    concurrency: int = 8,
    progress: bool = True,
) -> int:
    from api.model_ref import resolve_model_dir
    from engine import Model, frozen_startup_heap

    loaded = Model.load(resolve_model_dir(model))
    with frozen_startup_heap():  # the loaded heap out of the GC's walks (engine/startup_heap.py)
        return _caption_files(files, loaded, prompt, max_tokens, as_json, out, concurrency, progress)


def _caption_files(
    files: list[str],
    loaded: Any,
    prompt: str,
    max_tokens: int,
    as_json: bool,
    out: str | None,
    concurrency: int,
    progress: bool,
) -> int:
    from api.batch.file_source import expand_paths
    from api.batch.job import run_caption_job
    from engine import caption_many_async

    if out is not None:
        s = run_caption_job(
            files,
            out,
            model=loaded,
            prompt=prompt,
            max_tokens=max_tokens,
            concurrency=concurrency,
            progress=progress,
        )
        print(
            f"{out}: {s.captioned} captioned, {s.reused} reused, {s.skipped} already done, "
            f"{s.errors} errors of {s.total} files in {s.elapsed_s:.1f}s",
            file=sys.stderr,
        )
        return 1 if s.errors or s.earlier_errors else 0
    files = [str(f) for f in expand_paths(files)]
    results: dict[str, dict[str, Any]] = {}
    images: dict[str, Image] = {}
    for f in files:
        try:
            images[f] = Image.from_path(f)
        except PieMediaError as e:
            results[f] = {"error": e.to_dict()}
        except OSError as e:
            results[f] = {"error": {"code": "not_found", "message": str(e)}}
    if images:
        texts = asyncio.run(
            caption_many_async(loaded, list(images.values()), prompt=prompt, max_tokens=max_tokens)
        )
        for f, text in zip(images, texts, strict=True):
            results[f] = {"caption": text}
    for f in files:
        r = results[f]
        if as_json:
            print(json.dumps({"file": f, **r}))
        elif "error" in r:
            print(f"{f}: ERROR {r['error']['code']}: {r['error']['message']}")
        else:
            print(f"{Path(f).name}: {r['caption']!r}")
    sys.stdout.flush()
    return 1 if any("error" in r for r in results.values()) else 0
