"""Best-of-n: one shared prefill, n forks generated together (their decode steps share
batched passes), each branch sent as it is scored, the best returned.

Score (the same rule as the in-process version in the tests): a branch that ended on its
own (EOS) beats one cut at the token budget, then more distinct words, then the earlier
branch."""

from pie_sdk import Context, Sampler, send


def score(g):
    return (g.finish_reason == "eos", len(set(g.text.split())))


def best_of(model, prompt, n, k, temperature="0", seed="0"):
    base = Context(model).user(prompt).cue().flush()
    branches = [base.fork() for _ in range(int(k))]
    t = float(temperature)
    samplers = [Sampler(t, seed=int(seed) + i) if t > 0 else Sampler.greedy() for i in range(int(k))]
    gens = Context.generate_all(branches, int(n), samplers)
    best = 0
    for i, g in enumerate(gens):
        send(g.text)
        if score(g) > score(gens[best]):
            best = i
    for b in branches:
        b.drop()
    base.drop()
    return gens[best].text
