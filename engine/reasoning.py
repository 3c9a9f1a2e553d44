"""Thinking output: the thoughts a thinking model writes before its answer, split from it.

Gemma-4 with thinking on (``enable_thinking``, a template option) writes
``<|channel>thought\\n ... <channel|>`` and then the answer; Qwen3 thinking models write
``<think> ... </think>``. Each marker is one token, so the split follows token ids: the
markers' text never reaches either side, and the channel's name (``thought``) is not part
of the thoughts. Output with no opening marker is all answer (a template that opens the
thought in the prompt is not split). The split is what vLLM's reasoning parsers return as
``reasoning_content``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str
    end: str
    channel: str = ""
    """Text the thoughts open with that names the channel (dropped, with one newline)."""


FORMATS: dict[str, ReasoningFormat] = {
    "gemma4": ReasoningFormat("gemma4", "<|channel>", "<channel|>", "thought"),
    "qwen3_vl": ReasoningFormat("qwen3", "<think>", "</think>"),
}
"""Architecture family -> how its thinking models mark their thoughts."""


@dataclass(frozen=True)
class ReasoningMarkers:
    """A format bound to one tokenizer: the markers' token ids."""

    format: ReasoningFormat
    start_id: int
    end_id: int

    def split(self) -> ReasoningSplit:
        """A splitter for one choice's tokens as they are generated."""
        return ReasoningSplit(self)


def reasoning_markers(model: Any) -> ReasoningMarkers | None:
    """The thought markers of ``model``'s family as its tokenizer's ids; None when the
    family has none or the tokenizer lacks them as single tokens."""
    fmt = FORMATS.get(model.arch.family)
    if fmt is None:
        return None
    tok = model.tokenizer
    ids = [tok.convert_tokens_to_ids(t) for t in (fmt.start, fmt.end)]
    if any(i is None or i == tok.unk_token_id for i in ids):
        return None
    return ReasoningMarkers(fmt, int(ids[0]), int(ids[1]))


class ReasoningSplit:
    """One choice's generated tokens, split: ``feed(token, text)`` gives the (thoughts,
    answer) text that token releases. Until the start marker everything is answer; between
    the markers, thoughts; after the end marker, answer again."""

    def __init__(self, markers: ReasoningMarkers):
        self.markers = markers
        self.thinking = False
        self._head = ""  # thought text while it may still be the channel's name
        self._named = not markers.format.channel

    def passthrough(self, token: int) -> bool:
        """Whether ``token``'s text is all answer (no marker, not thinking): a caller's fast
        path may send it as it is (``feed`` must still see it)."""
        m = self.markers
        return not self.thinking and token != m.start_id and token != m.end_id

    def feed(self, token: int, text: str) -> tuple[str, str]:
        m, fmt = self.markers, self.markers.format
        if token == m.start_id and not self.thinking:
            self.thinking = True
            return "", text.replace(fmt.start, "")
        if token == m.end_id and self.thinking:
            self.thinking = False
            thought = self._release(text.replace(fmt.end, ""), final=True)
            return thought, ""
        if self.thinking:
            return self._release(text, final=False), ""
        return "", text

    def _release(self, text: str, *, final: bool) -> str:
        """Thought text, without the channel's name and the newline after it."""
        if self._named:
            return text
        self._head += text
        name = self.markers.format.channel
        head = self._head
        if not final and (name + "\n").startswith(head):
            return ""  # may still be the name: wait
        self._named = True
        self._head = ""
        if head.startswith(name):
            head = head[len(name) :]
            if head.startswith("\n"):
                head = head[1:]
        return head
