"""ctx.forward(): Pie's forward pass by hand, against transformers on the tiny checkpoints.

Tolerance: ``ATOL`` of conftest (float32 logits; the same modules and weights, sums
reordered by different shapes). Masks that differ by one key move logits by far more."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine import (
    BrleError,
    Context,
    ContextClosedError,
    ContextLengthExceededError,
    ForwardPassError,
    OutOfPagesError,
    Slot,
    SlotDistribution,
    SlotEmbedding,
    SlotEntropy,
    SlotLogits,
    SlotLogprobs,
    SlotToken,
    WorkingPageError,
    brle,
    step_timing,
)
from media import Image, InvalidRequestError
from tests.engine.conftest import TINY_GEMMA, TINY_QWEN, assert_logits_close, reference_logits

PROMPT = "Hello there, tell me a long story about a cat who lives in a small village near the sea."


def run(coro):
    return asyncio.run(coro)


def _ids(model, text: str = PROMPT) -> list[int]:
    return model.tokenize(text)


def _ref_inputs(model, ids: list[int], mask: torch.Tensor | None = None, sliding: int | None = None) -> dict:
    """transformers inputs: ids, plain positions, and a 4-D boolean mask (True = attend);
    for Gemma-4 a mask per layer kind, the sliding one cut to the window as ours is."""
    n = len(ids)
    inputs: dict = {"input_ids": torch.tensor([ids])}
    if model.arch.position_axes == 3:
        inputs["mm_token_type_ids"] = torch.zeros(1, n, dtype=torch.long)
        inputs["position_ids"] = torch.arange(n).view(1, 1, n).expand(3, 1, n)
    else:
        inputs["position_ids"] = torch.arange(n).view(1, n)
    if mask is not None:
        full = mask.view(1, 1, n, n)
        if sliding is None:
            inputs["attention_mask"] = full
        else:
            q = torch.arange(n)[:, None]
            k = torch.arange(n)[None, :]
            inputs["attention_mask"] = {
                "full_attention": full,
                "sliding_attention": full & (k > q - sliding).view(1, 1, n, n),
            }
    return inputs


async def _raw_logits_of_every_row(ctx: Context, ids: list[int], positions=None, mask=None) -> torch.Tensor:
    fp = ctx.forward().input_tokens(ids, positions)
    if mask is not None:
        fp.attention_mask(mask)
    first = fp.sampler(range(len(ids)), Slot.raw_logits())
    out = await fp.execute()
    assert all(isinstance(s, SlotLogits) for s in out)
    return torch.stack([out[first + i].logits for i in range(len(ids))])


# -- positions and masks --------------------------------------------------------------------------
@pytest.mark.parametrize("name", [TINY_QWEN, TINY_GEMMA])
def test_default_positions_are_bit_identical_to_flush(models, name):
    model = models[name]
    ids = _ids(model)

    async def main():
        a, b = Context(model), Context(model)
        flushed = await a.fill_tokens(ids).flush(return_logits=True)
        ours = await _raw_logits_of_every_row(b, ids, positions=list(range(len(ids))))
        a.close()
        b.close()
        return flushed, ours

    flushed, ours = run(main())
    assert torch.equal(flushed, ours)


@pytest.mark.parametrize("name", [TINY_QWEN, TINY_GEMMA])
def test_mask_hiding_a_span_equals_transformers_4d_mask(models, refs, name):
    model = models[name]
    ids = _ids(model)
    n = len(ids)
    hide = (3, 11)
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool))
    mask[hide[1] :, hide[0] : hide[1]] = False  # rows after the span never see it
    runs = [brle.encode(row) for row in mask]

    async def main():
        ctx = Context(model)
        out = await _raw_logits_of_every_row(ctx, ids, mask=runs)
        ctx.close()
        return out

    ours = run(main())
    sliding = model.hf.config.text_config.sliding_window if name == TINY_GEMMA else None
    ref = reference_logits(refs[name], **_ref_inputs(model, ids, mask, sliding))
    assert_logits_close(ours, ref, f"forward pass: BRLE mask hiding rows {hide}, {name}")
    plain = reference_logits(refs[name], **_ref_inputs(model, ids))
    assert (ours[hide[1] :] - plain[hide[1] :]).abs().max() > 1e-3  # the mask really bit


def test_mask_with_an_image_in_the_context_equals_transformers(qwen, qwen_ref, samples):
    """Qwen3-VL: an image spliced at an anchor (delimiters are the caller's tokens), then a
    question whose rows do not see the system text."""
    model = qwen
    image = Image.from_path(samples / "images" / "photo_640x480.jpg")
    head = model.tokenize("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\n")
    tail = model.tokenize("What is in it?<|im_end|>\n<|im_start|>assistant\n")

    async def main():
        ctx = Context(model)
        fp = ctx.forward()
        prepared = model.prepare(image)
        fp.input_tokens(head + list(prepared.prefix_tokens))
        placed = fp.input_image(prepared)
        fp.input_tokens(list(prepared.suffix_tokens) + tail)
        n = fp.num_rows
        mask = torch.tril(torch.ones(n, n, dtype=torch.bool))
        sys_end = len(head) - 3
        mask[n - len(tail) :, 1:sys_end] = False
        fp.attention_mask(mask)
        first = fp.sampler(range(n), Slot.raw_logits())
        out = await fp.execute()
        rows = list(ctx._rows)
        ctx.close()
        return prepared, placed, mask, torch.stack([out[first + i].logits for i in range(n)]), rows

    prepared, placed, mask, ours, rows = run(main())
    assert placed.token_count == prepared.token_count and placed.num_rows == prepared.token_count
    # the same rows as a context filled the usual way (ids, positions)
    usual = Context(model)
    usual.fill_tokens(head)
    usual.append_image(prepared)
    usual.fill_tokens(tail)
    assert [r.token for r in rows] == usual.token_ids
    assert [r.pos for r in rows] == [r.pos for r in usual._rows]
    usual.close()
    n = len(rows)
    inputs = {
        "input_ids": torch.tensor([[r.token for r in rows]]),
        "mm_token_type_ids": torch.tensor([[r.mm_type for r in rows]]),
        "position_ids": torch.tensor([list(r.pos) for r in rows]).t().reshape(3, 1, n),
        "attention_mask": mask.view(1, 1, n, n),
        **{k: v for k, v in prepared.inputs.items()},
    }
    ref = reference_logits(qwen_ref, **inputs)
    assert_logits_close(ours, ref, "forward pass: image at an anchor + BRLE mask, qwen")


def test_sliding_window_with_sink_over_300_tokens_and_pages_back(qwen, qwen_ref):
    """Greedy decoding where each new row sees the first 4 rows and the last 40; rows that
    fell out are hidden for good and their pages go back to the pool. Equal, token for
    token, to transformers given every row's mask."""
    model, sink, window, steps = qwen, 4, 40, 300
    ids = _ids(model)
    ps = model.pool.page_size

    def keep(total: int) -> list[tuple[int, int]]:
        return [(0, min(sink, total)), (max(0, total - window), total)]

    async def main():
        ctx = Context(model)
        masks: list[torch.Tensor] = []
        tokens: list[int] = []
        pending, dropped = ids, 0
        for _ in range(steps):
            start = ctx.committed
            fp = ctx.forward().input_tokens(pending)
            rows = []
            for i in range(len(pending)):
                total = start + i + 1
                runs = (
                    brle.from_ranges(total, keep(total))
                    if len(pending) == 1
                    else brle.encode(torch.arange(start + len(pending)) <= start + i)
                )
                rows.append(runs)
                masks.append(torch.from_numpy(brle.decode(runs, start + len(pending))))
            fp.attention_mask(rows)
            h = fp.sampler([len(pending) - 1], Slot.greedy())
            out = await fp.execute()
            tokens.append(out[h].token)
            pending = [out[h].token]
            committed = ctx.committed
            evict_end = committed + 1 - window  # the next row's window starts here
            if evict_end > sink:
                ctx.mask_token_range(sink, evict_end)
                dropped += ctx.drop_masked_kv_pages()
        held = len([p for p in ctx._table.pages if p != model.pool.hole_page])
        ctx.close()
        return tokens, masks, dropped, held

    before = model.pool.stats().in_use
    tokens, masks, dropped, held = run(main())
    n = len(ids) + steps - 1
    full = torch.zeros(n, n, dtype=torch.bool)
    for r, m in enumerate(masks):
        full[r, : m.shape[0]] = m[:n]
    ref = reference_logits(qwen_ref, **_ref_inputs(model, ids + tokens[:-1], full))
    want = ref[len(ids) - 1 :].argmax(dim=-1).tolist()
    assert tokens == want
    causal = reference_logits(qwen_ref, **_ref_inputs(model, ids + tokens[:-1]))
    assert (causal[-50:] - ref[-50:]).abs().max() > 1e-2  # the window really bit
    print(f"dropped {dropped} pages, held {held} at the end")
    # pages wholly before the window (past the sink's page) went back while it ran
    assert dropped >= (n - window) // ps - 1 - 1
    assert held <= -(-(window + sink) // ps) + 2
    assert model.pool.stats().in_use <= before + 1  # all back after close (the hole page stays)


# -- slots ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [TINY_QWEN, TINY_GEMMA])
def test_slots_equal_what_transformers_logits_give(models, refs, name):
    model = models[name]
    ids = _ids(model)
    last = len(ids) - 1
    cands = [5, 17, 99, 400]

    async def main():
        ctx = Context(model)
        fp = ctx.forward().input_tokens(ids)
        slots = {
            "raw": fp.sampler([last], Slot.raw_logits()),
            "lp": fp.sampler([last], Slot.logprob(17)),
            "lps": fp.sampler([last, 2], Slot.logprobs(cands)),
            "ent": fp.sampler([last], Slot.entropy()),
            "dist": fp.sampler([last], Slot.dist(0.7, 5)),
            "emb": fp.sampler([last], Slot.embedding()),
            "tok": fp.sampler([last], Slot.greedy()),
        }
        out = await fp.execute()
        hidden = await Context(model).fill_tokens(ids).hidden_states()
        ctx.close()
        return slots, out, hidden

    slots, out, hidden = run(main())
    ref = reference_logits(refs[name], **_ref_inputs(model, ids))
    lsm = torch.log_softmax(ref, dim=-1)
    assert isinstance(out[slots["raw"]], SlotLogits)
    assert_logits_close(out[slots["raw"]].logits, ref[-1], f"forward pass: raw_logits slot, {name}")
    assert out[slots["lp"]] == SlotLogprobs(pytest.approx([float(lsm[-1, 17])], abs=1e-4))
    assert out[slots["lps"]].values == pytest.approx(lsm[-1, cands].tolist(), abs=1e-4)
    assert out[slots["lps"] + 1].values == pytest.approx(lsm[2, cands].tolist(), abs=1e-4)
    entropy = float(-(lsm[-1].exp() * lsm[-1]).sum())
    assert isinstance(out[slots["ent"]], SlotEntropy)
    assert out[slots["ent"]].value == pytest.approx(entropy, abs=1e-4)
    probs, top = torch.softmax(ref[-1] / 0.7, dim=-1).topk(5)
    d = out[slots["dist"]]
    assert isinstance(d, SlotDistribution) and d.ids == top.tolist()
    assert d.probs == pytest.approx(probs.tolist(), abs=1e-5)
    e = out[slots["emb"]]
    assert isinstance(e, SlotEmbedding) and torch.allclose(e.vector, hidden[-1], atol=1e-5)
    assert out[slots["tok"]] == SlotToken(int(ref[-1].argmax()))
    assert len(out) == 8  # one slot per index


def test_several_slots_in_one_pass_equal_separate_passes(qwen):
    model = qwen
    ids = _ids(model)
    last = len(ids) - 1
    make = [
        lambda: Slot.top_p(
            0.8,
            0.9,
        ),
        lambda: Slot.dist(1.0, 4),
        lambda: Slot.entropy(),
        lambda: Slot.logprobs([1, 2, 3, 4]),
    ]

    async def one(slots: list[Slot]) -> list:
        ctx = Context(model, seed=7)
        fp = ctx.forward().input_tokens(ids)
        for s in slots:
            fp.sampler([last], s)
        out = await fp.execute()
        ctx.close()
        return list(out)

    async def main():
        together = await one([m() for m in make])
        apart = [(await one([m()]))[0] for m in make]
        return together, apart

    together, apart = run(main())
    assert together == apart


def test_logit_mask_limits_token_slots_only(qwen):
    model = qwen
    ids = _ids(model)
    allowed = [7, 8, 9]
    vocab = model.arch.vocab_size

    async def main():
        ctx = Context(model)
        fp = ctx.forward().input_tokens(ids).logit_mask(brle.from_ranges(vocab, [(7, 10)]))
        t = fp.sampler([len(ids) - 1], Slot.top_k(1.5, 50))
        g = fp.sampler([len(ids) - 1], Slot.greedy())
        d = fp.sampler([len(ids) - 1], Slot.dist(1.0, 3))
        out = await fp.execute()
        ctx.close()
        return out[t].token, out[g].token, out[d].ids

    sampled, greedy, dist = run(main())
    assert sampled in allowed and greedy in allowed
    assert not set(dist) <= set(allowed)  # dist sees the unmasked distribution


# -- speculation and working pages ----------------------------------------------------------------
def test_jacobi_style_loop_with_truncation_gives_the_greedy_text(qwen):
    model = qwen
    ids = _ids(model)
    steps = 24

    async def main():
        plain = Context(model).fill_tokens(ids)
        want = (await plain.generate(max_tokens=steps, stop=None)).tokens
        plain.close()
        ctx = Context(model)
        out = await ctx.forward().input_tokens(ids).execute()  # the prompt, no slot
        assert len(out) == 0
        ctx.truncate_working_page_tokens(1)  # the last prompt row is the first input below
        got: list[int] = []
        pending = ids[-1]
        guess = [want[1], 3, want[3]]  # a right draft, a wrong one, then what follows
        passes = 0
        while len(got) < steps:
            drafts = guess if len(got) == 0 else (want[len(got) + 1 : len(got) + 4] if passes % 2 else [1, 2])
            fp = ctx.forward().input_tokens([pending]).input_speculative_tokens(drafts)
            h = fp.sampler([0], Slot.greedy())
            out = await fp.execute()
            passes += 1
            new = out.tokens()
            assert out[h] == SlotToken(new[0]) and out.accepted == len(new) - 1
            ctx.truncate_working_page_tokens(len(drafts) - out.accepted)
            got.extend(new)
            pending = new[-1]
        assert ctx.token_ids == ids[:-1] + [ids[-1]] + got[: len(ctx.token_ids) - len(ids)]
        ctx.close()
        return want, got[:steps], passes

    want, got, passes = run(main())
    assert got == want
    assert passes < steps  # drafts were accepted


def test_working_pages_reserve_commit_release_truncate(qwen):
    model = qwen
    ps = model.pool.page_size
    ids = (_ids(model) * 8)[: ps * 2 + 5]

    async def main():
        ctx = Context(model)
        free = model.pool.available()
        ctx.reserve_working_pages(3)
        assert (ctx.working_page_count, ctx.committed_page_count) == (3, 0)
        assert model.pool.available() == free - 3
        await ctx.forward().input_tokens(ids).execute()
        assert ctx.working_page_token_count == len(ids) and ctx.working_page_count == 3
        with pytest.raises(WorkingPageError):
            ctx.commit_working_pages(3)  # only two are full
        ctx.commit_working_pages(2)
        assert (ctx.committed_page_count, ctx.working_page_count, ctx.working_page_token_count) == (2, 1, 5)
        with pytest.raises(WorkingPageError):
            ctx.truncate_working_page_tokens(6)
        ctx.truncate_working_page_tokens(2)
        assert ctx.working_page_token_count == 3 and ctx.working_page_count == 1
        # a fork shares the committed chain; its prefix is in the cache for a new context
        other = Context(model).fill_tokens(ids[: 2 * ps + 1])
        await other.flush()
        assert other.cached_rows == 2 * ps
        with pytest.raises(WorkingPageError):
            ctx.release_working_pages(2)
        ctx.release_working_pages(1)
        assert ctx.working_page_count == 0 and ctx.committed == 2 * ps
        other.close()
        ctx.close()
        assert model.pool.available() >= free

    run(main())


# -- bad input --------------------------------------------------------------------------------
def test_bad_passes_get_typed_errors_and_leave_the_context_usable(qwen, gemma, tiny_dir, tmp_path):
    model = qwen
    ids = _ids(model)

    async def main():
        ctx = Context(model)
        await ctx.forward().input_tokens(ids).execute()
        before = (ctx.committed, list(ctx.token_ids), ctx.working_page_count)
        kv = ctx.committed + 2

        async def refused(build, error):
            with pytest.raises(error):  # check() refuses what execute() does, running nothing
                build(ctx.forward()).check()
            fp = build(ctx.forward())
            with pytest.raises(error) as info:
                await fp.execute()
            assert (ctx.committed, list(ctx.token_ids), ctx.working_page_count) == before
            return info.value

        limit = model.max_model_len
        with pytest.raises(ForwardPassError, match="positions must be below"):
            ctx.forward().input_tokens([1], [limit])
        await refused(lambda fp: fp.input_tokens([1, 2]).attention_mask([[0, kv], [0, kv - 1]]), BrleError)
        await refused(lambda fp: fp.input_tokens([1, 2]).attention_mask([[0, kv]]), ForwardPassError)
        await refused(lambda fp: fp.input_tokens([1, 2]).attention_mask([[0, kv], [kv, 0]]), ForwardPassError)
        await refused(
            lambda fp: fp.input_tokens([1, 2]).attention_mask([[0, -1, kv + 1], [0, kv]]), BrleError
        )
        fp = ctx.forward().input_tokens([1, 2])
        fp.sampler([2], Slot.greedy())
        with pytest.raises(ForwardPassError, match="reads row 2"):
            fp.check()
        with pytest.raises(ForwardPassError, match="reads row 2"):
            await fp.execute()
        await refused(lambda fp: fp.input_tokens([1]).logit_mask([0, 5]), BrleError)
        with pytest.raises(WorkingPageError):
            ctx.commit_working_pages(ctx.working_page_count + 1)
        with pytest.raises(WorkingPageError):
            ctx.truncate_working_page_tokens(ctx.working_page_token_count + 1)
        with pytest.raises(OutOfPagesError):
            ctx.reserve_working_pages(model.pool.num_pages + 1)
        adapter = _tiny_adapter(gemma, tiny_dir, tmp_path / "lora")
        with pytest.raises(ForwardPassError, match="not loaded for this model"):
            ctx.forward().adapter(adapter)
        with pytest.raises(ForwardPassError):
            ctx.forward().input_tokens([model.arch.vocab_size])
        with pytest.raises(ContextLengthExceededError):
            ctx.forward().input_tokens([1] * (limit + 1), [0] * (limit + 1)).check()
        with pytest.raises(ContextLengthExceededError):
            await ctx.forward().input_tokens([1] * (limit + 1), [0] * (limit + 1)).execute()
        fp = ctx.forward().input_tokens([1])
        fp.check()  # a good pass passes, and check() runs nothing: the context is as it was
        assert (ctx.committed, list(ctx.token_ids)) == before[:2]
        running = asyncio.ensure_future(fp.execute())
        await asyncio.sleep(0)
        with pytest.raises(InvalidRequestError, match="await it first"):  # one pass at a time
            ctx.forward().input_tokens([2]).check()
        await running
        with pytest.raises(ForwardPassError, match="was executed"):
            fp.check()
        with pytest.raises(ForwardPassError, match="was executed"):
            await fp.execute()
        # still usable
        fp = ctx.forward().input_tokens([5])
        h = fp.sampler([0], Slot.greedy())
        assert isinstance((await fp.execute())[h], SlotToken)
        ctx.close()
        with pytest.raises(ContextClosedError):
            ctx.forward().input_tokens([1]).check()
        with pytest.raises(ContextClosedError):
            await ctx.forward().input_tokens([1]).execute()

    run(main())


def _tiny_adapter(model, tiny_dir, out):
    """A random LoRA adapter (peft's files) loaded for ``model``."""
    from fixtures.tiny_lora import build_adapter

    return model.load_adapter(build_adapter(model.path, out, seed=3))


def test_a_masked_pass_shares_the_forward_pass_with_plain_decodes(qwen):
    """A masked pass and plain generations of other contexts run in the same passes, and
    each gives what it gives alone."""
    model = qwen
    ids = _ids(model)
    n = len(ids)
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool))
    mask[5:, 1:4] = False

    async def alone():
        ctx = Context(model)
        logits = await _raw_logits_of_every_row(ctx, ids, mask=mask)
        ctx.close()
        g = Context(model).fill_tokens(ids[:9])
        text = (await g.generate(max_tokens=6, stop=None)).tokens
        g.close()
        return logits, text

    async def together():
        passes = model.scheduler.stats.passes
        g = Context(model).fill_tokens(ids[:9])
        ctx = Context(model)
        gen = asyncio.ensure_future(g.generate(max_tokens=6, stop=None))
        await asyncio.sleep(0)
        logits = await _raw_logits_of_every_row(ctx, ids, mask=mask)
        text = (await gen).tokens
        shared = model.scheduler.stats.passes - passes
        g.close()
        ctx.close()
        return logits, text, shared

    a_logits, a_text = run(alone())
    b_logits, b_text, shared = run(together())
    assert torch.allclose(a_logits, b_logits, atol=1e-5)
    assert a_text == b_text
    assert shared <= 7  # the masked pass rode along with the decode passes


