"""Hostile inferlets: each ends with a typed error, its KV pages return to the pool, and a
good inferlet running at the same time finishes with the right answer."""

from __future__ import annotations

import asyncio
import base64
import time

import pytest

from inferlets import (
    InferletCancelledError,
    InferletFailedError,
    InferletRun,
    InferletTimeoutError,
    InferletTrapError,
    RunLimits,
)
from tests.inferlets import direct

LIMITS = RunLimits(
    fuel=400_000_000, wall_s=20, max_handles=12, max_text_bytes=100_000, max_buffer_bytes=500_000
)
PNG = base64.b64encode(direct.png(16, 16)).decode()


def _against_good(rt, wasm, model, args, limits=LIMITS, control=None, after=None):
    """Run ``args`` beside a good chat inferlet; returns the bad run's exception."""
    in_use, open_before = model.pool.stats().in_use, model.open_contexts

    async def main():
        bad = asyncio.ensure_future(rt.run_async(wasm, args, limits=limits, control=control))
        good = asyncio.ensure_future(rt.run_async(wasm, ["chat", "tiny", "Hello", "8"]))
        if after is not None:
            await after()
        res = await asyncio.gather(bad, good, return_exceptions=True)
        assert res[1] == await direct.chat(model, "Hello", 8), res[1]
        return res[0]

    err = asyncio.run(main())
    assert model.pool.stats().in_use == in_use  # every page of both runs is back
    assert model.open_contexts == open_before
    return err


@pytest.mark.parametrize(
    ("args", "code", "kind"),
    [
        (["forged"], "inferlet_bad_handle", "bad-handle"),
        (["closed"], "inferlet_bad_handle", "bad-handle"),
        (["handles", "tiny"], "inferlet_limit", "limit"),
        (["media-handles", "tiny", PNG], "inferlet_limit", "limit"),
        (["oversized", "tiny", "200000"], "inferlet_limit", "limit"),
        (["oversized-media", "tiny", "600000"], "inferlet_limit", "limit"),
        (["tts", "tiny-csm", "Hello.", "0", "1", "1000"], "inferlet_limit", "limit"),
        # the rooms' own codes pass through unchanged
        (
            ["image-qa", "tiny", "q", "2", base64.b64encode(b"not an image").decode()],
            "unsupported_format",
            "media",
        ),
        (
            ["image-qa", "tiny", "q", "2", base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(40)).decode()],
            "corrupt",
            "media",
        ),
        (["continue", "tiny", "never-saved", "2"], "saved_context_not_found", "not-found"),
        (["tts", "tiny", "Hello.", "0", "1", "1"], "model_not_found", "not-found"),
    ],
)
def test_typed_error_from_host_call(rt, wasm, model, args, code, kind) -> None:
    err = _against_good(rt, wasm, model, args)
    assert isinstance(err, InferletFailedError), err
    assert err.details["guest_code"] == code and err.code == "inferlet_failed"
    assert err.details["guest_kind"] == kind  # the WIT error-kind case, seen by the guest


def test_runaway_loop_runs_out_of_fuel(rt, wasm, model) -> None:
    err = _against_good(rt, wasm, model, ["loop"])
    assert isinstance(err, InferletTrapError) and "fuel" in str(err)


def test_runaway_loop_hits_the_wall_clock(rt, wasm, model) -> None:
    t0 = time.monotonic()
    err = _against_good(rt, wasm, model, ["loop"], RunLimits(fuel=10**15, wall_s=1.5))
    assert isinstance(err, InferletTimeoutError) and err.code == "inferlet_timeout"
    assert time.monotonic() - t0 < 15


def test_memory_bomb_traps(rt, wasm, model) -> None:
    err = _against_good(rt, wasm, model, ["bomb"], RunLimits(memory_bytes=64 << 20))
    assert isinstance(err, InferletTrapError)


def test_guest_that_swallows_errors_still_times_out(rt, wasm, model) -> None:
    err = _against_good(rt, wasm, model, ["ignore-errors"], RunLimits(fuel=10**15, wall_s=1.5))
    assert isinstance(err, InferletTimeoutError)


def test_waiting_receive_times_out(rt, wasm, model) -> None:
    err = _against_good(
        rt, wasm, model, ["image-qa", "tiny", "q", "4", "-"], RunLimits(wall_s=1.0), control=InferletRun()
    )
    assert isinstance(err, InferletTimeoutError)


def test_cancel_ends_a_waiting_run(rt, wasm, model) -> None:
    control = InferletRun()

    async def cancel_soon():
        await asyncio.sleep(0.5)
        control.cancel()

    t0 = time.monotonic()
    err = _against_good(
        rt, wasm, model, ["image-qa", "tiny", "q", "4", "-"], control=control, after=cancel_soon
    )
    assert isinstance(err, InferletCancelledError) and err.code == "inferlet_cancelled"
    assert time.monotonic() - t0 < 15


def test_unknown_model_is_typed(rt, wasm) -> None:
    with pytest.raises(InferletFailedError) as e:
        asyncio.run(rt.run_async(wasm, ["chat", "nope", "Hi", "2"]))
    assert e.value.details["guest_code"] == "model_not_found"


def test_host_bug_is_a_typed_error_not_a_crash(rt, wasm, model, monkeypatch) -> None:
    """An unexpected exception inside a host call reaches the guest as
    ``inferlet_host_error``; the run ends typed and frees its pages."""
    from inferlets.host.iface_runtime import ModelCalls

    def broken(self, model, text):
        raise RuntimeError("simulated host bug")

    monkeypatch.setattr(ModelCalls, "tokenize", broken)
    in_use = model.pool.stats().in_use
    with pytest.raises(InferletFailedError) as e:
        asyncio.run(rt.run_async(wasm, ["tour", "tiny", "Hi", "2"]))
    assert e.value.details["guest_code"] == "inferlet_host_error"
    assert "simulated host bug" in str(e.value)
    assert model.pool.stats().in_use == in_use


def test_overlapping_speech_in_one_run_is_refused_not_deadlocked(rt, wasm) -> None:
    out = asyncio.run(rt.run_async(wasm, ["speech-overlap", "tiny-csm"], limits=RunLimits(wall_s=60)))
    assert out == "invalid_request invalid_request True"
