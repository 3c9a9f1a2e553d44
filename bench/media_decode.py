"""Media decode benchmarks, printed side by side as ratios.

    python bench/media_decode.py [--repeats N]

(a) JPEG: full decode vs reduced (DCT-domain draft) decode of a 4032x3024 photo
    through ``media.Image.from_bytes(data)`` vs ``reduce_to=(1008, 756)``.
(b) Video: sampling frames from two 60 s 720p H.264 clips that differ only in their
    keyframe interval (10 s vs 0.5 s), forcing ``strategy="sequential"`` and
    ``strategy="seek"``, and what ``strategy="auto"`` picks (the cost model in
    ``media/timeline.py``). 16 frames is the headline; a sweep over sample counts shows
    where seeking stops paying.

Times are wall-clock medians in one process; absolute numbers on shared CI machines
are noise, the ratios are the result.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fixtures.samples import ensure_bench_media, ensure_samples  # noqa: E402
from fixtures.video import BENCH_CLIPS, read_marker  # noqa: E402
from media import Image, Video  # noqa: E402
from media.frame_sources import THREAD_TYPE  # noqa: E402


def interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, tuple[float, float, object]]:
    """Like :func:`median_time` for several functions, run round-robin so that a change in
    machine load during the run hits every variant alike."""
    walls: dict[str, list[float]] = {k: [] for k in fns}
    cpus: dict[str, list[float]] = {k: [] for k in fns}
    outs: dict[str, object] = {}
    for _ in range(repeats):
        for k, fn in fns.items():
            c0, t0 = time.process_time(), time.perf_counter()
            outs[k] = fn()
            walls[k].append(time.perf_counter() - t0)
            cpus[k].append(time.process_time() - c0)
    return {k: (statistics.median(walls[k]), statistics.median(cpus[k]), outs[k]) for k in fns}


def median_time(fn: Callable[[], object], repeats: int) -> tuple[float, float, object]:
    """Median wall-clock and median process CPU time of ``repeats`` calls, and the last result.

    With decoder threads off the work is single-threaded, so CPU time measures the
    decoding work and is far less disturbed than wall time on a shared machine.
    """
    walls, cpus, out = [], [], None
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus), out


def bench_jpeg(samples: Path, repeats: int) -> None:
    data = (samples / "images" / "photo_4032x3024.jpg").read_bytes()
    Image.from_bytes(data)  # warm-up (imports, plugin registry)
    full_t, _, full = median_time(lambda: Image.from_bytes(data), repeats)
    red_t, _, red = median_time(lambda: Image.from_bytes(data, reduce_to=(1008, 756)), repeats)
    print("(a) JPEG 4032x3024 decode")
    print(f"    {'path':<28}{'size':>12}{'ms':>10}{'ratio':>9}")
    print(f"    {'full decode':<28}{'{}x{}'.format(*full.size):>12}{full_t * 1e3:>10.1f}{1.0:>9.2f}")
    print(
        f"    {'reduce_to=(1008, 756)':<28}{'{}x{}'.format(*red.size):>12}{red_t * 1e3:>10.1f}{red_t / full_t:>9.2f}"
    )
    print(f"    -> reduced decode is {full_t / red_t:.1f}x faster")
    print()


def bench_video(bench: Path, repeats: int) -> None:
    print("(b) Video: 16 frames from 60 s 1280x720 30 fps H.264 (sequential = 1.00)")
    print(f"    cores={os.cpu_count()} decoder threads={THREAD_TYPE or 'off'}; median of {repeats}")
    print(
        f"    {'clip':<24}{'strategy':<12}{'wall ms':>9}{'cpu ms':>8}{'ratio':>7}{'decoded':>9}"
        f"{'seeks':>7}{'model':>7}  auto picks"
    )
    for name in BENCH_CLIPS:
        v = Video.from_bytes((bench / name).read_bytes())
        idx = v.uniform_indices(16)
        plan = v.decode_plan(idx)
        est = {"sequential": plan.sequential_frames, "seek": plan.seek_frames, "auto": plan.auto_frames}
        results = interleaved(
            {
                strategy: (lambda v=v, strategy=strategy: v.sample(max_frames=16, strategy=strategy))
                for strategy in ("sequential", "seek", "auto")
            },
            repeats,
        )
        for _, _, s in results.values():
            assert [read_marker(f) for f in s.frames] == [i % 256 for i in s.indices]
        base = results["sequential"][1]
        first = results["sequential"][2].frames
        for strategy, (wall, cpu, s) in results.items():
            assert (s.frames == first).all(), "strategies must return identical frames"
            pick = s.strategy if strategy == "auto" else ""
            print(
                f"    {name:<24}{strategy:<12}{wall * 1e3:>9.0f}{cpu * 1e3:>8.0f}{cpu / base:>7.2f}"
                f"{s.frames_decoded:>9}{s.seeks:>7}{est[strategy]:>7}  {pick}"
            )
        kf = v.keyframe_indices
        gop = (kf[1] - kf[0]) if len(kf) > 1 else v.info.frame_count
        print(f"    {'':<24}(keyframes: {len(kf)}, one every {gop} frames)")
    print("    ratio = cpu time / sequential cpu time; model = frames the cost model expects to decode")
    print()


def bench_sweep(bench: Path, repeats: int) -> None:
    print("(c) Where seeking stops paying: cpu time / sequential cpu time, and auto's choice")
    print(f"    {'clip':<24}{'frames':>7}{'seek':>7}{'auto':>7}  auto picks (seeks)")
    for name in BENCH_CLIPS:
        v = Video.from_bytes((bench / name).read_bytes())
        for n in (4, 64, 256):
            r = interleaved(
                {
                    strategy: (lambda v=v, n=n, strategy=strategy: v.sample(max_frames=n, strategy=strategy))
                    for strategy in ("sequential", "seek", "auto")
                },
                repeats,
            )
            seq, seek, auto = (r[k][1] for k in ("sequential", "seek", "auto"))
            s = r["auto"][2]
            print(f"    {name:<24}{n:>7}{seek / seq:>7.2f}{auto / seq:>7.2f}  {s.strategy} ({s.seeks})")
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args()
    t0 = time.perf_counter()
    samples = ensure_samples()
    bench = ensure_bench_media()
    print(f"media ready in {time.perf_counter() - t0:.1f} s ({samples.parent})\n")
    bench_jpeg(samples, args.repeats)
    bench_video(bench, args.repeats)
    if not args.no_sweep:
        bench_sweep(bench, args.repeats)


if __name__ == "__main__":
    main()
