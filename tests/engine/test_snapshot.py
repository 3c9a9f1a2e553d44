"""Portable snapshots: a resumed context continues greedy generation exactly as the
original would (text and image, both families); bad bytes are typed errors."""

from __future__ import annotations

import pytest

from engine import (
    Context,
    NotASnapshotError,
    Sampler,
    SnapshotCorruptError,
    SnapshotModelMismatchError,
    SyncContext,
    max_tokens,
)
from media import Image
from tests.engine.test_parity_media import IMG_A

STEPS = 12


def _continue(ctx: SyncContext) -> list[int]:
    return ctx.generate(Sampler.greedy(), max_tokens(STEPS)).tokens


@pytest.mark.parametrize("family", ["qwen", "gemma"])
@pytest.mark.parametrize("with_image", [False, True])
def test_resumed_context_continues_exactly(request, family: str, with_image: bool) -> None:
    model = request.getfixturevalue(family)
    parts = ([Image.from_bytes(IMG_A)] if with_image else []) + ["Tell me about this."]

    original = SyncContext(model).system("Be brief.").user(*parts).cue()
    original.flush()  # committed rows and pending rows both survive
    original.fill("Well,")
    data = original.ctx.snapshot()
    want = _continue(original)
    original.user("And then?").cue()  # the chat state closes the turn and opens the next
    want_ids = original.ctx.token_ids
    original.close()

    resumed = SyncContext(Context.resume(model, data))
    assert _continue(resumed) == want
    resumed.user("And then?").cue()
    assert resumed.ctx.token_ids == want_ids
    resumed.close()


def test_sampling_state_survives(qwen) -> None:
    original = SyncContext(qwen, seed=9).user("Pick words.").cue()
    original.generate(Sampler.multinomial(1.0), max_tokens(3))  # advance the generator
    data = original.ctx.snapshot()
    want = original.generate(Sampler.multinomial(1.0), max_tokens(6)).tokens
    resumed = SyncContext(Context.resume(qwen, data))
    assert resumed.generate(Sampler.multinomial(1.0), max_tokens(6)).tokens == want
    original.close()
    resumed.close()


def test_bad_snapshots_are_typed_errors(qwen, gemma) -> None:
    ctx = SyncContext(qwen).user("Hi").cue()
    data = ctx.ctx.snapshot()
    ctx.close()
    with pytest.raises(NotASnapshotError):
        Context.resume(qwen, b"definitely not a snapshot")
    with pytest.raises(SnapshotCorruptError):
        Context.resume(qwen, data[:-40])  # truncated
    altered = bytearray(data)
    altered[len(altered) // 2] ^= 0xFF
    with pytest.raises(SnapshotCorruptError, match="checksum"):
        Context.resume(qwen, bytes(altered))
    with pytest.raises(SnapshotModelMismatchError):
        Context.resume(gemma, data)


def test_saved_export_import_round_trip(qwen, gemma) -> None:
    """``model.saved.export`` is a snapshot; ``import_`` saves the rebuilt context, which
    opens and continues exactly as the exported one."""
    ctx = SyncContext(qwen).user(Image.from_bytes(IMG_A), "Tell me about this.").cue()
    qwen.saved.save("pic", ctx.ctx)
    want = _continue(ctx)
    ctx.close()
    data = qwen.saved.export("pic")
    qwen.saved.delete("pic")
    qwen.saved.import_("pic2", data, model=qwen)
    opened = SyncContext(qwen.saved.open("pic2"))
    assert _continue(opened) == want
    opened.close()
    qwen.saved.delete("pic2")
    with pytest.raises(SnapshotModelMismatchError):
        gemma.saved.import_("x", data, model=gemma)
    assert "x" not in gemma.saved


@pytest.mark.parametrize("family", ["qwen", "gemma"])
def test_snapshot_with_kv_resumes_on_a_cold_model_computing_one_row(request, tiny_dir, family: str) -> None:
    """With ``include_kv`` a resume into another Model instance (empty prefix cache, as on
    another machine) computes only its last committed row again and continues exactly."""
    from engine import Model

    model = request.getfixturevalue(family)
    original = (
        SyncContext(model).system("Be brief.").user(Image.from_bytes(IMG_A), "Tell me about this.").cue()
    )
    original.flush()
    original.fill("Well,")  # pending rows travel as rows
    data = original.ctx.snapshot(include_kv=True)
    light = original.ctx.snapshot()
    committed = original.ctx.committed
    want = _continue(original)
    original.close()
    assert committed > 32 and len(data) > len(light)

    cold = Model.load(model.path, kv_pages=64, device="cpu")
    resumed = Context.resume(cold, data)
    assert resumed.committed == committed and len(resumed.pages) >= committed // cold.pool.page_size
    pending = resumed.pending  # "Well,"
    assert pending > 0
    before = cold.runner.rows_computed
    got = _continue(SyncContext(resumed))
    # The first pass computes only the pending rows, each later step one row.
    assert cold.runner.rows_computed - before == pending + len(got) - 1
    assert got == want
    resumed.close()
    # Without pending rows the last committed row is computed again (logits not stored).
    ctx = SyncContext(Context.resume(cold, data))
    ctx.ctx.truncate(committed)
    before = cold.runner.rows_computed
    ctx.generate(Sampler.greedy(), max_tokens(1))
    assert cold.runner.rows_computed - before == 1
    ctx.close()
    light_ctx = Context.resume(cold, light)
    assert light_ctx.committed == 0  # the light snapshot's rows are all pending
    light_ctx.close()


def test_kv_snapshot_into_another_dtype_is_a_typed_error(qwen, tiny_dir) -> None:
    import torch

    from engine import Model

    ctx = SyncContext(qwen).user("Hello there.").cue()
    ctx.flush()
    data = ctx.ctx.snapshot(include_kv=True)
    ctx.close()
    half = Model.load(qwen.path, kv_pages=16, device="cpu", dtype=torch.bfloat16)
    with pytest.raises(SnapshotModelMismatchError, match="dtype|resume without K/V"):
        Context.resume(half, data)
    assert half.pool.available() == 16


def test_default_sampler_and_stop_travel(qwen) -> None:
    """``ctx.sampler`` / ``ctx.stop`` (what generate uses when given nothing) survive a
    snapshot and a fork; the resumed context's plain ``generate()`` continues as the
    original's would."""
    from engine import stop_strings

    original = Context(qwen, seed=4)
    original.sampler = Sampler.top_k_top_p(0.9, 8, 0.95)
    original.stop = max_tokens(7) | stop_strings("\n\n", include=True)
    sync = SyncContext(original).user("Write a line.").cue()
    data = original.snapshot()
    assert original.fork().sampler == original.sampler
    want = sync.generate()
    resumed = Context.resume(qwen, data)
    assert resumed.sampler == original.sampler and resumed.stop == original.stop
    got = SyncContext(resumed).generate()
    assert got.tokens == want.tokens and got.finish_reason == want.finish_reason
    custom = Context(qwen)
    custom.sampler = Sampler.custom(lambda ids, ps: ids[0])
    assert Context.resume(qwen, custom.snapshot()).sampler is None  # code is not stored
    for c in (original, resumed, custom):
        c.close()
