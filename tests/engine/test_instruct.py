"""Pie's pie:instruct on the engine (engine.instruct, engine.instruct_decoders): conversations
built from the fillers tokenize exactly as the checkpoint's template renders them whole (and
as a Context builds them), and the decoders' events over real tokenizations of replies (a
thought, a tool call, a stop token, a character split across tokens) are Pie's."""

from __future__ import annotations

import json

import pytest

from engine import InvalidRequestError, SyncContext
from engine.grammar import GrammarMatcher
from engine.instruct import InstructFormat, ToolUse
from engine.instruct_decoders import ChatDecoder, ReasoningDecoder, ToolCallDecoder
from tests.tool_definitions import TIME, WEATHER

BRAIN = "🧠"  # four UTF-8 bytes: several byte tokens in both tiny tokenizers


def _template_ids(model, messages, *, cue=True, **options):
    """The reference: the tokenizer's own apply_chat_template, tokenized as a prompt."""
    text = model.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=cue, **{**model.chat.template_kwargs, **options}
    )
    return model.tokenizer.encode(text, add_special_tokens=False)


def _build(fmt, calls):
    ids = []
    for name, *args in calls:
        ids += getattr(fmt, name)(*args)
    return ids


CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris. 🗼"},
    {"role": "user", "content": " Et l'Allemagne ? "},
]


@pytest.mark.parametrize("name", ["qwen", "gemma"])
def test_a_conversation_from_the_fillers_is_the_template_s_tokens(name, request):
    model = request.getfixturevalue(name)
    fmt = InstructFormat.for_model(model)
    s, u1, a, u2 = (m["content"] for m in CONVERSATION)
    want = _template_ids(model, CONVERSATION)
    assert _build(fmt, [("system", s), ("user", u1), ("assistant", a), ("user", u2), ("cue",)]) == want
    assert _build(fmt, [("system_user", s, u1), ("assistant", a), ("user", u2), ("cue",)]) == want
    # The engine's own Context builds the same rows.
    ctx = SyncContext(model).system(s).user(u1).assistant(a).user(u2).cue()
    assert ctx.token_ids == want
    ctx.close()
    # No system turn: first_user opens (Gemma-4's <bos> with it).
    want = _template_ids(model, CONVERSATION[1:])
    assert _build(fmt, [("first_user", u1), ("assistant", a), ("user", u2), ("cue",)]) == want
    # Without the cue: the history alone.
    assert _build(fmt, [("first_user", u1)]) == _template_ids(model, CONVERSATION[1:2], cue=False)


def test_the_pieces_of_each_family(qwen, gemma):
    q, g = InstructFormat.for_model(qwen), InstructFormat.for_model(gemma)
    assert qwen.detokenize(q.cue()) == "<|im_start|>assistant\n"
    assert qwen.detokenize(q.seal()) == "<|im_end|>\n"
    assert [qwen.detokenize([t]) for t in q.stop_tokens()] == ["<|im_end|>", "<|endoftext|>"]  # Pie's order
    assert qwen.detokenize(q.system("S")) == "<|im_start|>system\nS<|im_end|>\n"
    # Gemma-4: <bos> opens; the template's generation prompt has the empty thought channel.
    assert gemma.detokenize(g.first_user(" hi ")) == "<bos><|turn>user\nhi<turn|>\n"
    assert gemma.detokenize(g.user("hi")) == "<|turn>user\nhi<turn|>\n"
    assert gemma.detokenize(g.cue()) == "<|turn>model\n<|channel>thought\n<channel|>"
    assert gemma.detokenize(g.seal()) == "<turn|>\n"
    assert [gemma.detokenize([t]) for t in g.stop_tokens()] == ["<turn|>", "<eos>"]
    # An earlier thought is dropped from a replayed Gemma-4 turn, as the template drops it.
    assert gemma.detokenize(g.assistant("<|channel>thought\nhmm<channel|>Berlin.")) == (
        "<|turn>model\nBerlin.<turn|>\n"
    )
    # for_model caches per model and options; the pieces are fresh lists.
    assert InstructFormat.for_model(qwen) is q and q.cue() is not q.cue()