# -- staged passes (Pie's pass speculation) -------------------------------------------------------
async def _decode_by_hand(model, ids: list[int], steps: int, *, speculate: bool, detour=None) -> list[int]:
    """Greedy decoding one hand-built pass per token; ``detour(ctx, i)`` may do something
    else between passes (a miss for the staged pass)."""
    ctx = Context(model)
    token, out_tokens = None, []
    pending = ids
    for i in range(steps):
        fp = ctx.forward().input_tokens(pending).pass_speculation(speculate)
        h = fp.sampler([len(pending) - 1], Slot.greedy())
        token = (await fp.execute())[h].token
        out_tokens.append(token)
        pending = [token]
        if detour is not None:
            pending = await detour(ctx, i, pending)
    ctx.close()
    return out_tokens


def test_staged_passes_hit_and_give_the_same_tokens(qwen):
    model = qwen
    ids = _ids(model)
    steps = 20

    async def main():
        c = model.counters
        plain = await _decode_by_hand(model, ids, steps, speculate=False)
        stats = model.scheduler.stats
        hits, misses, queued, overlapped = (
            c.staged_hits,
            c.staged_misses,
            stats.steps,
            stats.overlapped_passes,
        )
        with step_timing.TIMING.recording() as timing:
            staged = await _decode_by_hand(model, ids, steps, speculate=True)
            waits = dict(timing.counts), dict(timing.seconds)
        return (
            plain,
            staged,
            c.staged_hits - hits,
            c.staged_misses - misses,
            stats.steps - queued,
            stats.overlapped_passes - overlapped,
            waits,
        )

    plain, staged, hits, misses, queued, overlapped, (counts, seconds) = run(main())
    assert staged == plain
    assert hits == steps - 1  # every pass after the prompt's found its pass staged
    assert misses == 1  # the one staged after the last pass, dropped at close
    assert steps <= queued <= steps + 1  # no step queued twice: a hit awaits the staged one
    # queueing time (bench/forward_pass.py's): the prompt's pass queued, every hit too, each
    # from its execute to the worker's start of its pass (never below zero)
    assert counts["queue: a hand-built pass, execute to its pass's start"] == 1
    assert counts["queue: a hand-built pass, execute to its pass's start (staged hit)"] == hits
    assert all(v >= 0 for k, v in seconds.items() if k.startswith("queue: "))
    # a pass staged when its predecessor is claimed goes to the worker beside that one while
    # it runs (the scheduler wakes for it), not after: here a pass (~1 ms) outlasts the
    # caller's turn (~0.1 ms), so nearly every staged pass overlaps (1 without the wake)
    assert overlapped >= hits // 2, (overlapped, hits)


