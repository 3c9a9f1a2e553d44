"""Tool calling on ``/v1/chat/completions``: OpenAI's ``tools``, ``tool_choice`` and
``parallel_tool_calls`` bound to the engine's ``engine.tool_calls``.

The tools render into the prompt through the checkpoint's chat template, whatever the
choice (as vLLM does by default). ``"auto"`` parses the calls the model chose to write;
``"required"`` and a named function add a grammar so that the output is only calls (to any
tool, or to that one), each call's arguments valid against its ``parameters`` schema;
``"none"`` leaves the text as it is. A family without a tool-call format, or a template
that does not render tools, is a 400 rather than calls that nobody parses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from api.http.schemas.chat import ChatCompletionRequest, DeltaToolCall, FunctionCallOut, ToolCallOut
from engine import Grammar, InvalidRequestError, ToolCall, ToolCallFormat, check_tools, tool_call_format
from media import PieMediaError


@dataclass(frozen=True)
class ToolUse:
    tools: list[dict[str, Any]]
    choice: str
    """"none", "auto", "required", or the one function's name."""
    format: ToolCallFormat
    grammar: Grammar | None
    """With "required" or a named function: the output is only calls."""

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    def finish_reason(self, reason: str | None, calls: tuple[ToolCall, ...]) -> str | None:
        """ "tool_calls" when the model chose to call (OpenAI keeps "stop" when the caller
        named the function)."""
        if calls and self.choice in ("auto", "required"):
            return "tool_calls"
        return reason

    @staticmethod
    def calls_out(calls: tuple[ToolCall, ...]) -> list[ToolCallOut] | None:
        if not calls:
            return None
        return [
            ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in calls
        ]

    @staticmethod
    def deltas(calls: tuple[ToolCall, ...]) -> list[DeltaToolCall]:
        """Each call whole in one delta (OpenAI's stream shape; a client concatenates the
        ``arguments`` of one index, here a single piece)."""
        return [
            DeltaToolCall(index=k, id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments))
            for k, c in enumerate(calls)
        ]


def tool_use_of(body: ChatCompletionRequest, model: Any) -> ToolUse | None:
    """The request's tool use (None without tools), checked: typed 400s for a choice
    without tools, a choice naming no tool, tools this model cannot take, and a forced
    call together with a ``response_format``."""
    choice_field = body.tool_choice
    choice = (
        choice_field.function.name if choice_field is not None and not isinstance(choice_field, str) else None
    )
    choice = choice or choice_field or ("auto" if body.tools else "none")
    if not body.tools:  # none, or an empty list (sent by some clients): plain chat
        if choice not in ("none", "auto"):
            raise InvalidRequestError(f"tool_choice {choice!r} needs tools", param="tool_choice")
        return None
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    check_tools(tools, choice)
    fmt = tool_call_format(model)
    grammar = None
    if choice not in ("none", "auto"):
        if body.response_format is not None and body.response_format.type != "text":
            raise InvalidRequestError(
                "a required or named tool_choice constrains the output itself; leave out response_format",
                param="response_format",
            )
        chosen = tools if choice == "required" else [t for t in tools if t["function"]["name"] == choice]
        # A named function is called once; "required" takes several unless told otherwise.
        grammar = fmt.grammar(
            chosen, model.tokenizer, parallel=body.parallel_tool_calls and choice == "required"
        )
        try:
            grammar.compiled()  # a bad parameters schema is a 400 now
        except PieMediaError as e:
            e.details.setdefault("param", "tools")
            raise
    return ToolUse(tools, choice, fmt, grammar)
