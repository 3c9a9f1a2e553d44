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