def test_a_late_claim_finds_the_next_pass_staged_beside_the_running_one(qwen):
    """A caller that takes its time between passes (an inferlet's guest: its turn runs on
    another thread) claims the staged pass while that pass runs; the pass it stages then
    must go to the worker beside the running one, not after it (the scheduler wakes for
    it), so the worker goes from pass to pass and the next claim waits for no queue."""
    model = qwen
    ids = _ids(model)
    steps = 16

    async def late(ctx, i, pending):
        for _ in range(3):  # past the scheduler's own turn after a pass, well within a pass
            await asyncio.sleep(0)
        return pending

    async def main():
        c, stats = model.counters, model.scheduler.stats
        plain = await _decode_by_hand(model, ids, steps, speculate=False)
        hits, overlapped = c.staged_hits, stats.overlapped_passes
        staged = await _decode_by_hand(model, ids, steps, speculate=True, detour=late)
        return plain, staged, c.staged_hits - hits, stats.overlapped_passes - overlapped

    plain, staged, hits, overlapped = run(main())
    assert staged == plain
    assert hits == steps - 1
    assert overlapped >= hits // 2, (overlapped, hits)


def test_staged_pass_misses_fall_back_to_the_same_tokens(qwen):
    """Between passes: another token than the one drawn, a truncation, a mask; each drops the
    staged pass and the loop goes on exactly as without staging."""
    model = qwen
    ids = _ids(model)
    steps = 12

    async def detour(ctx, i, pending):
        if i == 2:
            return [7]  # not the token drawn
        if i == 5:
            ctx.truncate_working_page_tokens(1)  # drop the last row: it is input again
            return [ctx_token_before(ctx), *pending]
        if i == 8:
            ctx.mask_token_range(1, 3)
        return pending

    last_rows: dict[int, int] = {}

    def ctx_token_before(ctx):
        return last_rows[id(ctx)]

    async def tracking(ctx, i, pending):
        last_rows[id(ctx)] = ctx.token_ids[-1]
        return await detour(ctx, i, pending)

    async def main():
        c = model.counters
        plain = await _decode_by_hand(model, ids, steps, speculate=False, detour=tracking)
        misses = c.staged_misses
        staged = await _decode_by_hand(model, ids, steps, speculate=True, detour=tracking)
        return plain, staged, c.staged_misses - misses

    plain, staged, misses = run(main())
    assert staged == plain
    assert misses >= 3


