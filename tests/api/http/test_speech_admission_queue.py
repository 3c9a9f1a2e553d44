"""Speech admission over HTTP (issue 43 items 2-4), on one real server (uvicorn, tiny CSM and
a tiny chat model) whose ``--speech-realtime-safety`` counts the tiny model's real measured
frame time as too slow (a budget of 80 ns per 80 ms frame): a second *stream* would put the
first behind real time.

- whole answers (``?stream=false``) have no real-time deadline: eight at once all answer 200,
  batched, each equal to its solo clip; a stream past the time bound still gets 429;
- a whole answer that would slow a running stream waits in the bounded queue, visible on
  /metrics (how many wait, the longest wait), and gets 429 with Retry-After at its deadline;
- Retry-After is the real wait within a second: a whole answer of known length occupies the
  model, a stream is refused, and retries show when it would really have got in;
- a saturating burst of speech beside chat, with clients that give up while they wait: every
  request is answered or refused within the bound, and the server serves afterwards.

Durations are asserted only as bounds (the queue's deadline plus generous slack) and the
Retry-After check as +-1 s against the wait measured in the same run.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import numpy as np
import pytest

from tests.api.http.conftest import Server, metric_sample, scrape_metrics, start_server, stop_server

CSM = "tiny-csm"
CHAT = "tiny-qwen3-vl"
QUEUE_TIMEOUT_S = 2.0
QUEUE_SIZE = 4
FRAME_S = 0.08
WHOLE = {"stream": "false"}
VOICES = ["alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx"]
TIMEOUT = httpx.Timeout(120, connect=10)


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory):
    s = start_server(
        tmp_path_factory.mktemp("speech-queue"),
        "--speech-realtime-safety",
        "0.000001",
        models=("tiny", CSM),
        env={
            "PIE_MEDIA_SPEECH_QUEUE_TIMEOUT_S": str(QUEUE_TIMEOUT_S),
            "PIE_MEDIA_SPEECH_QUEUE_SIZE": str(QUEUE_SIZE),
        },
    )
    yield s
    stop_server(s)


_metrics = scrape_metrics
_sample = metric_sample


def _body(
    text: str, voice: str = "alloy", seconds: float = 3.0, fmt: str = "pcm", stream: bool = False
) -> dict:
    """A speech request; ``stream``: the client asks for a stream (``stream_format`` given),
    which is promised real time (admitted at once or refused)."""
    return {
        "model": CSM,
        "input": text,
        "voice": voice,
        "response_format": fmt,
        "max_duration": seconds,
        "temperature": 0,
        **({"stream_format": "audio"} if stream else {}),
    }


def _settle(server: Server, timeout: float = 30) -> dict[str, float]:
    """/metrics once nothing runs or waits (every slot and page given back)."""
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(server)
        idle = (
            _sample(m, "pie_media_running_contexts", model=CSM) == 0
            and _sample(m, "pie_media_speech_waiting", model=CSM) == 0
            and _sample(m, "pie_media_requests_in_flight", model=CSM) == 0
        )
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


class _Stream:
    """A streamed speech answer read on a thread (so the server never waits on this client)."""

    def __init__(self, server: Server, body: dict):
        self.http = httpx.Client(base_url=server.url, timeout=TIMEOUT)
        self.response = self.http.send(
            self.http.build_request("POST", "/v1/audio/speech", json=body), stream=True
        )
        self.status = self.response.status_code
        self.first = threading.Event()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for _ in self.response.iter_bytes():
                self.first.set()
        except httpx.HTTPError:
            pass  # closed by the test
        finally:
            self.first.set()
            self.done.set()

    def close(self) -> None:
        self.response.close()
        self.thread.join(30)
        self.http.close()


@pytest.mark.parametrize("params", [WHOLE, None], ids=["stream=false", "plain"])
def test_eight_whole_answers_at_once_are_batched_and_equal_their_solo_clips(strict: Server, params) -> None:
    """Eight non-streamed requests at once: sent whole (``?stream=false``) or plain (pcm as
    it is generated, read whole by the client, as an SDK's ``create`` does): none needs real
    time, so none is refused for it."""
    texts = [f"Voice number {i} says hello to the crowd." for i in range(8)]
    before = _settle(strict)

    async def all_at_once() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=strict.url, timeout=TIMEOUT) as c:
            return await asyncio.gather(
                *(
                    c.post("/v1/audio/speech", json=_body(t, v), params=params)
                    for t, v in zip(texts, VOICES, strict=True)
                )
            )

    answers = asyncio.run(all_at_once())
    assert [r.status_code for r in answers] == [200] * 8, [
        r.text[:300] for r in answers if r.status_code != 200
    ]
    after = _settle(strict)
    grew = {
        name: _sample(after, name, model=CSM) - _sample(before, name, model=CSM)
        for name in ("pie_media_engine_passes_total", "pie_media_engine_steps_total")
    }
    assert grew["pie_media_engine_steps_total"] > 2 * grew["pie_media_engine_passes_total"]  # batched
    assert _sample(after, "pie_media_speech_refused_total", model=CSM, reason="time") == _sample(
        before, "pie_media_speech_refused_total", model=CSM, reason="time"
    )
    with httpx.Client(base_url=strict.url, timeout=TIMEOUT) as http:
        for text, voice, got in zip(texts, VOICES, answers, strict=True):
            if params is WHOLE:
                assert int(got.headers["content-length"]) == len(got.content) > 0
            solo = http.post("/v1/audio/speech", json=_body(text, voice), params=WHOLE)
            assert solo.status_code == 200
            a, b = (np.frombuffer(x, "<i2").astype(np.int32) for x in (got.content, solo.content))
            assert len(a) == len(b) == round(3.0 / FRAME_S) * 1920  # 3 s: no early end
            assert np.abs(a - b).max() <= 2  # 16-bit steps (batched frames give the same codes)


def test_a_stream_past_real_time_is_refused_and_a_whole_answer_waits_to_its_deadline(strict: Server) -> None:
    _settle(strict)
    stream = _Stream(strict, _body("A long story.", seconds=300, stream=True))
    try:
        assert stream.status == 200
        assert stream.first.wait(30)  # audio is flowing
        with httpx.Client(base_url=strict.url, timeout=TIMEOUT) as http:
            refused = http.post("/v1/audio/speech", json=_body("A second stream.", seconds=1, stream=True))
            assert refused.status_code == 429, refused.text
            err = refused.json()["error"]
            assert err["code"] == "queue_full" and err["reason"] == "time" and "real time" in err["message"]
            assert int(refused.headers["retry-after"]) >= 1

            seen: list[tuple[float, float]] = []

            def watch() -> None:  # /metrics while the whole answer waits
                end = time.monotonic() + QUEUE_TIMEOUT_S
                while time.monotonic() < end:
                    m = _metrics(strict)
                    seen.append(
                        (
                            _sample(m, "pie_media_speech_waiting", model=CSM),
                            _sample(m, "pie_media_speech_longest_wait_seconds", model=CSM),
                        )
                    )
                    time.sleep(0.2)

            watcher = threading.Thread(target=watch)
            watcher.start()
            start = time.monotonic()
            waited = http.post("/v1/audio/speech", json=_body("A whole file.", seconds=1), params=WHOLE)
            took = time.monotonic() - start
            watcher.join(30)
        assert waited.status_code == 429, waited.text
        err = waited.json()["error"]
        assert err["code"] == "queue_full" and err["reason"] == "time"
        assert err["waited_s"] >= QUEUE_TIMEOUT_S and int(waited.headers["retry-after"]) >= 1
        assert QUEUE_TIMEOUT_S <= took < QUEUE_TIMEOUT_S + 5
        assert any(count == 1 and longest > 0 for count, longest in seen), seen
        m = _metrics(strict)
        assert _sample(m, "pie_media_speech_wait_timeouts_total", model=CSM, reason="time") >= 1
        assert _sample(m, "pie_media_speech_waited_total", model=CSM, reason="time") >= 1
        assert not stream.done.is_set()  # the stream ran all along
    finally:
        stream.close()
    m = _settle(strict)
    assert _sample(m, "pie_media_running_contexts", model=CSM) == 0


def _retry_after_and_real_wait(server: Server) -> tuple[int, float, int, float]:
    """Occupy the model with a whole answer of known length (a stream beside it would fall
    behind real time), get a stream refused, and retry until it gets in: (Retry-After, the
    real wait, the occupier's frames, the wall seconds per frame it was sized by)."""
    _settle(server)
    # a lone request first: this moment's wall time per frame (its prefill and decode in it)
    start = time.monotonic()
    warm = httpx.post(
        f"{server.url}/v1/audio/speech", json=_body("Warm.", seconds=5), params=WHOLE, timeout=TIMEOUT
    )
    assert warm.status_code == 200
    per_frame = (time.monotonic() - start) / round(5 / FRAME_S)
    frames = int(min(3700, max(40, 3.5 / per_frame)))  # ~3 s: the warm-up counts its overheads too
    occupier: list[httpx.Response] = []
    hold = threading.Thread(
        target=lambda: occupier.append(
            httpx.post(
                f"{server.url}/v1/audio/speech",
                json=_body("A long story.", seconds=frames * FRAME_S),
                params=WHOLE,
                timeout=TIMEOUT,
            )
        )
    )
    hold.start()
    try:
        deadline = time.monotonic() + 30
        while _sample(_metrics(server), "pie_media_running_contexts", model=CSM) != 1:
            assert time.monotonic() < deadline and hold.is_alive()
            time.sleep(0.1)
        time.sleep(0.5)  # its frames are running: their pace is measured
        probe = _body("Hi.", seconds=0.2, stream=True)
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
            refused = http.post("/v1/audio/speech", json=probe)
            told_at = time.monotonic()
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["reason"] == "time"
            retry_after = int(refused.headers["retry-after"])
            while True:
                r = http.post("/v1/audio/speech", json=probe)
                if r.status_code == 200:
                    real_wait = time.monotonic() - told_at
                    break
                assert r.status_code == 429 and time.monotonic() - told_at < 60
                time.sleep(0.1)
    finally:
        hold.join(120)
    assert occupier and occupier[0].status_code == 200
    assert len(occupier[0].content) == frames * 1920 * 2  # it ran its whole frame budget
    return retry_after, real_wait, frames, per_frame


def test_retry_after_is_the_real_wait_within_a_second(strict: Server) -> None:
    """Retry-After against the wait measured in the same run. The estimate reads the pace of
    the running frames; another process on a shared machine can halve or double that pace
    within seconds, which no estimate foresees: a measure is taken again when it missed, a
    few seconds later (up to eight times: five in a row all missed once in a clean clone's
    CI, every one by 1.1-1.3 s, while the other worker's tests loaded the machine; the same
    tree hit at once in four other runs and alone), and one must hit."""
    tries = []
    for attempt in range(8):
        if attempt:
            time.sleep(3)  # let a neighbour's burst pass
        retry_after, real_wait, frames, per_frame = _retry_after_and_real_wait(strict)
        tries.append((retry_after, round(real_wait, 2), frames, round(per_frame * 1e3, 1)))
        if abs(retry_after - real_wait) <= 1.0 and retry_after >= 2:  # (>= 2: not the floor by luck)
            break
    else:
        raise AssertionError(f"(Retry-After, real wait s, frames, ms per frame) of each try: {tries}")


def test_a_saturating_burst_beside_chat_is_answered_or_refused_within_the_bound(strict: Server) -> None:
    before = _settle(strict)
    bound = QUEUE_TIMEOUT_S + 20  # the deadline, plus a whole clip's frames and decode on a busy CPU
    # long enough to run through the whole burst on any machine (closed after it): every
    # whole answer would slow it, so they queue (4) or are refused at once (the rest)
    stream = _Stream(strict, _body("The stream that saturates.", seconds=300, stream=True))
    assert stream.status == 200 and stream.first.wait(30)

    async def burst() -> list[tuple[str, int | None, float, httpx.Response | None]]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=strict.url, timeout=TIMEOUT, limits=limits) as c:

            async def timed(kind: str, call) -> tuple[str, int | None, float, httpx.Response | None]:
                start = time.monotonic()
                try:
                    r = await call
                except httpx.TimeoutException:  # a client that gave up while it waited
                    return kind, None, time.monotonic() - start, None
                return kind, r.status_code, time.monotonic() - start, r

            calls = []
            for i in range(10):
                fmt = "wav" if i % 2 else "pcm"
                body = _body(f"Whole answer {i}.", VOICES[i % 8], seconds=1, fmt=fmt)
                calls.append(timed("whole", c.post("/v1/audio/speech", json=body, params=WHOLE)))
            for i in range(4):
                body = _body(f"Stream {i}.", VOICES[i], seconds=1, stream=True)
                calls.append(timed("stream", c.post("/v1/audio/speech", json=body)))
            for i in range(3):
                body = _body(f"Gives up {i}.", VOICES[i], seconds=1)
                short = httpx.Timeout(0.3, connect=10)
                calls.append(
                    timed("gives_up", c.post("/v1/audio/speech", json=body, params=WHOLE, timeout=short))
                )
            for i in range(6):
                chat = {
                    "model": CHAT,
                    "messages": [{"role": "user", "content": f"Count to {i}."}],
                    "max_tokens": 16,
                }
                calls.append(timed("chat", c.post("/v1/chat/completions", json=chat)))
            return await asyncio.gather(*calls)

    try:
        results = asyncio.run(burst())
        assert not stream.done.is_set()  # it saturated the model all along
    finally:
        stream.close()
    for kind, status, took, r in results:
        assert took < bound, (kind, status, took)
        if kind == "gives_up":
            continue
        if kind == "chat":
            assert status == 200, r.text
            continue
        assert status in (200, 429), (kind, status, r.text[:300])
        if status == 429:
            err = r.json()["error"]
            assert err["code"] == "queue_full" and err["reason"] in ("time", "queue", "max_streams", "pages")
            assert int(r.headers["retry-after"]) >= 1
        else:
            assert len(r.content) > 0
    whole = [status for kind, status, _, _ in results if kind == "whole"]
    assert 429 in whole  # the queue (4) was full for some of the ten
    after = _settle(strict)
    assert _sample(after, "pie_media_speech_waiting", model=CSM) == 0
    assert _sample(after, "pie_media_running_contexts", model=CSM) == 0
    assert _sample(after, "pie_media_requests_in_flight", model=CSM) == 0
    waited = sum(
        (_sample(after, "pie_media_speech_waited_total", model=CSM, reason=r) or 0)
        - (_sample(before, "pie_media_speech_waited_total", model=CSM, reason=r) or 0)
        for r in ("time", "max_streams", "pages")
    )
    assert waited >= 1
    # and the server serves: a whole answer, a stream, a chat
    with httpx.Client(base_url=strict.url, timeout=TIMEOUT) as http:
        ok = http.post("/v1/audio/speech", json=_body("Still here.", seconds=0.5), params=WHOLE)
        assert ok.status_code == 200 and len(ok.content) > 0
        ok = http.post("/v1/audio/speech", json=_body("Still streaming.", seconds=0.5, stream=True))
        assert ok.status_code == 200 and len(ok.content) > 0
        chat = {"model": CHAT, "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 4}
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
