"""``pie:instruct/reasoning``: a decoder that splits a thinking model's thought from its
answer: start / delta / complete events (engine/instruct.py)."""

from __future__ import annotations

from typing import Any

from wasmtime import component as wc

from inferlets.host.binding import Interface, Resource, wit
from inferlets.host.pie_core.model import ModelRes


class ReasoningDecoderRes(Resource):
    WIT = ("pie:instruct/reasoning", "decoder")

    def __init__(self, decoder: Any):
        self.decoder = decoder


class Reasoning(Interface):
    NAME = "pie:instruct/reasoning"
    RESOURCES = (ReasoningDecoderRes,)

    @wit("create-decoder")
    def create_decoder(self, m: ModelRes) -> ReasoningDecoderRes:
        from engine.instruct_decoders import ReasoningDecoder

        return ReasoningDecoderRes(ReasoningDecoder(self.host.text_model(m)))

    @wit("[method]decoder.feed")
    def feed(self, d: ReasoningDecoderRes, tokens: list[int]) -> wc.Variant:
        ev = d.decoder.feed(list(tokens))
        return wc.Variant(ev[0], ev[1] if len(ev) > 1 else None)

    @wit("[method]decoder.reset")
    def reset(self, d: ReasoningDecoderRes) -> None:
        d.decoder.reset()
