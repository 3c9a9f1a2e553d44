"""One variable-length attention call per layer for the Qwen3-VL vision tower
(``encoders/varlen_attention.py``).

On the CPU the flashinfer kernel runs on the stand-in ragged wrapper
(``tests/encoders/fake_flashinfer_ragged.py``: flashinfer's documented semantics in plain
torch) inside the real tower of the tiny checkpoint, against the same tower's per-image
sdpa path. Tolerance 1e-6 absolute on the tower's outputs (float32, magnitudes up to ~1.8):
both compute exact softmax attention of the same rows in float32, but the stand-in sums
with einsum and sdpa with its own kernel, so they differ in the last bits (measured 1.2e-7
at most). The bound is tight on purpose: the tiny random tower's attention is nearly
uniform, so mistakes show small there (measured: rows attending across images 2.4e-3, a
10% wrong scale 2.3e-5). The attention function alone, on random q/k/v, is held to 1e-5
(a wrong scale or segment there is O(0.1)).

The CUDA test (skipped without a GPU) compares every kernel usable there with the per-image
path in bfloat16, each against a float32 per-image run of the same weights.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from encoders import encoder_for  # noqa: E402
from encoders import varlen_attention as va  # noqa: E402
from encoders.qwen3_vl import Qwen3VLEncoder  # noqa: E402
from fixtures.tiny_models import ensure_tiny_model  # noqa: E402
from media import Image  # noqa: E402
from tests.encoders import fake_flashinfer_ragged  # noqa: E402
from tests.encoders.fake_flashinfer_ragged import FakeRagged  # noqa: E402

ATOL = 1e-6
"""The tower's outputs, varlen vs per image (see the module doc)."""
FN_ATOL = 1e-5
"""The attention function alone vs sdpa per segment."""


def _noise(width: int, height: int, seed: int) -> Image:
    rng = np.random.default_rng(seed)
    return Image.from_array(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def encoder() -> Qwen3VLEncoder:
    enc = encoder_for(ensure_tiny_model("tiny-qwen3-vl"), varlen_attention="auto")
    assert isinstance(enc, Qwen3VLEncoder)
    return enc


@pytest.fixture
def fake():
    with fake_flashinfer_ragged.installed() as module:
        yield module


@pytest.fixture
def three_images(encoder):
    """Three images of different sizes (256, 320 and 540 patches before merging)."""
    sizes = [(256, 256), (320, 256), (384, 360)]
    items = [encoder.prepare(_noise(w, h, seed=i)) for i, (w, h) in enumerate(sizes)]
    assert len({p.inputs["pixel_values"].shape[0] for p in items}) == 3
    pixels = torch.cat([p.inputs["pixel_values"] for p in items])
    grid = torch.cat([p.inputs["image_grid_thw"] for p in items])
    return items, pixels, grid


def _tower_out(tower, pixels, grid):
    with torch.no_grad():
        out = tower(pixels, grid_thw=grid, return_dict=True)
    return [out.pooler_output, *out.deepstack_features, out.last_hidden_state]


def _assert_close(got: list[torch.Tensor], want: list[torch.Tensor], atol: float) -> float:
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        worst = max(worst, (g.float() - w.float()).abs().max().item())
    assert worst <= atol, worst
    return worst


def test_cpu_keeps_per_image_attention(encoder):
    """On the CPU no kernel is picked under "auto": the tower stays on sdpa."""
    tower = encoder.tower
    assert encoder.varlen_kernel is None
    assert tower.config._attn_implementation == "sdpa"


def test_tower_on_the_ragged_kernel_equals_per_image(encoder, fake, three_images):
    """Three images of different sizes: the flashinfer kernel (stand-in) gives the per-image
    path's output, attending once per layer, planned once per tower call."""
    _, pixels, grid = three_images
    tower = encoder.tower
    depth = len(tower.blocks)
    want = _tower_out(tower, pixels, grid)
    kernel = va.FlashInferRagged(workspace_bytes=1024)
    before = va.set_attention(tower, va.register(kernel))
    try:
        assert before == "sdpa"
        assert all(b.attn.config._attn_implementation == kernel.attention_name for b in tower.blocks)
        got = _tower_out(tower, pixels, grid)
        assert FakeRagged.calls == ["plan"] + ["run"] * depth
        assert kernel.calls == depth and kernel.plans == 1
        _assert_close(got, want, ATOL)
        # A second call (new cu_seqlens) plans again, once.
        got = _tower_out(tower, pixels[:256], grid[:1])
        assert FakeRagged.calls == (["plan"] + ["run"] * depth) * 2 and kernel.plans == 2
        _assert_close(got, _per_image(tower, pixels[:256], grid[:1]), ATOL)
    finally:
        va.set_attention(tower, before)


def _per_image(tower, pixels, grid):
    name = va.set_attention(tower, "sdpa")
    try:
        return _tower_out(tower, pixels, grid)
    finally:
        va.set_attention(tower, name)


def test_video_frames_are_separate_segments(encoder, fake):
    """A video's temporal patches attend within themselves (transformers' convention): two
    videos of 2 and 3 temporal patches beside each other, against the per-image path."""
    tower = encoder.tower
    patch = tower.config.in_channels * tower.config.temporal_patch_size * tower.config.patch_size**2
    grid = torch.tensor([[2, 4, 6], [3, 6, 4]])
    pixels = torch.randn(int(grid.prod(-1).sum()), patch, generator=torch.Generator().manual_seed(3))
    want = _tower_out(tower, pixels, grid)
    kernel = va.FlashInferRagged(workspace_bytes=1024)
    before = va.set_attention(tower, va.register(kernel))
    try:
        got = _tower_out(tower, pixels, grid)
    finally:
        va.set_attention(tower, before)
    _assert_close(got, want, ATOL)
    assert kernel.calls == len(tower.blocks)


def test_encode_batch_through_the_kernel(encoder, fake, three_images):
    """``encode`` of three images with the kernel in place: the embeddings of each equal the
    per-image tower's, and one tower call serves all three."""
    items, _, _ = three_images
    encoder.cache.clear()
    want = encoder.encode(items)
    encoder.cache.clear()
    kernel = va.FlashInferRagged(workspace_bytes=1024)
    before = va.set_attention(encoder.tower, va.register(kernel))
    try:
        got = encoder.encode(items)
    finally:
        va.set_attention(encoder.tower, before)
        encoder.cache.clear()
    assert kernel.plans == 1 and kernel.calls == len(encoder.tower.blocks)
    for g, w in zip(got, want, strict=True):
        _assert_close([g.embeddings, *g.deepstack], [w.embeddings, *w.deepstack], ATOL)


def _sdpa_segments(q, k, v, cu):
    """Reference: sdpa per segment of (rows, heads, dim) tensors."""
    out = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
        out.append(F.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1))
    return torch.cat(out)


