"""speech.mimi_stream: a stream decoded chunk by chunk, every frame once, joins to the
whole-clip ``MimiModel.decode``.

Tolerances (measured on this machine, 40-frame clips, chunks of 1, 2, 3 and 5 frames):
- float64 codec: max |chunks - whole| 4.7e-7, which is only the float32 cast of the returned
  PCM (raw amplitude ~12): the state handling is exact. Held to F64_ATOL = 1e-5.
- float32 codec: max 2.7e-5 at a raw peak of 11.8 (the random-weight decoder's activations
  reach ~20, so its float32 ulp is ~2e-6; transformers' own decode of a prefix differs from
  the whole clip's by up to 1e-5 here, from convolution kernels run at other lengths).
  1e-5 absolute is therefore below float32's reach on this codec; held to F32_RTOL = 1e-5
  of the clip's peak (1.2e-4 absolute here), 4x the measured. The second codec shape (layer
  scale 1, raw peak 82): float32 max 1.0e-4 (1.2e-6 of the peak), float64 3.6e-6 (the cast).
"""

from __future__ import annotations

import copy
import time

import numpy as np
import pytest
import torch

from speech import SpeechError, audio_cutoff
from speech.mimi_stream import MimiStreamDecoder, NonCausalCodecError, StreamDecodeQueue, stream_decoder_for

F64_ATOL = 1e-5
F32_RTOL = 1e-5
CHUNKS = (1, 2, 3, 5)
FRAMES = 40


