"""Role methods append what the checkpoint's chat template renders, turn by turn."""

from __future__ import annotations

import pytest

from engine import InvalidRequestError, Sampler, SyncContext, max_tokens
from tests.engine.conftest import TINY_GEMMA, TINY_QWEN


def _msg(role, text):
    return {"role": role, "content": [{"type": "text", "text": text}]}


@pytest.mark.parametrize("name", [TINY_QWEN, TINY_GEMMA])
def test_multi_turn_history_equals_the_template(models, name):
    model = models[name]
    ctx = SyncContext(model).system("Be brief.").user("Hi!").assistant("Hello.").user("How are you?").cue()
    conv = [
        _msg("system", "Be brief."),
        _msg("user", "Hi!"),
        _msg("assistant", "Hello."),
        _msg("user", "How are you?"),
    ]
    text = model.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert ctx.token_ids == model.tokenizer.encode(text, add_special_tokens=False)
    ctx.close()


@pytest.mark.parametrize("name", [TINY_QWEN, TINY_GEMMA])
def test_turns_at_once_equal_role_calls_with_two_renders(models, name, samples, monkeypatch):
    """``turns`` appends what the same role calls append (an image included, and after a
    generated turn), rendering the template twice however long the conversation: role
    calls render it twice per turn, which made a 20000-message request hold the event
    loop for minutes."""
    from media import Image

    model = models[name]
    photo = Image.from_path(samples / "images" / "rgba.png")
    convo = [
        ("system", ("Be brief.",)),
        ("user", (photo, "What is this?")),
        ("assistant", ("A square.",)),
        ("user", ("And the colour?",)),
    ]
    one = SyncContext(model)
    for role, parts in convo:
        getattr(one, role)(*parts)
    one.cue()
    renders = []
    original = type(model.chat).render
    monkeypatch.setattr(
        type(model.chat), "render", lambda self, *a, **k: renders.append(1) or original(self, *a, **k)
    )
    many = SyncContext(model).turns(convo * 25)
    assert len(renders) == 2
    renders.clear()
    both = SyncContext(model).turns(convo).cue()
    assert both.token_ids == one.token_ids
    assert [(s.start, s.rows) for s in both.spans] == [(s.start, s.rows) for s in one.spans]
    # after a generation, the open assistant turn is closed first, as a role call does
    one.generate(Sampler.greedy(), max_tokens(3))
    both.generate(Sampler.greedy(), max_tokens(3))
    one.user("Again?").system("Short.").cue()
    both.turns([("user", ("Again?",)), ("system", ("Short.",))]).cue()
    assert both.token_ids == one.token_ids
    with pytest.raises(InvalidRequestError, match="role"):
        many.turns([("robot", ("x",))])
    for ctx in (one, many, both):
        ctx.close()


def test_turn_after_generation_closes_the_assistant_turn_qwen(qwen):
    # the model "answered" with its end-of-turn token: only the newline is missing
    ctx = SyncContext(qwen).user("Hi!").cue().fill("Hello there.<|im_end|>").user("And now?").cue()
    conv = [_msg("user", "Hi!"), _msg("assistant", "Hello there."), _msg("user", "And now?")]
    text = qwen.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert ctx.token_ids == qwen.tokenizer.encode(text, add_special_tokens=False)
    ctx.close()
    # stopped on length: the end-of-turn token is added too
    ctx = SyncContext(qwen).user("Hi!").cue()
    out = ctx.generate(Sampler.greedy(), max_tokens(5))
    ctx.user("And now?").cue()
    said = qwen.detokenize(out.tokens, skip_special_tokens=True)
    conv = [_msg("user", "Hi!"), _msg("assistant", said), _msg("user", "And now?")]
    assert ctx.text() == qwen.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    ctx.close()


def test_turn_after_generation_closes_the_assistant_turn_gemma(gemma):
    ctx = SyncContext(gemma).user("Hi!").cue().fill("Hello there.<turn|>").user("And now?").cue()
    assert ctx.text().endswith(
        "Hello there.<turn|>\n<|turn>user\nAnd now?<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"
    )
    ctx.close()
    ctx = SyncContext(gemma).user("Hi!").cue()
    ctx.generate(Sampler.greedy(), max_tokens(3))
    ctx.user("Next").cue()
    assert "<turn|>\n<|turn>user\nNext<turn|>\n" in ctx.text()
    ctx.close()


def test_media_marker_without_media_is_refused(qwen, gemma):
    with pytest.raises(InvalidRequestError):
        SyncContext(gemma).user("look: <|image|>")
    with pytest.raises(InvalidRequestError):
        SyncContext(qwen).user("look: <|vision_start|><|image_pad|><|vision_end|>")


def test_media_the_model_cannot_take(qwen, samples):
    from encoders import UnsupportedMediaKindError
    from media import Audio

    audio = Audio.from_path(samples / "audio" / "tone_16k_mono.wav")
    with pytest.raises(UnsupportedMediaKindError):
        SyncContext(qwen).user(audio, "What is this?")
    with pytest.raises(UnsupportedMediaKindError):
        SyncContext(qwen).append_audio(audio)


# ------------------------------------------------------------- the chat state, no model


class _Markers:
    def media_marker(self, kind):
        return f"<{kind}>"

    def placeholder_ids(self):
        return {"image": 1, "audio": 2}


class _Media:
    def __init__(self, kind):
        self.kind = kind


def test_template_pieces_cut_the_text_at_each_marker():
    from engine.chat import template_pieces

    a, b = _Media("image"), _Media("audio")
    pieces = list(template_pieces("say <image> and <audio>!", [a, b], _Markers()))
    assert pieces == ["say ", a, " and ", b, "!"]
    assert list(template_pieces("<image>", [a], _Markers())) == ["", a]
    # lazily: what comes before a missing marker is yielded first
    gen = template_pieces("x <image> y", [a, b], _Markers())
    assert [next(gen), next(gen)] == ["x ", a]
    with pytest.raises(InvalidRequestError, match="rendered no audio marker"):
        next(gen)
    with pytest.raises(InvalidRequestError, match="holds a audio marker with no audio attached"):
        list(template_pieces("<image> then <audio>", [a], _Markers()))


def test_chat_message_and_state():
    from engine.chat import ChatState, chat_message

    img = _Media("image")
    raw = object()
    message, media = chat_message("user", ["look", raw, "at it"], lambda p: img if p is raw else None)
    assert message == {
        "role": "user",
        "content": [{"type": "text", "text": "look"}, {"type": "image"}, {"type": "text", "text": "at it"}],
    }
    assert media == [img]

    state = ChatState()
    state.record([1, 2])
    assert state.turn_tokens == []  # no open turn: nothing recorded
    state.open()
    state.record([5, 6, 7])
    fork = state.copy()
    state.forget(2)
    assert state.turn_tokens == [5] and fork.turn_tokens == [5, 6, 7]

    class Template:
        def close_turn(self, history, content, raw, options=None):
            assert options == {}  # the state's template options (none set here) reach every render
            return f"</{content}|{raw}>"

    def detokenize(ids, skip_special_tokens=False):
        return ("s" if skip_special_tokens else "r") + ",".join(map(str, ids))

    assert state.close_turn(Template(), detokenize) == "</s5|r5>"
    assert not state.open_turn and state.turn_tokens == []
    assert state.messages == [_msg("assistant", "s5")]
    assert state.close_turn(Template(), detokenize) == ""  # nothing open