def test_attention_function_on_cpu_tensors(fake):
    """The registered function itself, with transformers' calling convention: (1, heads,
    rows, dim) in, (1, rows, heads, dim) out, equal to sdpa per segment."""
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 7, 19, 20, 64], dtype=torch.int32)
    q, k, v = (torch.randn(64, 4, 16, generator=g) for _ in range(3))
    kernel = va.FlashInferRagged(workspace_bytes=1024)
    name = va.register(kernel)
    module = torch.nn.Module()
    module.config = type("Cfg", (), {"_attn_implementation": name})()
    as_hf = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
    out, weights = va.varlen_attention_forward(
        module, *as_hf, None, scaling=16**-0.5, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=44
    )
    assert weights is None and out.shape == (1, 64, 4, 16)
    torch.testing.assert_close(out[0], _sdpa_segments(q, k, v, cu), atol=FN_ATOL, rtol=0)
    # Anything a vision tower never asks for is refused, not attended wrongly.
    for bad in (
        {"cu_seq_lens_q": None},
        {"cu_seq_lens_k": cu.clone()},
        {"is_causal": True},
        {"dropout": 0.1},
    ):
        kwargs = {"scaling": 0.25, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, **bad}
        with pytest.raises(ValueError):
            va.varlen_attention_forward(module, *as_hf, None, **kwargs)
    with pytest.raises(ValueError):
        va.varlen_attention_forward(module, *as_hf, torch.zeros(1, 1, 64, 64), cu_seq_lens_q=cu)


def test_choice_and_selection(monkeypatch):
    monkeypatch.delenv(va.ENV_VAR, raising=False)
    assert va.requested_choice(None) == "auto"
    monkeypatch.setenv(va.ENV_VAR, "OFF")
    assert va.requested_choice(None) == "off"
    assert va.requested_choice("torch") == "torch"  # the option wins over the environment
    monkeypatch.setenv(va.ENV_VAR, "fast")
    with pytest.raises(va.VarlenUnavailableError, match=va.ENV_VAR):
        va.requested_choice(None)
    with pytest.raises(va.VarlenUnavailableError, match="varlen_attention"):
        va.requested_choice("yes")
    # This transformers hands our names the cu_seqlens (and would not hand them to sdpa).
    assert va.transformers_passes_cu_seqlens(va.NAME_PREFIX + "torch")[0]
    assert not va.transformers_passes_cu_seqlens("sdpa")[0]
    kernel, why = va.select_kernel("cpu", torch.bfloat16, 64, "off")
    assert kernel is None and "off" in why
    kernel, why = va.select_kernel("cpu", torch.bfloat16, 64, "auto")
    assert kernel is None and "CUDA" in why
    for name in ("torch", "flashinfer"):  # asked by name and unusable: a clear error
        with pytest.raises(va.VarlenUnavailableError, match="cannot run here"):
            va.select_kernel("cpu", torch.bfloat16, 64, name)


