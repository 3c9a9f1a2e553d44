"""``context``: create, fill, turns, cue, flush, generate, decode step, verify draft, fork, save/open,
truncate, drop. Every call runs on the event loop (see ``state``). Contexts are Pie's
(``pie_core/context.py``: create / fork / save / open / delete are its calls); generate,
decode-step and verify-draft are this world's conveniences on the engine's context."""

from __future__ import annotations

import asyncio
from typing import Any

from engine import Context, Sampler, stopping
from engine.drafting import MAX_DRAFT
from inferlets.host.errors import InferletLimitError
from inferlets.host.pie_core.context import ContextIface, ContextRes
from inferlets.host.pie_core.media import PreparedMedia
from inferlets.host.state import RunState
from inferlets.host.wit_values import field, part, record
from media import InvalidRequestError

ROLES = ("system", "user", "assistant")
MAX_DIST = 4096


def sampler_of(r: Any) -> tuple[Sampler, int | None]:
    k = int(field(r, "top-k"))
    s = Sampler(
        temperature=float(field(r, "temperature")),
        topk=k or None,
        topp=float(field(r, "top-p")),
        minp=float(field(r, "min-p")),
    )
    return s, field(r, "seed")


class ContextCalls:
    FUNCS = {
        "create": ("create", False, True),
        "fill": ("fill", False, True),
        "fill-tokens": ("fill_tokens", False, True),
        "turn": ("turn", False, True),
        "append-media": ("append_media", False, True),
        "cue": ("cue", False, True),
        "flush": ("flush", False, True),
        "generate": ("generate", True, True),
        "generate-all": ("generate_all", False, True),
        "decode-step": ("decode_step", True, True),
        "decode-step-all": ("decode_step_all", False, True),
        "verify-draft": ("verify_draft", False, True),
        "fork": ("fork", False, True),
        "save": ("save", False, True),
        "open": ("open", False, True),
        "delete-saved": ("delete_saved", False, True),
        "truncate": ("truncate", False, True),
        "token-ids": ("token_ids", False, True),
        "drop": ("drop", False, True),
    }

    def __init__(self, run: RunState):
        self.run = run
        self.pie = ContextIface(run.pie)

    def _res(self, h: int) -> ContextRes:
        return self.run.handles.get(h, "context")

    def _ctx(self, h: int) -> Context:
        return self._res(h).live()

    def create(self, model: str) -> int:
        self.run.handles.ensure_room()
        return self.run.handles.add("context", self.pie.create(self.run.pie.model_res(model)))

    def fill(self, h: int, text: str) -> None:
        self.run.on_loop(self._ctx(h).fill, self.run.text(text))

    def fill_tokens(self, h: int, ids: list[int]) -> None:
        self.run.buffer(ids, "token ids", 4)
        self.run.on_loop(self._ctx(h).fill_tokens, ids)

    def turn(self, h: int, role: str, parts: list[Any]) -> None:
        ctx = self._ctx(h)
        if role not in ROLES:
            raise InvalidRequestError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        content: list[Any] = []
        for p in parts:
            tag, value = part(p)
            if tag == "text":
                content.append(self.run.text(value))
            else:
                content.append(self._media_for(ctx, value))
        self.run.on_loop(getattr(ctx, role), *content)

    def _media_for(self, ctx: Context, h: int) -> Any:
        item: PreparedMedia = self.run.handles.get(h, "media")
        if item.model is not ctx.model:
            raise InvalidRequestError(f"media handle {h} was prepared for another model, not this context's")
        return item.prepared

    def append_media(self, h: int, m: int) -> None:
        ctx = self._ctx(h)
        prepared = self._media_for(ctx, m)
        self.run.on_loop(getattr(ctx, f"append_{prepared.kind}"), prepared)

    def cue(self, h: int) -> None:
        self.run.on_loop(self._ctx(h).cue)

    def flush(self, h: int) -> None:
        self.run.wait_for(self._ctx(h).flush())

    def _stop(self, ctx: Context, stop: Any, contexts: int = 1) -> stopping.StopCondition:
        n = int(field(stop, "max-tokens"))
        if not 1 <= n <= self.run.limits.max_tokens:
            raise InferletLimitError(
                f"max-tokens must be 1..{self.run.limits.max_tokens}, got {n}",
                limit=self.run.limits.max_tokens,
            )
        n = self.run.token_allowance(contexts, n)
        cond: stopping.StopCondition = stopping.max_tokens(n)
        strings = [self.run.text(x, "a stop string") for x in field(stop, "stop-strings")]
        if strings:
            cond = cond | stopping.stop_strings(*strings)
        if field(stop, "eos") and ctx.model.eos_token_ids:
            cond = cond | stopping.eos(ctx.model.eos_token_ids)
        return cond

    def _contexts(self, hs: list[int]) -> list[Context]:
        ctxs = [self._ctx(h) for h in hs]
        if len(set(map(id, ctxs))) != len(ctxs):
            raise InvalidRequestError("a context is listed twice")
        return ctxs

    def generate(self, h: int, sampler: Any, stop: Any) -> Any:
        return self.generate_all([h], [sampler], stop)[0]

    def generate_all(self, hs: list[int], samplers: list[Any], stop: Any) -> list[Any]:
        ctxs = self._contexts(hs)
        if len(samplers) not in (1, len(ctxs)):
            raise InvalidRequestError(
                f"give one sampler or one per context ({len(ctxs)}), not {len(samplers)}"
            )
        parsed = [sampler_of(s) for s in samplers] * (len(ctxs) if len(samplers) == 1 else 1)
        conds = [self._stop(c, stop, len(ctxs)) for c in ctxs]

        async def one(ctx: Context, s: Sampler, seed: int | None, cond: stopping.StopCondition) -> Any:
            if seed is not None:
                ctx.reseed(seed)
            return await ctx.generate(s, cond)

        async def go() -> list[Any]:
            return await asyncio.gather(
                *(one(c, s, seed, cond) for c, (s, seed), cond in zip(ctxs, parsed, conds, strict=True))
            )

        done = self.run.wait_for(go())
        self.run.spend_tokens(sum(len(g.tokens) for g in done))
        return [record(text=g.text, tokens=list(g.tokens), finish_reason=g.finish_reason) for g in done]

    def decode_step(self, h: int, top_k: int) -> Any:
        return self.decode_step_all([h], top_k)[0]

    def decode_step_all(self, hs: list[int], top_k: int) -> list[Any]:
        ctxs = self._contexts(hs)
        if not 1 <= top_k <= MAX_DIST:
            raise InvalidRequestError(f"top-k must be 1..{MAX_DIST}, got {top_k}")
        self.run.token_allowance(len(ctxs), 1)

        async def go() -> list[Any]:
            return await asyncio.gather(*(c.decode_step_dist(top_n=top_k) for c in ctxs))

        dists = self.run.wait_for(go())
        self.run.spend_tokens(len(ctxs))
        return [record(ids=d.ids.tolist(), probs=d.probs.tolist()) for d in dists]

    def verify_draft(self, h: int, draft: list[int], sampler: Any) -> list[int]:
        ctx = self._ctx(h)
        if len(draft) > MAX_DRAFT:
            raise InferletLimitError(
                f"a draft holds at most {MAX_DRAFT} tokens, got {len(draft)}", limit=MAX_DRAFT
            )
        s, seed = sampler_of(sampler)
        self.run.token_allowance(1, 1)

        async def go() -> list[int]:
            if seed is not None:
                ctx.reseed(seed)
            return await ctx.verify_draft(draft, s)

        accepted = self.run.wait_for(go())
        self.run.spend_tokens(len(accepted))
        return accepted

    def fork(self, h: int) -> int:
        self.run.handles.ensure_room()
        return self.run.handles.add("context", self.pie.fork(self._res(h)))

    def save(self, h: int, name: str, overwrite: bool) -> None:
        self.pie.save_as(self._res(h), self.pie.saved_name(name), overwrite=overwrite)

    def open(self, model: str, name: str) -> int:
        self.run.handles.ensure_room()
        return self.run.handles.add("context", self.pie.open(self.run.pie.model_res(model), name))

    def delete_saved(self, model: str, name: str) -> None:
        self.pie.delete(self.run.pie.model_res(model), name)

    def truncate(self, h: int, n: int) -> None:
        self.run.on_loop(self._ctx(h).truncate, n)

    def token_ids(self, h: int) -> list[int]:
        ctx = self._ctx(h)
        return self.run.on_loop(lambda: ctx.token_ids)

    def drop(self, h: int) -> None:
        self.run.handles.drop(h, "context")
