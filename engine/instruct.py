"""A model's instruct format as token deltas: what Pie 0.4.0's ``pie:instruct`` chat and
tool-use fillers return (``system``, ``first-user``, ``user``, ``system-user``,
``assistant``, ``cue``, ``seal``, ``stop-tokens``, ``equip``, ``answer``, ``format``).

Pie hard-codes each family's delimiters in Rust (``runtime/src/model/instruct/*.rs``).
Here every piece comes from the checkpoint's own chat template instead, rendered through
``engine.chat.ChatTemplate`` for a short probe conversation and cut where the piece
begins and ends, then tokenized as the engine tokenizes a rendered prompt. So a
conversation built from these deltas tokenizes exactly as the template renders it whole
(and as ``Context`` builds it), whatever the family; the tests check it for Qwen3-VL and
Gemma-4. Where the template and Pie's Rust differ, the template wins:

* ``cue()`` is the template's generation prompt: for Gemma-4 with thinking off it ends in
  the empty thought channel ``<|channel>thought\\n<channel|>`` (Pie: ``<|turn>model\\n``).
* ``seal()`` closes an assistant turn as the template does (``<|im_end|>\\n``,
  ``<turn|>\\n``); Pie's returns the stop-token list. ``cue() + reply + seal()`` equals
  ``assistant(reply)`` (for Gemma-4 with the empty thought channel in between: its template
  drops the channel from history).
* ``stop_tokens()``: the token that closes the template's turn, then the checkpoint's
  end-of-sequence ids (Qwen: ``<|im_end|>``, ``<|endoftext|>``; Gemma-4: ``<turn|>``,
  ``<eos>``, as Pie lists them).
* ``system()``, ``first_user()`` and ``system_user()`` open a conversation (Gemma-4's
  ``<bos>`` included, as Pie's); ``user()`` and ``assistant()`` continue one. ``assistant()``
  replays a turn the way the template renders an earlier turn (e.g. Gemma-4 drops its
  thoughts).
* ``equip(tools)`` opens a conversation with the template's tools block (follow it with
  ``user()``); ``equip(tools, system=...)`` renders the system message into the same turn,
  as the template does. Tool calling needs a family whose call format the engine parses
  (``engine.tool_calls``): others get a typed error (Pie returns no tokens).
* ``answer(name, value)`` is the template's tool-result turn; ``answers`` renders several
  results of one assistant turn together (the template folds them into one turn).

Template keywords (``enable_thinking``, ...) come from ``Model.load(chat_template_kwargs=)``
and from ``for_model(model, options)``.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property
from typing import Any

from engine.chat import Message
from engine.errors import InvalidRequestError
from engine.grammar import Grammar
from engine.reasoning import reasoning_markers
from engine.tool_calls import FORMATS as TOOL_CALL_FORMATS
from engine.tool_calls import check_tools, tool_call_format

_PROBE = "PROBE"
"""Content of the probe turns the pieces are cut from (plain ASCII, no space to trim)."""
_BEFORE: Message = {"role": "user", "content": "hi"}
_AFTER: Message = {"role": "user", "content": "ok"}

Tool = str | Mapping[str, Any]
"""A tool as Pie passes it (its JSON text) or already parsed."""


def _user(text: str) -> Message:
    return {"role": "user", "content": text}


class InstructFormat:
    """One model's instruct pieces (one per model and template options: ``for_model``)."""

    def __init__(self, model: Any, options: Mapping[str, Any] | None = None):
        # A weak reference: ``for_model``'s cache is keyed weakly by the model, which a
        # strong one in its value would keep alive for good.
        try:
            self._model: Callable[[], Any] = weakref.ref(model)
        except TypeError:  # an object without weak references (a test's stand-in)
            self._model = lambda: model
        self.options: dict[str, Any] = dict(options or {})
        if "tools" in self.options:
            raise InvalidRequestError("pass tools to equip(), not as a template option", param="options")

    @property
    def model(self) -> Any:
        model = self._model()
        if model is None:
            raise InvalidRequestError("the model of this instruct format was unloaded")
        return model

    @classmethod
    def for_model(cls, model: Any, options: Mapping[str, Any] | None = None) -> InstructFormat:
        """The format of ``model`` (cached per model and ``options``)."""
        key = json.dumps(dict(options or {}), sort_keys=True, default=repr)
        with _LOCK:
            per_model = _CACHE.setdefault(model, {})
            fmt = per_model.get(key)
            if fmt is None:
                fmt = per_model[key] = cls(model, options)
        return fmt

    # -- rendering ------------------------------------------------------------------------
    def _render(self, messages: list[Message], *, cue: bool = False, tools: list[Any] | None = None) -> str:
        options = self.options if tools is None else {**self.options, "tools": tools}
        return self.model.chat.render(messages, add_generation_prompt=cue, options=options)

    def _turns(self, history: list[Message], messages: list[Message]) -> str:
        return self.model.chat.turns(history, messages, self.options)

    def _ids(self, text: str) -> list[int]:
        return self.model.tokenize(text) if text else []

    @cached_property
    def _head(self) -> str:
        """The probe conversation the pieces follow: one user turn."""
        return self._render([_BEFORE])

    @cached_property
    def _tail(self) -> str:
        """A user turn after the probe (what follows a replayed assistant turn)."""
        return self._user_text(_AFTER["content"])

    def _user_text(self, msg: str) -> str:
        whole = self._render([_BEFORE, _user(msg)])
        if not whole.startswith(self._head):
            raise InvalidRequestError(
                "the chat template re-renders earlier turns when a user turn is added (it is "
                "not prefix-stable), so the turn cannot be a token delta"
            )
        return whole[len(self._head) :]

    def _assistant_text(self, msg: str) -> str:
        """An assistant turn as the template renders it between two user turns."""
        assistant = {"role": "assistant", "content": msg}
        whole = self._render([_BEFORE, assistant, _AFTER])
        head, tail = self._head, self._tail
        if not (whole.startswith(head) and whole.endswith(tail)) or len(whole) < len(head) + len(tail):
            raise InvalidRequestError(
                "the chat template renders an assistant turn differently from its neighbours "
                "(not prefix-stable), so it cannot be replayed as a token delta"
            )
        return whole[len(head) : len(whole) - len(tail)]

    # -- chat -----------------------------------------------------------------------------
    def system(self, msg: str) -> list[int]:
        """A system turn that opens the conversation."""
        return self._ids(self._render([{"role": "system", "content": msg}]))

    def first_user(self, msg: str) -> list[int]:
        """A user turn that opens the conversation."""
        return self._ids(self._render([_user(msg)]))

    def user(self, msg: str) -> list[int]:
        """A user turn after earlier turns."""
        return self._ids(self._user_text(msg))

    def system_user(self, system: str, user: str) -> list[int]:
        """A system turn and a user turn that open the conversation."""
        return self._ids(self._render([{"role": "system", "content": system}, _user(user)]))

    def assistant(self, msg: str) -> list[int]:
        """An earlier assistant turn replayed (as the template renders history)."""
        return self._ids(self._assistant_text(msg))

    @cached_property
    def _cue_ids(self) -> list[int]:
        return self._ids(self.model.chat.cue([_BEFORE], self.options))

    def cue(self) -> list[int]:
        """The generation prompt: the model's turn starts."""
        return list(self._cue_ids)

    @cached_property
    def _seal_ids(self) -> list[int]:
        text = self._assistant_text(_PROBE)
        at = text.rfind(_PROBE)
        if at < 0:
            raise InvalidRequestError("the chat template does not render an assistant turn's text")
        return self._ids(text[at + len(_PROBE) :])

    def seal(self) -> list[int]:
        """What closes the model's turn after its reply, as the template closes it."""
        return list(self._seal_ids)

    @cached_property
    def _stop_ids(self) -> list[int]:
        eos = sorted(int(i) for i in self.model.eos_token_ids or ())
        seal = self._seal_ids
        closing = [seal[0]] if seal and seal[0] in self._added_ids else []
        return closing + [i for i in eos if i not in closing]

    def stop_tokens(self) -> list[int]:
        """Token ids that end the model's turn."""
        return list(self._stop_ids)

    @cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(int(i) for i in self.model.tokenizer.get_added_vocab().values())

    @cached_property
    def cue_opens_thought(self) -> bool:
        """Whether the generation prompt leaves a thought open (a template that starts the
        model thinking): the reply's first tokens are thoughts, with no start marker."""
        markers = reasoning_markers(self.model)
        if markers is None or markers.start_id not in self._cue_ids:
            return False
        last = len(self._cue_ids) - 1 - self._cue_ids[::-1].index(markers.start_id)
        return markers.end_id not in self._cue_ids[last:]

    # -- tool use -------------------------------------------------------------------------
    def equip(self, tools: Sequence[Tool], *, system: str | None = None) -> list[int]:
        """The template's tools block, opening the conversation (with ``system`` in the
        same turn); follow it with ``user()``."""
        tool_call_format(self.model)
        parsed = parse_tools(tools)
        opening = [] if system is None else [{"role": "system", "content": system}]
        whole = self._render([*opening, _AFTER], tools=parsed)
        tail = self._tail
        if not whole.endswith(tail):
            raise InvalidRequestError(
                "the chat template renders the user turn after its tools differently, so the "
                "tools block cannot be cut out as a token delta"
            )
        return self._ids(whole[: len(whole) - len(tail)])

    def answer(self, name: str, value: str) -> list[int]:
        """A tool's result, as the template renders a tool turn after the call."""
        return self.answers([(name, value)])

    def answers(self, results: Sequence[tuple[str, str]]) -> list[int]:
        """Several tools' results after one assistant turn (the template may fold them into
        one turn, which separate ``answer`` calls do not)."""
        tool_call_format(self.model)
        calls = [{"type": "function", "function": {"name": n, "arguments": {}}} for n, _ in results]
        history = [_BEFORE, {"role": "assistant", "content": "", "tool_calls": calls}]
        turns = [{"role": "tool", "name": n, "content": v} for n, v in results]
        return self._ids(self._turns(history, turns))

    def tool_grammar(self, tools: Sequence[Tool]) -> Grammar | None:
        """Output that is only tool calls (one or more) to ``tools``, in the family's call
        format, each call's arguments valid against its tool's parameters; None when there
        are no tools or the family has no call format the engine parses."""
        if not tools:
            return None
        try:
            fmt = tool_call_format(self.model)
        except InvalidRequestError:
            return None
        functions = [_as_function(t) for t in parse_tools(tools)]
        check_tools(functions, "auto")
        return fmt.grammar(functions, self.model.tokenizer, parallel=True)

    @property
    def has_tool_calls(self) -> bool:
        """Whether the family has a call format the engine parses."""
        return self.model.arch.family in TOOL_CALL_FORMATS


