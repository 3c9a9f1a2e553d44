"""Gemma-4 audio preparation: log-mel features bit-identical to ``Gemma4AudioFeatureExtractor``.

The reference (transformers ``models/gemma4/feature_extraction_gemma4.py``), for one clip:

1. the waveform (mono float32 at 16 kHz; the processor never resamples, the caller does)
   is truncated to ``max_length`` = 480 000 samples (30 s: ``__call__``'s default, with
   ``truncation=True``), then zero-padded on the right to a multiple of 128 samples
   (``pad_to_multiple_of``), with an attention mask of 1s over the real samples;
2. ``frame_length // 2`` = 160 zeros are prepended ("semicausal" padding) and frames of
   ``frame_length + 1`` = 321 samples are taken every ``hop_length`` = 160 samples;
3. the last sample of each frame is dropped (or used by the optional pre-emphasis), the
   320 samples are multiplied by a periodic Hann window (float32), ``np.fft.rfft`` with
   ``n = fft_length`` = 512 (so zero-padded to 512), magnitude;
4. ``magnitude @ mel_filters`` (128 HTK triangles over 0..8 kHz, float64, no norm),
   ``log(mel + mel_floor)`` with ``mel_floor`` = 1e-3, optional per-bin mean/stddev,
   cast to float32;
5. a frame is valid when the last sample of its 321-sample window is real audio; invalid
   frames are zeroed, and the mask is ``input_features_mask``.

We run the same numpy operations on the same dtypes (the float32 window and pocketfft
``rfft``, the float64 filter bank and log), so the features equal the reference's bit for
bit; the speed comes from skipping the padding/batching machinery and the masked frames,
carrying cache-sized row blocks through the whole chain (every row is computed
independently, so blocking changes no bit), reused buffers instead of clip-sized
temporaries, and the filter bank as a sparse product (a float64 sum in another order,
which the final float32 cast hides; see ``LogMel.__init__``). ``LogMel(exact=False)``
also does the filter bank and log in float32.

Why only numpy's FFT: torch's and scipy's FFTs round differently, and ``log(mel + 1e-3)``
amplifies that on near-silent frames (up to ~1e-4 absolute measured); the float32 filter
bank and log of the fast mode stay within ~5e-7.

Tokens: the processor's ``replace_audio_token`` subsamples the mask twice by 2 (the
audio tower's two stride-2 convolutions) and counts the survivors: with ``V`` valid mel
frames that is ``ceil(ceil(V / 2) / 2)`` soft tokens, i.e. one per 40 ms, 750 for 30 s.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.sparse

from encoders.errors import UnsupportedModelError

__all__ = ["AudioSettings", "LogMel", "audio_token_count", "valid_frame_count"]

# Rows transformed together: the block's frames and spectrum stay in cache.
_BLOCK_ROWS = 128


@dataclass(frozen=True)
class AudioSettings:
    """``Gemma4AudioFeatureExtractor`` settings, derived as its ``__init__`` derives them
    (``frame_length``/``hop_length`` come from the millisecond values, as in the reference,
    whatever sample counts the saved config also carries)."""

    sampling_rate: int = 16_000
    feature_size: int = 128
    frame_length: int = 320
    hop_length: int = 160
    fft_length: int = 512
    min_frequency: float = 0.0
    max_frequency: float = 8000.0
    preemphasis: float = 0.0
    preemphasis_htk_flavor: bool = True
    dither: float = 0.0
    input_scale_factor: float = 1.0
    mel_floor: float = 1e-3
    per_bin_mean: tuple[float, ...] | None = None
    per_bin_stddev: tuple[float, ...] | None = None
    padding_value: float = 0.0
    max_length: int = 480_000
    """``__call__``'s ``max_length`` (truncation) default: 30 s at 16 kHz."""
    pad_to_multiple_of: int = 128
    """``__call__``'s ``pad_to_multiple_of`` default."""

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> AudioSettings:
        sr = int(cfg.get("sampling_rate", 16_000))
        frame_ms = float(cfg.get("frame_length_ms", 20.0))
        hop_ms = float(cfg.get("hop_length_ms", 10.0))
        frame_length = int(round(sr * frame_ms / 1000.0))
        hop_length = int(round(sr * hop_ms / 1000.0))
        if frame_length < 2 or hop_length < 1:
            raise UnsupportedModelError(f"audio frame/hop lengths {frame_length}/{hop_length} are not usable")
        fft_length = 2 ** math.ceil(math.log2(frame_length))
        if cfg.get("fft_overdrive", False):
            fft_length *= 2
        feature_size = int(cfg.get("feature_size", 128))

        def bins(key: str) -> tuple[float, ...] | None:
            v = cfg.get(key)
            if v is None:
                return None
            flat = np.asarray(v, dtype=np.float64).reshape(-1)  # saved as (1, 1, F) by to_dict
            if flat.size != feature_size:
                raise UnsupportedModelError(f"feature extractor `{key}` must have {feature_size} values")
            return tuple(float(x) for x in flat)

        if cfg.get("padding_side", "right") != "right":
            raise UnsupportedModelError("only right-padded Gemma-4 audio feature extraction is supported")
        return cls(
            sampling_rate=sr,
            feature_size=feature_size,
            frame_length=frame_length,
            hop_length=hop_length,
            fft_length=fft_length,
            min_frequency=float(cfg.get("min_frequency", 0.0)),
            max_frequency=float(cfg.get("max_frequency", 8000.0)),
            preemphasis=float(cfg.get("preemphasis", 0.0)),
            preemphasis_htk_flavor=bool(cfg.get("preemphasis_htk_flavor", True)),
            dither=float(cfg.get("dither", 0.0)),
            input_scale_factor=float(cfg.get("input_scale_factor", 1.0)),
            mel_floor=float(cfg.get("mel_floor", 1e-3)),
            per_bin_mean=bins("per_bin_mean"),
            per_bin_stddev=bins("per_bin_stddev"),
            padding_value=float(cfg.get("padding_value", 0.0)),
        )

    @property
    def max_seconds(self) -> float:
        return self.max_length / self.sampling_rate


