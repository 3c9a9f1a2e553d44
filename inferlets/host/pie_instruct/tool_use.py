"""``pie:instruct/tool-use``: tools rendered into the prompt the model's way, results
answered, calls decoded from the generated tokens, and the grammar / matcher that force
a well-formed call (engine/instruct.py, engine/tool_calls.py)."""

from __future__ import annotations

from typing import Any

from wasmtime import component as wc

from inferlets.host.binding import Interface, Resource, wit
from inferlets.host.pie_core.inference import GrammarRes, MatcherRes
from inferlets.host.pie_core.model import ModelRes


class ToolDecoderRes(Resource):
    WIT = ("pie:instruct/tool-use", "decoder")

    def __init__(self, decoder: Any):
        self.decoder = decoder


class ToolUse(Interface):
    NAME = "pie:instruct/tool-use"
    RESOURCES = (ToolDecoderRes,)

    def _format(self, m: ModelRes) -> Any:
        from engine.instruct import InstructFormat

        return InstructFormat.for_model(self.host.text_model(m))

    def _source(self, m: ModelRes, tools: list[str]) -> Any:
        """The grammar forcing a call of one of ``tools`` (None: the model has no call format)."""
        from engine.grammar_matcher import GrammarSource

        grammar = self._format(m).tool_grammar([self.host.state.text(t, "a tool") for t in tools])
        return None if grammar is None else GrammarSource(kind="ebnf", text=grammar.source, grammar=grammar)

    @wit("equip")
    def equip(self, m: ModelRes, tools: list[str]) -> list[int]:
        return list(self._format(m).equip([self.host.state.text(t, "a tool") for t in tools]))

    @wit("answer")
    def answer(self, m: ModelRes, name: str, value: str) -> list[int]:
        return list(self._format(m).answer(name, self.host.state.text(value, "a tool result")))

    @wit("create-decoder")
    def create_decoder(self, m: ModelRes) -> ToolDecoderRes:
        from engine.instruct_decoders import ToolCallDecoder

        return ToolDecoderRes(ToolCallDecoder(self.host.text_model(m)))

    @wit("format")
    def format(self, m: ModelRes, tools: list[str]) -> GrammarRes | None:
        source = self._source(m, tools)
        return None if source is None else GrammarRes(source)

    @wit("create-matcher")
    def create_matcher(self, m: ModelRes, tools: list[str]) -> MatcherRes:
        from engine.grammar_matcher import TokenMatcher

        source = self._source(m, tools)
        if source is None:
            raise RuntimeError(f"model {m.name!r} has no tool-call format to match")
        return MatcherRes(TokenMatcher(source, self.host.text_model(m)))

    @wit("[method]decoder.feed")
    def feed(self, d: ToolDecoderRes, tokens: list[int]) -> wc.Variant:
        ev = d.decoder.feed(list(tokens))
        if ev[0] == "call":
            return wc.Variant("call", (ev[1], ev[2]))
        return wc.Variant(ev[0], None)

    @wit("[method]decoder.reset")
    def reset(self, d: ToolDecoderRes) -> None:
        d.decoder.reset()
