"""A server with the scheduler's overlap forced on (``PIE_MEDIA_OVERLAP=1``; on the CPU it
is off by default, on CUDA on) answers as the engine does in process without it: greedy
chats streamed and whole, token for token, with a stop string that lands mid-answer;
seeded sampled choices; several streams at once. The real uvicorn server on 127.0.0.1,
driven by the real ``openai`` client."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.api.http.conftest import Server, start_server, stop_server

QWEN = "tiny-qwen3-vl"
PROMPTS = [f"Prompt {i}: tell me about the sea, the sky and the ships." for i in range(4)]


@pytest.fixture(scope="module")
def overlap_server(tmp_path_factory: pytest.TempPathFactory):
    s = start_server(tmp_path_factory.mktemp("overlap"), models=("tiny",), env={"PIE_MEDIA_OVERLAP": "1"})
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def overlap_client(overlap_server: Server):
    return openai.OpenAI(base_url=overlap_server.v1, api_key="unused-on-loopback", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def plain():
    from api.model_ref import load_model

    model = load_model("tiny", device="cpu")
    model.scheduler.overlap = False  # the plain loop (the CPU's default), whatever the environment
    return model


def _in_process(model, prompt: str, max_tokens: int, stop: list[str] | None = None) -> tuple[str, str]:
    from engine import CompletionParams, Turn, complete, run_sync

    params = CompletionParams(max_tokens=max_tokens, stop=tuple(stop or ()))
    results, _ = run_sync(complete(model, [Turn("user", (prompt,))], params))
    return results[0].text, results[0].finish_reason


def _stream(client: openai.OpenAI, prompt: str, **kw) -> tuple[str, str | None]:
    chunks = client.chat.completions.create(
        model=QWEN, messages=[{"role": "user", "content": prompt}], temperature=0, stream=True, **kw
    )
    text, finish = "", None
    for c in chunks:
        if c.choices:
            text += c.choices[0].delta.content or ""
            finish = c.choices[0].finish_reason or finish
    return text, finish


def test_greedy_streams_equal_the_plain_loop_in_process(overlap_client, plain) -> None:
    text, finish = _in_process(plain, PROMPTS[0], 24)
    assert (text, finish) == _stream(overlap_client, PROMPTS[0], max_tokens=24)
    whole = overlap_client.chat.completions.create(
        model=QWEN, messages=[{"role": "user", "content": PROMPTS[0]}], temperature=0, max_tokens=24
    )
    assert whole.choices[0].message.content == text
    # A stop string taken from the middle of that answer: it ends exactly there.
    words = text.split()
    assert len(words) > 3, text
    stop = words[len(words) // 2]
    cut, reason = _in_process(plain, PROMPTS[0], 24, stop=[stop])
    assert reason == "stop"
    assert (cut, reason) == _stream(overlap_client, PROMPTS[0], max_tokens=24, stop=[stop])


def test_concurrent_streams_and_seeded_choices(overlap_client, plain) -> None:
    expected = [_in_process(plain, p, 16) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: _stream(overlap_client, p, max_tokens=16), PROMPTS))
    assert got == expected
    msgs = [{"role": "user", "content": "Tell me a story."}]
    a = overlap_client.chat.completions.create(
        model=QWEN, messages=msgs, max_tokens=8, temperature=1.0, top_p=0.9, n=2, seed=7
    )
    b = overlap_client.chat.completions.create(
        model=QWEN, messages=msgs, max_tokens=8, temperature=1.0, top_p=0.9, n=2, seed=7
    )
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]


def test_metrics_count_the_overlapped_passes(overlap_server: Server, overlap_client) -> None:
    _stream(overlap_client, PROMPTS[1], max_tokens=12)
    body = httpx.get(f"{overlap_server.url}/metrics", timeout=30).text
    line = next(ln for ln in body.splitlines() if ln.startswith("pie_media_engine_overlapped_passes_total{"))
    assert 'model="tiny-qwen3-vl"' in line and float(line.rsplit(" ", 1)[1]) > 0
    # The device feed needs CUDA graphs: exported, and 0 on this CPU server.
    fed = next(ln for ln in body.splitlines() if ln.startswith("pie_media_engine_device_fed_passes_total{"))
    assert 'model="tiny-qwen3-vl"' in fed and float(fed.rsplit(" ", 1)[1]) == 0