_CACHE: weakref.WeakKeyDictionary[Any, dict[str, InstructFormat]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def parse_tools(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """Tools as Pie passes them (each a JSON object's text) as the template takes them;
    a typed error naming the first that is not a JSON object."""
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        if isinstance(tool, str):
            try:
                tool = json.loads(tool)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"tool {i} is not valid JSON: {e}", param="tools") from None
        if not isinstance(tool, Mapping):
            raise InvalidRequestError(f"tool {i} is not a JSON object", param="tools")
        out.append(dict(tool))
    return out


def _as_function(tool: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's tool shape; a bare function (``{"name": ..., "parameters": ...}``, which
    Pie also takes) wrapped in it."""
    if "function" not in tool and "name" in tool:
        return {"type": "function", "function": tool}
    return tool


class ToolUse:
    """``pie:instruct/tool-use`` as calls on a model (its decoder:
    ``engine.instruct_decoders.ToolCallDecoder``, which imports this module)."""

    @staticmethod
    def equip(model: Any, tools: Sequence[Tool]) -> list[int]:
        return InstructFormat.for_model(model).equip(tools)

    @staticmethod
    def answer(model: Any, name: str, value: str) -> list[int]:
        return InstructFormat.for_model(model).answer(name, value)

    @staticmethod
    def format(model: Any, tools: Sequence[Tool]) -> Grammar | None:
        return InstructFormat.for_model(model).tool_grammar(tools)


__all__ = ["InstructFormat", "ToolUse", "parse_tools"]
