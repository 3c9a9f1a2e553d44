"""KV-cache quantization (``Model.load(kv_dtype=...)``, ``engine.kv_quant``).

Bounds, justified:

* Element level (exact arithmetic, checked on random data): int8 with a scale per (row,
  kv head) ``s = max|x| / 127`` rounds ``x / s`` to the nearest integer in [-127, 127],
  so ``|deq - x| <= s / 2 = max|x| / 254`` in every element (~0.4% of the head's largest
  value). fp8 e4m3 with ``s = max|x| / 448`` has 3 mantissa bits: ``|deq - x| <= |x| *
  2^-4 + s * 2^-10`` (relative half-ulp for normals, half the subnormal spacing below).
* Logits (both tiny families, a prompt with an image, float32 model): every prefill row's
  logits and 16 teacher-forced decode steps (the float model's greedy tokens fed to both,
  so the comparison never drifts onto another text) against the float32 KV model. int8's
  per-element error is ~15x smaller than fp8's (1/254 vs 1/16 relative), which the bounds
  follow. The tiny Gemma-4 is a random model with many near-ties: even bfloat16 KV (2^-9
  relative) flips 1.4% of its prefill top-1s there (measured), so its bounds are looser.
  Measured (cosine / max |err| over max |logit| / top-1, prefill then decode):
  qwen int8 0.999997 / 0.0044 / 1.0, 0.999999 / 0.0011 / 1.0; qwen fp8 0.99991 / 0.021 /
  1.0, 0.99995 / 0.008 / 1.0; gemma int8 0.99992 / 0.031 / 0.96, 0.9996 / 0.049 / 0.94;
  gemma fp8 0.9981 / 0.18 / 0.87, 0.9937 / 0.16 / 0.81. A broken scale (wrong axis,
  missing dequantization) gives cosine far below every bound.
* Free-running greedy (32 tokens): qwen int8 and fp8 equal the float KV tokens for all 32
  (asserted: >= 24); gemma int8 equal for the first 12 (asserted >= 8), gemma fp8 differs
  from the first token on (a near-tie; not asserted, only its logits bounds above).
"""

from __future__ import annotations

import pytest
import torch

from engine import (
    AttentionBackendUnavailableError,
    Context,
    InvalidRequestError,
    Model,
    SnapshotModelMismatchError,
    SyncContext,
    attention_select,
)
from engine.attention_flashinfer import FlashInferBackend
from engine.decode_graphs import DecodeGraphs
from engine.kv_pool import KVPool, LayerLayout, bytes_per_page
from engine.kv_quant import KVFormat, dequantize, quantize_rows, resolve_kv_dtype
from media import Image
from tests.engine.conftest import TINY_GEMMA, TINY_QWEN
from tests.engine.fake_flashinfer import installed
from tests.engine.test_parity_media import IMG_A

NAMES = [TINY_QWEN, TINY_GEMMA]
STEPS = 16
BOUNDS = {  # (family, kv_dtype): (min cosine, max |err| / max |logit|, min top-1 agreement)
    (TINY_QWEN, "int8"): (0.9999, 0.02, 1.0),
    (TINY_QWEN, "fp8_e4m3"): (0.999, 0.06, 0.95),
    (TINY_GEMMA, "int8"): (0.999, 0.10, 0.85),
    (TINY_GEMMA, "fp8_e4m3"): (0.99, 0.35, 0.7),
}
GREEDY_PREFIX = {(TINY_QWEN, "int8"): 24, (TINY_QWEN, "fp8_e4m3"): 24, (TINY_GEMMA, "int8"): 8}


@pytest.fixture(scope="module")
def kv_models(tiny_dir):
    return {
        (name, kv): Model.load(tiny_dir(name), kv_pages=256, device="cpu", kv_dtype=kv)
        for name in NAMES
        for kv in ("int8", "fp8_e4m3")
    }


def _prompt(model: Model) -> SyncContext:
    return (
        SyncContext(model).system("Be brief.").user(Image.from_bytes(IMG_A), "What is in this picture?").cue()
    )


