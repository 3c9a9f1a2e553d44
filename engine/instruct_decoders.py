"""The event decoders of Pie 0.4.0's ``pie:instruct``: generated token ids in, one event per
``feed`` out, as Pie's runtime emits them (``runtime/src/model/instruct/decoders.rs`` and
the Qwen tool decoder), as plain tuples the WIT binding turns into variants.

``ChatDecoder`` (``chat.decoder``):
  ``("delta", text)``: the text the batch added (``""`` when none, e.g. half of a
  character split across tokens: it goes out whole with the token that completes it);
  ``("done", text)``: a stop token (``InstructFormat.stop_tokens``) arrived; ``text`` is
  everything since the last reset or done, the stop token and what followed it in the
  batch left out; the decoder starts over. Text is decoded with special tokens kept
  (``<think>`` included), as Pie decodes it. ``("interrupt", id)`` is in the WIT but
  Pie 0.4.0 never emits it; neither does this.

``ReasoningDecoder`` (``reasoning.decoder``):
  ``("start",)`` when the start marker arrives (``<think>``, Gemma-4's ``<|channel>``);
  ``("delta", text)`` with the thought text the batch added (``""`` outside a thought:
  Pie's idle event); ``("complete", text)`` at the end marker with the whole thought.
  The markers come from ``engine.reasoning`` (Gemma-4's thoughts lose their channel name
  ``thought\\n`` there; Pie 0.4.0 has no Gemma-4 reasoning decoder). A generation prompt
  that leaves a thought open starts the decoder inside it.

``ToolCallDecoder`` (``tool-use.decoder``):
  ``("call", name, arguments)`` when a call's block closes, its arguments as compact JSON
  (``{"city":"Paris"}``, key order kept, as Pie's serde_json writes them); ``("start",)``
  otherwise (Pie's one other event: "a call is in progress, keep feeding", also its idle
  event). A block that is not a call (bad JSON, no name) yields no call. A family with no
  call format the engine parses only ever answers ``("start",)``, as Pie's no-op decoder.

Where Pie's decoders lose events or text this keeps them: all of a batch's tokens are
read (Pie's reasoning decoder drops the rest of a batch after a marker), and when one
batch crosses two boundaries (a whole thought, two calls) the later events wait in order
and come out of the next ``feed`` calls (``feed([])`` takes them without new tokens).
Text is decoded incrementally (``engine.incremental_text``), not the whole output per
token as Pie does; both hold back an unfinished character.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Sequence
from typing import Any

from engine.errors import InvalidRequestError
from engine.incremental_text import IncrementalText
from engine.instruct import InstructFormat
from engine.reasoning import reasoning_markers
from engine.tool_calls import FORMATS as TOOL_CALL_FORMATS

ChatEvent = tuple[str, str] | tuple[str, int]
ReasoningEvent = tuple[str] | tuple[str, str]
ToolEvent = tuple[str] | tuple[str, str, str]

_UNFINISHED = "\ufffd"


class _Text:
    """A token stream's decode (special tokens kept), released as it becomes safe: never
    ending in an unfinished character (Pie's ``safe_emit_end``)."""

    def __init__(self, model: Any):
        self._model = model
        self._vocab = len(model.tokenizer)
        self._width = max(self._vocab, int(getattr(getattr(model, "arch", None), "vocab_size", 0) or 0))
        self._inc = IncrementalText(self._decode, model.byte_fallback_ids)
        self.text = ""
        self.sent = 0

    def _decode(self, ids: Sequence[int]) -> str:
        return self._model.detokenize(ids, skip_special_tokens=False)

    def check(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            if not 0 <= t < self._width:
                raise InvalidRequestError(
                    f"token id {t} is not in the model's vocabulary (0..{self._width - 1})", param="tokens"
                )

    def push(self, token: int) -> str:
        """Add ``token``; the text it releases. An id past the tokenizer but inside the
        model's logits (the embedding table's padding rows, which a sampler over the whole
        row can draw) has no text."""
        if token >= self._vocab:
            return ""
        self.text = self._inc.push(int(token))
        end = len(self.text.rstrip(_UNFINISHED))
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : end], end
        return out


class ChatDecoder:
    """``pie:instruct/chat`` decoder of one model's generated tokens."""

    def __init__(self, model: Any, instruct: InstructFormat | None = None):
        self.model = model
        self._stop = frozenset((instruct or InstructFormat.for_model(model)).stop_tokens())
        self.reset()

    def reset(self) -> None:
        self._text = _Text(self.model)

    def feed(self, tokens: Sequence[int]) -> ChatEvent:
        self._text.check(tokens)
        out = []
        for t in tokens:
            if t in self._stop:
                whole = self._text.text
                self.reset()
                return ("done", whole)
            out.append(self._text.push(t))
        return ("delta", "".join(out))


class ReasoningDecoder:
    """``pie:instruct/reasoning`` decoder of one model's generated tokens."""

    def __init__(self, model: Any, instruct: InstructFormat | None = None):
        self.model = model
        self._markers = reasoning_markers(model)
        fmt = instruct or InstructFormat.for_model(model)
        self._cue = fmt.cue() if self._markers is not None and fmt.cue_opens_thought else []
        self.reset()

    def reset(self) -> None:
        self._text = _Text(self.model)
        self._events: deque[ReasoningEvent] = deque()
        self._thought: list[str] = []
        self._pending = ""
        m = self._markers
        self._split = m.split() if m is not None else None
        if self._split is not None and self._cue:
            # The prompt opened the thought: read the cue from its start marker on.
            start = len(self._cue) - 1 - self._cue[::-1].index(m.start_id)
            for t in self._cue[start:]:
                self._split.feed(t, self.model.detokenize([t], skip_special_tokens=False))

    def feed(self, tokens: Sequence[int]) -> ReasoningEvent:
        self._text.check(tokens)
        split = self._split
        if split is None:
            return ("delta", "")
        for t in tokens:
            was = split.thinking
            thought, _ = split.feed(t, self._text.push(t))
            if thought:
                self._thought.append(thought)
                self._pending += thought
            if split.thinking and not was:
                self._events.append(("start",))
                self._thought, self._pending = [], ""
            elif was and not split.thinking:
                self._events.append(("complete", "".join(self._thought)))
                self._thought, self._pending = [], ""
        if self._events:
            return self._events.popleft()
        out, self._pending = self._pending, ""
        return ("delta", out)


class ToolCallDecoder:
    """``pie:instruct/tool-use`` decoder of one model's generated tokens."""

    def __init__(self, model: Any):
        self.model = model
        self._format = TOOL_CALL_FORMATS.get(model.arch.family)
        self.reset()

    def reset(self) -> None:
        self._text = _Text(self.model)
        self._buf = ""
        self._inside = False
        self._calls: deque[ToolEvent] = deque()

    def feed(self, tokens: Sequence[int]) -> ToolEvent:
        self._text.check(tokens)
        fmt = self._format
        if fmt is None:
            return ("start",)
        self._buf += "".join(self._text.push(t) for t in tokens)
        while True:
            if not self._inside:
                at = self._buf.find(fmt.start)
                if at < 0:
                    self._buf = self._buf[len(self._buf) - fmt.holds_back(self._buf) :]
                    break
                self._inside, self._buf = True, self._buf[at + len(fmt.start) :]
            else:
                at = self._buf.find(fmt.end)
                if at < 0:
                    break
                block, self._buf = self._buf[:at], self._buf[at + len(fmt.end) :]
                self._inside = False
                for call in fmt.parse(fmt.start + block + fmt.end).calls:
                    self._calls.append(("call", call.name, _compact(call.arguments)))
        return self._calls.popleft() if self._calls else ("start",)


def _compact(arguments: str) -> str:
    """Arguments JSON as Pie's serde_json writes it: no spaces, key order kept."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        value = arguments
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


__all__ = ["ChatDecoder", "ReasoningDecoder", "ToolCallDecoder"]
