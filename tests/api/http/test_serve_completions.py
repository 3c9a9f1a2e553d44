"""``POST /v1/completions`` on the real server, driven by the official ``openai`` client:
answers equal the engine's ``Completion.from_prompt`` token for token (greedy and seeded),
echo and the legacy logprobs have OpenAI's shape, several prompts number their choices
as OpenAI does, and bad requests are typed 400s."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.api.http.conftest import Server

QWEN = "tiny-qwen3-vl"
GEMMA = "tiny-gemma4"
PROMPT = "Once upon a time, in a quiet town,"


@pytest.fixture(scope="module")
def local():
    from api.model_ref import load_model

    return {QWEN: load_model("tiny", device="cpu"), GEMMA: load_model("tiny-gemma4", device="cpu")}


def engine_answer(model, prompt, **params):
    """[(text, token ids, finish reason)] per choice and the Completion, in process."""
    from engine import Completion, CompletionParams, Sampler, run_sync

    temperature = params.pop("temperature", 0)
    sampler = Sampler.greedy() if temperature == 0 else Sampler(temperature=temperature)

    async def go():
        c = Completion.from_prompt(model, prompt, CompletionParams(sampler=sampler, **params))
        out = [["", [], None] for _ in range(c.params.n)]
        async with c:
            async for ev in c:
                out[ev.index][0] += ev.text
                out[ev.index][1].append(ev.token)
                out[ev.index][2] = ev.finish_reason or out[ev.index][2]
        return [tuple(o) for o in out], c

    return run_sync(go())


@pytest.mark.parametrize("model", [QWEN, GEMMA])
def test_greedy_completion_equals_the_engine(client: openai.OpenAI, local, model: str) -> None:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    (want,), c = engine_answer(local[model], PROMPT, max_tokens=8)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want[0], want[2])
    assert r.usage.prompt_tokens == c.prompt_tokens and r.usage.completion_tokens == len(want[1])
    again = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert again.choices[0].text == want[0]
    assert (
        0 < again.usage.prompt_tokens_details.cached_tokens <= again.usage.prompt_tokens
    )  # the prefix cache


def test_streamed_seeded_choices_equal_the_whole_answer(client: openai.OpenAI, local) -> None:
    kw = dict(model=QWEN, prompt=PROMPT, max_tokens=10, temperature=0.9, seed=11, n=2)
    whole = client.completions.create(**kw)
    texts, reasons, usage = ["", ""], [None, None], None
    for chunk in client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        for ch in chunk.choices:
            texts[ch.index] += ch.text
            reasons[ch.index] = ch.finish_reason or reasons[ch.index]
        usage = chunk.usage or usage
    assert texts == [c.text for c in whole.choices] and reasons == [c.finish_reason for c in whole.choices]
    assert usage == whole.usage
    want, _ = engine_answer(local[QWEN], PROMPT, max_tokens=10, temperature=0.9, seed=11, n=2)
    assert texts == [w[0] for w in want]


def test_token_id_prompts_and_several_prompts(client: openai.OpenAI, local) -> None:
    ids = local[QWEN].tokenizer(PROMPT).input_ids
    by_text = client.completions.create(model=QWEN, prompt=PROMPT, max_tokens=5, temperature=0)
    by_ids = client.completions.create(model=QWEN, prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    # choice i of prompt p is index p * n + i, as OpenAI numbers them
    many = client.completions.create(
        model=QWEN, prompt=[PROMPT, "Two", PROMPT], max_tokens=5, temperature=0, n=2
    )
    assert [c.index for c in many.choices] == list(range(6))
    two, _ = engine_answer(local[QWEN], "Two", max_tokens=5)
    assert [c.text for c in many.choices] == [by_text.choices[0].text] * 2 + [two[0][0]] * 2 + [
        by_text.choices[0].text
    ] * 2
    assert many.usage.prompt_tokens == 2 * by_text.usage.prompt_tokens + len(
        local[QWEN].tokenizer("Two").input_ids
    )
    lists = client.completions.create(model=QWEN, prompt=[ids, ids[:3]], max_tokens=3, temperature=0)
    assert lists.choices[0].text == by_text.choices[0].text[: len(lists.choices[0].text)]


@pytest.mark.parametrize("model", [QWEN, GEMMA])
def test_echo_with_logprobs_scores_the_prompt(client: openai.OpenAI, local, model: str) -> None:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    ch = r.choices[0]
    _, c = engine_answer(local[model], PROMPT, max_tokens=0, prompt_logprobs=2)
    lp = ch.logprobs
    assert ch.text == PROMPT and ch.finish_reason == "length" and r.usage.completion_tokens == 0
    assert len(lp.tokens) == c.prompt_tokens == r.usage.prompt_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == [p.logprob for p in c.prompt_logprobs[1:]]
    # OpenAI's legacy shape: the 2 most probable plus the chosen token when it is not among them
    assert all(len(t) <= 3 for t in lp.top_logprobs[1:])
    for tok, chosen, top, p in zip(
        lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], c.prompt_logprobs[1:], strict=True
    ):
        assert top[tok] == chosen
        assert len(top) == len({t for t, _ in p.top_logprobs} | {p.token})
    # text_offset: the token strings' lengths so far (vLLM's rule)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_echo_then_completion_streams_the_same(client: openai.OpenAI) -> None:
    kw = dict(model=GEMMA, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=1)
    whole = client.completions.create(**kw).choices[0]
    text, tokens, lps = "", [], []
    for chunk in client.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            text += ch.text
            if ch.logprobs:
                tokens += ch.logprobs.tokens
                lps += ch.logprobs.token_logprobs
    assert text == whole.text and text.startswith(PROMPT)
    assert tokens == whole.logprobs.tokens and lps == whole.logprobs.token_logprobs


def test_raw_sse_shape(server: Server) -> None:
    body = {"model": QWEN, "prompt": "Hi", "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.v1}/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["choices"][0]["index"] == 0 for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"prompt": []}, "empty list"),
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt": [5, 10**9]}, "outside the vocabulary"),
        ({"prompt": ["x"] * 65}, "up to 64"),
        ({"prompt": ["x", [5, 6]]}, "not mixed"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "max_tokens": 0}, "needs echo"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "x", "max_tokens": 10**6}, "over this server's limit"),
    ],
)
def test_bad_requests_are_400(server: Server, extra: dict, message: str) -> None:
    r = httpx.post(f"{server.v1}/completions", json={"model": QWEN, **extra}, timeout=60)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


def test_an_unknown_model_is_404(server: Server) -> None:
    r = httpx.post(f"{server.v1}/completions", json={"model": "nope", "prompt": "x"}, timeout=60)
    assert r.status_code == 404


@pytest.mark.parametrize("model", [QWEN, GEMMA])
def test_penalties_and_logit_bias_equal_the_engine(client: openai.OpenAI, local, model: str) -> None:
    from engine import Penalties

    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0)
    r = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        presence_penalty=0.5,
        frequency_penalty=0.8,
        logit_bias={"17": 5.0, "42": -100},
        extra_body={"repetition_penalty": 1.3},
    )
    penalties = Penalties.of(presence=0.5, frequency=0.8, repetition=1.3, logit_bias={17: 5.0, 42: -100.0})
    (want,), _ = engine_answer(local[model], PROMPT, max_tokens=10, penalties=penalties)
    assert r.choices[0].text == want[0] != plain.choices[0].text


def test_legacy_top_logprobs_always_name_the_chosen_token(client: openai.OpenAI) -> None:
    """The issue's request: an echoed prompt token that is not the most probable one still
    appears in its own ``top_logprobs`` entry (OpenAI and vLLM add it: up to logprobs + 1
    entries), and so does every generated token, sampled ones included."""
    prompt = "The capital of France is Paris"
    r = client.completions.create(
        model=QWEN, prompt=prompt, max_tokens=1, logprobs=1, echo=True, temperature=0
    )
    lp = r.choices[0].logprobs
    assert lp.top_logprobs[0] is None
    outside = 0
    for tok, chosen, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert top[tok] == chosen and 1 <= len(top) <= 2
        assert max(top.values()) >= chosen
        outside += len(top) == 2
    assert outside > 0  # a random model's prompt has tokens it would not have picked
    sampled = (
        client.completions.create(
            model=QWEN, prompt=prompt, max_tokens=6, logprobs=0, temperature=1.0, seed=7
        )
        .choices[0]
        .logprobs
    )
    assert all(
        top == {tok: chosen}
        for tok, chosen, top in zip(sampled.tokens, sampled.token_logprobs, sampled.top_logprobs, strict=True)
    )
