"""``pie:instruct/chat``: a model's chat format as token deltas, and a decoder of the
generated tokens into delta / interrupt / done events (engine/instruct.py)."""

from __future__ import annotations

from typing import Any

from wasmtime import component as wc

from inferlets.host.binding import Interface, Resource, wit
from inferlets.host.pie_core.model import ModelRes


class ChatDecoderRes(Resource):
    WIT = ("pie:instruct/chat", "decoder")

    def __init__(self, decoder: Any):
        self.decoder = decoder


def _format(host: Any, m: ModelRes) -> Any:
    from engine.instruct import InstructFormat

    return InstructFormat.for_model(host.text_model(m))


class Chat(Interface):
    NAME = "pie:instruct/chat"
    RESOURCES = (ChatDecoderRes,)

    @wit("system")
    def system(self, m: ModelRes, message: str) -> list[int]:
        return list(_format(self.host, m).system(self.host.state.text(message)))

    @wit("first-user")
    def first_user(self, m: ModelRes, message: str) -> list[int]:
        return list(_format(self.host, m).first_user(self.host.state.text(message)))

    @wit("user")
    def user(self, m: ModelRes, message: str) -> list[int]:
        return list(_format(self.host, m).user(self.host.state.text(message)))

    @wit("system-user")
    def system_user(self, m: ModelRes, system: str, user: str) -> list[int]:
        st = self.host.state
        return list(_format(self.host, m).system_user(st.text(system), st.text(user)))

    @wit("assistant")
    def assistant(self, m: ModelRes, message: str) -> list[int]:
        return list(_format(self.host, m).assistant(self.host.state.text(message)))

    @wit("cue")
    def cue(self, m: ModelRes) -> list[int]:
        return list(_format(self.host, m).cue())

    @wit("seal")
    def seal(self, m: ModelRes) -> list[int]:
        return list(_format(self.host, m).seal())

    @wit("stop-tokens")
    def stop_tokens(self, m: ModelRes) -> list[int]:
        return list(_format(self.host, m).stop_tokens())

    @wit("create-decoder")
    def create_decoder(self, m: ModelRes) -> ChatDecoderRes:
        from engine.instruct_decoders import ChatDecoder

        return ChatDecoderRes(ChatDecoder(self.host.text_model(m)))

    @wit("[method]decoder.feed")
    def feed(self, d: ChatDecoderRes, tokens: list[int]) -> wc.Variant:
        ev = d.decoder.feed(list(tokens))
        return wc.Variant(ev[0], ev[1] if len(ev) > 1 else None)

    @wit("[method]decoder.reset")
    def reset(self, d: ChatDecoderRes) -> None:
        d.decoder.reset()