@pytest.mark.parametrize("name", ["qwen", "gemma"])
def test_cue_reply_seal_closes_the_turn_as_the_template_does(name, request):
    model = request.getfixturevalue(name)
    fmt = InstructFormat.for_model(model)
    reply = model.tokenize("Paris. 🗼")
    sealed = fmt.cue() + reply + fmt.seal()
    if name == "qwen":
        assert sealed == fmt.assistant("Paris. 🗼")
    else:  # the template drops the generation prompt's empty thought channel from history
        channel = model.tokenize("<|channel>thought\n<channel|>")
        header = fmt.cue()[: -len(channel)]
        assert fmt.cue() == header + channel
        assert fmt.assistant("Paris. 🗼") == header + reply + fmt.seal()
    # The turn closes with the first stop token, as generation stops on it.
    assert fmt.seal()[0] == fmt.stop_tokens()[0]


def test_template_options_reach_every_piece(gemma):
    fmt = InstructFormat.for_model(gemma, {"enable_thinking": True})
    assert fmt is not InstructFormat.for_model(gemma)
    want = _template_ids(gemma, CONVERSATION[1:2], enable_thinking=True)
    assert fmt.first_user(CONVERSATION[1]["content"]) + fmt.cue() == want
    assert gemma.detokenize(fmt.cue()) == "<|turn>model\n"
    assert not fmt.cue_opens_thought
    with pytest.raises(InvalidRequestError, match="equip"):
        InstructFormat(gemma, {"tools": []})


def test_tools_and_answers_are_the_template_s_tokens(qwen, gemma):
    fmt = InstructFormat.for_model(qwen)
    tools = [json.dumps(WEATHER), json.dumps(TIME)]
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": '{"sky": "clear"}'},
        {"role": "user", "content": "And tomorrow?"},
    ]
    replay = (
        fmt.cue()
        + qwen.tokenize(
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
        )
        + fmt.seal()
    )
    got = ToolUse.equip(qwen, tools) + fmt.user("Weather in Oslo?") + replay
    got += ToolUse.answer(qwen, "get_weather", '{"sky": "clear"}') + fmt.user("And tomorrow?") + fmt.cue()
    assert got == _template_ids(qwen, messages, tools=[WEATHER, TIME])
    # A system message goes into the tools turn, as the template puts it.
    with_system = [{"role": "system", "content": "Use the tools."}, *messages[:1]]
    got = fmt.equip(tools, system="Use the tools.") + fmt.user("Weather in Oslo?") + fmt.cue()
    assert got == _template_ids(qwen, with_system, tools=[WEATHER, TIME])
    # Two results of one turn fold into one user turn; two answer() calls make two.
    both = qwen.detokenize(fmt.answers([("a", "1"), ("b", "2")]))
    assert (
        both
        == "<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>\n"
    )
    # Bad tools, and a family with no call format here: typed errors (Pie: no tokens).
    with pytest.raises(InvalidRequestError, match="tool 0 is not valid JSON"):
        fmt.equip(["{nope"])
    with pytest.raises(InvalidRequestError, match="tool 1 is not a JSON object"):
        fmt.equip([json.dumps(WEATHER), "[1]"])
    with pytest.raises(InvalidRequestError, match="not supported for gemma4"):
        ToolUse.equip(gemma, tools)
    with pytest.raises(InvalidRequestError, match="not supported for gemma4"):
        ToolUse.answer(gemma, "get_weather", "{}")


def test_the_tool_format_is_a_grammar_that_takes_the_model_s_calls(qwen, gemma):
    bare = json.dumps(WEATHER["function"])  # Pie also takes a bare function
    grammar = ToolUse.format(qwen, [bare, json.dumps(TIME)])
    assert grammar is not None and grammar.kind == "lark"

    def takes(text):
        m = GrammarMatcher(grammar, qwen)
        for t in qwen.tokenize(text):
            if not m.allowed()[t]:
                return False
            m.accept(t)
        return m.accepting

    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    assert takes(one) and takes(two)
    assert not takes(one.replace("get_weather", "get_mood"))
    assert not takes(one.replace('"days": 2', '"days": 99'))
    assert ToolUse.format(qwen, []) is None
    assert ToolUse.format(gemma, [bare]) is None  # no enforceable format: option<grammar> = none
    with pytest.raises(InvalidRequestError, match="same function name"):
        ToolUse.format(qwen, [bare, bare])


