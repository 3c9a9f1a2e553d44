"""The flashinfer attention backend and the choice of backend at load time.

Three layers:

* selection and lazy import (CPU, always run): ``attention="auto"`` picks torch on the
  CPU, ``"flashinfer"`` there raises a typed error, an unknown name raises, and neither
  ``import engine`` nor loading a model on the CPU imports flashinfer;
* the backend's own bookkeeping (page tables, the split of a pass into decode / prefill /
  custom-mask parts, one plan per pass and layer kind, query rows gathered and scattered
  back), run on the CPU in float32 against ``_FakeWrapper``: a stand-in for the two
  flashinfer wrappers written from flashinfer's documented semantics (see its docstring).
  This checks our side of the contract, not flashinfer's kernels;
* the real kernels (CUDA + flashinfer only, skipped otherwise): logits equal the torch
  backend's in bfloat16 within ``BF16_ATOL``; greedy tokens equal up to near-ties.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import AttentionBackendUnavailableError, Context, InvalidRequestError, Model, Sampler, SyncContext
from engine import attention_flashinfer as afi
from engine.attention import TORCH_BACKEND, BatchMeta, SeqMeta
from engine.attention_flashinfer import FlashInferBackend
from engine.attention_select import select_backend
from engine.kv_pool import KVPool, LayerLayout
from engine.stopping import max_tokens
from media import Image
from tests.engine.conftest import ATOL, TINY_GEMMA, TINY_QWEN, assert_logits_close
from tests.engine.fake_flashinfer import _FakeWrapper, installed
from tests.engine.test_parity_media import IMG_A

NAMES = [TINY_QWEN, TINY_GEMMA]
PROMPT = "Hello there, tell me a long story about a cat who lives in a small village near the sea."
REPO = Path(__file__).resolve().parents[2]


def _cuda_flashinfer() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    ok, why = afi.flashinfer_available()
    return ok, why


HAVE_FLASHINFER, WHY_NOT = _cuda_flashinfer()
needs_flashinfer = pytest.mark.skipif(not HAVE_FLASHINFER, reason=f"flashinfer kernels: {WHY_NOT}")

# bfloat16 tolerance on logits for the real kernels: flashinfer vs the torch backend, both
# bf16 with the same weights, so only attention differs. Both accumulate in fp32 but round
# to bf16 (relative step 2^-8) at different points (flashinfer's prefill kernel also
# rounds the softmax probabilities to bf16 before P.V), and every later bf16 layer carries
# the difference on.
# The tiny random models' logits lie within about ±1.3. Measured on the CPU with
# _FakeWrapper in bf16 (fp32 math, bf16 output, as the kernels' accumulators): max |Δ|
# 0.008 (Qwen3-VL) and 0.022 (Gemma-4, sliding layers) over prefill, chunks, decode, image
# and mixed passes. 0.05 leaves about 2x for the kernels' extra rounding. What it must
# catch: in the fp32 runs here a sliding window off by one moved logits by 0.85, no window
# by 0.93, a missing media-block mask by 0.64.
BF16_ATOL = 0.05
# Synthetic attention outputs (unit-variance bf16 inputs, |o| < ~3) against the torch
# backend in fp32 on the same values: bf16 output rounding alone gives 0.008 there (measured
# with _FakeWrapper in bf16 on the CPU, head dims 64 and 128); a mask error
# moves outputs by O(0.1-1).
BF16_ATTEND_ATOL = 3e-2


# ------------------------------------------------------------------------- selection


def test_auto_picks_torch_on_cpu(qwen):
    assert qwen.device.type == "cpu"
    assert qwen.attention_backend == "torch"
    assert qwen.runner.backend is TORCH_BACKEND


def test_flashinfer_on_cpu_raises_a_typed_error(tiny_dir):
    with pytest.raises(AttentionBackendUnavailableError) as err:
        Model.load(tiny_dir(TINY_QWEN), device="cpu", kv_pages=8, attention="flashinfer")
    e = err.value
    assert isinstance(e, InvalidRequestError)
    assert e.code == "attention_backend_unavailable"
    assert "flashinfer needs a CUDA device; this model is on cpu" in str(e)
    assert e.to_dict()["backend"] == "flashinfer"


def test_unknown_backend_raises(tiny_dir):
    with pytest.raises(
        InvalidRequestError, match=r"unknown attention backend 'bogus'.*auto, torch, flashinfer"
    ):
        Model.load(tiny_dir(TINY_QWEN), device="cpu", kv_pages=8, attention="bogus")
    with pytest.raises(InvalidRequestError, match="unknown attention backend"):  # speech too
        Model.load(tiny_dir("tiny-csm"), device="cpu", attention="bogus")


def test_selection_rules(monkeypatch):
    """The rule without a GPU: ``flashinfer_available`` is replaced, nothing is imported."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(afi, "flashinfer_available", lambda: (True, "flashinfer (stub)"))
    assert isinstance(select_backend("auto", device=cuda, dtype=torch.bfloat16), FlashInferBackend)
    assert isinstance(select_backend("flashinfer", device=cuda, dtype=torch.float16), FlashInferBackend)
    assert select_backend("torch", device=cuda, dtype=torch.bfloat16) is TORCH_BACKEND
    # float32: auto stays on torch, an explicit request says why it cannot be served
    assert select_backend("auto", device=cuda, dtype=torch.float32) is TORCH_BACKEND
    with pytest.raises(
        AttentionBackendUnavailableError, match="float16 or bfloat16; this model is torch.float32"
    ):
        select_backend("flashinfer", device=cuda, dtype=torch.float32)
    monkeypatch.setattr(afi, "flashinfer_available", lambda: (False, "flashinfer does not import (stub)"))
    assert select_backend("auto", device=cuda, dtype=torch.bfloat16) is TORCH_BACKEND
    with pytest.raises(AttentionBackendUnavailableError, match=r"does not import \(stub\)"):
        select_backend("flashinfer", device=cuda, dtype=torch.bfloat16)


