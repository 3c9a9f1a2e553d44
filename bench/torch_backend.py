"""The torch attention backend with its prefills batched across sequences, against the same
backend one sequence at a time and against transformers (issue 33, part 5).

    python bench/torch_backend.py                          # CPU: the tiny Qwen3-VL fixture
    python bench/torch_backend.py --device cuda            # GPU: 2B-shaped Qwen3-VL, bfloat16
    python bench/torch_backend.py --device cuda --dtype float32 --concurrency 1,8,32

For N = 1, 8, 32 (``--concurrency``): N captions at once (``--size`` square random images,
~300 prompt rows at the default 544 on the tiny fixture, 448 on the 2B shape as
bench/gpu/bench.py), greedy, ``--tokens`` new tokens each, with ``engine.Model`` forced to
the torch backend:

* ``batched``: ``TORCH_BACKEND.batch_sequences = True`` (this change: the multi-row sequences
  of a pass in one padded SDPA call per layer);
* ``per_sequence``: ``batch_sequences = False`` (before: one gather, mask and SDPA call per
  sequence and layer; the same code as git 2e136cc's ``engine/attention.py`` for those);
* ``transformers``: ``generate`` on the same checkpoint, one left-padded batch
  (bench/gpu/bench.py's ``run_reference``).

Tokens/s are medians of ``--repeats`` runs taken round-robin. Attention alone: the first pass
of each batched run that holds several multi-row sequences (the image prefills) is recorded
(meta, query per layer) and replayed through ``TorchBackend.attend`` for every layer, tables
rebuilt each time (they are built once per pass), batched vs per sequence: ms per pass.
On CUDA every timing syncs the device. Writes JSON to ``--out``.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Run as a script, this folder comes first on sys.path and bench/engine.py would shadow the
# ``engine`` package: the repository root goes first instead.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@contextlib.contextmanager
def checkpoint(shape: str, device: str, dtype: torch.dtype) -> Iterator[Path]:
    """``tiny``: the fixture itself; ``2b``: bench/gpu/bench.py's 2B-shaped random Qwen3-VL
    (built in a temporary folder on the device)."""
    if shape == "tiny":
        from fixtures.tiny_models import ensure_tiny_model

        yield ensure_tiny_model("tiny-qwen3-vl")
        return
    from bench.gpu.bench import checkpoint_dir

    with checkpoint_dir(None, smoke=False, device=device, dtype=dtype) as path:
        yield path


class PassRecorder:
    """Wraps ``TORCH_BACKEND.attend`` (an instance attribute over the method) and keeps the
    first pass that attends two or more multi-row sequences: its meta and each layer's query
    and keyword arguments, for replay."""

    def __init__(self, backend: Any):
        self.backend = backend
        self.meta: Any = None
        self.layers: list[tuple[int, torch.Tensor, dict]] = []
        self._real = type(backend).attend

    def __enter__(self) -> PassRecorder:
        real, backend = self._real, self.backend

        def attend(meta, layer, query, **kw):
            if self.meta is None and sum(s.q_len > 1 for s in meta.seqs) >= 2:
                self.meta = meta
            if meta is self.meta:
                self.layers.append((layer, query.detach().clone(), dict(kw)))
            return real(backend, meta, layer, query, **kw)

        backend.attend = attend
        return self

    def __exit__(self, *exc: object) -> None:
        del self.backend.attend

    def replay_ms(self, device: str, batched: bool, repeats: int) -> float | None:
        """Median ms of one pass's attention (every layer), tables built afresh each time."""
        from engine.attention import BatchMeta

        if self.meta is None:
            return None
        m = self.meta
        before = self.backend.batch_sequences
        self.backend.batch_sequences = batched
        walls = []
        try:
            for i in range(repeats + 1):
                meta = BatchMeta(
                    pool=m.pool,
                    seqs=m.seqs,
                    slots=m.slots,
                    block_overlay_layers=m.block_overlay_layers,
                    backend=m.backend,
                )
                _sync(device)
                t0 = time.perf_counter()
                with torch.inference_mode():
                    for layer, query, kw in self.layers:
                        self.backend.attend(meta, layer, query, **kw)
                _sync(device)
                if i:  # the first is a warm-up
                    walls.append(time.perf_counter() - t0)
        finally:
            self.backend.batch_sequences = before
        return 1e3 * statistics.median(walls)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--shape", choices=("tiny", "2b"), default=None, help="default: tiny on cpu, 2b on cuda"
    )
    parser.add_argument(
        "--dtype", choices=tuple(DTYPES), default=None, help="default: float32 on cpu, bfloat16 on cuda"
    )
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument(
        "--tokens", type=int, default=None, help="new tokens per caption (default 4 cpu, 32 cuda)"
    )
    parser.add_argument("--size", type=int, default=None, help="image side (default 544 tiny, 448 2b)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads on the CPU")
    parser.add_argument("--no-reference", action="store_true", help="skip transformers")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--note", default="", help="saved with the figures (what the run shows)")
    args = parser.parse_args(argv)

    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if not cuda:
        torch.set_num_threads(args.threads)
    shape = args.shape or ("2b" if cuda else "tiny")
    dtype = DTYPES[args.dtype or ("bfloat16" if cuda else "float32")]
    tokens = args.tokens or (32 if cuda else 4)
    size = args.size or (544 if shape == "tiny" else 448)
    levels = [int(c) for c in args.concurrency.split(",")]
    out = args.out or ROOT / "bench" / "results" / f"torch_backend_{'cuda' if cuda else 'cpu'}.json"

    from transformers import Qwen3VLForConditionalGeneration

    from bench.engine import hf_processor
    from bench.gpu.bench import images, run_ours, run_reference
    from engine import Model
    from engine.attention import TORCH_BACKEND

    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if cuda else f"cpu ({torch.get_num_threads()} threads)",
        "torch": torch.__version__,
        "dtype": str(dtype),
        "shape": shape,
        "image_size": size,
        "tokens_per_caption": tokens,
        "repeats": args.repeats,
        "note": args.note,
        "levels": {},
    }
    with checkpoint(shape, args.device, dtype) as path:
        model = Model.load(path, device=args.device, dtype=dtype, attention="torch", kv_pages=2048)
        ref = None
        if not args.no_reference:
            ref = Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=dtype).to(args.device).eval()
            proc = hf_processor(path)
        run_ours(model, images(2, size, seed=1), 2, args.device)  # warm-up

        def ours(batched: bool, pics: list) -> dict:
            TORCH_BACKEND.batch_sequences = batched
            try:
                return run_ours(model, pics, tokens, args.device)
            finally:
                TORCH_BACKEND.batch_sequences = True

        for n in levels:
            row: dict[str, Any] = {}
            runs: dict[str, list[dict]] = {"batched": [], "per_sequence": [], "transformers": []}
            for r in range(args.repeats + 1):
                # New images for every run: a repeated prompt would hit the encoder cache and
                # the prefix cache (its K/V pages), and skip the prefill being measured.
                pics = images(n, size, seed=10_000 * n + 2 * r)
                recorder = PassRecorder(TORCH_BACKEND)
                with recorder:
                    b = ours(True, pics)
                if r == 0:  # warm-up round; keep its recorded prefill for the replay
                    row["prompt_rows"] = [s.q_len for s in recorder.meta.seqs] if recorder.meta else None
                    row["attention_ms_per_prefill_pass"] = {
                        "batched": recorder.replay_ms(args.device, True, args.repeats),
                        "per_sequence": recorder.replay_ms(args.device, False, args.repeats),
                        "layers": len(recorder.layers),
                    }
                    ours(False, images(n, size, seed=10_000 * n + 2 * r + 1))
                    continue
                runs["batched"].append(b)
                runs["per_sequence"].append(ours(False, images(n, size, seed=10_000 * n + 2 * r + 1)))
                if ref is not None:  # the batched run's images: its first caption is compared
                    runs["transformers"].append(run_reference(ref, proc, pics, tokens, args.device))
            for name, rs in runs.items():
                if rs:
                    row[name] = {
                        "tok_s": statistics.median(x["tok_s"] for x in rs),
                        "img_s": statistics.median(x["img_s"] for x in rs),
                        "wall_s": statistics.median(x["wall_s"] for x in rs),
                    }
            if ref is not None:
                row["batched_first_caption_equals_transformers"] = [
                    x["first_tokens"] == t["first_tokens"]
                    for x, t in zip(runs["batched"], runs["transformers"], strict=True)
                ]
            att = row["attention_ms_per_prefill_pass"]
            ratios = {"batched / per_sequence tok/s": row["batched"]["tok_s"] / row["per_sequence"]["tok_s"]}
            if att["batched"] and att["per_sequence"]:
                ratios["attention per_sequence / batched ms"] = att["per_sequence"] / att["batched"]
            if "transformers" in row:
                t = row["transformers"]["tok_s"]
                ratios["batched / transformers tok/s"] = row["batched"]["tok_s"] / t
                ratios["per_sequence / transformers tok/s"] = row["per_sequence"]["tok_s"] / t
            row["ratios"] = ratios
            result["levels"][str(n)] = row
            print(f"N={n}: prompt rows {row['prompt_rows'] and max(row['prompt_rows'])}")
            print(
                f"  tok/s  batched {row['batched']['tok_s']:.1f}  per-sequence {row['per_sequence']['tok_s']:.1f}"
                + (f"  transformers {row['transformers']['tok_s']:.1f}" if "transformers" in row else "")
            )
            if att["batched"]:
                print(
                    f"  attention per prefill pass ({att['layers']} layers): batched {att['batched']:.2f} ms"
                    f"  per-sequence {att['per_sequence']:.2f} ms"
                )
            print("  " + "  ".join(f"{k}: {v:.2f}x" for k, v in ratios.items()))
            if ref is not None:
                print(
                    f"  batched first caption == transformers: {row['batched_first_caption_equals_transformers']}"
                )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
