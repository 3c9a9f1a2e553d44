"""Tool calling: the format a model family writes tool calls in, parsed back out of the
generated text, and a grammar that forces calls when the caller requires them.

The tools themselves reach the prompt through the checkpoint's own chat template
(``tools=`` of ``apply_chat_template``, as the reference renders them); what the model
writes back is family-specific. Qwen's templates ask for Hermes-style blocks::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one per call, separated by a newline, after any text. That is the only format here; a
family without one (or a template that ignores ``tools``) refuses tools with a typed error
rather than returning calls nobody parsed. Parsing follows vLLM's Hermes parser: a block
that is not a JSON object with a ``name`` leaves the whole output as plain content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.errors import InvalidRequestError
from engine.grammar import JSON_LAYOUT, Grammar

ToolChoice = Literal["none", "auto", "required"] | str
"""``"none"``, ``"auto"``, ``"required"``, or the name of the one function to call."""


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def __repr__(self) -> str:
        return f"ToolCall({self.name}({self.arguments}))"


@dataclass(frozen=True)
class ParsedOutput:
    """Generated text split into its plain content (None when there is none) and calls."""

    content: str | None
    calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class ToolCallFormat:
    """How one family writes tool calls: each call's JSON between ``start`` and ``end``."""

    name: str
    start: str
    end: str

    def parse(self, text: str) -> ParsedOutput:
        """The content before the first call and every call; the text unchanged as content
        when it holds no call or a block is not a call (a model that wrote a malformed call
        gets its words back, not an error)."""
        at = text.find(self.start)
        if at < 0:
            return ParsedOutput(text)
        pattern = (
            re.escape(self.start) + r"(.*?)" + re.escape(self.end) + "|" + re.escape(self.start) + r"(.*)$"
        )
        calls: list[ToolCall] = []
        for closed, open_tail in re.findall(pattern, text[at:], flags=re.DOTALL):
            call = _call_of(closed or open_tail)
            if call is None:
                return ParsedOutput(text)
            calls.append(call)
        # The text before the first call, without the whitespace that separates it from
        # the call (None when nothing else is left), as a stream releases it.
        return ParsedOutput(text[:at].rstrip() or None, tuple(calls))

    def stream(self) -> ToolCallStream:
        """A splitter for one choice's text as it is generated."""
        return ToolCallStream(self)

    def holds_back(self, text: str) -> int:
        """How many characters at the end of streamed ``text`` might begin ``start`` (they
        wait until the next token says whether a call begins)."""
        for k in range(min(len(self.start) - 1, len(text)), 0, -1):
            if self.start.startswith(text[-k:]):
                return k
        return 0

    def grammar(self, tools: Sequence[Mapping[str, Any]], tokenizer: Any, *, parallel: bool) -> Grammar:
        """Output that is only calls (one, or with ``parallel`` one or more) to ``tools``,
        each call's arguments valid against its function's ``parameters`` schema. Markers
        that are added tokens of ``tokenizer`` are written as those tokens (llguidance's
        ``<token>`` syntax), as the model itself writes them: a text literal would let the
        grammar's own fast-forward emit the token and then refuse it."""
        added = tokenizer.get_added_vocab()

        def marker(text: str) -> str:
            return text if text in added else json.dumps(text)

        rules = []
        for i, tool in enumerate(tools):
            fn = _function(tool)
            schema = {
                "x-guidance": JSON_LAYOUT,
                "type": "object",
                "properties": {
                    "name": {"const": fn["name"]},
                    "arguments": fn.get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            rules.append(f"call_{i}: %json {json.dumps(schema)}")
        call = " | ".join(f"call_{i}" for i in range(len(tools)))
        block = f'{marker(self.start)} "\\n" call "\\n" {marker(self.end)}'
        start = 'start: block ("\\n" block)*' if parallel else "start: block"
        return Grammar.lark("\n".join([start, f"block: {block}", f"call: {call}", *rules]))


class ToolCallStream:
    """One choice's output as it streams: ``feed`` each piece of text and send back the
    content it releases; ``finish`` gives the rest and the calls. What is released adds up
    to ``ToolCallFormat.parse``'s content for the whole text, so a streamed answer equals
    the whole one: text that may begin a call, and whitespace that may end the content
    before one, wait for the next piece."""

    def __init__(self, fmt: ToolCallFormat):
        self.fmt = fmt
        self.text = ""
        self.sent = 0
        self.in_calls = False

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.in_calls:
            return ""
        at = self.text.find(self.fmt.start, self.sent)
        if at >= 0:
            self.in_calls = True
            end = len(self.text[:at].rstrip())
        else:
            end = len(self.text) - self.fmt.holds_back(self.text)
            end = len(self.text[:end].rstrip())
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : end], end
        return out

    def finish(self) -> tuple[str, tuple[ToolCall, ...]]:
        """(content not yet released, the calls) once the choice has ended."""
        parsed = self.fmt.parse(self.text)
        if parsed.calls:
            return "", parsed.calls
        rest, self.sent = self.text[self.sent :], len(self.text)
        return rest, ()


HERMES = ToolCallFormat("hermes", "<tool_call>", "</tool_call>")
FORMATS: dict[str, ToolCallFormat] = {"qwen3_vl": HERMES}
"""Architecture family -> the tool-call format its chat templates ask for."""


def tool_call_format(model: Any) -> ToolCallFormat:
    """The format ``model`` writes tool calls in; a typed error when it has none or its
    chat template does not put tools in the prompt."""
    fmt = FORMATS.get(model.arch.family)
    if fmt is None:
        raise InvalidRequestError(
            f"tool calling is not supported for {model.arch.family} models here (no tool-call "
            "parser for their format); leave out tools",
            param="tools",
        )
    if not model.chat.renders_tools:
        raise InvalidRequestError(
            "this checkpoint's chat template does not render tools, so the model would never "
            "see them; leave out tools or serve a template that renders them",
            param="tools",
        )
    return fmt


def check_tools(tools: Sequence[Mapping[str, Any]], choice: ToolChoice) -> None:
    """Typed errors for tools the template cannot take (each must be a function with a
    name) and for a ``choice`` naming no tool."""
    names = [_function(t)["name"] for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError("two tools have the same function name", param="tools")
    if choice == "required" and not tools:
        raise InvalidRequestError("tool_choice 'required' needs tools", param="tool_choice")
    if choice not in ("none", "auto", "required") and choice not in names:
        raise InvalidRequestError(
            f"tool_choice names {choice!r}, which is not one of the tools ({', '.join(names) or 'none'})",
            param="tool_choice",
        )


def _function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    fn = tool.get("function") if tool.get("type", "function") == "function" else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise InvalidRequestError(
            'each tool is {"type": "function", "function": {"name": ..., "parameters": {...}}}',
            param="tools",
        )
    params = fn.get("parameters")
    if params is not None and not isinstance(params, Mapping):
        raise InvalidRequestError(
            f"tool {fn['name']!r}: parameters must be a JSON schema object", param="tools"
        )
    return fn


def _call_of(block: str) -> ToolCall | None:
    try:
        obj = json.loads(block.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))
