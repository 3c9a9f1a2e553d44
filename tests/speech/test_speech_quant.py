"""``SpeechModel.load(quantization=...)``: the engine's int8 / int4 weight-only layers on CSM.

Quantized weights are not the float weights, so codes are compared by closeness, not equality.
The measure is teacher-forced: the same backbone hidden states and the same previous codes go
through the float and the quantized heads, and their logits must agree within:

- int8 (one scale per output channel, rounding error <= 1/254 of the channel's max |w|):
  relative logit error <= INT8_REL (measured 0.007 for the codebook-0 head, 0.013 through the
  tiny depth decoder's two layers); greedy picks agree at >= INT8_AGREE of the positions
  (measured 0.94 / 1.0: random weights have near-ties that a 1% error flips) and the first frame
  spoken from each of three prompts equals the float model's (measured 3/3; later frames drift
  apart once one code differs, as any autoregressive model's do);
- int4 (groups of 32 input features, 15 steps between the group's min and max: ~8x int8's
  step): relative depth-logit error <= INT4_REL (measured 0.16), greedy agreement >= INT4_AGREE
  (measured 0.83). The tiny codebook-0 head (67 outputs, not a multiple of 16) stays float.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import QuantizationUnavailableError
from engine.quantization import QuantizedLinear
from speech import SpeechModel

INT8_REL, INT8_AGREE = 0.03, 0.85
INT4_REL, INT4_AGREE = 0.3, 0.6
TEXTS = ("Hello there.", "The train leaves at nine.", "Is this seat taken?")
FRAMES = 8


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 64, generator=g), torch.randint(0, 64, (16, 4), generator=g)


@torch.inference_mode()
def _logits(model: SpeechModel, hidden: torch.Tensor, ids: torch.Tensor):
    lm = model.hf.lm_head(hidden)
    depth = model.hf.depth_decoder(input_ids=ids, backbone_last_hidden_state=hidden, logits_to_keep=0)
    return lm.float(), depth.logits.float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _agree(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.argmax(-1) == b.argmax(-1)).float().mean())


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_codes_close_to_float(csm, tiny_dir, inputs, method):
    quant = SpeechModel.load(tiny_dir("tiny-csm"), device="cpu", quantization=method)
    assert quant.quantization == method and f"quantization={method}" in repr(quant)
    hf = quant.hf
    # every linear layer of the backbone and the depth decoder is swapped ...
    layers = [m for m in (hf.backbone_model, hf.depth_decoder.model) for m in m.modules()]
    assert not any(type(m) is torch.nn.Linear for m in layers)
    assert sum(isinstance(m, QuantizedLinear) for m in layers) == 2 * 7 + 2 * 7 + 1
    # ... while the embeddings, the per-codebook depth heads and Mimi keep the float weights
    assert hf.depth_decoder.codebooks_head.weight.dtype == torch.float32
    assert not any(isinstance(m, QuantizedLinear) for m in hf.codec_model.modules())

    (fl, fd), (ql, qd) = _logits(csm, *inputs), _logits(quant, *inputs)
    rel, agree = (INT8_REL, INT8_AGREE) if method == "int8" else (INT4_REL, INT4_AGREE)
    assert _rel(qd, fd) <= rel and _agree(qd, fd) >= agree
    assert _rel(ql, fl) <= rel and _agree(ql, fl) >= agree

    for i, text in enumerate(TEXTS):
        ours = quant.speak(text, i % 2, max_duration=FRAMES / 12.5, temperature=0)
        assert ours.codes.shape == (FRAMES, 4) and ours.codes.min() >= 0 and ours.codes.max() < 64
        assert np.isfinite(ours.pcm).all() and len(ours.pcm) == FRAMES * 1920
        if method == "int8":
            ref = csm.speak(text, i % 2, max_duration=FRAMES / 12.5, temperature=0)
            np.testing.assert_array_equal(ours.codes[0], ref.codes[0])


@pytest.mark.parametrize("method", ["fp8", "int3"])
def test_unavailable_quantization_is_a_typed_error(tiny_dir, method):
    with pytest.raises(QuantizationUnavailableError) as e:
        SpeechModel.load(tiny_dir("tiny-csm"), device="cpu", quantization=method)
    assert "int8" in str(e.value)
