"""Qwen3-VL pixel preparation, bit-identical to the reference processors and faster:
rescale + normalise + patchify fused and done one cache-sized band at a time straight
into the output tensor, for images (:class:`ImagePixels`) and resized video frames
(:func:`video_pixels`)."""

from __future__ import annotations

import math
import mmap

import numpy as np
import torch
from PIL import Image as PILImage

from encoders.qwen3_vl.settings import ImageSettings, VideoSettings

__all__ = ["ImagePixels", "alloc_float32", "video_pixels"]


class ImagePixels:
    """Rescale + normalise + patchify for images, bit-identical to the reference's
    float64-rescale / float32-normalise / numpy-patchify chain, without its passes over
    full-size float64 and float32 copies.

    The output of each uint8 level is a fixed float32 number; ``self.lut`` holds the
    reference's value for all 256 levels (computed with the reference's own numpy
    operations). Pixels are converted band by band (whole merge rows, about 2 MB of
    float32 at a time, so a band stays in cache) with float32 arithmetic that was
    checked against the table for every level and channel when this object was built;
    if the check fails (an unusual mean/std/rescale_factor), the table itself is used.

    The band loop uses numpy, single-threaded on purpose: hundreds of small intra-op
    parallel regions (torch/OpenMP) stall badly when the cores are shared with other
    work, and the work is bound by memory traffic anyway.
    """

    def __init__(self, s: ImageSettings):
        self.s = s
        levels = np.arange(256, dtype=np.uint8)
        lut = np.empty((3, 256), dtype=np.float32)
        for c in range(3):
            x: np.ndarray = levels
            if s.do_rescale:  # image_transforms.rescale: float64 product, cast to float32
                x = (x.astype(np.float64) * s.rescale_factor).astype(np.float32)
            if s.do_normalize:  # image_transforms.normalize: float32 (x - mean) / std
                x = x.astype(np.float32)
                x = (x - np.array(s.image_mean[c], dtype=np.float32)) / np.array(
                    s.image_std[c], dtype=np.float32
                )
            lut[c] = np.asarray(x, dtype=np.float32)
        self.lut = lut
        self._divisor = np.float32(1.0 / s.rescale_factor) if s.do_rescale else None
        # Channel-uniform mean/std (Qwen3-VL: 0.5) are scalars and the arithmetic runs on the
        # band as decoded (channels last); otherwise it runs after the merge-order transpose,
        # where each channel is a contiguous p*p block (numpy broadcasting over a last axis of
        # 3 is slow).
        self.uniform = len(set(s.image_mean)) == 1 and len(set(s.image_std)) == 1
        if self.uniform:
            self._mean: np.ndarray = np.array(s.image_mean[0], dtype=np.float32)
            self._std: np.ndarray = np.array(s.image_std[0], dtype=np.float32)
        else:
            self._mean = np.array(s.image_mean, dtype=np.float32).reshape(3, 1, 1)
            self._std = np.array(s.image_std, dtype=np.float32).reshape(3, 1, 1)
        probe = np.repeat(np.arange(256, dtype=np.float32)[None, :, None], 3, axis=0)  # (channel, level, 1)
        self.arithmetic_exact = bool(np.array_equal(self._arith(probe).reshape(3, 256), lut))

    def _arith(self, x: np.ndarray) -> np.ndarray:
        """In place on float32 ``x`` (channels on axis -3 unless mean/std are uniform)."""
        if self._divisor is not None:
            np.divide(x, self._divisor, out=x)
        if self.s.do_normalize:
            np.subtract(x, self._mean, out=x)
            np.divide(x, self._std, out=x)
        return x

    def __call__(self, source: np.ndarray | PILImage.Image) -> torch.Tensor:
        """RGB pixels (an (H, W, 3) uint8 array or a mode-RGB PIL image), H and W multiples
        of patch * merge -> (patches, 3 * T * p * p) float32."""
        s = self.s
        p, m, t = s.patch_size, s.merge_size, s.temporal_patch_size
        if isinstance(source, np.ndarray):
            h, w = int(source.shape[0]), int(source.shape[1])
        else:
            w, h = source.size
        bh, bw = h // (p * m), w // (p * m)
        out_t = alloc_float32((bh, bw, m, m, 3, t, p, p))
        out = out_t.numpy()
        rows = max(1, (2 << 20) // (m * p * w * 3 * 4))
        lut = self.lut.reshape(-1)
        offsets = (np.arange(3) * 256).reshape(3, 1, 1)
        for r0 in range(0, bh, rows):
            r1 = min(bh, r0 + rows)
            y0, y1 = r0 * m * p, r1 * m * p
            if isinstance(source, np.ndarray):
                band = source[y0:y1]
            else:  # a band at a time: no full-size uint8 copy of the resized image
                band = np.frombuffer(source.crop((0, y0, w, y1)).tobytes(), dtype=np.uint8).reshape(
                    y1 - y0, w, 3
                )
            # (rows, m, p, bw, m, p, C) -> (rows, bw, m, m, C, p, p): the reference's merge order
            order = (0, 3, 1, 4, 6, 2, 5)
            split = (r1 - r0, m, p, bw, m, p, 3)
            if not self.arithmetic_exact:
                x = lut[band.reshape(split).transpose(order) + offsets]
            elif self.uniform:
                x = self._arith(band.astype(np.float32))
                x = np.ascontiguousarray(x.reshape(split).transpose(order))
            else:
                x = np.ascontiguousarray(band.reshape(split).transpose(order)).astype(np.float32)
                self._arith(x)
            dst = out[r0:r1]
            for k in range(t):  # the one frame fills every temporal slot
                dst[:, :, :, :, :, k] = x
        return out_t.view(bh * bw * m * m, 3 * t * p * p)


_HUGE_PAGE_MIN_BYTES = 8 << 20


def alloc_float32(shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised float32 CPU tensor. Large ones (a 12 MP photo makes 290 MB of
    pixel values) come from anonymous memory advised for transparent huge pages: in a VM,
    first-touch faults on 4 KB pages cost more than all the arithmetic that fills them
    (measured here: 170 ms to fill 290 MB of fresh ``torch.empty``, 40 ms with huge
    pages). The tensor keeps the mapping alive and unmaps it when freed."""
    n = math.prod(shape)
    nbytes = n * 4
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < _HUGE_PAGE_MIN_BYTES or advice is None:
        return torch.empty(shape, dtype=torch.float32)
    try:
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buf.madvise(advice)
    except (OSError, ValueError, AttributeError):
        return torch.empty(shape, dtype=torch.float32)
    return torch.frombuffer(buf, dtype=torch.float32, count=n).view(shape)


def video_pixels(frames: torch.Tensor, s: VideoSettings) -> torch.Tensor:
    """(N, C, H, W) uint8 resized frames (any memory layout) -> (t * h * w patches,
    C*T*p*p) float32, bit-identical to ``Qwen3VLVideoProcessor._preprocess`` (fused
    rescale+normalise in float32, then patchify; the last temporal group padded with
    copies of the last frame).

    The reference converts the whole clip to float32, normalises it in place and then
    copies it into merge order: three passes over hundreds of MB (16 frames of 720p make
    170 MB of float32). Here each temporal group is converted, normalised and scattered
    into merge order one band of merge rows at a time (about 2 MB, so it stays in cache),
    with the same float32 operations per element, straight into the output. numpy,
    single-threaded on purpose (see ``ImagePixels``)."""
    n, c, h, w = frames.shape
    p, m, t = s.patch_size, s.merge_size, s.temporal_patch_size
    gt, gh, gw = -(-n // t), h // p, w // p
    bh, bw = gh // m, gw // m
    order = list(range(n)) + [n - 1] * (gt * t - n)
    if s.do_rescale and s.do_normalize:  # TorchvisionBackend._fuse_mean_std_and_rescale_factor
        sub = (torch.tensor(s.image_mean) * (1.0 / s.rescale_factor)).numpy()
        div = (torch.tensor(s.image_std) * (1.0 / s.rescale_factor)).numpy()
        mul = None
    elif s.do_normalize:
        sub = torch.tensor(s.image_mean).numpy()
        div = torch.tensor(s.image_std).numpy()
        mul = None
    else:
        sub = div = None
        mul = np.float32(s.rescale_factor) if s.do_rescale else None
    if sub is not None:
        sub, div = sub.reshape(1, c, 1, 1), div.reshape(1, c, 1, 1)  # type: ignore[union-attr]
    src = frames.numpy()  # a view; the layout only changes the read pattern
    out_t = alloc_float32((gt, bh, bw, m, m, c, t, p, p))
    out = out_t.numpy()
    rows = max(1, (2 << 20) // (t * c * m * p * w * 4))  # merge rows per band
    x_buf = np.empty((t, c, rows * m * p, w), dtype=np.float32)
    for g in range(gt):
        group = order[g * t : (g + 1) * t]
        for r0 in range(0, bh, rows):
            r1 = min(bh, r0 + rows)
            y0, y1 = r0 * m * p, r1 * m * p
            x = x_buf[:, :, : y1 - y0]
            for k, f in enumerate(group):
                x[k] = src[f, :, y0:y1]  # uint8 -> float32, exact
            if sub is not None:
                np.subtract(x, sub, out=x)
                np.divide(x, div, out=x)
            elif mul is not None:
                np.multiply(x, mul, out=x)
            # (t, c, rows, m, p, bw, m, p) -> (rows, bw, m, m, c, t, p, p): the merge order
            out[g, r0:r1] = x.reshape(t, c, r1 - r0, m, p, bw, m, p).transpose(2, 5, 3, 6, 1, 0, 4, 7)
    return out_t.view(gt * gh * gw, c * t * p * p)