# -- decoders over real tokenizations ----------------------------------------------------

QWEN_REPLY = (
    f"<think>\nThe user wants {BRAIN} weather.\n</think>\n\nSure.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris ☀", "days": 2}}\n</tool_call>'
)
GEMMA_REPLY = f"<|channel>thought\nParis, {BRAIN} surely<channel|>Paris é {BRAIN}!"


def _one_by_one(decoder, ids):
    return [decoder.feed([t]) for t in ids]


@pytest.mark.parametrize("name, reply", [("qwen", QWEN_REPLY), ("gemma", GEMMA_REPLY)])
def test_the_chat_decoder_streams_the_reply_and_is_done_at_the_stop_token(name, reply, request):
    model = request.getfixturevalue(name)
    fmt = InstructFormat.for_model(model)
    ids = model.tokenize(reply)
    # The character really is split across tokens.
    assert any("\ufffd" in model.detokenize([t]) for t in ids)
    stop = fmt.stop_tokens()[0]
    dec = ChatDecoder(model)
    events = _one_by_one(dec, ids)
    assert {e[0] for e in events} == {"delta"}
    deltas = [e[1] for e in events]
    assert "".join(deltas) == reply  # special tokens kept, as Pie decodes
    assert "" in deltas and not any("\ufffd" in d for d in deltas)
    assert BRAIN in deltas or any(d.endswith(BRAIN) for d in deltas)
    # The stop token: done with the whole text; what follows it in the batch is dropped,
    # and the decoder starts over.
    assert dec.feed([stop, *model.tokenize("junk")]) == ("done", reply)
    assert dec.feed([stop]) == ("done", "")
    # One batch: one delta with all of it.
    dec.reset()
    assert dec.feed(ids) == ("delta", reply)
    assert dec.feed(model.tokenize("more") + [fmt.stop_tokens()[-1]]) == ("done", reply + "more")
    # reset() forgets what was fed.
    dec.feed(ids[:5])
    dec.reset()
    assert dec.feed([stop]) == ("done", "")
    width = max(len(model.tokenizer), model.arch.vocab_size)
    with pytest.raises(InvalidRequestError, match="not in the model's vocabulary"):
        dec.feed([width])
    if width > len(model.tokenizer):  # a padding row of the logits: drawable, no text
        assert dec.feed([len(model.tokenizer)]) == ("delta", "")


@pytest.mark.parametrize(
    "name, reply, thought",
    [
        ("qwen", QWEN_REPLY, f"\nThe user wants {BRAIN} weather.\n"),  # Pie keeps the newlines
        ("gemma", GEMMA_REPLY, f"Paris, {BRAIN} surely"),  # the channel's name is not thought
    ],
)
def test_the_reasoning_decoder_reports_the_thought(name, reply, thought, request):
    model = request.getfixturevalue(name)
    ids = model.tokenize(reply)
    dec = ReasoningDecoder(model)
    events = _one_by_one(dec, ids)
    assert events[0] == ("start",)
    at = next(i for i, e in enumerate(events) if e[0] == "complete")
    assert events[at] == ("complete", thought)
    assert all(e[0] == "delta" for e in events[1:at] + events[at + 1 :])
    assert "".join(e[1] for e in events[1:at]) == thought
    assert not any("\ufffd" in e[-1] for e in events)
    assert all(e == ("delta", "") for e in events[at + 1 :])  # the answer is not thought: idle
    # A batch crossing both markers: start now, complete on the next feed (none lost).
    dec.reset()
    assert dec.feed(ids) == ("start",)
    assert dec.feed([]) == ("complete", thought)
    assert dec.feed([]) == ("delta", "")
    # Text after the start marker in the same batch comes with the next delta.
    first = next(i for i, e in enumerate(events) if e[0] == "delta" and e[1])
    dec.reset()
    assert dec.feed(ids[: first + 1]) == ("start",)
    assert dec.feed([]) == ("delta", "".join(e[1] for e in events[1 : first + 1]))
    # reset() goes back outside.
    dec.reset()
    assert dec.feed(ids[3:6]) == ("delta", "")


