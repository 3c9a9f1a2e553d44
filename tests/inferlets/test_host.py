"""Inferlet host: the guest's greedy output equals the engine's, token for token, and hostile
guests end with typed errors while the pool gets its pages back."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from api.model_ref import load_model
from engine import Context
from fixtures.paths import cache_root
from inferlets import (
    InferletFailedError,
    InferletRuntime,
    InferletTrapError,
    RunLimits,
    build_component,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "inferlets" / "examples"


@pytest.fixture(scope="module")
def wasm() -> Path:
    return build_component(EXAMPLES, cache_root() / "inferlets-build")


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")


@pytest.fixture(scope="module")
def rt(model) -> InferletRuntime:
    return InferletRuntime({"tiny": model}, cache_root())


async def _direct(model, prompt: str, n: int) -> str:
    c = Context(model).user(prompt).cue()
    try:
        return (await c.generate(max_tokens=n)).text
    finally:
        c.close()


def test_chat_equals_engine(rt, wasm, model) -> None:
    async def main():
        sends: list[str] = []
        out = await rt.run_async(wasm, ["chat", "tiny", "Describe a cat.", "12"], on_send=sends.append)
        assert out == await _direct(model, "Describe a cat.", 12)

    asyncio.run(main())


def test_best_of_sends_each_branch(rt, wasm, model) -> None:
    async def main():
        sends: list[str] = []
        out = await rt.run_async(wasm, ["best-of", "tiny", "Hi", "6", "3"], on_send=sends.append)
        want = await _direct(model, "Hi", 6)
        assert sends == [want] * 3  # greedy forks of one prefill agree
        assert out == want

    asyncio.run(main())


@pytest.mark.parametrize(
    ("args", "err", "code"),
    [
        (["forged"], InferletFailedError, "inferlet_bad_handle"),
        (["handles", "tiny"], InferletFailedError, "inferlet_limit"),
        (["loop"], InferletTrapError, "fuel"),
        (["bomb"], InferletTrapError, "trapped"),
    ],
)
def test_hostile_guest_gets_typed_error_and_good_one_still_right(rt, wasm, model, args, err, code) -> None:
    in_use = model.pool.stats().in_use

    async def main():
        bad = rt.run_async(wasm, args, limits=RunLimits(fuel=300_000_000, wall_s=10, max_handles=16))
        good = rt.run_async(wasm, ["chat", "tiny", "Hello", "8"])
        res = await asyncio.gather(bad, good, return_exceptions=True)
        assert isinstance(res[0], err) and code in str(res[0])
        assert res[1] == await _direct(model, "Hello", 8)

    asyncio.run(main())
    assert model.pool.stats().in_use == in_use  # every page of both runs is back


def test_cli_run_prints_sends_then_result(wasm, model) -> None:
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "api.cli", "inferlet", "run", str(wasm), "--model", "tiny", "--"]
    r = subprocess.run([*cmd, "best-of", "tiny", "Hi", "4", "2"], capture_output=True, text=True, timeout=120)
    want = asyncio.run(_direct(model, "Hi", 4))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [want] * 3
    bad = subprocess.run([*cmd, "forged"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "inferlet_bad_handle" in bad.stderr


def test_concurrent_inferlets_share_forward_passes(rt, wasm, model) -> None:
    """Eight guests generating 8 tokens each: the scheduler batches their steps, so
    passes are far fewer than steps (serial would be one step per pass)."""
    stats = model.scheduler.stats

    async def main():
        p0, s0 = stats.passes, stats.steps
        runs = [rt.run_async(wasm, ["chat", "tiny", f"Prompt {i}", "8"]) for i in range(8)]
        outs = await asyncio.gather(*runs)
        counted = stats.passes - p0, stats.steps - s0
        for i, out in enumerate(outs):
            assert out == await _direct(model, f"Prompt {i}", 8)
        return counted

    passes, steps = asyncio.run(main())
    assert stats.max_steps_in_pass >= 2
    assert passes < steps / 2, (passes, steps)