def test_a_closed_context_with_a_staged_pass_gives_its_pages_back(qwen):
    model = qwen
    ids = _ids(model)

    async def main():
        free = model.pool.available()
        ctx = Context(model)
        fp = ctx.forward().input_tokens(ids).pass_speculation(True)
        fp.sampler([len(ids) - 1], Slot.greedy())
        await fp.execute()
        assert ctx._staged is not None
        ctx.close()
        for _ in range(50):
            if model.pool.available() >= free:
                break
            await asyncio.sleep(0.02)
        return free

    free = run(main())
    assert model.pool.available() >= free


def test_generate_honours_rows_hidden_for_good(qwen):
    """``mask_token_range`` applies to the engine's own passes too: ``generate`` after it
    equals a hand-built loop whose every row's mask hides the same rows."""
    model = qwen
    ids = _ids(model)
    steps, hide = 10, (2, 9)

    async def main():
        a = Context(model).fill_tokens(ids)
        await a.flush()
        a.mask_token_range(*hide)
        got = (await a.generate(max_tokens=steps, stop=None)).tokens
        a.close()
        b = Context(model)
        await b.forward().input_tokens(ids).execute()
        b.truncate_working_page_tokens(1)
        pending, want = [ids[-1]], []
        for _ in range(steps):
            kv = b.committed + 1
            visible = torch.ones(kv, dtype=torch.bool)
            visible[hide[0] : hide[1]] = False
            fp = b.forward().input_tokens(pending).attention_mask(visible[None, :])
            h = fp.sampler([0], Slot.greedy())
            pending = [(await fp.execute())[h].token]
            want.append(pending[0])
        b.close()
        plain = Context(model).fill_tokens(ids)
        unmasked = (await plain.generate(max_tokens=steps, stop=None)).tokens
        plain.close()
        return got, want, unmasked

    got, want, unmasked = run(main())
    assert got == want
    assert got != unmasked  # the hidden rows mattered