def test_engine_never_imports_flashinfer_on_cpu():
    """In a fresh interpreter: import engine, load and run a model on the CPU (the backend
    module is not even imported), ask whether flashinfer is available; flashinfer is still
    not imported."""
    code = textwrap.dedent(
        """
        import sys
        import torch
        import engine
        from fixtures.tiny_models import ensure_tiny_model
        assert "flashinfer" not in sys.modules, "import engine imported flashinfer"
        m = engine.Model.load(ensure_tiny_model("tiny-qwen3-vl"), device="cpu", kv_pages=16)
        assert m.attention_backend == "torch", m.attention_backend
        ctx = engine.SyncContext(m).user("hi").cue()
        ctx.generate(engine.Sampler.greedy(), engine.max_tokens(2))
        assert "engine.attention_flashinfer" not in sys.modules, "the backend module was imported"
        import engine.attention_flashinfer as afi
        if not torch.cuda.is_available():
            ok, why = afi.flashinfer_available()
            assert not ok and "CUDA" in why, why
        assert "flashinfer" not in sys.modules, "flashinfer was imported"
        print("ok")
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


@pytest.fixture(scope="module")
def fake_flashinfer():
    with installed() as fake:
        yield fake


GEMMA_BLOCKS = "tiny-gemma4 + vision blocks"


@pytest.fixture(scope="module")
def gemma_blocks_dir(tmp_path_factory, tiny_dir) -> Path:
    """The tiny Gemma-4 with what its fixture leaves off (as test_gemma4_variants):
    bidirectional attention in image blocks on the sliding layers, and KV sharing."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from fixtures import tiny_gemma4

    cfg = tiny_gemma4.config_dict()
    cfg["text_config"] = {
        **cfg["text_config"],
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "num_kv_shared_layers": 2,
        "use_bidirectional_attention": "vision",
    }
    torch.manual_seed(7)
    hf = Gemma4ForConditionalGeneration(Gemma4Config(**cfg)).eval()
    folder = tmp_path_factory.mktemp("gemma4-blocks")
    hf.save_pretrained(folder)
    for f in tiny_dir(TINY_GEMMA).iterdir():
        if (
            f.is_file()
            and f.suffix != ".safetensors"
            and f.name not in ("config.json", "generation_config.json")
        ):
            shutil.copy(f, folder / f.name)
    return folder


@pytest.fixture(scope="module")
def blocks_ref(gemma_blocks_dir) -> Model:
    model = Model.load(gemma_blocks_dir, kv_pages=256, device="cpu")
    assert model.runner.block_overlay_layers == {0, 2}
    return model


@pytest.fixture(scope="module")
def fake_models(fake_flashinfer, gemma_blocks_dir, tiny_dir):
    """Second copies of the tiny models (own pools) running FlashInferBackend on the fake."""
    out = {}
    for name, src in [
        (TINY_QWEN, tiny_dir(TINY_QWEN)),
        (TINY_GEMMA, tiny_dir(TINY_GEMMA)),
        (GEMMA_BLOCKS, gemma_blocks_dir),
    ]:
        model = Model.load(src, kv_pages=512, device="cpu", attention="torch")
        model.runner.backend = FlashInferBackend("cpu", workspace_bytes=1024, head_dims=None)
        model.attention_backend = "flashinfer"
        out[name] = model
    return out


@pytest.fixture(scope="module")
def cpu_refs(models, blocks_ref) -> dict[str, Model]:
    return {**models, GEMMA_BLOCKS: blocks_ref}


# ------------------------------------------------------------- scenarios (fake and GPU)

Close = Callable[[torch.Tensor, torch.Tensor, str], None]


def _chat(model: Model) -> SyncContext:
    return SyncContext(model).system("You are terse.").user(PROMPT).cue()


def _image(model: Model) -> Any:
    if model.architecture == "Gemma4ForConditionalGeneration":
        return model.prepare(Image.from_bytes(IMG_A), max_soft_tokens=70)
    return Image.from_bytes(IMG_A)


def check_text_then_decode(ref: Model, ours: Model, close: Close, label: str, steps: int = 4) -> None:
    """A text prompt in one prefill pass, then ``steps`` one-row decode passes."""
    a, b = _chat(ref), _chat(ours)
    la, lb = a.flush(return_logits=True), b.flush(return_logits=True)
    close(lb, la, f"{label}: prefill")
    for i in range(steps):
        tok = int(la[-1].argmax())
        la = a.fill_tokens([tok]).flush(return_logits=True)
        lb = b.fill_tokens([tok]).flush(return_logits=True)
        close(lb, la, f"{label}: decode step {i}")
    a.close()
    b.close()


def check_chunked_prefill(ref: Model, ours: Model, close: Close, label: str, rows: int = 7) -> None:
    """Prefill in ``rows``-row chunks (causal chunks starting mid-context) vs one pass."""
    ids = _chat(ref).token_ids
    saved = ours.max_prefill_rows
    ours.max_prefill_rows = rows
    try:
        lb = SyncContext(ours).fill_tokens(ids).flush(return_logits=True)
    finally:
        ours.max_prefill_rows = saved
    la = SyncContext(ref).fill_tokens(ids).flush(return_logits=True)
    close(lb, la, f"{label}: {rows}-row prefill chunks")


def check_image(ref: Model, ours: Model, close: Close, label: str) -> None:
    a = SyncContext(ref).user(_image(ref), "Describe this image.").cue()
    b = SyncContext(ours).user(_image(ours), "Describe this image.").cue()
    assert a.token_ids == b.token_ids
    close(b.flush(return_logits=True), a.flush(return_logits=True), f"{label}: image prompt")
    a.close()
    b.close()


def _mixed_pass(model: Model) -> tuple[list[torch.Tensor], int]:
    """One forward pass holding two decode rows, a prefill chunk that starts mid-context
    and a fresh prompt with an image; returns each context's logits and the pass count."""

    async def go() -> tuple[list[torch.Tensor], int]:
        ctxs = [Context(model).user(f"Question {i}: what is the sea made of?").cue() for i in range(3)]
        for c in ctxs:
            await c.flush()
        ctxs[0].fill_tokens(model.tokenize(" Water")[:1])
        ctxs[1].fill_tokens(model.tokenize(" Salt")[:1])
        ctxs[2].fill_tokens(model.tokenize(" Mostly water, some salt and"))
        ctxs.append(Context(model).user(_image(model), "And this?").cue())
        assert [c.pending for c in ctxs[:2]] == [1, 1] and ctxs[2].pending > 1
        before = model.scheduler.stats.passes
        logits = await asyncio.gather(*(c.flush(return_logits=True) for c in ctxs))
        passes = model.scheduler.stats.passes - before
        for c in ctxs:
            c.close()
        return list(logits), passes

    return asyncio.run(go())


def check_mixed_batch(ref: Model, ours: Model, close: Close, label: str) -> None:
    la, pa = _mixed_pass(ref)
    lb, pb = _mixed_pass(ours)
    assert pa == pb == 1, (pa, pb)
    for i, (x, y) in enumerate(zip(lb, la, strict=True)):
        close(x, y, f"{label}: context {i} of a mixed pass")


def _masked_pass(model: Model) -> tuple[list[torch.Tensor], int]:
    """One forward pass holding a hand-built pass with its own attention mask (a row that
    sees a later row of its pass, a span hidden from the rows after it) beside a one-row
    decode step of another context and a fresh prompt: each context's logits, pass count."""
    from engine import Slot

    async def go() -> tuple[list[torch.Tensor], int]:
        plain = Context(model).user("What is the sea made of?").cue()
        await plain.flush()
        plain.fill_tokens(model.tokenize(" Water")[:1])
        fresh = Context(model).user(PROMPT).cue()
        masked = Context(model)
        ids = model.tokenize(PROMPT)
        n = len(ids)
        mask = torch.tril(torch.ones(n, n, dtype=torch.bool))
        mask[8:, 2:6] = False
        mask[3, 4] = True  # row 3 sees row 4, later in its own pass
        fp = masked.forward().input_tokens(ids).attention_mask(mask)
        first = fp.sampler(range(n), Slot.raw_logits())
        before = model.scheduler.stats.passes
        out, a, b = await asyncio.gather(
            fp.execute(), plain.flush(return_logits=True), fresh.flush(return_logits=True)
        )
        passes = model.scheduler.stats.passes - before
        for c in (plain, fresh, masked):
            c.close()
        return [torch.stack([out[first + i].logits for i in range(n)]), a, b], passes

    return asyncio.run(go())


def check_masked_pass(ref: Model, ours: Model, close: Close, label: str) -> None:
    la, pa = _masked_pass(ref)
    lb, pb = _masked_pass(ours)
    assert pa == pb == 1, (pa, pb)
    for what, x, y in zip(("masked pass", "decode row beside it", "prompt beside it"), lb, la, strict=True):
        close(x, y, f"{label}: {what}")


def check_concurrent_decodes(ref: Model, ours: Model, label: str, n: int = 12) -> None:
    """Several contexts generating together (batched decode passes): same tokens."""
    prompts = ["Say one thing.", PROMPT, "Another, somewhat longer, request about the sea and boats."]

    async def together(model: Model) -> list[list[int]]:
        ctxs = [Context(model).user(p).cue() for p in prompts]
        outs = await asyncio.gather(*(c.generate(Sampler.greedy(), max_tokens(n)) for c in ctxs))
        for c in ctxs:
            c.close()
        return [o.tokens for o in outs]

    before = ours.scheduler.stats.max_steps_in_pass
    assert asyncio.run(together(ours)) == asyncio.run(together(ref)), label
    assert max(before, ours.scheduler.stats.max_steps_in_pass) >= len(prompts)


def check_greedy(ref: Model, ours: Model, label: str, n: int = 16, atol: float | None = None) -> None:
    """Greedy tokens equal (``atol`` None), or, for low precision, each of ours is an
    argmax of the reference's logits along our path up to ``2 * atol``: when two logit
    vectors differ by at most atol, the argmax of one is within 2 atol of the other's
    maximum, so a near-tie may go either way and nothing else may."""
    a, b = _chat(ref), _chat(ours)
    prompt = b.token_ids
    ta = a.generate(Sampler.greedy(), max_tokens(n)).tokens
    tb = b.generate(Sampler.greedy(), max_tokens(n)).tokens
    a.close()
    b.close()
    if atol is None or tb == ta:
        assert tb == ta, f"{label}: greedy tokens differ"
        return
    c = SyncContext(ref).fill_tokens(prompt + tb[:-1])
    logits = c.flush(return_logits=True)[len(prompt) - 1 :]
    c.close()
    gaps = [float(row.max() - row[t]) for row, t in zip(logits, tb, strict=True)]
    assert max(gaps) <= 2 * atol, f"{label}: greedy token off the reference argmax by {max(gaps):.3g}"


# ------------------------------------------------------- the bookkeeping, on the fake


def _fp32_close(ours: torch.Tensor, ref: torch.Tensor, label: str) -> None:
    assert_logits_close(ours, ref, f"fake flashinfer vs torch: {label}", atol=ATOL)


@pytest.mark.parametrize("name", NAMES)
def test_fake_text_prefill_and_decode(models, fake_models, name):
    check_text_then_decode(models[name], fake_models[name], _fp32_close, name)


@pytest.mark.parametrize("name", NAMES)
def test_fake_chunked_prefill(models, fake_models, name):
    check_chunked_prefill(models[name], fake_models[name], _fp32_close, name)


@pytest.mark.parametrize("name", [*NAMES, GEMMA_BLOCKS])
def test_fake_image(cpu_refs, fake_models, name):
    check_image(cpu_refs[name], fake_models[name], _fp32_close, name)


@pytest.mark.parametrize("name", [*NAMES, GEMMA_BLOCKS])
def test_fake_mixed_pass(cpu_refs, fake_models, name):
    check_mixed_batch(cpu_refs[name], fake_models[name], _fp32_close, name)


@pytest.mark.parametrize("name", [*NAMES, GEMMA_BLOCKS])
def test_fake_masked_pass_beside_plain_rows(cpu_refs, fake_models, name):
    """A hand-built pass's own mask reaches flashinfer's custom-mask plan; the decode row
    and the prompt in the same pass keep their plans."""
    _FakeWrapper.calls.clear()
    check_masked_pass(cpu_refs[name], fake_models[name], _fp32_close, name)
    assert ("plan", "custom") in _FakeWrapper.calls


@pytest.mark.parametrize("name", NAMES)
def test_fake_concurrent_decodes_and_greedy(models, fake_models, name):
    check_concurrent_decodes(models[name], fake_models[name], name)
    check_greedy(models[name], fake_models[name], name)


def test_one_plan_per_pass_and_layer_kind(fake_models):
    """Gemma-4 has two layer kinds (sliding, full): a prefill pass plans the prefill
    wrapper once per kind and runs it in every layer; with an image and bidirectional
    blocks the sliding layers plan a custom mask instead."""
    model = fake_models[TINY_GEMMA]
    n_layers = model.hf.config.text_config.num_hidden_layers
    _FakeWrapper.calls.clear()
    ctx = _chat(model)
    ctx.flush(return_logits=True)  # (return_logits: no prefix cache, every row is computed)
    assert _FakeWrapper.calls.count(("plan", "prefill")) == 2
    assert sum(1 for c in _FakeWrapper.calls if c[0] == "run") == n_layers
    _FakeWrapper.calls.clear()
    plans = model.runner.backend.plans  # the counter bench/gpu/profile_decode.py reads
    ctx.fill_tokens([5]).flush(return_logits=True)
    assert _FakeWrapper.calls.count(("plan", "decode")) == 2
    assert model.runner.backend.plans - plans == 2
    assert [c for c in _FakeWrapper.calls if c[0] == "run"] == [("run", "_FakeDecode")] * n_layers
    ctx.close()
    model = fake_models[GEMMA_BLOCKS]
    _FakeWrapper.calls.clear()
    ctx = SyncContext(model).user(_image(model), "Describe this image.").cue()
    ctx.flush(return_logits=True)
    plans = [c[1] for c in _FakeWrapper.calls if c[0] == "plan"]
    assert sorted(plans) == ["custom", "prefill"]  # sliding layers: custom; full: prefill
    assert sum(1 for c in _FakeWrapper.calls if c[0] == "run") == 4
    ctx.close()


def _synthetic_meta(
    page_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: str
) -> tuple[BatchMeta, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer, five sequences in one pass: two decodes, a fresh prefill, a prefill
    chunk starting mid-context (mid-page), and a chunk with a media block. K/V of the
    earlier rows are random; this pass's rows come with the returned key/value."""
    torch.manual_seed(0)
    pool = KVPool(
        [LayerLayout(kv_heads, head_dim)], num_pages=64, page_size=page_size, dtype=dtype, device=device
    )
    kc, vc = pool.kv(0)
    kc.normal_()
    vc.normal_()
    shapes = [(37, 1), (5, 1), (0, 23), (19, 9), (3, 14)]  # (kv_start, q_len)
    pages = torch.randperm(64)
    seqs, slots, at, q_start = [], [], 0, 0
    for kv_start, q_len in shapes:
        n = -(-(kv_start + q_len) // page_size)
        table = pages[at : at + n]
        at += n
        rows = torch.arange(kv_start, kv_start + q_len)
        slots.append(table[rows // page_size] * page_size + rows % page_size)
        seqs.append(SeqMeta(q_start=q_start, q_len=q_len, kv_start=kv_start, pages=table.to(device)))
        q_start += q_len
    blocks = torch.full((14,), -1)
    blocks[2:11] = 0  # a 9-row media block inside the last chunk
    seqs[-1].block_ids = blocks.to(device)
    meta = BatchMeta(
        pool=pool, seqs=seqs, slots=torch.cat(slots).to(device), block_overlay_layers=frozenset({0})
    )
    n_rows = q_start
    key = torch.randn(1, kv_heads, n_rows, head_dim, dtype=dtype, device=device)
    value = torch.randn(1, kv_heads, n_rows, head_dim, dtype=dtype, device=device)
    return meta, key, value, torch.randn(1, 2 * kv_heads, n_rows, head_dim, dtype=dtype, device=device)


VARIANTS = [
    pytest.param(None, None, False, id="causal"),
    pytest.param(8, None, False, id="window8"),
    pytest.param(None, 5.0, False, id="softcap"),
    pytest.param(8, 5.0, True, id="window8-softcap-blocks"),
    pytest.param(None, None, True, id="blocks"),
]


def _attend_both(
    backend: FlashInferBackend, device: str, dtype: torch.dtype, page_size: int, head_dim: int, variant: tuple
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ours, the torch backend's in float32 on the same values) for one synthetic pass."""
    window, softcap, blocks = variant
    meta, key, value, query = _synthetic_meta(page_size, 2, head_dim, dtype, device)
    if not blocks:
        meta.block_overlay_layers = frozenset()
    backend.write(meta, 0, key, value)
    pool = meta.pool
    ref_pool = KVPool(pool.layers, num_pages=pool.num_pages, page_size=page_size, device=device)
    ref_pool.kv(0)[0].copy_(pool.kv(0)[0])
    ref_pool.kv(0)[1].copy_(pool.kv(0)[1])
    ref_meta = BatchMeta(
        pool=ref_pool, seqs=meta.seqs, slots=meta.slots, block_overlay_layers=meta.block_overlay_layers
    )
    kw = {"scaling": head_dim**-0.5, "sliding_window": window, "softcap": softcap}
    ours = backend.attend(meta, 0, query, **kw)
    theirs = TORCH_BACKEND.attend(ref_meta, 0, query.float(), **kw)
    assert ours.shape == theirs.shape and ours.dtype == dtype
    return ours.float(), theirs


@pytest.mark.parametrize("variant", [p.values for p in VARIANTS], ids=[p.id for p in VARIANTS])
def test_fake_attend_equals_torch_attend(fake_flashinfer, variant):
    """Window, softcap and media blocks on a synthetic pool (GQA 4:2, page size 4)."""
    backend = FlashInferBackend("cpu", workspace_bytes=1024, head_dims=None)
    ours, theirs = _attend_both(backend, "cpu", torch.float32, 4, 8, variant)
    assert (ours - theirs).abs().max().item() < 1e-5


# --------------------------------------------------------------- the real kernels (GPU)


def _bf16_close(ours: torch.Tensor, ref: torch.Tensor, label: str) -> None:
    assert_logits_close(ours, ref, f"flashinfer vs torch, bf16: {label}", atol=BF16_ATOL)


@pytest.fixture(scope="module")
def gpu_pairs(gemma_blocks_dir, tiny_dir):
    """Per tiny model: (torch backend, flashinfer backend), both bfloat16 on CUDA."""
    if not HAVE_FLASHINFER:
        pytest.skip(f"flashinfer kernels: {WHY_NOT}")
    out = {}
    for name, src in [
        (TINY_QWEN, tiny_dir(TINY_QWEN)),
        (TINY_GEMMA, tiny_dir(TINY_GEMMA)),
        (GEMMA_BLOCKS, gemma_blocks_dir),
    ]:
        ref = Model.load(src, kv_pages=512, dtype=torch.bfloat16, attention="torch")
        ours = Model.load(src, kv_pages=512, dtype=torch.bfloat16, attention="flashinfer")
        assert ours.attention_backend == "flashinfer" and ours.device.type == "cuda"
        # The tiny models' head sizes (16, 32) are outside KERNEL_HEAD_DIMS, so by default
        # their layers would fall back to torch attention; send every layer to flashinfer so
        # these tests exercise its kernels (a failure here may mean no kernel for the size).
        ours.runner.backend = FlashInferBackend("cuda", head_dims=None)
        out[name] = (ref, ours)
    return out


@needs_flashinfer
def test_gpu_auto_picks_flashinfer_for_bf16_and_torch_for_fp32(tiny_dir):
    assert (
        Model.load(tiny_dir(TINY_QWEN), kv_pages=16, dtype=torch.bfloat16).attention_backend == "flashinfer"
    )
    assert Model.load(tiny_dir(TINY_QWEN), kv_pages=16).attention_backend == "torch"  # float32


@needs_flashinfer
@pytest.mark.parametrize("variant", [p.values for p in VARIANTS], ids=[p.id for p in VARIANTS])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_attend_equals_torch_attend(variant, head_dim):
    """The kernels on a synthetic pool (GQA 4:2, page size 16) at head dims flashinfer
    ships kernels for, against the torch backend in fp32 on the same bf16 values."""
    backend = FlashInferBackend("cuda")
    ours, theirs = _attend_both(backend, "cuda", torch.bfloat16, 16, head_dim, variant)
    assert (ours - theirs).abs().max().item() < BF16_ATTEND_ATOL


@needs_flashinfer
@pytest.mark.parametrize("name", NAMES)
def test_gpu_text_prefill_and_decode(gpu_pairs, name):
    check_text_then_decode(*gpu_pairs[name], _bf16_close, f"{name} bf16")


@needs_flashinfer
def test_gpu_qwen_image(gpu_pairs):
    check_image(*gpu_pairs[TINY_QWEN], _bf16_close, "qwen bf16")


@needs_flashinfer
@pytest.mark.parametrize("name", NAMES)
def test_gpu_chunked_prefill(gpu_pairs, name):
    check_chunked_prefill(*gpu_pairs[name], _bf16_close, f"{name} bf16")


@needs_flashinfer
@pytest.mark.parametrize("name", NAMES)
def test_gpu_batch_of_contexts(gpu_pairs, name):
    check_mixed_batch(*gpu_pairs[name], _bf16_close, f"{name} bf16")


@needs_flashinfer
@pytest.mark.parametrize("name", [TINY_GEMMA, GEMMA_BLOCKS])
def test_gpu_gemma_sliding_window_and_image_blocks(gpu_pairs, name):
    """Gemma-4 image prompts longer than the sliding window; with ``GEMMA_BLOCKS`` the
    sliding layers' image rows see each other both ways (custom-mask plans) and two
    layers read shared K/V."""
    ref, ours = gpu_pairs[name]
    ctx = SyncContext(ref).user(_image(ref), "Describe this image.").cue()
    assert len(ctx) > ref.hf.config.text_config.sliding_window  # the window bites
    ctx.close()
    check_image(ref, ours, _bf16_close, f"{name} bf16")
    check_mixed_batch(ref, ours, _bf16_close, f"{name} bf16")


@needs_flashinfer
@pytest.mark.parametrize("name", [*NAMES, GEMMA_BLOCKS])
def test_gpu_masked_pass_beside_plain_rows(gpu_pairs, name):
    check_masked_pass(*gpu_pairs[name], _bf16_close, f"{name} bf16")


@needs_flashinfer
@pytest.mark.parametrize("name", NAMES)
def test_gpu_greedy_16_tokens(gpu_pairs, name):
    check_greedy(*gpu_pairs[name], f"{name} bf16", n=16, atol=BF16_ATOL)


def test_head_sizes_without_kernels_use_torch_attention():
    """A layer whose head size flashinfer ships no kernel for is attended by the torch
    backend (no flashinfer call, so this runs on the CPU without it)."""
    backend = FlashInferBackend("cpu", workspace_bytes=1024)  # default: 64/128/256 only
    meta, key, value, query = _synthetic_meta(16, 2, 32, torch.float32, "cpu")
    backend.write(meta, 0, key, value)
    kw = {"scaling": 32**-0.5, "sliding_window": None, "softcap": None}
    ours = backend.attend(meta, 0, query, **kw)
    assert torch.equal(ours, TORCH_BACKEND.attend(meta, 0, query, **kw))
    assert backend.num_wrappers == 0  # flashinfer was never asked
