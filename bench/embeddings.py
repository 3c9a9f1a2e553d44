"""Embeddings benchmark: ours (``model.embed_many``) vs transformers forward + pooling.

    python -m bench.embeddings [--quick]

Uses ``bench.engine``'s bigger random Qwen3-VL (hidden 512, 8 layers). Both sides embed
the same batch of texts with mean pooling and L2 normalisation: ours through the engine
(prefills share forward passes), transformers as one right-padded batch
(``output_hidden_states=True``, ``hidden_states[-1]`` averaged over the attention mask).
Prints the largest difference between the two sides, embeddings/s of each and the ratio
(interleaved medians).
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script (python bench/embeddings.py), this folder comes first on sys.path and its
# engine.py / inferlets.py / speech.py would shadow those packages: the repository root
# goes first instead. (python -m bench.embeddings works either way.)
sys.path[:] = [str(Path(__file__).resolve().parents[1])] + [
    p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent
]

import argparse
import tempfile

import torch

from bench.engine import build_checkpoint
from bench.timing import interleaved

TEXTS = [
    "The old lighthouse keeper looked at the sea.",
    "A small cat sleeps on a warm windowsill in the afternoon sun.",
    "Trains leave the station every twenty minutes.",
    "She wrote the letter twice before sending it.",
    "Rain again, and the garden is finally green.",
    "Numbers: one, two, three, four, five, six, seven.",
    "The bridge was closed for repairs until spring.",
    "He ordered coffee and read the morning paper slowly.",
]


def main(argv: list[str] | None = None) -> int:
    """Embed the same batch both ways and print embeddings/s and the ratio."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args(argv)
    repeats = 1 if args.quick else 5
    torch.set_num_threads(2)

    from transformers import Qwen3VLForConditionalGeneration

    from engine import Model

    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(Path(tmp))
        model = Model.load(path, device="cpu", kv_pages=2048, page_size=32)
        ref = Qwen3VLForConditionalGeneration.from_pretrained(path).eval()
        rows = [model.tokenize(t) for t in TEXTS]
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1

        def theirs() -> torch.Tensor:
            with torch.no_grad():
                out = ref(
                    input_ids=ids,
                    attention_mask=mask,
                    mm_token_type_ids=torch.zeros_like(ids),
                    output_hidden_states=True,
                )
            states = out.hidden_states[-1].float()
            m = mask.unsqueeze(-1).float()
            pooled = (states * m).sum(1) / m.sum(1)
            return torch.nn.functional.normalize(pooled, dim=-1)

        def ours() -> torch.Tensor:
            return model.embed_many(TEXTS, pooling="mean")

        results = interleaved({"ours": ours, "transformers": theirs}, repeats)
        (t_ours, e_ours), (t_ref, e_ref) = results["ours"], results["transformers"]
        n = len(TEXTS)
        print(f"embeddings: {n} texts, mean pooling, up to {width} tokens, CPU")
        print(f"  max |ours - transformers|: {(e_ours - e_ref).abs().max().item():.2e}")
        print(f"  ours:         {t_ours:7.3f} s  {n / t_ours:8.1f} emb/s")
        print(f"  transformers: {t_ref:7.3f} s  {n / t_ref:8.1f} emb/s")
        print(f"  ratio ours/transformers (emb/s): {t_ref / t_ours:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
