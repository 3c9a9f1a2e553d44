"""`pie-media inferlet build DIR` / `pie-media inferlet run FILE.wasm --model tiny -- ARGS`."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path


def add_inferlet_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inferlet", help="build and run WebAssembly inferlets")
    isub = p.add_subparsers(dest="inferlet_command", required=True)
    b = isub.add_parser("build", help="build a Python inferlet directory (module app.py) into a component")
    b.add_argument("dir", type=Path)
    b.add_argument("-o", "--out", type=Path, default=None, help="output folder (default: the cache)")
    r = isub.add_parser("run", help="run a component; prints its sends as they come and its result")
    r.add_argument("wasm", type=Path)
    r.add_argument("--model", action="append", default=None, help="model ref (repeatable; default tiny)")
    r.add_argument("args", nargs=argparse.REMAINDER, help="after --: the inferlet's arguments")


def run_inferlet(args: argparse.Namespace) -> int:
    """Dispatch the inferlet subcommands; typed errors print and exit 2."""
    from fixtures.paths import cache_root
    from inferlets import InferletRuntime, build_component
    from media import PieMediaError

    try:
        if args.inferlet_command == "build":
            print(build_component(args.dir, args.out or cache_root() / "inferlets-build"))
            return 0
        from api.model_ref import load_model

        rest = list(args.args)  # REMAINDER swallows options after FILE: split at "--"
        cut = rest.index("--") if "--" in rest else len(rest)
        extra = argparse.ArgumentParser(prog="pie-media inferlet run")
        extra.add_argument("--model", action="append", default=None)
        opts = extra.parse_args(rest[:cut])
        guest_args = rest[cut + 1 :]
        refs = (args.model or []) + (opts.model or []) or ["tiny"]
        rt = InferletRuntime({ref: load_model(ref) for ref in refs}, cache_root())
        out = asyncio.run(rt.run_async(args.wasm, guest_args, on_send=lambda s: print(s, flush=True)))
        print(out)
        return 0
    except (FileNotFoundError, PieMediaError) as e:
        print(f"pie-media: {e}", file=sys.stderr)
        return 2