def _whole(codec, codes: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        ids = torch.as_tensor(codes, dtype=torch.long).transpose(0, 1).unsqueeze(0)
        return codec.decode(ids).audio_values[0, 0].double().numpy()


def _chunked(decoder: MimiStreamDecoder, codes: np.ndarray, step: int) -> np.ndarray:
    state = decoder.start()
    parts = []
    for i in range(0, len(codes), step):
        pcm = decoder.decode(state, codes[i : i + step])
        assert pcm.dtype == np.float32
        assert len(pcm) == len(codes[i : i + step]) * decoder.samples_per_frame
        parts.append(pcm)
    assert state.frames == len(codes)
    return np.concatenate(parts).astype(np.float64)


def _double(codec):
    """A float64 copy (the codebooks' cached ``_embed`` is a plain attribute: recomputed)."""
    codec = copy.deepcopy(codec).double()
    for module in codec.modules():
        if hasattr(module, "_embed"):
            module._embed = None
    return codec


def _codes(num_codebooks: int, codebook_size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, codebook_size, size=(FRAMES, num_codebooks))


def _other_codec(**overrides):
    """A random Mimi of another shape: 3 upsamplers (4, 3, 2), 2 residual layers with conv
    shortcuts, replicate padding, 2 transformer layers whose attention matters (layer scale 1)
    and a sliding window of 6 positions, far shorter than the clip's 80."""
    from transformers import MimiConfig, MimiModel

    config = dict(
        sampling_rate=24000,
        audio_channels=1,
        hidden_size=16,
        num_filters=4,
        num_residual_layers=2,
        upsampling_ratios=[4, 3, 2],
        kernel_size=5,
        last_kernel_size=5,
        residual_kernel_size=3,
        use_conv_shortcut=True,
        pad_mode="replicate",
        codebook_size=32,
        codebook_dim=8,
        vector_quantization_hidden_dimension=8,
        num_quantizers=3,
        upsample_groups=16,
        num_hidden_layers=2,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=6,
        layer_scale_initial_scale=1.0,
    )
    config.update(overrides)
    torch.manual_seed(5)
    model = MimiModel(MimiConfig(**config)).eval()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("codebook.embed_sum"):
                buffer.copy_(torch.randn(buffer.shape))
    return model


@pytest.fixture(scope="module")
def tiny_codec(csm):
    return csm.hf.codec_model


@pytest.fixture(scope="module")
def other_codec():
    return _other_codec()


def test_tiny_codec_chunks_join_to_whole_clip_float32(tiny_codec):
    codes = _codes(4, 64)
    whole = _whole(tiny_codec, codes)
    decoder = MimiStreamDecoder(tiny_codec)
    assert decoder.samples_per_frame == 1920 and len(whole) == FRAMES * 1920
    tol = F32_RTOL * np.abs(whole).max()
    for step in CHUNKS:
        np.testing.assert_allclose(
            _chunked(decoder, codes, step), whole, rtol=0, atol=tol, err_msg=f"step {step}"
        )


def test_tiny_codec_state_handling_is_exact_in_float64(tiny_codec):
    codec = _double(tiny_codec)
    codes = _codes(4, 64, seed=1)
    whole = _whole(codec, codes)
    decoder = MimiStreamDecoder(codec)
    for step in CHUNKS:
        np.testing.assert_allclose(
            _chunked(decoder, codes, step), whole, rtol=0, atol=F64_ATOL, err_msg=f"step {step}"
        )


def test_other_codec_shape_with_sliding_window(other_codec):
    codes = _codes(3, 32, seed=2)
    decoder = MimiStreamDecoder(other_codec)
    assert decoder.samples_per_frame == 2 * 4 * 3 * 2
    whole = _whole(other_codec, codes)
    assert len(whole) == FRAMES * decoder.samples_per_frame
    for step in CHUNKS:
        got = _chunked(decoder, codes, step)
        np.testing.assert_allclose(got, whole, rtol=0, atol=F32_RTOL * np.abs(whole).max(), err_msg=f"{step}")
    double = _double(other_codec)
    np.testing.assert_allclose(
        _chunked(MimiStreamDecoder(double), codes, 3), _whole(double, codes), rtol=0, atol=F64_ATOL
    )


def test_window_matters_so_the_cache_is_tested(other_codec):
    """Frames past the transformer's window: decoding only the last frames from a fresh state
    differs from the stream (the upsample/conv tails and KV cache carry real information)."""
    codes = _codes(3, 32, seed=3)
    decoder = MimiStreamDecoder(other_codec)
    whole = _whole(other_codec, codes)
    fresh = decoder.decode(decoder.start(), codes[-2:])
    assert np.abs(fresh - whole[-len(fresh) :]).max() > 1e-3


def test_streams_are_independent(tiny_codec):
    decoder = MimiStreamDecoder(tiny_codec)
    a, b = _codes(4, 64, seed=4), _codes(4, 64, seed=5)
    sa, sb = decoder.start(), decoder.start()
    pa, pb = [], []
    for i in range(0, 10, 2):  # interleaved on one decoder
        pa.append(decoder.decode(sa, a[i : i + 2]))
        pb.append(decoder.decode(sb, b[i : i + 2]))
    for got, codes in ((pa, a[:10]), (pb, b[:10])):
        whole = _whole(tiny_codec, codes)
        np.testing.assert_allclose(np.concatenate(got), whole, rtol=0, atol=F32_RTOL * np.abs(whole).max())


def test_decode_many_batches_streams_at_any_point(other_codec):
    """Streams at different positions, chunks of different lengths in one call: each joins
    to its own whole clip (a new stream's replicate padding comes from its own row)."""
    decoder = MimiStreamDecoder(other_codec)
    clips = [_codes(3, 32, seed=10 + k) for k in range(3)]
    states = [decoder.start() for _ in clips]
    parts: list[list[np.ndarray]] = [[], [], []]
    at = [0, 0, 0]
    rounds = [[(0, 1), (1, 2)], [(0, 3), (1, 2), (2, 2)], [(2, 1), (0, 2)], [(0, 5), (1, 1), (2, 2)]]
    for rows in rounds:  # (stream, frames) per row; a stream joins late (2), lengths differ
        chunks = [clips[k][at[k] : at[k] + n] for k, n in rows]
        for (k, n), pcm in zip(rows, decoder.decode_many([states[k] for k, _ in rows], chunks), strict=True):
            parts[k].append(pcm)
            at[k] += n
    for k, codes in enumerate(clips):
        done = codes[: at[k]]
        whole = _whole(other_codec, done)
        got = np.concatenate(parts[k]).astype(np.float64)
        np.testing.assert_allclose(got, whole, rtol=0, atol=F32_RTOL * np.abs(whole).max(), err_msg=f"{k}")
    with pytest.raises(ValueError):
        decoder.decode_many([states[0], states[0]], [clips[0][:1], clips[0][1:2]])


def test_lockstep_streams_share_the_transformer_past_its_window(other_codec):
    """Streams at the same position run the decoder transformer as one batch (caches stacked
    and split back), far past the 6-position sliding window."""
    decoder = MimiStreamDecoder(other_codec)
    clips = [_codes(3, 32, seed=30 + k) for k in range(3)]
    states = [decoder.start() for _ in clips]
    parts: list[list[np.ndarray]] = [[] for _ in clips]
    for i in range(0, FRAMES, 2):
        for k, pcm in enumerate(decoder.decode_many(states, [c[i : i + 2] for c in clips])):
            parts[k].append(pcm)
    for k, codes in enumerate(clips):
        whole = _whole(other_codec, codes)
        got = np.concatenate(parts[k]).astype(np.float64)
        np.testing.assert_allclose(got, whole, rtol=0, atol=F32_RTOL * np.abs(whole).max(), err_msg=f"{k}")
    assert all(len(layer.keys[0, 0]) == 5 for s in states for layer in s.cache.layers)  # window - 1 kept


def test_queue_decodes_every_stream_and_drops_cancelled(tiny_codec):
    from concurrent.futures import ThreadPoolExecutor

    decoder = MimiStreamDecoder(tiny_codec)
    clips = [_codes(4, 64, seed=20 + k) for k in range(4)]
    with ThreadPoolExecutor(max_workers=1) as pool:
        queue = StreamDecodeQueue(decoder, pool)
        states = [queue.start() for _ in clips]
        parts: list[list[np.ndarray]] = [[] for _ in clips]
        for i in range(0, 6, 2):
            futures = [queue.submit(st, c[i : i + 2]) for st, c in zip(states, clips, strict=True)]
            for k, f in enumerate(futures):
                parts[k].append(f.result(timeout=30))
        blocker = pool.submit(time.sleep, 0.2)  # the worker is busy: the next submit waits
        dropped = queue.submit(decoder.start(), clips[0][:2])
        assert dropped.cancel()
        kept = queue.submit(states[1], clips[1][6:8])
        blocker.result()
        parts[1].append(kept.result(timeout=30))
    for k, codes in enumerate(clips):
        got = np.concatenate(parts[k])
        whole = _whole(tiny_codec, codes[: len(got) // decoder.samples_per_frame])
        np.testing.assert_allclose(got, whole, rtol=0, atol=F32_RTOL * np.abs(whole).max())
    assert states[1].frames == 8 and states[0].frames == 6


def test_empty_and_bad_shapes(tiny_codec):
    decoder = MimiStreamDecoder(tiny_codec)
    state = decoder.start()
    assert decoder.decode(state, np.zeros((0, 4), dtype=np.int64)).shape == (0,)
    assert state.frames == 0
    with pytest.raises(ValueError):
        decoder.decode(state, np.zeros(4, dtype=np.int64))


@pytest.mark.parametrize("overrides", [{"use_causal_conv": False}, {"trim_right_ratio": 0.5}])
def test_non_causal_codec_is_refused(overrides):
    codec = _other_codec(num_residual_layers=1, num_hidden_layers=1, **overrides)
    with pytest.raises(NonCausalCodecError) as e:
        MimiStreamDecoder(codec)
    assert isinstance(e.value, SpeechError) and e.value.code == "non_causal_codec"
    assert stream_decoder_for(codec) is None


def test_speech_model_streams_with_it(csm):
    """The model's streamed chunks come from the stream decoder: equal to it frame for frame."""
    assert isinstance(csm.mimi_stream.decoder, MimiStreamDecoder)
    chunks = list(csm.speak_stream("Hello there.", 1, max_duration=0.8, temperature=0, chunk_frames=3))
    clip = csm.speak("Hello there.", 1, max_duration=0.8, temperature=0)
    assert [len(c) for c in chunks][:-1] == [3 * 1920] * (len(chunks) - 1)
    codes = clip.codes[: audio_cutoff(clip.codes, csm.eos_id)]
    decoder = MimiStreamDecoder(csm.hf.codec_model)
    state = decoder.start()
    expected = [np.clip(decoder.decode(state, codes[i : i + 3]), -1, 1) for i in range(0, len(codes), 3)]
    np.testing.assert_array_equal(np.concatenate(chunks), np.concatenate(expected))
