"""A tour of the context API, returned as JSON: tokenize/detokenize, system + user turns,
flush, a decode step's distribution, save/open, truncate, a seeded top-k/top-p sample,
fill_tokens and stop strings, the clock. The tests run the same program on the engine."""

import json

from pie_sdk import Context, Sampler, detokenize, now, tokenize


def tour(model, prompt, n):
    n = int(n)
    t0 = now()
    out = {}
    ids = tokenize(prompt, model)
    out["tokenize"] = ids
    out["detokenize"] = detokenize(ids, model)
    ctx = Context(model).system("Be brief.").user(prompt).cue().flush()
    d = ctx.decode_step(top_k=5)
    out["dist"] = [d.ids, d.probs]
    name = "tour:" + prompt
    ctx.save(name, overwrite=True)
    g = ctx.generate_full(n)
    out["greedy"] = [g.text, g.tokens, g.finish_reason]
    again = Context.open(name, model)
    g2 = again.generate_full(n)
    out["reopened"] = g2.tokens
    again.truncate(len(again) - len(g2.tokens))
    g3 = again.generate_full(n, sampler=Sampler(0.9, top_k=20, top_p=0.9, seed=7))
    out["sampled"] = g3.tokens
    raw = Context(model).fill_tokens(ids)
    g4 = raw.generate_full(n, stop=["e"], eos=False)
    out["stopped"] = [g4.text, g4.finish_reason]
    out["length"] = len(raw)
    Context.delete_saved(name, model)
    for c in (ctx, again, raw):
        c.drop()
    out["clock_ok"] = now() >= t0
    return json.dumps(out)