def test_audio_at_an_anchor_equals_the_usual_span(gemma, samples):
    """Gemma-4: an audio clip's placeholder rows placed by hand (its delimiters the caller's
    tokens) are the rows and logits of ``append_audio``."""
    from media import Audio

    model = gemma
    clip = Audio.from_path(samples / "audio" / "tone_16k_mono.wav")
    head = model.tokenize("Listen:")

    async def main():
        prepared = model.prepare(clip)
        usual = Context(model).fill_tokens(head)
        usual.append_audio(prepared)
        usual.fill_tokens(head)
        want = await usual.flush(return_logits=True)
        rows = [(r.token, r.pos) for r in usual._rows]
        usual.close()
        ctx = Context(model)
        fp = ctx.forward().input_tokens(head + list(prepared.prefix_tokens))
        placed = fp.input_audio(prepared)
        fp.input_tokens(list(prepared.suffix_tokens) + head)
        first = fp.sampler(range(fp.num_rows), Slot.raw_logits())
        n = fp.num_rows
        out = await fp.execute()
        got = torch.stack([out[first + i].logits for i in range(n)])
        mine = [(r.token, r.pos) for r in ctx._rows]
        ctx.close()
        return prepared, placed, want, got, rows, mine

    prepared, placed, want, got, rows, mine = run(main())
    assert placed.token_count == prepared.token_count
    assert mine == rows
    assert torch.equal(got, want)


