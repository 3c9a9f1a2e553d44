"""Role blocks from the checkpoint's own chat template, appended turn by turn.

A context keeps the list of messages it has seen. Each role call renders the template
(through the tokenizer's ``apply_chat_template``, i.e. the same Jinja the reference
processor uses) for the history with and without the new message and appends the
difference; ``cue()`` appends the difference that ``add_generation_prompt`` makes. So a
conversation built call by call yields exactly the text the template renders for the
whole conversation, which is what ``processor.apply_chat_template`` + the processor
tokenize (deltas meet at special tokens such as ``<|im_start|>`` / ``<|turn>``, where the
tokenizer splits anyway, so tokenizing them apart gives the same ids).

Media parts render as the template's marker (``<|vision_start|><|image_pad|><|vision_end|>``,
``<|image|>``, ...); the context replaces each marker with the prepared span, as the
processor replaces it with the expanded placeholders.

After a generation, ``close_turn`` completes the assistant turn the way the template
would render it (e.g. the ``\\n`` after ``<|im_end|>``, or the end-of-turn token when the
generation stopped on length), keeping the tokens the model actually produced.

A context's side of it is ``ChatState`` (the messages so far, the assistant turn being
generated), ``chat_message`` (a role call's content as a template message plus its
media) and ``template_pieces`` (rendered text cut at the media markers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from jinja2 import TemplateError

from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from encoders import Prepared

Message = dict[str, Any]
ROLES = ("system", "user", "assistant", "tool")
"""The roles a chat turn can have (each a ``Context`` method; "tool" carries a tool's
result back, rendered as the template renders tool messages)."""
RESERVED_TEMPLATE_KEYS = frozenset(
    {
        "messages",
        "tools",
        "add_generation_prompt",
        "chat_template",
        "tokenize",
        "documents",
        "continue_final_message",
    }
)
"""Template keywords the engine sets itself (tools through ``Context.use_tools``)."""
TOOL_PROBE = [{"type": "function", "function": {"name": "probe", "description": "", "parameters": {}}}]


class ChatTemplate:
    def __init__(self, tokenizer: Any, template: str | None, **template_kwargs: Any):
        self.tokenizer = tokenizer
        self.template = template
        self.template_kwargs = template_kwargs
        self._renders_tools: bool | None = None

    @property
    def available(self) -> bool:
        return bool(self.template)

    @property
    def renders_tools(self) -> bool:
        """Whether the template puts ``tools`` in the prompt (a render with a tool differs
        from one without); a template that ignores them cannot take tool calling."""
        if self._renders_tools is None:
            probe = [{"role": "user", "content": "hi"}]
            self._renders_tools = self.available and self.render(
                probe, options={"tools": TOOL_PROBE}
            ) != self.render(probe)
        return self._renders_tools

    def render(
        self,
        messages: list[Message],
        *,
        add_generation_prompt: bool = False,
        options: Mapping[str, Any] | None = None,
    ) -> str:
        if not self.template:
            raise InvalidRequestError(
                "this checkpoint has no chat template (tokenizer_config.json 'chat_template' or "
                "chat_template.jinja); use fill() / fill_tokens() instead of role methods"
            )
        if not messages and not add_generation_prompt:
            return ""
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                chat_template=self.template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **{**self.template_kwargs, **(options or {})},
            )
        except TemplateError as e:  # the template's own raise_exception(), or options it cannot use
            raise InvalidRequestError(f"the chat template refused the conversation: {e}") from None

    def _delta(self, before: str, after: str, what: str) -> str:
        if not after.startswith(before):
            raise InvalidRequestError(
                f"the chat template re-renders earlier turns when {what} is added (it is not "
                "prefix-stable), so the turn cannot be appended to a live context; build the "
                "prompt with render() and fill() it instead"
            )
        return after[len(before) :]

    def turns(
        self, history: list[Message], messages: list[Message], options: Mapping[str, Any] | None = None
    ) -> str:
        """Text that appending all of ``messages`` to ``history`` adds, from two renders
        whatever their number (a render per message would make a conversation sent whole
        cost the square of its length)."""
        what = f"a {messages[0]['role']} turn" if len(messages) == 1 else f"{len(messages)} turns"
        return self._delta(
            self.render(history, options=options), self.render([*history, *messages], options=options), what
        )

    def cue(self, history: list[Message], options: Mapping[str, Any] | None = None) -> str:
        """Text of the generation prompt after ``history``."""
        return self._delta(
            self.render(history, options=options),
            self.render(history, add_generation_prompt=True, options=options),
            "the cue",
        )

    def close_turn(
        self, history: list[Message], content: str, raw: str, options: Mapping[str, Any] | None = None
    ) -> str:
        """What still has to follow an assistant turn whose generated text is ``raw``
        (special tokens included; ``content`` = the same without them) for the context to
        read as the template renders ``history + [assistant: content]``."""
        cued = self.render(history, add_generation_prompt=True, options=options)
        full = self.render([*history, {"role": "assistant", "content": content}], options=options)
        body = self._delta(cued, full, "an assistant turn") if full.startswith(cued) else None
        if body is None:
            # Templates that drop the generation prompt from rendered history (e.g. an
            # empty thought channel): close the turn with what follows the content.
            base = self.render(history, options=options)
            body = self._delta(base, full, "an assistant turn")
        if body.startswith(raw):
            return body[len(raw) :]
        at = body.rfind(content) if content else -1
        closing = body[at + len(content) :] if at >= 0 else ""
        # Drop the part of the closing the model already produced (its end-of-turn token).
        for k in range(len(closing), 0, -1):
            if raw.endswith(closing[:k]):
                return closing[k:]
        return closing


class MediaMarkers(Protocol):
    """What ``template_pieces`` needs from an architecture (``engine.architectures``)."""

    def media_marker(self, kind: str) -> str: ...

    def placeholder_ids(self) -> dict[str, int]: ...


@dataclass
class ChatState:
    """The conversation a context holds: the messages its role calls added, and after
    ``cue()`` the assistant turn being generated (its token ids, to close it later)."""

    messages: list[Message] = field(default_factory=list)
    open_turn: bool = False
    turn_tokens: list[int] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)
    """What every render of this conversation passes to the template besides the messages:
    ``tools``, and per-conversation template keywords such as ``enable_thinking`` (set
    before the first turn: templates render them at its start)."""

    def copy(self) -> ChatState:
        return ChatState(list(self.messages), self.open_turn, list(self.turn_tokens), dict(self.options))

    def open(self) -> None:
        """The generation prompt was appended: what follows is the assistant's turn."""
        self.open_turn = True
        self.turn_tokens = []

    def record(self, ids: Sequence[int]) -> None:
        """Token ids appended to the context (part of the open turn, if any)."""
        if self.open_turn:
            self.turn_tokens.extend(ids)

    def forget(self, removed: int) -> None:
        """The context's last ``removed`` rows were cut off."""
        if self.open_turn and removed:
            keep = max(0, len(self.turn_tokens) - removed)
            del self.turn_tokens[keep:]

    def close_turn(self, template: ChatTemplate, detokenize: Callable[..., str]) -> str:
        """Close the open assistant turn, if any: record it in the history and return the
        text still to append for the context to read as the template renders it ("" when
        no turn is open). ``detokenize(ids, skip_special_tokens=...)``: the model's."""
        if not self.open_turn:
            return ""
        raw = detokenize(self.turn_tokens)
        content = detokenize(self.turn_tokens, skip_special_tokens=True)
        tail = template.close_turn(self.messages, content, raw, self.options)
        self.open_turn = False
        self.turn_tokens = []
        self.messages.append({"role": "assistant", "content": [{"type": "text", "text": content}]})
        return tail


