"""Speech admission by real time over HTTP: a real server (uvicorn, tiny CSM) whose
``--speech-realtime-safety`` makes the tiny model's real measured frame time count as too
slow (a budget of 80 ns per 80 ms frame). One stream runs; a second would put both behind
real time, so it gets 429 with Retry-After and ``reason: time``; /metrics shows the
measured frame time, the bound, the refusal by reason and the running and finished
streams' real-time margins; once the first stream ends, the model serves again.
No duration is asserted: the margins are checked for presence and sign only.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.api.http.conftest import Server, metric_sample, scrape_metrics, start_server, stop_server

CSM = "tiny-csm"
BODY = {
    "model": CSM,
    "input": "A long story.",
    "voice": "alloy",
    "response_format": "pcm",
    "max_duration": 300,
    "stream_format": "audio",  # a stream: real time is promised, so past it the answer is 429
}


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory: pytest.TempPathFactory):
    s = start_server(
        tmp_path_factory.mktemp("speech-realtime"), "--speech-realtime-safety", "0.000001", models=(CSM,)
    )
    yield s
    stop_server(s)


_metrics = scrape_metrics
_sample = metric_sample


def test_a_stream_that_would_fall_behind_real_time_gets_429(strict_server: Server) -> None:
    before = _metrics(strict_server)
    assert _sample(before, "pie_media_speech_frame_pass_seconds", model=CSM, batch="1") > 0  # warm-up
    assert _sample(before, "pie_media_speech_frame_audio_seconds", model=CSM) == pytest.approx(0.08)
    assert _sample(before, "pie_media_speech_streams_fit", model=CSM, bound="time") == 1
    assert _sample(before, "pie_media_speech_refused_total", model=CSM, reason="time") == 0
    with httpx.Client(base_url=strict_server.url, timeout=60) as http:
        r = http.send(http.build_request("POST", "/v1/audio/speech", json=BODY), stream=True)
        try:
            assert r.status_code == 200
            chunks = r.iter_bytes()
            next(chunks)  # audio is flowing: the stream has two frames or more
            refused = http.post("/v1/audio/speech", json=BODY)
            assert refused.status_code == 429, refused.text
            # when the running stream's frame budget (300 s of audio) runs out, at its pace
            assert int(refused.headers["retry-after"]) >= 2
            err = refused.json()["error"]
            assert err["code"] == "queue_full" and err["reason"] == "time"
            assert "real time" in err["message"]
            during = _metrics(strict_server)
            assert _sample(during, "pie_media_speech_refused_total", model=CSM, reason="time") == 1
            assert _sample(during, "pie_media_speech_admitted_total", model=CSM) == 1
            assert _sample(during, "pie_media_speech_stream_realtime_margin", model=CSM, stat="min") > 0
            assert _sample(during, "pie_media_speech_predicted_realtime_margin", model=CSM) > 0
            assert _sample(during, "pie_media_running_contexts", model=CSM) == 1
        finally:
            r.close()  # the client leaves mid-stream
    deadline = time.monotonic() + 30
    while (
        _sample(_metrics(strict_server), "pie_media_running_contexts", model=CSM)
        and time.monotonic() < deadline
    ):
        time.sleep(0.1)
    after = _metrics(strict_server)
    assert _sample(after, "pie_media_running_contexts", model=CSM) == 0
    assert _sample(after, "pie_media_speech_realtime_margin_count", model=CSM) == 1
    assert _sample(after, "pie_media_speech_realtime_margin_sum", model=CSM) > 0
    assert _sample(after, "pie_media_speech_streams_behind_realtime", model=CSM) == 0
    ok = httpx.post(f"{strict_server.url}/v1/audio/speech", json={**BODY, "max_duration": 0.3}, timeout=60)
    assert ok.status_code == 200 and len(ok.content) > 0
