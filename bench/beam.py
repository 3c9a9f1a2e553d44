"""Beam search benchmark: ours vs transformers ``generate(num_beams=4)``, one process.

    python -m bench.beam [--quick]

Uses ``bench.engine``'s bigger random Qwen3-VL (hidden 512, 8 layers). Both sides search
the same text prompt with width 4, no EOS (so both run exactly ``max_tokens`` steps) and
return all 4 hypotheses; the script checks that the best sequences agree, then prints
generated tokens/s (width x steps / wall) of each side and the ratio, interleaved medians.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script (python bench/beam.py), this folder comes first on sys.path and its
# engine.py / inferlets.py / speech.py would shadow those packages: the repository root
# goes first instead. (python -m bench.beam works either way.)
sys.path[:] = [str(Path(__file__).resolve().parents[1])] + [
    p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent
]

import argparse
import tempfile

import torch

from bench.engine import build_checkpoint
from bench.timing import interleaved

WIDTH = 4
PROMPT = "The old lighthouse keeper looked at the sea and said that"


def main(argv: list[str] | None = None) -> int:
    """Run both searches side by side and print tokens/s and the ratio."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    args = parser.parse_args(argv)
    steps, repeats = (8, 1) if args.quick else (32, 3)
    torch.set_num_threads(2)

    from transformers import GenerationConfig, Qwen3VLForConditionalGeneration

    from engine import Model, SyncContext

    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(Path(tmp))
        model = Model.load(path, device="cpu", kv_pages=2048, page_size=32)
        ref = Qwen3VLForConditionalGeneration.from_pretrained(path).eval()
        ref.generation_config.eos_token_id = None
        ids = model.tokenize(PROMPT)
        inputs = {
            "input_ids": torch.tensor([ids]),
            "mm_token_type_ids": torch.zeros(1, len(ids), dtype=torch.long),
        }
        config = GenerationConfig(
            max_new_tokens=steps,
            do_sample=False,
            num_beams=WIDTH,
            num_return_sequences=WIDTH,
            eos_token_id=None,
            pad_token_id=0,
        )

        def theirs() -> list[int]:
            with torch.no_grad():
                out = ref.generate(**inputs, generation_config=config)
            return out[0, len(ids) :].tolist()

        def ours() -> list[int]:
            ctx = SyncContext(model).fill_tokens(ids)
            try:
                return list(ctx.beam_search(WIDTH, steps, eos=(), num_return=WIDTH)[0].tokens)
            finally:
                ctx.close()

        results = interleaved({"ours": ours, "transformers": theirs}, repeats)
        (t_ours, best_ours), (t_ref, best_ref) = results["ours"], results["transformers"]
        tokens = WIDTH * steps
        print(f"beam search width {WIDTH}, {steps} steps, prompt {len(ids)} tokens, CPU")
        print(f"  same best sequence: {best_ours == best_ref}")
        print(f"  ours:         {t_ours:7.3f} s  {tokens / t_ours:8.1f} tok/s")
        print(f"  transformers: {t_ref:7.3f} s  {tokens / t_ref:8.1f} tok/s")
        print(f"  ratio ours/transformers (tok/s): {t_ref / t_ours:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
