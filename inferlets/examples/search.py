"""Beam search written in the guest on the next-token distribution.

Each step every beam's top ``2 * width`` next tokens (one batched decode step for all
beams) extend its score by log p; the best continuations over all beams are taken in
order: one ending in EOS becomes a finished hypothesis (if it ranks within the first
``width``), the others become the next beams (forks sharing pages). The search stops at
``max_tokens`` or when the best running beam can no longer beat the worst finished one.
Hypotheses are scored ``sum log p / length ** length_penalty``; returns the best text and
sends each returned hypothesis as "score<TAB>text"."""

import math

from pie_sdk import Context, detokenize, models, send


def _norm(total, length, penalty):
    return total / (max(length, 1) ** penalty)


def beam(model, prompt, width, max_tokens, num_return="1", length_penalty="1.0"):
    width, max_tokens, num_return = int(width), int(max_tokens), int(num_return)
    penalty = float(length_penalty)
    eos = next(set(m.eos_tokens) for m in models() if m.name == model)
    root = Context(model).user(prompt).cue()
    beams = [(root, (), 0.0)]
    finished = []  # (normalized score, tokens)
    for step in range(max_tokens):
        dists = Context.decode_step_all([b for b, _, _ in beams], 2 * width)
        cands = []
        for bi, ((_, _, s), d) in enumerate(zip(beams, dists, strict=True)):
            for tok, p in d:
                if p > 0:
                    cands.append((s + math.log(p), bi, tok))
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        chosen = []
        for rank, (value, bi, tok) in enumerate(cands[: 2 * width]):
            if tok in eos:
                if rank < width:
                    toks = (*beams[bi][1], tok)
                    finished.append((_norm(value, len(toks), penalty), toks))
                continue
            chosen.append((bi, tok, value))
            if len(chosen) == width:
                break
        finished.sort(key=lambda f: -f[0])
        del finished[width:]
        new = []
        for bi, tok, value in chosen:
            child = beams[bi][0].fork().fill_tokens([tok])
            new.append((child, (*beams[bi][1], tok), value))
        for b, _, _ in beams:
            b.drop()
        beams = new
        if not beams:
            break
        if len(finished) >= width:
            best_running = max(_norm(s, step + 1, penalty) for _, _, s in beams)
            if best_running <= finished[-1][0]:
                break
    results = list(finished) + [(_norm(s, len(t), penalty), t) for _, t, s in beams]
    for b, _, _ in beams:
        b.drop()
    results.sort(key=lambda r: -r[0])
    texts = []
    for score, toks in results[:num_return]:
        texts.append(detokenize(toks, model))
        send(f"{score:.6f}\t{texts[-1]}")
    return texts[0]