def test_a_model_without_markers_never_starts_a_thought(qwen):
    plain = qwen.tokenize("Just an answer.<|im_end|>")
    assert _one_by_one(ReasoningDecoder(qwen), plain) == [("delta", "")] * len(plain)


def test_the_tool_decoder_reports_each_call_once(qwen, gemma):
    ids = qwen.tokenize(QWEN_REPLY)
    dec = ToolCallDecoder(qwen)
    events = _one_by_one(dec, ids)
    calls = [e for e in events if e[0] == "call"]
    assert calls == [("call", "get_weather", '{"city":"Paris ☀","days":2}')]  # serde_json's compact text
    assert events[-1] == calls[0] and set(events[:-1]) == {("start",)}
    # Two calls in one batch: one per feed.
    two = QWEN_REPLY + '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    dec.reset()
    assert dec.feed(qwen.tokenize(two))[0] == "call"
    assert dec.feed([]) == ("call", "get_time", '{"zone":"UTC"}')
    assert dec.feed([]) == ("start",)
    # A block that is not a call yields none; the next one still parses.
    bad = '<tool_call>\n{"arguments": {}}\n</tool_call><tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    dec.reset()
    assert [e for e in _one_by_one(dec, qwen.tokenize(bad)) if e[0] == "call"] == [("call", "f", "{}")]
    # reset() forgets a half-written call.
    dec.reset()
    dec.feed(ids[: ids.index(qwen.tokenizer.convert_tokens_to_ids("<tool_call>")) + 3])
    dec.reset()
    assert dec.feed(qwen.tokenize('"}}\n</tool_call>')) == ("start",)
    # Gemma-4 has no call format here: Pie's no-op decoder.
    gemma_ids = gemma.tokenize(GEMMA_REPLY)
    assert set(_one_by_one(ToolCallDecoder(gemma), gemma_ids)) == {("start",)}
    assert ToolCallDecoder(gemma).feed(gemma_ids) == ("start",)


def test_a_prompt_that_opens_the_thought_starts_the_decoder_inside(qwen):
    """A Qwen3-thinking style template ends its generation prompt in ``<think>\\n``: the
    reply starts with thoughts and has no start marker."""
    from types import SimpleNamespace

    from engine.chat import ChatTemplate

    template = qwen.chat.template.replace(
        "{{- '<|im_start|>assistant\\n' -}}", "{{- '<|im_start|>assistant\\n<think>\\n' -}}"
    )
    assert template != qwen.chat.template
    names = ("tokenizer", "tokenize", "detokenize", "arch", "eos_token_ids", "byte_fallback_ids")
    thinking = SimpleNamespace(
        chat=ChatTemplate(qwen.tokenizer, template), **{n: getattr(qwen, n) for n in names}
    )
    fmt = InstructFormat(thinking)
    assert qwen.detokenize(fmt.cue()) == "<|im_start|>assistant\n<think>\n" and fmt.cue_opens_thought
    ids = qwen.tokenize(f"Hmm {BRAIN}.\n</think>\n\nYes.")
    dec = ReasoningDecoder(thinking, fmt)
    events = _one_by_one(dec, ids)
    assert ("start",) not in events and ("complete", f"Hmm {BRAIN}.\n") in events
    assert "".join(e[1] for e in events if e[0] == "delta") == f"Hmm {BRAIN}.\n"
    dec.reset()  # back inside, as the prompt left it
    assert dec.feed(ids) == ("complete", f"Hmm {BRAIN}.\n")