def chat_message(
    role: str,
    content: Sequence[Any],
    prepare: Callable[[Any], Prepared],
    extra: Mapping[str, Any] | None = None,
) -> tuple[Message, list[Prepared]]:
    """A role call's ``content`` (text parts and media, in order) as a template message,
    with each media part prepared (``prepare``: the model's). ``extra`` adds the message's
    other keys the template reads (an assistant's ``tool_calls``, a tool's ``tool_call_id``)."""
    parts: list[dict[str, Any]] = []
    media: list[Prepared] = []
    for part in content:
        if isinstance(part, str):
            parts.append({"type": "text", "text": part})
        else:
            p = prepare(part)
            media.append(p)
            parts.append({"type": p.kind})
    return {"role": role, "content": parts, **(extra or {})}, media


def template_pieces(text: str, media: Sequence[Prepared], arch: MediaMarkers) -> Iterator[str | Prepared]:
    """``text`` as rendered by the template, cut at the media markers: the text before each
    marker, then the media item that replaces it, ..., then the rest. Lazily, so a context
    appending the pieces stops where a marker is missing (``InvalidRequestError``); a
    marker left in the text with no media attached is refused before the rest."""
    rest = text
    for p in media:
        marker = arch.media_marker(p.kind)
        at = rest.find(marker)
        if at < 0:
            raise InvalidRequestError(f"the chat template rendered no {p.kind} marker {marker!r}")
        yield rest[:at]
        yield p
        rest = rest[at + len(marker) :]
    for kind in arch.placeholder_ids():
        if arch.media_marker(kind) in rest:
            raise InvalidRequestError(
                f"the turn's text holds a {kind} marker with no {kind} attached "
                f"({arch.media_marker(kind)!r}); pass the media as a content part"
            )
    if rest:
        yield rest
