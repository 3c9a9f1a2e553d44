"""One argmax read per pass (ForwardRunner.batch_argmax, on by default on CUDA): greedy
contexts take the runner's argmax instead of reading their own logits."""

from __future__ import annotations

import pytest

from engine import Model, Sampler
from tests.engine.conftest import TINY_GEMMA, TINY_QWEN
from tests.engine.test_decode_graphs import _decode_all


@pytest.fixture(scope="module")
def pair(tiny_dir):
    plain = Model.load(tiny_dir(TINY_QWEN), kv_pages=256, device="cpu")
    batched = Model.load(tiny_dir(TINY_QWEN), kv_pages=256, device="cpu")
    assert not plain.runner.batch_argmax  # off on the CPU, where numpy's argmax is cheap
    batched.runner.batch_argmax = True
    return plain, batched


def test_greedy_tokens_unchanged(pair, tiny_dir):
    plain, batched = pair
    lengths = [6, 2, 5, 4, 7]
    assert _decode_all(batched, lengths) == _decode_all(plain, lengths)
    gemma = Model.load(tiny_dir(TINY_GEMMA), kv_pages=256, device="cpu")
    expected = _decode_all(gemma, lengths)
    gemma.runner.batch_argmax = True
    assert _decode_all(gemma, lengths) == expected


def test_the_hint_is_what_greedy_takes_and_only_greedy(pair, monkeypatch):
    """A runner that reports argmax 7 for every "last" step: greedy decode steps follow it
    (so the shortcut is really taken), a sampled generation does not."""
    _, batched = pair
    real = batched.runner.run

    def lying(steps):
        out = real(steps)
        for s in steps:
            if s.argmax is not None:
                s.argmax = 7
        return out

    monkeypatch.setattr(batched.runner, "run", lying)
    from engine import SyncContext, max_tokens

    ctx = SyncContext(batched).user("Say something.").cue()
    tokens = ctx.generate(Sampler.greedy(), max_tokens(5)).tokens
    assert tokens[1:] == [7, 7, 7, 7]  # the first comes from the prompt's pass ("last+hidden")
    ctx.close()
    ctx = SyncContext(batched, seed=3).user("Say something.").cue()
    sampled = ctx.generate(Sampler.multinomial(1.0), max_tokens(5)).tokens
    assert sampled[1:] != [7, 7, 7, 7]
    ctx.close()


def test_with_graph_decode(tiny_dir):
    """The graph path (rehearsed) sets the hints too; plain greedy equals the plain engine."""
    import asyncio

    from engine import Context, max_tokens
    from engine.attention_flashinfer import FlashInferBackend
    from engine.decode_graphs import DecodeGraphs
    from tests.engine.fake_flashinfer import installed

    def greedy_all(model: Model) -> list[list[int]]:
        async def go():
            ctxs = [Context(model).user(p).cue() for p in ("One.", "Two, three.", "Four five six?")]
            try:
                gens = await asyncio.gather(*(c.generate(Sampler.greedy(), max_tokens(6)) for c in ctxs))
                return [g.tokens for g in gens]
            finally:
                for c in ctxs:
                    c.close()

        return asyncio.run(go())

    with installed():
        models = []
        for graphs in (False, True):
            m = Model.load(tiny_dir(TINY_QWEN), kv_pages=256, device="cpu", attention="torch")
            m.runner.backend = FlashInferBackend("cpu", workspace_bytes=1024, head_dims=None)
            if graphs:
                m.runner.graphs = DecodeGraphs(m.runner, max_batch=4, capture=False)
                m.runner.batch_argmax = True
            models.append(m)
        expected = greedy_all(models[0])
        assert greedy_all(models[1]) == expected
        assert models[1].runner.graphs.replays >= 5


def test_hints_in_passes_that_mix_prefill_and_decode(pair, monkeypatch):
    """A context prefilling while others decode: the pass holds "last+hidden" and "last"
    steps; each hint is its own row's argmax."""
    import asyncio

    from engine import Context, max_tokens

    _, batched = pair
    real = batched.runner.run
    mixed = []

    def checking(steps):
        out = real(steps)
        kinds = {s.logits for s in steps}
        if "last" in kinds and len(kinds) > 1:
            mixed.append(kinds)
        for s, o in zip(steps, out, strict=True):
            if s.argmax is not None:
                assert s.logits == "last" and s.argmax == int(o.argmax())
        return out

    monkeypatch.setattr(batched.runner, "run", checking)

    async def go():
        a = Context(batched).user("Tell me a long story about boats.").cue()
        start = batched.runner.passes
        task = asyncio.create_task(a.generate(Sampler.greedy(), max_tokens(40)))
        for _ in range(2000):  # bounded: until a has prefilled and decoded once
            if batched.runner.passes - start >= 2:
                break
            await asyncio.sleep(0.001)
        b = Context(batched).user("Now something else entirely, a poem about paging.").cue()
        await asyncio.gather(task, b.generate(Sampler.greedy(), max_tokens(3)))
        a.close()
        b.close()

    asyncio.run(go())
    assert mixed, "no pass mixed a prefill with decode steps"