def _forced(model: Model, forced: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(prefill logits of every row, logits of STEPS decode steps, the greedy tokens); with
    ``forced`` those tokens are fed instead of the model's own."""
    ctx = _prompt(model)
    prefill = ctx.flush(return_logits=True)
    last, steps, tokens = prefill[-1], [], []
    for i in range(STEPS):
        tokens.append(int(last.argmax()))
        ctx.fill_tokens([tokens[-1] if forced is None else forced[i]])
        last = ctx.flush(return_logits=True)[-1]
        steps.append(last)
    ctx.close()
    return prefill, torch.stack(steps), tokens


def _agreement(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    cos = torch.nn.functional.cosine_similarity(got.double().flatten(), ref.double().flatten(), dim=0).item()
    rel = ((got - ref).abs().max() / ref.abs().max()).item()
    top1 = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return cos, rel, top1


# ------------------------------------------------------------------ element-level bounds
def test_int8_and_fp8_rows_within_their_bounds():
    torch.manual_seed(0)
    x = torch.randn(64, 4, 32) * torch.logspace(-3, 2, 64)[:, None, None]  # rows of every scale
    x[3, 1] = 0.0  # an all-zero head: stored as zeros, no division by zero
    int8 = resolve_kv_dtype("int8", torch.float32)
    q, s = quantize_rows(x, int8)
    assert q.dtype == torch.int8 and s.shape == (64, 4)
    err = (dequantize(q, s, torch.float32) - x).abs()
    amax = x.abs().amax(-1, keepdim=True)
    assert bool((err <= amax / 254 * (1 + 1e-5) + 1e-30).all())
    assert bool((dequantize(q, s, torch.float32)[3, 1] == 0).all())
    fp8 = resolve_kv_dtype("fp8_e4m3", torch.float32)
    q, s = quantize_rows(x, fp8)
    assert q.dtype == torch.float8_e4m3fn
    err = (dequantize(q, s, torch.float32) - x).abs()
    assert bool((err <= x.abs() * 2**-4 + s[..., None] * 2**-10 + 1e-30).all())


def test_unknown_kv_dtype_is_a_typed_error(tiny_dir):
    for bad in ("int4", "fp8_e5m2", "float64"):
        with pytest.raises(InvalidRequestError, match="kv_dtype"):
            resolve_kv_dtype(bad, torch.float32)
    with pytest.raises(InvalidRequestError, match="unknown kv_dtype 'int4'"):
        Model.load(tiny_dir(TINY_QWEN), device="cpu", kv_pages=8, kv_dtype="int4")
    with pytest.raises(InvalidRequestError):
        KVPool([LayerLayout(2, 8)], num_pages=2, kv_dtype="bogus")
    assert resolve_kv_dtype("auto", torch.bfloat16).storage == torch.bfloat16
    assert resolve_kv_dtype(None, torch.float16).name == "float16"


# ------------------------------------------------------------------------------ the pool
def test_capacity_in_rows_for_the_same_memory():
    """2B-shaped layers (8 kv heads x 128): bf16 -> int8 is 256 / (128 + 4 scale bytes) =
    1.94x the rows, float32 -> int8 512 / 132 = 3.88x."""
    layers = [LayerLayout(8, 128)] * 28
    budget = 64 << 20

    def rows(kv: str, dtype: torch.dtype) -> int:
        return budget // bytes_per_page(layers, 16, resolve_kv_dtype(kv, dtype)) * 16

    assert rows("int8", torch.bfloat16) / rows("auto", torch.bfloat16) == pytest.approx(256 / 132, rel=0.01)
    assert rows("int8", torch.float32) / rows("auto", torch.float32) == pytest.approx(512 / 132, rel=0.01)
    assert rows("fp8_e4m3", torch.bfloat16) == rows("int8", torch.bfloat16)
    per_layer_fp8 = KVFormat("fp8_e4m3", torch.float8_e4m3fn, "tensor")  # flashinfer's: no row scales
    assert bytes_per_page(layers, 16, per_layer_fp8) * 2 == bytes_per_page(layers, 16, torch.bfloat16)


def test_model_pool_holds_more_rows(tiny_dir):
    """Same kv_memory, the tiny models' real layouts (small heads, so scales weigh more)."""
    for name in NAMES:
        base = Model.load(tiny_dir(name), device="cpu", kv_memory=4 << 20)
        q = Model.load(tiny_dir(name), device="cpu", kv_memory=4 << 20, kv_dtype="int8")
        a, b = base.pool_stats(), q.pool_stats()
        assert (a.kv_dtype, b.kv_dtype) == ("float32", "int8 (per-row scales)")
        assert b.bytes_per_page * b.num_pages <= 4 << 20
        assert 3.0 < b.capacity_rows / a.capacity_rows < 4.0, (a.capacity_rows, b.capacity_rows)
        m = q.metrics()
        assert (m.kv_capacity_rows, m.kv_dtype) == (b.capacity_rows, b.kv_dtype)
        assert "kv_dtype=int8" in repr(q) and q.pool.k[0].dtype == torch.int8


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_copy_page_and_tails_carry_the_scales(kv):
    pool = KVPool(
        [LayerLayout(2, 8), LayerLayout(2, 8, shares_with=0)], num_pages=4, page_size=4, kv_dtype=kv
    )
    torch.manual_seed(1)
    key, value = torch.randn(4, 2, 8) * 5, torch.randn(4, 2, 8) / 7
    a, b, c = pool.allocate(3)
    pool.write(0, torch.arange(4) + a * 4, key, value)
    want = pool.read(0, torch.arange(4) + a * 4, torch.float32)
    assert (want[0] - key).abs().max() < 5 * 0.2 and (want[1] - value).abs().max() < 0.1
    pool.copy_page(a, b, rows=3)
    got = pool.read_pages(1, torch.tensor([b]), 3, torch.float32)  # layer 1 reads layer 0's pages
    assert torch.equal(got[0], want[0][:3]) and torch.equal(got[1], want[1][:3])
    pool.put_tail(b"t", a, 2, "out")
    pool.write(0, torch.arange(4) + a * 4, key * 100, value * 100)  # the source is rewritten
    assert pool.take_tail(b"t", c) == (2, "out")
    got = pool.read_pages(0, torch.tensor([c]), 2, torch.float32)
    assert torch.equal(got[0], want[0][:2]) and torch.equal(got[1], want[1][:2])


# ------------------------------------------------------------------ logits on both families
@pytest.mark.parametrize(("name", "kv"), list(BOUNDS))
def test_logits_close_to_float_kv_with_an_image(models, kv_models, name, kv):
    model = kv_models[name, kv]
    assert model.pool.kv_format.quantized and model.attention_backend == "torch"
    ref_prefill, ref_steps, tokens = _forced(models[name])
    prefill, steps, _ = _forced(model, tokens)
    assert prefill.shape == ref_prefill.shape and prefill.shape[0] > 20  # image rows included
    want_cos, want_rel, want_top1 = BOUNDS[name, kv]
    for label, got, ref in (("prefill", prefill, ref_prefill), ("decode", steps, ref_steps)):
        cos, rel, top1 = _agreement(got, ref)
        print(f"{name} {kv} {label}: cosine {cos:.6f}  max rel err {rel:.4f}  top-1 {top1:.3f}")
        assert cos >= want_cos and rel <= want_rel and top1 >= want_top1, (label, cos, rel, top1)


@pytest.mark.parametrize(("name", "kv"), list(GREEDY_PREFIX))
def test_greedy_tokens_equal_float_kv(models, kv_models, name, kv):
    ref = _prompt(models[name]).generate(max_tokens=32).tokens
    got = _prompt(kv_models[name, kv]).generate(max_tokens=32).tokens
    same = next(
        (i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), min(len(ref), len(got))
    )
    print(f"{name} {kv}: greedy tokens equal for the first {same} of 32")
    assert same >= GREEDY_PREFIX[name, kv]


# ------------------------------------------- forks, prefix cache, snapshots on quantized K/V
@pytest.mark.parametrize("name", NAMES)
def test_fork_prefix_cache_and_snapshot_together(kv_models, name):
    model = kv_models[name, "int8"]
    base = _prompt(model)
    base.flush()
    fork = base.fork()
    want = base.generate(max_tokens=8).tokens
    assert fork.generate(max_tokens=8).tokens == want  # the fork's copy-on-write pages + scales

    computed = model.runner.rows_computed
    again = _prompt(model)  # the same prefix: taken from the prefix cache (and tail)
    again.flush()
    assert model.runner.rows_computed - computed < 10
    data = again.snapshot(include_kv=True)
    assert again.generate(max_tokens=8).tokens == want

    resumed = SyncContext(Context.resume(model, data))
    assert resumed.generate(max_tokens=8).tokens == want
    for c in (base, fork, again, resumed):
        c.close()


def test_snapshot_kv_dtype_mismatch_is_refused(models, kv_models):
    int8 = kv_models[TINY_QWEN, "int8"]
    ctx = _prompt(int8)
    ctx.flush()
    with_kv, without = ctx.snapshot(include_kv=True), ctx.snapshot()
    want = ctx.generate(max_tokens=4).tokens
    ctx.close()
    with pytest.raises(SnapshotModelMismatchError, match=r"int8 \(per-row scales\).*torch\.float32") as e:
        Context.resume(models[TINY_QWEN], with_kv)
    assert e.value.details["model_kv_dtype"] == "torch.float32"
    with pytest.raises(SnapshotModelMismatchError, match="fp8_e4m3"):
        Context.resume(kv_models[TINY_QWEN, "fp8_e4m3"], with_kv)
    other = SyncContext(Context.resume(models[TINY_QWEN], without))  # no K/V: any pool
    assert len(other.generate(max_tokens=4).tokens) == len(want)
    other.close()


# ------------------------------------------------ flashinfer's fp8 path, rehearsed on the CPU
@pytest.fixture(scope="module")
def fake_flashinfer():
    with installed() as fake:
        yield fake


FP8_PER_LAYER = KVFormat("fp8_e4m3", torch.float8_e4m3fn, "tensor")


def _on_fake(tiny_dir, name: str, *, graphs: bool = False) -> Model:
    """The pool flashinfer gets (fp8, one scale per layer), attended by the stand-in."""
    model = Model.load(tiny_dir(name), kv_pages=256, device="cpu", attention="torch", kv_dtype=FP8_PER_LAYER)
    model.runner.backend = FlashInferBackend("cpu", workspace_bytes=1024, head_dims=None)
    model.attention_backend = "flashinfer"
    if graphs:
        model.runner.graphs = DecodeGraphs(model.runner, max_batch=4, capture=False)
    return model


@pytest.mark.parametrize("name", NAMES)
def test_flashinfer_fp8_bookkeeping_on_the_stand_in(fake_flashinfer, tiny_dir, name):
    """The flashinfer backend (and graph decode) on an fp8 pool: planned with the fp8
    kv_data_type, run with k_scale / v_scale, equal to the torch backend reading the same
    pages; the per-layer pool is what Model.load builds when flashinfer is chosen."""
    torch_model = Model.load(
        tiny_dir(name), kv_pages=256, device="cpu", attention="torch", kv_dtype=FP8_PER_LAYER
    )
    assert torch_model.pool.k_scale[0].dim() == 0
    fi, graphs = _on_fake(tiny_dir, name), _on_fake(tiny_dir, name, graphs=True)
    ref = _prompt(torch_model).flush(return_logits=True)
    got = _prompt(fi).flush(return_logits=True)
    assert (got - ref).abs().max().item() < 1e-3
    fake_flashinfer.BatchDecodeWithPagedKVCacheWrapper.calls.clear()
    want = [_prompt(torch_model).generate(max_tokens=6).tokens for _ in range(2)]
    assert [_prompt(fi).generate(max_tokens=6).tokens for _ in range(2)] == want
    assert [_prompt(graphs).generate(max_tokens=6).tokens for _ in range(2)] == want
    assert graphs.runner.graphs.replays > 0


def test_int8_kv_stays_off_flashinfer(monkeypatch, tiny_dir):
    """flashinfer has no int8 K/V kernels: "auto" keeps the torch backend, "flashinfer"
    is refused with the reason (CUDA and flashinfer pretended present)."""
    monkeypatch.setattr(attention_select, "_flashinfer_unusable", lambda device, dtype: None)
    cuda, int8 = torch.device("cuda"), resolve_kv_dtype("int8", torch.bfloat16)
    assert (
        attention_select.select_backend("auto", device=cuda, dtype=torch.bfloat16, kv_format=int8).name
        == "torch"
    )
    with pytest.raises(AttentionBackendUnavailableError, match="not kv_dtype int8"):
        attention_select.select_backend("flashinfer", device=cuda, dtype=torch.bfloat16, kv_format=int8)
    fp8 = resolve_kv_dtype("fp8_e4m3", torch.bfloat16)
    assert attention_select._kv_unusable(torch.bfloat16, fp8) is None
    with pytest.raises(AttentionBackendUnavailableError):  # on the CPU: no flashinfer at all
        monkeypatch.undo()
        Model.load(tiny_dir(TINY_QWEN), device="cpu", kv_pages=8, kv_dtype="fp8_e4m3", attention="flashinfer")


# ------------------------------------------------------------- --kv-cache-dtype to the pool
def test_kv_cache_dtype_flag_reaches_model_load(monkeypatch, tmp_path):
    import uvicorn
    from fastapi.testclient import TestClient

    from api.cli import main
    from api.http.settings import ServeSettings

    assert "kv_dtype" not in ServeSettings(device="cpu").model_load_options()
    assert ServeSettings(device="cpu", kv_cache_dtype="int8").model_load_options()["kv_dtype"] == "int8"
    apps = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: apps.append(app))
    args = ["serve", "--model", TINY_QWEN, "--device", "cpu", "--kv-pages", "32"]
    assert main([*args, "--kv-cache-dtype", "int8", "--state-dir", str(tmp_path)]) == 0
    with TestClient(apps[0]) as client:
        text = client.get("/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("pie_media_kv_capacity_rows{"))
    assert 'kv_dtype="int8 (per-row scales)"' in line and line.endswith(" 1024.0"), line
    with pytest.raises(SystemExit):
        main([*args, "--kv-cache-dtype", "int4"])
