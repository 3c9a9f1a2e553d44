"""The engine stage of a batch job: every prompt of a prepared sample (and of each of
its video segments) captioned, several prompts sharing the media's prefill.

With several prompts the conversation is built once per prompt without running anything
(a context's rows cost nothing until flushed), the rows they all begin with (the media
and the template around it) are prefilled once, and each prompt is a ``fork`` of that
context with its own remaining rows: the media's KV pages are computed and held once."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from api.batch.spec import CaptionSpec


@dataclass
class Outcome:
    prompt: str
    text: str | None = None
    tokens: int = 0
    error: BaseException | None = None


def _common_prefix(rows: list[list[int]]) -> int:
    n = min(len(r) for r in rows)
    first = rows[0]
    for i in range(n):
        t = first[i]
        if any(r[i] != t for r in rows[1:]):
            return i
    return n


async def caption_prompts(model: Any, prepared: Any, prompts: list[str], spec: CaptionSpec) -> list[Outcome]:
    from engine import Context

    sampler, grammar, penalties = spec.sampler(), spec.grammar(), spec.penalties()

    async def run(ctx: Any, prompt: str) -> Outcome:
        try:
            gen = await ctx.generate(
                sampler, max_tokens=spec.max_tokens, grammar=grammar, penalties=penalties
            )
        except Exception as e:  # noqa: BLE001 - this prompt's record
            return Outcome(prompt, error=e)
        return Outcome(prompt, gen.text, len(gen.tokens))

    if len(prompts) == 1:
        try:
            async with Context(model, seed=spec.seed) as ctx:
                ctx.user(prepared, prompts[0]).cue()
                return [await run(ctx, prompts[0])]
        except Exception as e:  # noqa: BLE001 - a prompt over the context length, ...
            return [Outcome(prompts[0], error=e)]

    contexts: list[Any] = []
    try:
        ids = []
        for p in prompts:
            with Context(model) as probe:
                probe.user(prepared, p).cue()
                ids.append(probe.token_ids)
        shared = _common_prefix(ids)
        root = Context(model, seed=spec.seed)
        contexts.append(root)
        root.user(prepared, prompts[0]).cue()
        root.truncate(shared)
        await root.flush()
        contexts.extend(root.fork() for _ in prompts[1:])
        for i, ctx in enumerate(contexts):
            if spec.seed is not None:
                ctx.reseed(spec.seed)
            ctx.fill_tokens(ids[i][shared:])
        return list(await asyncio.gather(*(run(c, p) for c, p in zip(contexts, prompts, strict=True))))
    except Exception as e:  # noqa: BLE001 - the shared prefill failed: every prompt's record
        return [Outcome(p, error=e) for p in prompts]
    finally:
        for c in contexts:
            c.close()


def structured(text: str | None, spec: CaptionSpec) -> Any:
    """The parsed JSON of a ``--json-schema`` caption (None when it is not JSON)."""
    if spec.json_schema is None or text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None
