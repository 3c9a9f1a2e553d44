"""The same engine on a GPU (skipped without one): logits against the CPU reference."""

from __future__ import annotations

import pytest
import torch

from engine import Model, Sampler, SyncContext, max_tokens
from media import Image
from tests.engine.conftest import TINY_GEMMA, TINY_QWEN, reference_greedy, reference_logits
from tests.engine.test_parity_media import IMG_A

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

# fp32 on the GPU with TF32 off; cuBLAS/cuDNN reorder sums differently from the CPU.
GPU_ATOL = 1e-3


@pytest.mark.parametrize("name", [TINY_QWEN, TINY_GEMMA])
def test_gpu_logits_and_greedy(refs, name, tiny_dir):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = Model.load(tiny_dir(name), kv_pages=64)
    assert model.device.type == "cuda" and model.pool.k[0].is_cuda
    ctx = SyncContext(model).user(Image.from_bytes(IMG_A), "Describe this image, please, in detail.").cue()
    ids = ctx.token_ids
    ours = ctx.flush(return_logits=True).cpu()
    ref_ctx_inputs = {"input_ids": torch.tensor([ids])}
    (span,) = ctx.spans
    prepared = span.prepared
    types = torch.zeros(1, len(ids), dtype=torch.long)
    rows = list(span.rows)
    types[0, rows] = torch.tensor(prepared.mm_token_type or [0] * len(rows))
    ref_ctx_inputs.update({k: v.cpu() for k, v in prepared.inputs.items()}, mm_token_type_ids=types)
    theirs = reference_logits(refs[name], **ref_ctx_inputs)
    assert (ours - theirs).abs().max().item() < GPU_ATOL
    tokens = ctx.generate(Sampler.greedy(), max_tokens(8)).tokens
    assert tokens == reference_greedy(refs[name], 8, **ref_ctx_inputs)
    ctx.close()


@pytest.fixture(scope="module")
def qwen_head64(tmp_path_factory, tiny_dir):
    """The tiny Qwen3-VL with head size 64 (flashinfer has kernels for it; the fixture's 16
    goes to the torch fallback), random bf16 weights built on the GPU."""
    import shutil

    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from fixtures import tiny_qwen3_vl

    cfg = tiny_qwen3_vl.config_dict()
    cfg["text_config"].update(hidden_size=256, head_dim=64, intermediate_size=512)
    cfg["text_config"]["rope_parameters"] = {
        **cfg["text_config"]["rope_parameters"],
        "mrope_section": [16, 8, 8],
    }
    cfg["vision_config"]["out_hidden_size"] = 256
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**cfg)).to(torch.bfloat16).eval()
    folder = tmp_path_factory.mktemp("qwen-head64")
    hf.save_pretrained(folder)
    for f in tiny_dir(TINY_QWEN).iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, folder / f.name)
    return folder


def test_cuda_graph_decode_equals_plain_flashinfer(qwen_head64):
    """Real capture and replay (engine.decode_graphs): five contexts, one with an image,
    decoded together with shrinking batches, equal to the same flashinfer engine without
    graphs (greedy tokens; top probabilities within bf16 noise)."""
    pytest.importorskip("flashinfer")
    from tests.engine.test_decode_graphs import _decode_all

    kw = {"device": "cuda", "dtype": torch.bfloat16, "attention": "flashinfer", "kv_pages": 256}
    plain = Model.load(qwen_head64, **kw)
    graphs = Model.load(qwen_head64, cuda_graphs=8, **kw)
    lengths = [9, 3, 7, 5, 12]
    p_plain, p_graph = [], []
    assert _decode_all(graphs, lengths, p_graph) == _decode_all(plain, lengths, p_plain)
    g = graphs.runner.graphs
    assert g.captures >= 4 and g.replays >= max(lengths) - 1, g
    for mine, theirs in zip(p_graph, p_plain, strict=True):
        for (_, pa), (_, pb) in zip(mine, theirs, strict=True):
            assert (pa[:3] - pb[:3]).abs().max().item() < 2e-2


def test_device_fed_graph_passes_equal_the_plain_loop(qwen_head64):
    """The device feed on a real GPU (engine.scheduler, with the overlap, which is on by
    default on CUDA): greedy graph passes launched before the running pass's tokens reach
    the host, their ids taken from its argmax on the device. The same tokens as the same
    graphs without the feed, and passes were really fed."""
    pytest.importorskip("flashinfer")
    from tests.engine.test_decode_graphs import greedy_texts

    kw = {"device": "cuda", "dtype": torch.bfloat16, "attention": "flashinfer", "kv_pages": 256}
    model = Model.load(qwen_head64, cuda_graphs=8, **kw)
    lengths = [9, 3, 7, 5, 24]
    sched = model.scheduler
    assert sched.overlap and sched.device_feed  # the CUDA defaults
    sched.device_feed = False
    unfed = greedy_texts(model, lengths)
    sched.device_feed = True
    before = sched.stats.fed_passes
    fed = greedy_texts(model, lengths)
    assert fed == unfed
    assert sched.stats.fed_passes > before, sched.stats


async def _slots_of_one_pass(model: Model, ids: list[int]) -> tuple[list, int]:
    """Every slot kind on the last row of one hand-built pass after ``ids``, and how many
    forward passes the scheduler ran for it."""
    from engine import Context, Slot

    ctx = Context(model)
    try:
        await ctx.forward().input_tokens(ids[:-1]).execute()
        passes = model.scheduler.stats.passes
        fp = ctx.forward().input_tokens(ids[-1:])
        slots = [
            Slot.greedy(),
            Slot.dist(1.0, 5),
            Slot.dist(0.7, 3),
            Slot.entropy(),
            Slot.logprobs([1, 2, 3]),
            Slot.raw_logits(),
            Slot.embedding(),
        ]
        handles = [fp.sampler([0], s) for s in slots]
        out = await fp.execute()
        return [out[h] for h in handles], model.scheduler.stats.passes - passes
    finally:
        ctx.close()


def check_slots_on_device(device: str, tiny_dir, name: str = TINY_QWEN) -> None:
    """The slots of one pass on ``device`` equal the CPU model's (issue 40: several slots
    from the one pass's logits, on the device): the token, the dists' ids, and the values
    within fp32 reduction-order noise (GPU_ATOL on logits; 1e-4 on probabilities)."""
    import asyncio

    ref = Model.load(tiny_dir(name), kv_pages=64, device="cpu")
    ours = Model.load(tiny_dir(name), kv_pages=64, device=device)
    assert ours.device.type == torch.device(device).type
    ids = SyncContext(ref).user("Name three colours, please.").cue().token_ids
    (a, passes_a), (b, passes_b) = (asyncio.run(_slots_of_one_pass(m, ids)) for m in (ref, ours))
    assert passes_a == passes_b == 1  # every slot from the one pass's logits
    assert b[0].token == a[0].token
    for i in (1, 2):
        assert b[i].ids == a[i].ids
        assert b[i].probs == pytest.approx(a[i].probs, abs=1e-4)
    assert b[3].value == pytest.approx(a[3].value, abs=1e-3)
    assert b[4].values == pytest.approx(a[4].values, abs=1e-3)
    assert (b[5].logits.cpu() - a[5].logits.cpu()).abs().max().item() < GPU_ATOL
    assert (b[6].vector.cpu() - a[6].vector.cpu()).abs().max().item() < GPU_ATOL


def test_gpu_slots_of_one_pass_equal_the_cpu_ones(tiny_dir):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    check_slots_on_device("cuda", tiny_dir)
