"""`pie-media inferlet build DIR` / `pie-media inferlet run FILE.wasm --model tiny -- ARGS`.

``build`` knows both project layouts: Pie's (``Pie.toml`` + ``main.py`` with ``async def
main(input: dict)``, built with Pie's own SDK, ``inferlet`` 0.4.0, for Pie 0.4.0's world)
and pie-media's own (a folder with ``app.py`` for the ``pie:media`` world). ``run`` takes a
Pie-world component's input as one JSON argument after ``--`` (``{}`` when none is given),
checked against ``--manifest Pie.toml``'s ``[parameters]`` when given."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import threading
from pathlib import Path


def _run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", default=None, help="model ref (repeatable; default tiny)")
    p.add_argument("--message", action="append", default=None, help="a message for the guest's receive()")
    p.add_argument("--stdin", action="store_true", help="each stdin line is a message for receive()")
    p.add_argument("--wall-s", type=float, default=None, help="wall-clock budget in seconds")
    p.add_argument("--fuel", type=int, default=None, help="fuel (CPU) budget")
    p.add_argument("--memory-mb", type=int, default=None, help="guest memory cap in MiB")
    p.add_argument("--max-handles", type=int, default=None, help="live contexts + media + streams")
    p.add_argument(
        "--manifest", type=Path, default=None, help="Pie.toml: check a Pie inferlet's input against it"
    )


def add_inferlet_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inferlet", help="build and run WebAssembly inferlets")
    isub = p.add_subparsers(dest="inferlet_command", required=True)
    b = isub.add_parser(
        "build",
        help="build a Python inferlet folder into a component: a Pie project (Pie.toml + main.py, Pie's SDK) "
        "or a pie-media one (app.py)",
    )
    b.add_argument("dir", type=Path)
    b.add_argument("-o", "--out", type=Path, default=None, help="output folder (default: the cache)")
    r = isub.add_parser(
        "run", help="run a component; prints its sends as they come and its result (Ctrl-C cancels)"
    )
    r.add_argument("wasm", type=Path)
    _run_options(r)
    r.add_argument("args", nargs=argparse.REMAINDER, help="after --: the inferlet's arguments")


def _limits(opts: argparse.Namespace):
    from dataclasses import replace

    from inferlets import RunLimits

    limits = RunLimits()
    changes = {
        "wall_s": opts.wall_s,
        "fuel": opts.fuel,
        "memory_bytes": opts.memory_mb << 20 if opts.memory_mb else None,
        "max_handles": opts.max_handles,
    }
    return replace(limits, **{k: v for k, v in changes.items() if v is not None})


def _feed_stdin(control) -> None:
    def pump() -> None:
        for line in sys.stdin:
            control.post(line.rstrip("\n"))
        control.close_input()

    threading.Thread(target=pump, daemon=True, name="inferlet-stdin").start()


def _pie_input(guest_args: list[str], manifest: Path | None) -> str:
    """A Pie inferlet's one input: the JSON object after ``--`` (``{}`` without one)."""
    import json

    from inferlets.pie_project import PieInputError, PieManifest

    if len(guest_args) > 1:
        raise PieInputError(
            'a Pie inferlet takes one input: a JSON object after --, e.g. -- \'{"prompt": "hi"}\''
        )
    text = guest_args[0] if guest_args else "{}"
    try:
        value = json.loads(text)
    except ValueError as e:
        raise PieInputError(f"the input is not JSON: {e}") from None
    if manifest is not None:
        PieManifest.load(manifest.parent if manifest.name == "Pie.toml" else manifest).check_input(value)
    return text


def run_inferlet(args: argparse.Namespace) -> int:
    """Dispatch the inferlet subcommands; typed errors print and exit 2."""
    from fixtures.paths import cache_root
    from inferlets import InferletCancelledError, InferletRun, InferletRuntime, build_component
    from media import PieMediaError

    try:
        if args.inferlet_command == "build":
            from inferlets.build import build_pie_component
            from inferlets.pie_project import is_pie_project

            if is_pie_project(args.dir):
                print(build_pie_component(args.dir, args.out or cache_root() / "pie-build"))
            else:
                print(build_component(args.dir, args.out or cache_root() / "inferlets-build"))
            return 0
        from api.model_ref import load_model

        rest = list(args.args)  # REMAINDER swallows options after FILE: split at "--"
        cut = rest.index("--") if "--" in rest else len(rest)
        extra = argparse.ArgumentParser(prog="pie-media inferlet run")
        _run_options(extra)
        opts = extra.parse_args(rest[:cut])
        for name in ("wall_s", "fuel", "memory_mb", "max_handles", "manifest"):
            if getattr(opts, name) is None:
                setattr(opts, name, getattr(args, name))
        guest_args = rest[cut + 1 :]
        refs = (args.model or []) + (opts.model or []) or ["tiny"]
        control = InferletRun(
            (args.message or []) + (opts.message or []), close=not (args.stdin or opts.stdin)
        )
        if args.stdin or opts.stdin:
            _feed_stdin(control)
        rt = InferletRuntime({ref: load_model(ref) for ref in refs}, cache_root())
        if rt.is_pie_world(args.wasm):
            guest_args = [_pie_input(guest_args, opts.manifest)]
        run = rt.run_async(
            args.wasm,
            guest_args,
            on_send=lambda s: print(s, flush=True),
            limits=_limits(opts),
            control=control,
            on_output=lambda stream, text: print(
                text, end="", file=sys.stderr if stream == "stderr" else sys.stdout
            ),
        )
        # Ctrl-C cancels the run (it ends at its next host call) instead of killing the loop
        # its host calls need.
        previous = signal.signal(signal.SIGINT, lambda *_: control.cancel())
        try:
            out = asyncio.run(run)
        except InferletCancelledError:
            print("pie-media: inferlet_cancelled: interrupted", file=sys.stderr)
            return 130
        finally:
            signal.signal(signal.SIGINT, previous)
        print(out)
        return 0
    except (FileNotFoundError, PieMediaError) as e:
        code = getattr(e, "code", None)
        msg = str(e)
        print(f"pie-media: {msg if code in (None, 'inferlet_failed') else f'{code}: {msg}'}", file=sys.stderr)
        return 2
