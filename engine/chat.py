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
"""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidRequestError

Message = dict[str, Any]


class ChatTemplate:
    def __init__(self, tokenizer: Any, template: str | None, **template_kwargs: Any):
        self.tokenizer = tokenizer
        self.template = template
        self.template_kwargs = template_kwargs

    @property
    def available(self) -> bool:
        return bool(self.template)

    def render(self, messages: list[Message], *, add_generation_prompt: bool = False) -> str:
        if not self.template:
            raise InvalidRequestError(
                "this checkpoint has no chat template (tokenizer_config.json 'chat_template' or "
                "chat_template.jinja); use fill() / fill_tokens() instead of role methods"
            )
        if not messages and not add_generation_prompt:
            return ""
        return self.tokenizer.apply_chat_template(
            messages,
            chat_template=self.template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.template_kwargs,
        )

    def _delta(self, before: str, after: str, what: str) -> str:
        if not after.startswith(before):
            raise InvalidRequestError(
                f"the chat template re-renders earlier turns when {what} is added (it is not "
                "prefix-stable), so the turn cannot be appended to a live context; build the "
                "prompt with render() and fill() it instead"
            )
        return after[len(before) :]

    def turn(self, history: list[Message], message: Message) -> str:
        """Text that appending ``message`` to ``history`` adds."""
        return self._delta(
            self.render(history), self.render([*history, message]), f"a {message['role']} turn"
        )

    def cue(self, history: list[Message]) -> str:
        """Text of the generation prompt after ``history``."""
        return self._delta(self.render(history), self.render(history, add_generation_prompt=True), "the cue")

    def close_turn(self, history: list[Message], content: str, raw: str) -> str:
        """What still has to follow an assistant turn whose generated text is ``raw``
        (special tokens included; ``content`` = the same without them) for the context to
        read as the template renders ``history + [assistant: content]``."""
        cued = self.render(history, add_generation_prompt=True)
        full = self.render([*history, {"role": "assistant", "content": content}])
        body = self._delta(cued, full, "an assistant turn") if full.startswith(cued) else None
        if body is None:
            # Templates that drop the generation prompt from rendered history (e.g. an
            # empty thought channel): close the turn with what follows the content.
            base = self.render(history)
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
