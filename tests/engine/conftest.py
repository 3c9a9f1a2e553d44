"""Shared fixtures: the tiny checkpoints loaded once per test session, both as engine
models and as the transformers reference models they must match."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# The tiny models gain nothing from intra-op threads, and on a loaded 2-core machine
# OpenMP's spinning workers turn microsecond ops into ~15 ms ones (measured here: SDPA on a
# (1, 4, 1, 16) query, 0.01 ms with 1 thread vs 16 ms with 2 under load).
torch.set_num_threads(1)

TINY_QWEN = "tiny-qwen3-vl"
TINY_GEMMA = "tiny-gemma4"

# Parity tolerance for float32 logits on CPU. Our pass and the reference run the same
# transformers modules with the same weights; what differs is where K/V come from (our
# pages vs the reference's tensors), how SDPA is entered (explicit mask vs is_causal),
# and for prefill chunks / batched decode the matmul shapes. Those reorder float32 sums,
# which moves logits by ~1e-6 at these magnitudes (|logits| < 30); 1e-4 leaves room for
# that and is still far below anything a wrong mask, position or embedding would cause
# (those move logits by 1e-2 or more).
ATOL = 1e-4


@pytest.fixture(scope="session")
def qwen(tiny_dir):
    from engine import Model

    return Model.load(tiny_dir(TINY_QWEN), kv_pages=512, device="cpu")


@pytest.fixture(scope="session")
def gemma(tiny_dir):
    from engine import Model

    return Model.load(tiny_dir(TINY_GEMMA), kv_pages=512, device="cpu")


@pytest.fixture(scope="session")
def qwen_ref(qwen):
    from transformers import Qwen3VLForConditionalGeneration

    return Qwen3VLForConditionalGeneration.from_pretrained(qwen.path).eval()


@pytest.fixture(scope="session")
def gemma_ref(gemma):
    from transformers import Gemma4ForConditionalGeneration

    return Gemma4ForConditionalGeneration.from_pretrained(gemma.path).eval()


@pytest.fixture(scope="session")
def models(qwen, gemma):
    return {TINY_QWEN: qwen, TINY_GEMMA: gemma}


@pytest.fixture(scope="session")
def refs(qwen_ref, gemma_ref):
    return {TINY_QWEN: qwen_ref, TINY_GEMMA: gemma_ref}


def reference_greedy(ref, n: int, **inputs) -> list[int]:
    """``generate(do_sample=False)`` for exactly ``n`` new tokens (EOS disabled)."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    saved = ref.generation_config.eos_token_id
    ref.generation_config.eos_token_id = None  # else generate() merges the checkpoint's EOS back in
    try:
        with torch.no_grad():
            out = ref.generate(**inputs, generation_config=config)
    finally:
        ref.generation_config.eos_token_id = saved
    tokens = out[0, inputs["input_ids"].shape[1] :].tolist()
    assert len(tokens) == n
    return tokens


def reference_logits(ref, **inputs) -> torch.Tensor:
    with torch.no_grad():
        return ref(**inputs).logits[0].float()


# Max |Δ logits| per parity check, printed at the end of the run (the numbers the
# tolerance above is judged against).
PARITY: dict[str, float] = {}


def pass_logits(model, text: str, adapter=None) -> torch.Tensor:
    """Raw logits of every row of ``text`` in one hand-built pass (``ctx.forward()``), under
    ``adapter`` when given."""
    from engine import Context
    from engine.slots import Slot

    ids = model.tokenize(text)

    async def main() -> torch.Tensor:
        ctx = Context(model)
        fp = ctx.forward().input_tokens(ids)
        if adapter is not None:
            fp.adapter(adapter)
        first = fp.sampler(range(len(ids)), Slot.raw_logits())
        out = await fp.execute()
        ctx.close()
        return torch.stack([out[first + i].logits for i in range(len(ids))])

    return asyncio.run(main())


def assert_logits_close(ours: torch.Tensor, theirs: torch.Tensor, label: str, atol: float = ATOL) -> float:
    assert ours.shape == theirs.shape, (ours.shape, theirs.shape)
    diff = (ours.float().cpu() - theirs.float().cpu()).abs().max().item()
    PARITY[label] = max(diff, PARITY.get(label, 0.0))
    assert diff < atol, f"{label}: max |Δ logits| {diff:.3g} >= {atol}"
    return diff


def pytest_terminal_summary(terminalreporter):
    if PARITY:
        terminalreporter.section("engine parity: max |Δ logits| vs transformers (float32)")
        for label, diff in sorted(PARITY.items()):
            terminalreporter.write_line(f"{diff:10.3g}  {label}")


# ------------------------------------------------------------------ waiting without races

WAIT_S = 30.0
"""Upper bound of every wait below: a test that waits longer has failed, not hung."""


async def until(condition: Callable[[], bool], what: str, *, timeout: float = WAIT_S) -> None:
    """Yield to the event loop until ``condition()`` holds; fail after ``timeout`` seconds."""

    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.001)

    try:
        await asyncio.wait_for(poll(), timeout)
    except TimeoutError:
        pytest.fail(f"waited {timeout}s for {what}")


class PassGate:
    """Holds every forward pass of ``model`` at its start until ``open()``: a test can act
    while a pass is known to be running. Installed with ``monkeypatch`` (undone after the
    test); the gate opens by itself after ``WAIT_S`` so a failing test cannot hang the
    worker thread."""

    def __init__(self, model, monkeypatch: pytest.MonkeyPatch):
        self.started = threading.Event()
        self._open = threading.Event()
        run = model.runner.run

        def gated(steps):
            self.started.set()
            self._open.wait(WAIT_S)
            return run(steps)

        monkeypatch.setattr(model.runner, "run", gated)

    async def running(self) -> None:
        """Wait until a pass has started (and is held)."""
        await until(self.started.is_set, "a forward pass to start")

    def open(self) -> None:
        self._open.set()