def test_staged_hits_and_misses_reach_metrics(qwen):
    """/metrics' ``pie_media_engine_staged_passes_total{result=...}`` counts what the engine
    counted (read at scrape time from the served model)."""
    from prometheus_client import generate_latest

    from api.http.metrics import ServiceMetrics
    from api.http.registry import ModelRegistry, ServedModel

    registry = ModelRegistry()
    registry.add(ServedModel("tiny-qwen3-vl", qwen, "chat", 4))
    metrics = ServiceMetrics(registry)

    def scraped() -> dict[str, float]:
        out = {}
        for line in generate_latest(metrics.registry).decode().splitlines():
            if line.startswith("pie_media_engine_staged_passes_total{"):
                out[line.split('result="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
        return out

    before = scraped()
    run(_decode_by_hand(qwen, _ids(qwen), 6, speculate=True))
    after = scraped()
    assert after["hit"] - before["hit"] == 5 and after["miss"] - before["miss"] == 1


def test_dropping_masked_pages_works_on_a_full_pool(tiny_dir):
    """The first drop needs the pool's hole page: with no free page left, one of the pages
    given up becomes it, so a full pool can still release pages (and then has some free)."""
    from engine import Model

    model = Model.load(tiny_dir(TINY_QWEN), kv_pages=4, device="cpu")
    ps = model.pool.page_size

    async def main():
        ctx = Context(model)
        await ctx.forward().input_tokens([5] * (4 * ps)).execute()
        assert model.pool.available() == 0
        ctx.mask_token_range(0, 3 * ps)
        dropped = ctx.drop_masked_kv_pages()
        free = model.pool.available()
        fp = ctx.forward().input_tokens([6])
        h = fp.sampler([0], Slot.greedy())
        token = (await fp.execute())[h].token
        ctx.close()
        return dropped, free, token

    dropped, free, token = run(main())
    assert (dropped, free) == (2, 2)  # three pages hidden: one became the hole, two went back
    assert 0 <= token < model.arch.vocab_size