def test_encoder_option_reaches_the_tower(monkeypatch):
    """``varlen_attention`` is checked when the encoder is made; "flashinfer" on the CPU is
    refused when the tower is built, with the reason."""
    tiny = ensure_tiny_model("tiny-qwen3-vl")
    with pytest.raises(va.VarlenUnavailableError):
        encoder_for(tiny, varlen_attention="sometimes")
    enc = encoder_for(tiny, varlen_attention="flashinfer", load_weights=False)
    with pytest.raises(va.VarlenUnavailableError, match="needs CUDA|need CUDA"):
        enc.tower  # noqa: B018
    monkeypatch.setenv(va.ENV_VAR, "off")
    enc = encoder_for(tiny, load_weights=False)
    assert enc.tower.config._attn_implementation == "sdpa" and enc.varlen_kernel is None


# ----------------------------------------------------------------------------------------------------
# CUDA
# ----------------------------------------------------------------------------------------------------


def _cuda_tower(head_dim: int = 64):
    """A random Qwen3-VL vision tower with heads of ``head_dim`` (the 2B's 64), 2 blocks."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    cfg = Qwen3VLVisionConfig(
        depth=2,
        hidden_size=2 * head_dim,
        intermediate_size=4 * head_dim,
        num_heads=2,
        out_hidden_size=64,
        deepstack_visual_indexes=[0],
        num_position_embeddings=2304,
    )
    torch.manual_seed(0)
    return Qwen3VLVisionModel._from_config(cfg).to("cuda").eval()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["torch", "flashinfer"])
def test_cuda_kernel_equals_per_image(name):
    """bfloat16 tower, 3 images of different sizes: the kernel's outputs are as close to a
    float32 per-image run as bfloat16 per-image sdpa is (within 2x of its error, plus one
    bfloat16 ulp at the outputs' scale), and the kernel runs once per layer."""
    ok, why = (
        va._torch_usable(torch.device("cuda"), torch.bfloat16, 64)
        if name == "torch"
        else va._flashinfer_usable(64)
    )
    if not ok:
        pytest.skip(why)
    tower = _cuda_tower()
    patch = tower.config.in_channels * tower.config.temporal_patch_size * tower.config.patch_size**2
    grid = torch.tensor([[1, 16, 16], [1, 20, 16], [1, 24, 28]], device="cuda")
    pixels = torch.randn(int(grid.prod(-1).sum()), patch, device="cuda")
    want32 = _tower_out(tower, pixels, grid)
    tower = tower.to(torch.bfloat16)
    per_image = _tower_out(tower, pixels.bfloat16(), grid)
    kernel = va._kernel(name)
    calls = kernel.calls
    before = va.set_attention(tower, va.register(kernel))
    try:
        got = _tower_out(tower, pixels.bfloat16(), grid)
    finally:
        va.set_attention(tower, before)
    assert kernel.calls - calls == len(tower.blocks)
    for g, p, w in zip(got, per_image, want32, strict=True):
        err_kernel = (g.float() - w).abs().max().item()
        err_sdpa = (p.float() - w).abs().max().item()
        ulp = w.abs().max().item() * 2**-8
        assert err_kernel <= 2 * err_sdpa + ulp, (name, err_kernel, err_sdpa)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_encoder_picks_a_kernel():
    """The tiny checkpoint's encoder on CUDA in bfloat16 picks a kernel under "auto" (its
    head size 16 fits torch's kernel) and its embeddings match the per-image tower's."""
    tiny = ensure_tiny_model("tiny-qwen3-vl")
    enc = encoder_for(tiny, device="cuda", dtype=torch.bfloat16)
    tower = enc.tower
    if enc.varlen_kernel is None:
        pytest.skip("no variable-length kernel usable on this GPU (see the log)")
    items = [
        enc.prepare(_noise(w, h, seed=i)) for i, (w, h) in enumerate([(256, 256), (320, 256), (384, 360)])
    ]
    got = enc.encode(items)
    enc.cache.clear()
    name = va.set_attention(tower, "sdpa")
    try:
        want = enc.encode(items)
    finally:
        va.set_attention(tower, name)
    for g, w in zip(got, want, strict=True):
        scale = w.embeddings.float().abs().max().item()
        assert (g.embeddings.float() - w.embeddings.float()).abs().max().item() <= 0.05 * scale
