"""Speculative decoding in a guest: a drafter proposes, the host checks each draft in one
batched pass (``verify-draft``) and keeps what the model agrees with.

``NgramDrafter`` is the SDK's prompt-lookup drafter; ``RepeatDrafter`` below is a guest's
own (subclass ``Drafter``): it bets the last token repeats. Either way the output equals
plain generation (greedy, or the same seed); only the number of passes changes."""

import json

from pie_sdk import Context, Drafter, NgramDrafter, Sampler


class RepeatDrafter(Drafter):
    """Proposes the last token ``k`` more times (right whenever the model loops)."""

    def __init__(self, k=4):
        self.k, self.last = k, None

    def update(self, accepted):
        if accepted:
            self.last = accepted[-1]

    def draft(self):
        return [] if self.last is None else [self.last] * self.k


def speculative(model, prompt, n, drafter="ngram", temperature="0", seed="0"):
    ctx = Context(model).user(prompt).cue()
    d = NgramDrafter(max_ngram=3, num_draft=4) if drafter == "ngram" else RepeatDrafter()
    t = float(temperature)
    sampler = Sampler(t, seed=int(seed)) if t > 0 else None
    g = ctx.generate_with_drafter(d, max_tokens=int(n), sampler=sampler)
    history = len(ctx)
    ctx.drop()
    return json.dumps({"text": g.text, "tokens": g.tokens, "finish_reason": g.finish_reason, "rows": history})