def valid_frame_count(num_samples: int, s: AudioSettings) -> int:
    """Mel frames whose whole window lies on real samples (``input_features_mask.sum()``)."""
    # frame i covers padded samples [i*hop, i*hop + frame_length] (frame_length + 1 of
    # them) after frame_length // 2 zeros were prepended; its last sample is real when
    # i*hop + frame_length < frame_length // 2 + num_samples.
    last = num_samples + s.frame_length // 2 - s.frame_length - 1
    return 0 if last < 0 else last // s.hop_length + 1


def audio_token_count(valid_frames: int) -> int:
    """Soft tokens for ``valid_frames`` valid mel frames: the mask subsampled twice by 2
    (``mask[::2]``), as ``Gemma4Processor.replace_audio_token`` and the tower do."""
    t = valid_frames
    for _ in range(2):
        t = (t + 1) // 2
    return t


class LogMel:
    """The log-mel spectrogram and frame mask of one clip, as the reference computes it.

    ``exact=True`` (default): bit-identical to the reference (float64 filter bank and log,
    as there). ``exact=False``: the filter bank product and the log in float32 -- a fifth
    less time; features differ from the reference by float32 rounding only (at most
    ~5e-7 absolute on the test clips, whose values span about -7..3).
    """

    def __init__(self, s: AudioSettings, *, exact: bool = True):
        # The reference's own helpers define the window and the filter bank; computed once.
        from transformers.audio_utils import mel_filter_bank, window_function

        self.s = s
        self.exact = exact
        self.window = window_function(s.frame_length).astype(np.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the all-zero top filter, as the reference
            self.mel_filters = mel_filter_bank(
                num_frequency_bins=s.fft_length // 2 + 1,
                num_mel_filters=s.feature_size,
                min_frequency=s.min_frequency,
                max_frequency=s.max_frequency,
                sampling_rate=s.sampling_rate,
                norm=None,
                mel_scale="htk",
            )  # float64, (fft_length // 2 + 1, feature_size)
        self.mel_floor = np.array(s.mel_floor, dtype=np.float64)
        self.per_bin_mean = None if s.per_bin_mean is None else np.array(s.per_bin_mean).reshape(1, -1)
        self.per_bin_stddev = None if s.per_bin_stddev is None else np.array(s.per_bin_stddev).reshape(1, -1)
        self._dtype = np.float64 if exact else np.float32
        if not exact:
            self.mel_filters = self.mel_filters.astype(np.float32)
            self.mel_floor = np.array(s.mel_floor, dtype=np.float32)
            if self.per_bin_mean is not None:
                self.per_bin_mean = self.per_bin_mean.astype(np.float32)
            if self.per_bin_stddev is not None:
                self.per_bin_stddev = self.per_bin_stddev.astype(np.float32)
        # The filter bank is sparse: a bin feeds at most two adjacent triangles, so of the
        # 257 x 128 products per frame the dense matmul mostly adds exact zeros. A CSR product
        # over the nonzeros gives the same float64 sums up to summation order (1e-16
        # relative), which the final cast to float32 removes: the features stay equal to
        # the reference's on every clip we test (tests/encoders), at a fifth of the work.
        self._filters_t = scipy.sparse.csr_matrix(self.mel_filters.T)

    def padded_length(self, num_samples: int) -> int:
        m = self.s.pad_to_multiple_of
        return -(-num_samples // m) * m if m else num_samples

    def num_frames(self, num_samples: int) -> int:
        """Rows of ``input_features`` for a clip of ``num_samples`` (after truncation)."""
        s = self.s
        total = self.padded_length(num_samples) + s.frame_length // 2
        return max(0, (total - (s.frame_length + 1)) // s.hop_length + 1)

    def __call__(self, waveform: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``waveform``: 1-D float32 at ``sampling_rate``, already truncated to ``max_length``.
        Returns (features (frames, feature_size) float32, mask (frames,) bool)."""
        s = self.s
        n = int(waveform.shape[0])
        pad_left = s.frame_length // 2
        frames = self.num_frames(n)
        x = np.zeros(pad_left + self.padded_length(n), dtype=np.float32)
        if s.padding_value != 0.0:
            x[pad_left + n :] = s.padding_value
        src = np.asarray(waveform, dtype=np.float32)
        if s.dither > 0.0:  # random, as the reference (never set in released configs)
            src = src + s.dither * np.random.randn(*src.shape).astype(np.float32)
        if s.input_scale_factor != 1.0:
            src = src * s.input_scale_factor
        x[pad_left : pad_left + n] = src
        # Padding samples are scaled/dithered in the reference too; both are no-ops on zeros
        # unless dither is on, in which case the padded frames are masked out anyway.

        out = np.zeros((frames, s.feature_size), dtype=np.float32)
        valid = min(frames, valid_frame_count(n, s))
        mask = np.zeros(frames, dtype=bool)
        mask[:valid] = True
        if valid == 0:
            return out, mask
        # Masked frames are zero in the reference's output: compute only the valid ones,
        # in cache-sized row blocks, each carried through the whole chain before the next
        # (no clip-sized temporaries: fewer page faults and cache misses):
        # 1. window * frame -> float32 rfft -> magnitude, as float64 (the exact float32
        #    values: the reference's matmul upcasts them), stored transposed (bins, rows);
        # 2. the filter bank as a sparse product (see __init__) -> (feature_size, rows);
        # 3. + mel_floor, log, per-bin normalisation in place, cast to float32 into ``out``.
        # (Worker threads over row blocks were tried: slower, 13 -> 23 ms for 30 s.)
        self._compute(x, valid, out)
        return out, mask

    def _compute(self, x: np.ndarray, rows: int, out: np.ndarray) -> None:
        """``out[:rows]`` = the log-mel of the first ``rows`` frames of the padded signal:
        the reference's float32 window and FFT (each frame zero-padded to ``fft_length``
        in a reused buffer, which is what ``rfft(n=fft_length)`` does internally), then
        the filter bank and log in ``self._dtype``."""
        s = self.s
        size = s.frame_length + 1
        n_block = min(rows, _BLOCK_ROWS)
        block = np.zeros((n_block, s.fft_length), dtype=np.float32)
        spectrum = np.empty((n_block, s.fft_length // 2 + 1), dtype=np.complex64)
        magnitude_t = np.empty((s.fft_length // 2 + 1, n_block), dtype=self._dtype)
        for a in range(0, rows, _BLOCK_ROWS):
            b = min(rows, a + _BLOCK_ROWS)
            m = b - a
            view = np.lib.stride_tricks.as_strided(
                x[a * s.hop_length :],
                shape=(m, size),
                strides=(x.strides[0] * s.hop_length, x.strides[0]),
                writeable=False,
            )
            if s.preemphasis > 0.0:
                if s.preemphasis_htk_flavor:
                    first = view[:, :1] * (1.0 - s.preemphasis)
                    rest = view[:, 1:-1] - s.preemphasis * view[:, :-2]
                    frames = np.concatenate([first, rest], axis=-1)
                else:
                    frames = view[:, 1:] - s.preemphasis * view[:, :-1]
            else:
                frames = view[:, :-1]
            np.multiply(frames, self.window, out=block[:m, : s.frame_length])  # float32
            np.fft.rfft(block[:m], axis=-1, out=spectrum[:m])
            np.abs(spectrum[:m].T, out=magnitude_t[:, :m], casting="unsafe")
            mel_t = self._filters_t @ magnitude_t[:, :m]  # (feature_size, m)
            np.add(mel_t, self.mel_floor, out=mel_t)
            np.log(mel_t, out=mel_t)
            if self.per_bin_mean is not None:
                mel_t -= self.per_bin_mean.T
            if self.per_bin_stddev is not None:
                mel_t /= self.per_bin_stddev.T
            out[a:b] = mel_t.T  # cast to float32, as the reference's astype
