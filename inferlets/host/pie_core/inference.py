"""``pie:core/inference``: Pie's ``forward-pass`` on the engine's (``ctx.forward()``,
engine/forward_pass.py), its ``future-output``, and ``grammar`` / ``matcher`` on the
engine's grammar matcher (engine/grammar_matcher.py).

A pass is collected host-side (no engine call per builder call); ``execute`` builds the
engine pass and checks every input, mask and slot before it joins the batch (a bad one is
``execute``'s error), then returns a future the guest polls. A text pass on a context
with none of its passes running is built and checked on the guest's thread and handed to
the event loop without waiting for it; any other pass is built on the loop. Either way
the pass runs batched with every other context's."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from wasmtime import component as wc

from inferlets.host.binding import Interface, Resource, wit
from inferlets.host.pie_core.context import ContextRes
from inferlets.host.pie_core.model import ModelRes, TokenizerRes
from inferlets.host.pie_core.types import HostFuture
from inferlets.host.state import forwarded
from inferlets.host.wasi.poll import Pollable
from media import InvalidRequestError

MAX_PASS_ROWS = 1 << 16


_SLOTS: dict[tuple[str, Any], Any] = {}
"""Slots made so far, by (tag, payload): a decode loop asks for the same one every pass,
and building it (the sampler's checks) cost ~9 us of the ~50 an ``execute`` takes."""


def slot_of(v: wc.Variant) -> Any:
    """Pie's ``sampler`` variant -> an engine ``Slot`` (a frozen value: shared when equal)."""
    tag, p = v.tag, v.payload
    if isinstance(p, list):  # logprobs' token list: not hashable, and seldom the same
        return _new_slot(tag, p)
    key = (tag, p)
    slot = _SLOTS.get(key)
    if slot is None:
        slot = _new_slot(tag, p)
        if len(_SLOTS) < 4096:
            _SLOTS[key] = slot
    return slot


def _new_slot(tag: str, p: Any) -> Any:
    from engine.slots import Slot

    if tag == "multinomial":
        return Slot.multinomial(float(p[0]), int(p[1]) or None)
    if tag == "top-k":
        return Slot.top_k(float(p[0]), int(p[1]))
    if tag == "top-p":
        return Slot.top_p(float(p[0]), float(p[1]))
    if tag == "min-p":
        return Slot.min_p(float(p[0]), float(p[1]))
    if tag == "top-k-top-p":
        return Slot.top_k_top_p(float(p[0]), int(p[1]), float(p[2]))
    if tag == "embedding":
        return Slot.embedding()
    if tag == "dist":
        return Slot.dist(float(p[0]), int(p[1]))
    if tag == "raw-logits":
        return Slot.raw_logits()
    if tag == "logprob":
        return Slot.logprob(int(p))
    if tag == "logprobs":
        return Slot.logprobs(list(p))
    if tag == "entropy":
        return Slot.entropy()
    raise InvalidRequestError(f"unknown sampler {tag!r}")


def slot_output(s: Any) -> wc.Variant:
    """An engine slot result -> Pie's ``slot-output`` variant."""
    convert = _SLOT_OUTPUTS.get(type(s)) or _slot_outputs().get(type(s))
    if convert is None:
        raise TypeError(f"unknown slot result {type(s).__name__}")
    return convert(s)


_SLOT_OUTPUTS: dict[type, Any] = {}


def _slot_outputs() -> dict[type, Any]:
    """Each engine slot result type's conversion (filled on first use: the engine is
    imported when a pass first answers, not when the host is)."""
    from engine.slots import SlotDistribution, SlotEmbedding, SlotEntropy, SlotLogits, SlotLogprobs, SlotToken

    _SLOT_OUTPUTS.update(
        {
            SlotToken: lambda s: wc.Variant("token", int(s.token)),
            SlotDistribution: lambda s: wc.Variant(
                "distribution", ([int(i) for i in s.ids], [float(x) for x in s.probs])
            ),
            SlotLogits: lambda s: wc.Variant("logits", s.to_bytes()),
            SlotLogprobs: lambda s: wc.Variant("logprobs", [float(x) for x in s.values]),
            SlotEntropy: lambda s: wc.Variant("entropy", float(s.value)),
            SlotEmbedding: lambda s: wc.Variant("embedding", s.to_bytes()),
        }
    )
    return _SLOT_OUTPUTS


class ForwardPassRes(Resource):
    WIT = ("pie:core/inference", "forward-pass")

    def __init__(self, model: ModelRes):
        self.model_res = model
        self.context: ContextRes | None = None
        self.inputs: list[
            tuple[str, Any, Any]
        ] = []  # ("tokens", ids, positions) / ("image"|"audio", item, anchor)
        self.drafts: tuple[list[int], list[int]] | None = None
        self.output_spec = False
        self.pass_spec: bool | None = None
        self.attention: list[list[int]] | None = None
        self.logit_mask: list[int] | None = None
        self.samplers: list[tuple[list[int], Any]] = []
        self.adapter: Any = None
        self.zo_seed: int | None = None
        self.rows = 0
        self.executed = False

    def open(self) -> None:
        if self.executed:
            raise InvalidRequestError("this forward pass was executed already; build a new one")

    def __repr__(self) -> str:
        return f"ForwardPassRes({self.rows} rows, {len(self.samplers)} samplers)"


class FutureOutput(HostFuture):
    WIT = ("pie:core/inference", "future-output")


class GrammarRes(Resource):
    WIT = ("pie:core/inference", "grammar")

    def __init__(self, source: Any):
        self.source = source


class MatcherRes(Resource):
    WIT = ("pie:core/inference", "matcher")

    def __init__(self, matcher: Any):
        self.matcher = matcher


def _output(out: Any) -> wc.Record:
    r = wc.Record()
    r.slots = [slot_output(s) for s in out.slots]
    setattr(r, "spec-tokens", [int(t) for t in out.spec_tokens])
    setattr(r, "spec-positions", [int(p) for p in out.spec_positions])
    return r


class Inference(Interface):
    NAME = "pie:core/inference"
    RESOURCES = (ForwardPassRes, FutureOutput, GrammarRes, MatcherRes)

    # -- forward-pass builder (host-side only) -----------------------------------------------
    @wit("[constructor]forward-pass")
    def new(self, m: ModelRes) -> ForwardPassRes:
        self.host.text_model(m)
        return ForwardPassRes(m)

    @wit("[method]forward-pass.context")
    def context(self, p: ForwardPassRes, c: ContextRes) -> None:
        p.open()
        if c.model_res.model is not p.model_res.model:
            raise InvalidRequestError("the context belongs to another model than this forward pass")
        p.context = c

    def _rows(self, p: ForwardPassRes, tokens: list[int], positions: list[int]) -> None:
        if len(tokens) != len(positions):
            raise InvalidRequestError(f"{len(tokens)} tokens but {len(positions)} positions")
        p.rows += len(tokens)
        if p.rows > MAX_PASS_ROWS:
            raise InvalidRequestError(f"a pass takes at most {MAX_PASS_ROWS} rows")

    @wit("[method]forward-pass.input-tokens")
    def input_tokens(self, p: ForwardPassRes, tokens: list[int], positions: list[int]) -> None:
        p.open()
        self._rows(p, tokens, positions)
        p.inputs.append(("tokens", list(tokens), list(positions)))

    @wit("[method]forward-pass.input-image")
    def input_image(self, p: ForwardPassRes, image: Any, anchor: int) -> None:
        p.open()
        p.inputs.append(("image", image, int(anchor)))

    @wit("[method]forward-pass.input-audio")
    def input_audio(self, p: ForwardPassRes, audio: Any, anchor: int) -> None:
        p.open()
        p.inputs.append(("audio", audio, int(anchor)))

    @wit("[method]forward-pass.input-speculative-tokens")
    def input_speculative_tokens(self, p: ForwardPassRes, tokens: list[int], positions: list[int]) -> None:
        p.open()
        self._rows(p, tokens, positions)
        old = p.drafts or ([], [])
        p.drafts = (old[0] + list(tokens), old[1] + list(positions))

    @wit("[method]forward-pass.output-speculative-tokens")
    def output_speculative_tokens(self, p: ForwardPassRes, flag: bool) -> None:
        p.output_spec = bool(flag)

    @wit("[method]forward-pass.pass-speculation")
    def pass_speculation(self, p: ForwardPassRes, flag: bool) -> None:
        p.pass_spec = bool(flag)

    @wit("[method]forward-pass.attention-mask")
    def attention_mask(self, p: ForwardPassRes, masks: list[list[int]]) -> None:
        p.open()
        p.attention = [list(m) for m in masks]

    @wit("[method]forward-pass.logit-mask")
    def logit_mask(self, p: ForwardPassRes, mask: list[int]) -> None:
        p.open()
        p.logit_mask = list(mask)

    @wit("[method]forward-pass.sampler")
    def sampler(self, p: ForwardPassRes, indices: list[int], sampler: wc.Variant) -> None:
        p.open()
        p.samplers.append((list(indices), sampler))

    @wit("[method]forward-pass.adapter")
    def adapter(self, p: ForwardPassRes, adapter: Any) -> None:
        p.open()
        p.adapter = adapter

    # -- execute -------------------------------------------------------------------------------
    @wit("[method]forward-pass.execute")
    def execute(self, p: ForwardPassRes) -> FutureOutput:
        p.open()
        if p.context is None:
            raise InvalidRequestError("attach a context (forward-pass.context) before execute")
        host = self.host
        slots = [(idx, slot_of(v)) for idx, v in p.samplers]
        n_token_slots = sum(len(idx) for idx, s in slots if s.kind == "token")
        if n_token_slots:
            host.state.token_allowance(1, n_token_slots)
        res = p.context
        ctx = res.live()
        p.executed = True
        adapter = (
            host.engine_adapter(p.adapter, p.zo_seed)
            if (p.adapter is not None or p.zo_seed is not None)
            else None
        )

        def build() -> Any:
            fp = ctx.forward()
            for kind, a, b in p.inputs:
                if kind == "tokens":
                    fp.input_tokens(a, b)
                else:
                    getattr(fp, f"input_{kind}")(a.placed(ctx.model), b)
            if p.drafts is not None:
                fp.input_speculative_tokens(*p.drafts)
            if p.output_spec and p.logit_mask is None:
                # drafts are verified under this pass's one logit mask, which cannot follow a
                # grammar's state from token to token: a constrained pass proposes none
                fp.output_speculative_tokens(True)
            if p.pass_spec is not None:
                fp.pass_speculation(p.pass_spec)
            if p.attention is not None:
                fp.attention_mask(p.attention)
            if p.logit_mask is not None:
                fp.logit_mask(p.logit_mask)
            for idx, s in slots:
                fp.sampler(idx, s)
            if adapter is not None:
                fp.adapter(adapter)
            return fp

        if (
            adapter is None
            and res.quiet()
            and all(kind == "tokens" for kind, _, _ in p.inputs)
            and ctx.fits_reserved(p.rows)
        ):
            # The common pass (text rows, no adapter, in pages the context has reserved) on
            # a context with none of its passes running: built and checked here, on the
            # guest's thread, and handed to the loop without waiting for it (a hop less a
            # token: bench/inferlet_tax.py). Nothing else changes the context meanwhile
            # (the guest's other calls on it wait on the loop, behind this pass), and it
            # takes no page from the pool, so the loop cannot refuse it after this.
            fp = build()
            fp.check()
            fut = host.state.start_soon(fp.execute())
        else:

            async def start() -> concurrent.futures.Future:
                run, out = forwarded(build().execute())
                asyncio.ensure_future(run)
                await asyncio.sleep(0)  # the pass checks its inputs before its first wait
                if out.done() and out.exception() is not None:
                    raise out.exception()
                return out

            fut = host.wait_for(start())
        res.running = fut

        def convert(out: Any) -> wc.Record:
            r = _output(out)
            host.state.spend_tokens(sum(1 for v in r.slots if v.tag == "token"))
            return r

        return FutureOutput(fut, host, convert)

    @wit("[method]future-output.pollable")
    def output_pollable(self, f: FutureOutput) -> Pollable:
        return f.pollable()

    @wit("[method]future-output.get")
    def output_get(self, f: FutureOutput) -> wc.Record | None:
        return f.get()

    # -- grammar / matcher -----------------------------------------------------------------------
    @wit("[static]grammar.from-json-schema")
    def from_json_schema(self, schema: str) -> GrammarRes:
        from engine.grammar_matcher import GrammarSource

        return GrammarRes(GrammarSource.from_json_schema(self.host.state.text(schema, "a JSON schema")))

    @wit("[static]grammar.json")
    def json(self) -> GrammarRes:
        from engine.grammar_matcher import GrammarSource

        return GrammarRes(GrammarSource.any_json())

    @wit("[static]grammar.from-regex")
    def from_regex(self, pattern: str) -> GrammarRes:
        from engine.grammar_matcher import GrammarSource

        return GrammarRes(GrammarSource.from_regex(self.host.state.text(pattern, "a regex")))

    @wit("[static]grammar.from-ebnf")
    def from_ebnf(self, ebnf: str) -> GrammarRes:
        from engine.grammar_matcher import GrammarSource

        return GrammarRes(GrammarSource.from_ebnf(self.host.state.text(ebnf, "an EBNF grammar")))

    @wit("[method]grammar.to-string")
    def grammar_to_string(self, g: GrammarRes) -> str:
        return str(g.source)

    @wit("[constructor]matcher")
    def matcher(self, g: GrammarRes, t: TokenizerRes) -> MatcherRes:
        from engine.grammar_matcher import TokenMatcher

        return MatcherRes(TokenMatcher(g.source, t.model))

    @wit("[method]matcher.accept-tokens")
    def accept_tokens(self, m: MatcherRes, ids: list[int]) -> None:
        m.matcher.accept_tokens(list(ids))

    @wit("[method]matcher.next-token-logit-mask")
    def next_token_logit_mask(self, m: MatcherRes) -> list[int]:
        return list(m.matcher.next_token_mask_brle())

    @wit("[method]matcher.is-terminated")
    def is_terminated(self, m: MatcherRes) -> bool:
        return bool(m.matcher.is_terminated())

    @wit("[method]matcher.reset")
    def reset(self, m: MatcherRes) -> None:
        m.matcher.reset()
