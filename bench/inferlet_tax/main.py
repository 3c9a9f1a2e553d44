"""The inferlet bench/inferlet_tax.py times: Pie's python-example decode loop, greedy.

Loads the first model, appends the prompt's token ids as given (no chat template: the
bench hands the same ids to the engine's own ``generate``), then runs ``max_tokens``
argmax steps, one ``execute()`` per token, exactly as Pie's python-example iterates its
generator; returns the tokens as a JSON list. No stop tokens (the engine side has none
either) and no system speculation, so every step is one forward pass and one token.
"""

import json

from inferlet import Context, Model, Sampler, runtime


async def main(input: dict) -> str:
    model = Model.load(runtime.models()[0])
    ctx = Context(model)
    ctx.append([int(t) for t in input["prompt_tokens"]])
    tokens: list[int] = []
    g = ctx.generate(
        Sampler.argmax(),
        max_tokens=int(input["max_tokens"]),
        stop=[],
        system_speculation=False,
        auto_flush=False,
    )
    async for step in g:
        out = await step.execute()
        tokens.extend(out.tokens)
    ctx.release()
    return json.dumps(tokens)
