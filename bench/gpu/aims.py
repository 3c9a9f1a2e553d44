"""The last table of the GPU check: every aim of issue 33 that the check's outputs can
judge, the measured figure, and whether it is met. Reads OUT_DIR/gpu_bench.json (and
whatever else is there); writes OUT_DIR/gpu_aims.json.

    python bench/gpu/aims.py OUT_DIR [BENCH_JSON]   (default OUT_DIR/gpu_bench.json)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PREFERRED = ("flashinfer+graphs", "flashinfer", "torch")


def _best(bench: dict) -> tuple[str | None, dict]:
    for backend in PREFERRED:
        rows = bench.get("ours", {}).get(backend)
        if rows:
            return backend, rows
    return None, {}


def _row(rows: dict, c: int) -> dict | None:
    return rows.get(str(c)) or rows.get(c)


def aims(out_dir: Path, bench_file: Path | None = None) -> list[dict]:
    path = bench_file or out_dir / "gpu_bench.json"
    bench = json.loads(path.read_text()) if path.exists() else {}
    backend, rows = _best(bench)
    hf = bench.get("transformers", {})
    one, many = _row(rows, 1), _row(rows, 32)
    ref32 = _row(hf, 32)
    table: list[dict] = []

    def add(aim: str, figure: float | None, unit: str, ok: bool | None) -> None:
        table.append({"aim": aim, "figure": figure, "unit": unit, "met": ok})

    decode_ms = None
    if one and one.get("tokens", 0) > 1:
        decode_ms = 1e3 * (one["wall_s"] - one["ttft_p50_ms"] / 1e3) / (one["tokens"] - 1)
    add(
        "decode at concurrency 1 <= 2.0 ms/token",
        decode_ms,
        "ms",
        None if decode_ms is None else decode_ms <= 2.0,
    )
    decode_only = (
        bench.get("decode_only_tok_s", {}).get("32")
        if isinstance(bench.get("decode_only_tok_s"), dict)
        else None
    )
    add(
        "decode-only at 32 contexts >= 10,000 tok/s",
        decode_only,
        "tok/s",
        None if decode_only is None else decode_only >= 10_000,
    )
    img_s = many.get("img_s") if many else None
    add("captions at 32 >= 150 images/s", img_s, "img/s", None if img_s is None else img_s >= 150)
    ratio = many["tok_s"] / ref32["tok_s"] if many and ref32 else None
    add("captions at 32 >= 15x transformers", ratio, "x", None if ratio is None else ratio >= 15)
    ttft = many.get("ttft_p50_ms") if many else None
    add("TTFT p50 at 32 <= 100 ms", ttft, "ms", None if ttft is None else ttft <= 100)
    lead = None
    if one and "equal_leading_tokens" in one:
        lead = one["equal_leading_tokens"]
    add(
        "bf16 keeps >= 16 equal leading greedy tokens (bench caption)",
        lead,
        "tokens",
        None if lead is None else lead >= 16,
    )
    for row in table:
        row["backend"] = backend
        row["device"] = bench.get("device")
    return table


def main(argv: list[str]) -> int:
    out_dir = Path(argv[1] if len(argv) > 1 else "bench/results")
    table = aims(out_dir, Path(argv[2]) if len(argv) > 2 else None)
    print(f"\n{'aim (issue 33)':62} {'measured':>12}  met")
    for row in table:
        fig = "not measured" if row["figure"] is None else f"{row['figure']:.2f} {row['unit']}"
        met = {True: "yes", False: "NO", None: "-"}[row["met"]]
        print(f"{row['aim']:62} {fig:>12}  {met}")
    (out_dir / "gpu_aims.json").write_text(json.dumps(table, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
