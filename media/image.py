"""Still images: any raster Pillow reads, decoded to RGB uint8, validated, content-hashed.

Decoding is done in a fixed order so that hostile input is refused before it costs
anything:

1. the byte size is checked against ``MediaLimits.max_bytes``;
2. the format is identified from the file's magic bytes by Pillow's plugins, and
   only the header is parsed (lazy open);
3. the declared width x height and longest side (and every decoder tile's extent)
   are checked against ``max_image_pixels`` / ``max_image_side`` -- before any
   pixel buffer is allocated, so a 100000 x 100000 PNG of 100 KB costs nothing;
4. the pixels are decoded (first frame only for GIF/APNG/TIFF/WebP animations),
   truncated or malformed data raising rather than being padded with grey;
5. the result is normalised to RGB uint8 (see :meth:`Image.from_bytes`), the EXIF
   orientation is applied, and the optional reduced-size decode is applied.

Pillow's own decompression-bomb guard (``PIL.Image.MAX_IMAGE_PIXELS``, checked in
``PIL.Image.open``) is not used as a guard and is never mutated: we identify the
format with Pillow's plugin registry ourselves, so :class:`~media.limits.MediaLimits`
is the single authority, per call and thread-safe. Where a Pillow plugin still runs
its own check while loading (GIF frames, ICO/ICNS sizes) its
``DecompressionBombError`` is converted to :class:`MediaTooLargeError`.

Everything that can go wrong ends in a :class:`~media.errors.MediaError` subclass;
nothing else escapes :meth:`Image.from_bytes`.

Formats refused on purpose (:data:`EXCLUDED_FORMATS`): EPS (Pillow renders it by
running Ghostscript in a subprocess), WMF/EMF (vector), and Pillow's identify-only
stubs (BUFR, GRIB, HDF5, MPEG) which have no decoder. SVG and other vector formats
are not rasters and are refused as unsupported.

Known limitation: a PNG whose zlib stream ends cleanly before the last row (a
header that lies about the height, within the limits) decodes with the missing
rows black: Pillow treats the end of the compressed stream as the end of the image,
and re-inflating every PNG to check would cost ~30 % of a PNG decode. Memory stays
bounded by the declared, checked size.

Truncated files are refused because Pillow's module-wide
``PIL.ImageFile.LOAD_TRUNCATED_IMAGES`` defaults to ``False``; this module never
sets it. An application that sets it to ``True`` globally opts every Pillow user in
the process, including this one, into silently grey-padded truncated images.
"""

from __future__ import annotations

import io
import os
import re
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image as PILImage

from media.data_url import decode_data_url
from media.errors import (
    CorruptMediaError,
    EmptyMediaError,
    InvalidRequestError,
    MediaTooLargeError,
    PieMediaError,
    UnsupportedFormatError,
)
from media.hashing import content_hash, content_hash_parts
from media.integrity import PNG_SIGNATURE, verify_png
from media.limits import DEFAULT_LIMITS, MediaLimits
from media.pil_pixels import pixel_view, single_block_images
from media.png_fast import decode_png
from media.resize import resize, resize_array

__all__ = ["EXCLUDED_FORMATS", "Image"]

KIND = "image"

EXCLUDED_FORMATS: frozenset[str] = frozenset({"EPS", "WMF", "BUFR", "GRIB", "HDF5", "MPEG"})
"""Pillow formats we never open: EPS runs Ghostscript, WMF is vector, the rest are
identify-only stubs without a decoder."""

WHITE: tuple[int, int, int] = (255, 255, 255)

# EXIF tag 0x0112 (Orientation): the transpose that turns the stored pixels into the
# displayed picture, per the EXIF 2.3 specification, table "Orientation".
_ORIENTATION_TAG = 0x0112
_ORIENTATION_TRANSPOSE = {
    2: PILImage.Transpose.FLIP_LEFT_RIGHT,
    3: PILImage.Transpose.ROTATE_180,
    4: PILImage.Transpose.FLIP_TOP_BOTTOM,
    5: PILImage.Transpose.TRANSPOSE,
    6: PILImage.Transpose.ROTATE_270,
    7: PILImage.Transpose.TRANSVERSE,
    8: PILImage.Transpose.ROTATE_90,
}
_ORIENTATION_SWAPS_AXES = frozenset({5, 6, 7, 8})

_JPEG_FORMATS = frozenset({"JPEG", "MPO"})
_SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N"})
_WHITESPACE = re.compile(r"\s+")
_UNSUPPORTED_HINT = re.compile(r"not available|cannot find loader|unsupported|not supported", re.I)

_plugins_lock = threading.Lock()
_plugins_ready = False


def _ensure_plugins() -> None:
    """Import every Pillow plugin once (``PIL.Image.init`` is idempotent but not free)."""
    global _plugins_ready
    if not _plugins_ready:
        with _plugins_lock:
            PILImage.init()
            _plugins_ready = True


class Image:
    """A decoded still image: RGB, uint8, EXIF orientation applied, immutable.

    Build one with :meth:`from_bytes` (or :meth:`from_path`, :meth:`from_data_url`,
    :meth:`from_pil`, :meth:`from_array`). The pixels are read with :meth:`to_numpy`
    (a read-only HWC array, no copy) or :meth:`to_pil` (a fresh PIL image).

    ``content_hash`` identifies the decoded result: for encoded input it is the
    SHA-256/128 of the encoded bytes, salted with the options that changed the
    result (the background colour when something was transparent, the output size
    when ``reduce_to`` shrank the image). For :meth:`from_pil` / :meth:`from_array`
    it is a hash of the RGB pixels, so it never equals the hash of an encoded file.
    """

    __slots__ = ("_array", "_format", "_hash", "_pil", "_size", "_source_mode", "_source_size")
    kind = KIND

    def __init__(
        self,
        *,
        pil: PILImage.Image | None = None,
        array: np.ndarray | None = None,
        format: str | None,
        source_mode: str,
        source_size: tuple[int, int],
        content_hash: str,
    ) -> None:
        # Internal: use the from_* constructors. Exactly one of pil (mode RGB) or
        # array (HWC uint8, read-only) is given; the other is made on demand.
        if pil is None and array is None:
            raise InvalidRequestError("Image needs pixels", kind=KIND)
        self._pil = pil
        self._array = array
        if pil is not None:
            self._size = pil.size
        else:
            assert array is not None
            self._size = (int(array.shape[1]), int(array.shape[0]))
        self._format = format
        self._source_mode = source_mode
        self._source_size = source_size
        self._hash = content_hash

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_bytes(
        cls,
        data: bytes | bytearray | memoryview,
        limits: MediaLimits | None = None,
        *,
        background: Sequence[int] = WHITE,
        reduce_to: tuple[int, int] | None = None,
    ) -> Image:
        """Decode an encoded image (JPEG, PNG, WebP, GIF, BMP, TIFF, ... any raster
        Pillow reads) into RGB uint8.

        Normalisation to RGB:

        * transparency (RGBA, LA, PA, premultiplied RGBa/La, palette or grey/RGB
          images with a ``tRNS`` transparent colour) is alpha-composited over
          ``background`` (default white, as transformers' ``convert_to_rgb`` does);
        * CMYK, YCbCr, HSV, palette, grey and 1-bit images are converted by Pillow;
        * 16-bit grey (``I;16*``) keeps the high byte (``value >> 8``): exact for
          8-bit data stored as 16-bit (``v * 257 -> v``) and the same rule Pillow
          applies when it decodes 16-bit RGB/RGBA PNGs, so every 16-bit input is
          reduced the same way; 32-bit integer ``I`` images are clipped to
          0..65535 and reduced the same way; float ``F`` images are read as 0..1
          when their maximum is at most 1, as 0..255 when at most 255, and as
          0..65535 otherwise (NaN becomes 0);
        * the EXIF orientation tag (values 2..8) is applied, so ``width``/``height``
          are those of the picture as displayed.

        ``reduce_to=(w, h)`` asks for a cheaper, smaller decode for callers that are
        going to shrink the image anyway. JPEGs are decoded at 1/2, 1/4 or 1/8 scale
        directly in the DCT domain (Pillow's ``draft``), which skips most of the
        decoding work; any remaining integer factor, and every other format, is
        reduced with a box filter (``PIL.Image.reduce``). The result is never
        reduced below ``reduce_to`` on either side (sizes are in displayed
        orientation); an image already smaller is returned at full size.
        Accuracy trade-off: DCT-domain scaling and box reduction are not the same
        as a full decode followed by the bicubic resize the reference processors
        use, so pixels differ slightly (a few levels, more on sharp edges). It is
        off by default and the parity paths never use it.

        Raises (all :class:`~media.errors.MediaError`): ``EmptyMediaError`` for no
        bytes; ``MediaTooLargeError`` for bytes, pixels or side over ``limits``;
        ``UnsupportedFormatError`` for bytes no raster plugin recognises (text,
        SVG, audio) or a mode that cannot become RGB; ``CorruptMediaError`` for a
        recognised format whose header or data is malformed or truncated;
        ``InvalidRequestError`` for bad arguments.
        """
        limits = _check_limits(limits)
        bg = _check_background(background)
        target = _check_reduce_to(reduce_to)
        if isinstance(data, bytes):
            raw = data
        elif isinstance(data, (bytearray, memoryview)):
            limits.check_bytes(memoryview(data).nbytes, KIND)
            raw = bytes(data)  # own copy: a caller's buffer could change under the decoder
        else:
            raise InvalidRequestError(f"image data must be bytes, got {type(data).__name__}", kind=KIND)
        if not raw:
            raise EmptyMediaError("image data is empty (0 bytes)", limit=1, actual=0, kind=KIND)
        limits.check_bytes(len(raw), KIND)

        if raw.startswith(PNG_SIGNATURE):
            verify_png(raw, kind=KIND)
        try:
            src = _open_lazily(raw)
            digest: list[str] = []  # hashed while the fast PNG path inflates, if it runs
            fast = _fast_png(raw, src, limits, target, lambda: digest.append(content_hash(raw)))
            if fast is not None:
                return cls(
                    array=fast,
                    format=src.format,
                    source_mode=src.mode,
                    source_size=(fast.shape[1], fast.shape[0]),
                    content_hash=digest[0] if digest else content_hash(raw),
                )
            rgb, fmt, source_mode, source_size, salt = _decode(src, limits, bg, target)
        except PieMediaError:
            raise
        except PILImage.DecompressionBombError as e:
            raise _too_large_from_pillow(e, limits) from None
        except MemoryError:
            raise MediaTooLargeError(
                "ran out of memory decoding the image", limit=limits.max_image_pixels, kind=KIND
            ) from None
        except RecursionError:
            raise CorruptMediaError("image structure is nested too deeply", kind=KIND) from None
        except Exception as e:  # any other decoder failure: missing codec, or malformed input
            if _UNSUPPORTED_HINT.search(str(e)):
                raise UnsupportedFormatError(
                    f"image uses an unsupported feature: {_describe(e)}", kind=KIND
                ) from None
            raise CorruptMediaError(f"image is truncated or malformed: {_describe(e)}", kind=KIND) from None
        return cls(
            pil=rgb,
            format=fmt,
            source_mode=source_mode,
            source_size=source_size,
            content_hash=content_hash(raw, *salt),
        )

    @classmethod
    def from_path(cls, path: str | os.PathLike[str], limits: MediaLimits | None = None, **kw: Any) -> Image:
        """Read a file and decode it with :meth:`from_bytes` (same keyword options).

        The size is checked from ``stat`` before reading, and at most
        ``max_bytes + 1`` bytes are ever read (special files cannot stream forever).
        An unreadable path raises ``InvalidRequestError``.
        """
        limits = _check_limits(limits)
        try:
            p = Path(path)
        except TypeError:
            raise InvalidRequestError(
                f"image path must be a str or os.PathLike, got {type(path).__name__}", kind=KIND
            ) from None
        try:
            st = p.stat()
            if p.is_dir():
                raise InvalidRequestError(f"image path {str(p)!r} is a directory", kind=KIND)
            if p.is_file():
                limits.check_bytes(st.st_size, KIND)
            with p.open("rb") as f:
                data = f.read(limits.max_bytes + 1)
        except PieMediaError:
            raise
        except (OSError, ValueError) as e:
            raise InvalidRequestError(
                f"cannot read image file {str(p)!r}: {_describe(e)}", kind=KIND
            ) from None
        return cls.from_bytes(data, limits, **kw)

    @classmethod
    def from_data_url(cls, url: str, limits: MediaLimits | None = None, **kw: Any) -> Image:
        """Decode a ``data:image/<type>;base64,<payload>`` URL (RFC 2397).

        Only inline base64 image data is accepted; no URL is ever fetched (that
        would be an SSRF hole), so ``http:``, ``https:``, ``file:`` and friends raise
        ``InvalidRequestError``, and a data URL of another media type (``text/plain``)
        raises ``UnsupportedFormatError``. The declared image subtype is not trusted:
        the bytes are identified by their content. Whitespace inside the payload and
        missing ``=`` padding are tolerated; any other non-base64 character is not.
        """
        limits = _check_limits(limits)
        data = decode_data_url(url, kind=KIND, limits=limits)
        return cls.from_bytes(data, limits, **kw)

    @classmethod
    def from_pil(
        cls,
        image: PILImage.Image,
        limits: MediaLimits | None = None,
        *,
        background: Sequence[int] = WHITE,
    ) -> Image:
        """Normalise an in-memory (or lazily opened) PIL image like :meth:`from_bytes`
        does: limits, EXIF orientation, RGB conversion, compositing. The caller's
        image is not modified. ``content_hash`` hashes the resulting RGB pixels."""
        limits = _check_limits(limits)
        bg = _check_background(background)
        if not isinstance(image, PILImage.Image):
            raise InvalidRequestError(f"expected a PIL image, got {type(image).__name__}", kind=KIND)
        try:
            rgb, fmt, source_mode, source_size, _salt = _decode(image, limits, bg, None)
            if rgb is image:
                rgb = image.copy()
        except PieMediaError:
            raise
        except PILImage.DecompressionBombError as e:
            raise _too_large_from_pillow(e, limits) from None
        except MemoryError:
            raise MediaTooLargeError("ran out of memory converting the image", kind=KIND) from None
        except Exception as e:
            raise CorruptMediaError(f"image could not be converted: {_describe(e)}", kind=KIND) from None
        out = cls(pil=rgb, format=fmt, source_mode=source_mode, source_size=source_size, content_hash="")
        out._hash = _pil_pixel_hash(rgb)
        return out

    @classmethod
    def from_array(
        cls,
        array: np.ndarray,
        limits: MediaLimits | None = None,
        *,
        background: Sequence[int] = WHITE,
    ) -> Image:
        """Wrap pixels: ``uint8`` of shape (H, W) grey, (H, W, 1) grey, (H, W, 3) RGB
        or (H, W, 4) RGBA (composited over ``background``). The array is copied, so
        later changes to it do not reach the image. ``content_hash`` hashes the
        resulting RGB pixels (an RGB array and ``from_pil`` of the same pixels agree).
        """
        limits = _check_limits(limits)
        bg = _check_background(background)
        if not isinstance(array, np.ndarray):
            raise InvalidRequestError(f"expected a numpy array, got {type(array).__name__}", kind=KIND)
        if array.dtype != np.uint8:
            raise InvalidRequestError(f"image array must be uint8, got {array.dtype}", kind=KIND)
        if array.ndim == 3 and array.shape[2] == 1:
            array = array[:, :, 0]
        if not (array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (3, 4))):
            raise InvalidRequestError(
                f"image array must be HxW, HxWx1, HxWx3 or HxWx4, got shape {array.shape}", kind=KIND
            )
        h, w = int(array.shape[0]), int(array.shape[1])
        if h == 0 or w == 0:
            raise EmptyMediaError(f"image array has no pixels (shape {array.shape})", kind=KIND)
        _check_size(w, h, limits, "image array")
        if array.ndim == 2:
            source_mode = "L"
            rgb = np.repeat(array[:, :, None], 3, axis=2)
        elif array.shape[2] == 3:
            source_mode = "RGB"
            rgb = np.array(array, dtype=np.uint8, order="C", copy=True)
        else:
            source_mode = "RGBA"
            rgba = PILImage.fromarray(np.ascontiguousarray(array))
            pil, _ = _composite(rgba, bg)
            rgb = np.asarray(pil)
        rgb = np.ascontiguousarray(rgb)
        rgb.flags.writeable = False
        return cls(
            array=rgb,
            format=None,
            source_mode=source_mode,
            source_size=(w, h),
            content_hash=_pixel_hash(rgb),
        )

    # ------------------------------------------------------------------ accessors

    @property
    def width(self) -> int:
        return self._size[0]

    @property
    def height(self) -> int:
        return self._size[1]

    @property
    def size(self) -> tuple[int, int]:
        """``(width, height)`` as displayed (EXIF orientation applied, after ``reduce_to``)."""
        return self._size

    @property
    def source_size(self) -> tuple[int, int]:
        """``(width, height)`` of the full-resolution picture as displayed, before ``reduce_to``."""
        return self._source_size

    @property
    def format(self) -> str | None:
        """Pillow's format name of the input (``"JPEG"``, ``"PNG"``, ``"WEBP"``, ...);
        ``None`` for :meth:`from_array` and in-memory PIL images."""
        return self._format

    @property
    def source_mode(self) -> str:
        """Pillow mode of the input before normalisation (``"RGBA"``, ``"P"``, ``"I;16"``...)."""
        return self._source_mode

    @property
    def content_hash(self) -> str:
        return self._hash

    @property
    def nbytes(self) -> int:
        """Bytes of the decoded RGB pixels (``width * height * 3``)."""
        return self._size[0] * self._size[1] * 3

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready metadata: ``kind``, format, size after decoding, source mode and size, hash."""
        return {
            "kind": KIND,
            "format": self._format,
            "width": self._size[0],
            "height": self._size[1],
            "mode": self._source_mode,
            "source_width": self._source_size[0],
            "source_height": self._source_size[1],
            "content_hash": self._hash,
        }

    def to_numpy(self, copy: bool = False) -> np.ndarray:
        """Pixels as a C-contiguous ``(height, width, 3)`` uint8 RGB array.

        Without ``copy`` the same read-only array is returned on every call (no
        copy after the first); pass ``copy=True`` for a private writeable one.
        """
        arr = self._array
        if arr is None:
            assert self._pil is not None
            arr = np.ascontiguousarray(np.asarray(self._pil, dtype=np.uint8))
            arr.flags.writeable = False
            self._array = arr
        return arr.copy() if copy else arr

    def to_pil(self) -> PILImage.Image:
        """A new mode-``RGB`` PIL image (the caller may modify it freely)."""
        if self._pil is None:
            self._pil = PILImage.fromarray(self.to_numpy())
        return self._pil.copy()

    def resized(self, size: tuple[int, int], resample: int) -> PILImage.Image:
        """``to_pil().resize(size, resample)`` without the full-size copy ``to_pil`` makes
        (Pillow's resize reads its source and returns a new image; a 12 MP copy costs
        20-35 ms here), split across threads by :func:`media.resize.resize`. Same pixels
        as that call."""
        if self._pil is None:
            self._pil = PILImage.fromarray(self.to_numpy())
        return resize(self._pil, size, resample)

    def resized_array(self, size: tuple[int, int], resample: int) -> np.ndarray:
        """``np.asarray(to_pil().resize(size, resample))``, bit for bit, as a new
        ``(height, width, 3)`` uint8 array, without copying the source pixels first:
        :func:`media.resize.resize_array` (vectorised kernels on several threads where
        numba runs here, Pillow otherwise)."""
        source = self._pil if self._pil is not None else self.to_numpy()
        return resize_array(source, size, resample)

    def rgb_view(self) -> np.ndarray:
        """A read-only ``(height, width, 3)`` uint8 view of the pixels, without the copy
        :meth:`to_numpy` makes of a decoded image (it reads Pillow's memory in place,
        :func:`media.pil_pixels.pixel_view`, so it may be strided: use :meth:`to_numpy`
        where C order matters)."""
        if self._array is None and self._pil is not None:
            view = pixel_view(self._pil)
            if view is not None:
                return view[:, :, :3]
        return self.to_numpy()

    def __repr__(self) -> str:
        return (
            f"Image({self.width}x{self.height}, format={self._format!r}, "
            f"source_mode={self._source_mode!r}, hash={self._hash[:12]})"
        )


# ---------------------------------------------------------------------- decode steps


def _open_lazily(data: bytes) -> PILImage.Image:
    """Identify the format and parse only the header (no pixel allocation).

    This walks Pillow's plugin registry like ``PIL.Image.open`` does, minus the
    global ``MAX_IMAGE_PIXELS`` check (our limits are checked next), so that we can
    also tell "recognised but malformed" (corrupt) from "not an image" (unsupported).
    Plugins that sniff magic bytes are tried first; the few without a magic check
    (TGA, IM, SPIDER, ...) are tried only when none of those opened the file.
    """
    _ensure_plugins()
    prefix = data[:16]
    fp = io.BytesIO(data)
    failures: list[tuple[str, Exception]] = []
    refusals: list[str] = []
    guessers: list[tuple[str, Any]] = []
    for fmt in list(PILImage.ID):
        factory, accept = PILImage.OPEN[fmt]
        if accept is None:
            if fmt not in EXCLUDED_FORMATS:
                guessers.append((fmt, factory))
            continue
        try:
            verdict = accept(prefix)
        except Exception:
            continue
        if not verdict:
            continue
        if fmt in EXCLUDED_FORMATS:
            refusals.append(f"{fmt} images are not accepted")
            continue
        if isinstance(verdict, str):  # Pillow's "looks like X but support is not installed"
            refusals.append(verdict)
            continue
        opened = _try_factory(factory, fp, fmt, failures)
        if opened is not None:
            return opened
    # Some magics are weak (a TGA header can start like a CUR one), so the
    # magic-less plugins get their turn even after a magic matched and failed.
    guess_failures: list[tuple[str, Exception]] = []
    for fmt, factory in guessers:
        opened = _try_factory(factory, fp, fmt, guess_failures)
        if opened is not None:
            return opened
    if failures:
        fmt, err = failures[0]
        raise CorruptMediaError(
            f"image looks like {fmt} but its header is malformed: {_describe(err)}", kind=KIND
        )
    if refusals:
        raise UnsupportedFormatError(f"unsupported image: {refusals[0]}", kind=KIND)
    raise UnsupportedFormatError(
        f"not a recognised raster image format (starts with {prefix[:8]!r})", kind=KIND
    )


def _try_factory(factory: Any, fp: io.BytesIO, fmt: str, failures: list[tuple[str, Exception]]) -> Any:
    fp.seek(0)
    try:
        return factory(fp, "")
    except (PILImage.DecompressionBombError, MemoryError):
        raise
    except Exception as e:
        failures.append((fmt, e))
        return None


def _decode(
    src: PILImage.Image,
    limits: MediaLimits,
    background: tuple[int, int, int],
    reduce_to: tuple[int, int] | None,
) -> tuple[PILImage.Image, str | None, str, tuple[int, int], tuple[object, ...]]:
    """Header checks, (draft), load, RGB normalisation, orientation, reduction."""
    single_block_images()  # decoded pixels readable in place (media.pil_pixels)
    fmt = src.format
    what = f"{fmt} image" if fmt else "image"
    w, h = src.size
    _check_size(w, h, limits, what)
    for tile in getattr(src, "tile", None) or ():
        extents = tile[1] if len(tile) > 1 else None
        if isinstance(extents, tuple) and len(extents) == 4:
            x0, y0, x1, y1 = (int(v) for v in extents)
            _check_size(max(x1 - x0, 0), max(y1 - y0, 0), limits, f"{what} tile")

    drafting = reduce_to is not None and fmt in _JPEG_FORMATS and hasattr(src, "draft")
    if not drafting:
        # Load first: reading EXIF from some formats (PNG) loads the pixels, and
        # _orientation swallows EXIF errors -- a decode error must not be swallowed with
        # them (it left a PNG with a damaged stream or filter byte half-decoded).
        src.load()
    orientation = _orientation(src)
    swaps = orientation in _ORIENTATION_SWAPS_AXES
    if drafting:
        stored_target = (reduce_to[1], reduce_to[0]) if swaps else reduce_to
        src.draft(src.mode, stored_target)
    src.load()
    lw, lh = src.size
    if (lw, lh) != (w, h):  # a plugin may grow the canvas while loading (GIF frames)
        _check_size(lw, lh, limits, what)
    source_mode = src.mode

    rgb, composited = _to_rgb(src, background)
    transpose = _ORIENTATION_TRANSPOSE.get(orientation)
    if transpose is not None:
        rgb = rgb.transpose(transpose)
    source_size = (h, w) if swaps else (w, h)
    if reduce_to is not None:
        factor = min(rgb.width // reduce_to[0], rgb.height // reduce_to[1])
        if factor >= 2:
            rgb = rgb.reduce(factor)
    salt: list[object] = []
    if composited:
        salt.append(("background", background))
    if rgb.size != source_size:
        salt.append(("reduced", rgb.size))
    return rgb, fmt, source_mode, source_size, tuple(salt)


def _fast_png(
    raw: bytes,
    src: PILImage.Image,
    limits: MediaLimits,
    reduce_to: tuple[int, int] | None,
    meanwhile: Callable[[], object] | None = None,
) -> np.ndarray | None:
    """The pixels of a plain 8-bit RGB/grey PNG by :func:`media.png_fast.decode_png`
    (same pixels as Pillow, about 3x faster), or ``None`` for every image it does not
    take: then :func:`_decode` does the work, with all its checks and errors."""
    # decode_png itself declines transparency, EXIF and every other PNG type.
    if src.format != "PNG" or reduce_to is not None or src.mode not in ("RGB", "L"):
        return None
    w, h = src.size
    _check_size(w, h, limits, "PNG image")
    pixels = decode_png(raw, meanwhile=meanwhile)
    if pixels is None or pixels.shape[:2] != (h, w):
        return None
    pixels.flags.writeable = False
    return pixels


def _orientation(src: PILImage.Image) -> int:
    try:
        value = src.getexif().get(_ORIENTATION_TAG, 1)
    except Exception:  # malformed EXIF never stops a decode; orientation is then unknown
        return 1
    return value if isinstance(value, int) and value in _ORIENTATION_TRANSPOSE else 1


def _to_rgb(im: PILImage.Image, background: tuple[int, int, int]) -> tuple[PILImage.Image, bool]:
    """Return (RGB image, whether transparency was composited over ``background``)."""
    mode = im.mode
    if mode in _SIXTEEN_BIT_MODES or mode in ("I", "F"):
        return _high_depth_to_rgb(im, background)
    if mode == "RGB" and "transparency" not in im.info:
        return im, False
    if im.has_transparency_data:
        return _composite(im.convert("RGBA"), background)
    try:
        return im.convert("RGB"), False
    except ValueError as e:
        raise UnsupportedFormatError(
            f"image mode {mode} cannot be converted to RGB: {e}", kind=KIND
        ) from None


def _composite(rgba: PILImage.Image, background: tuple[int, int, int]) -> tuple[PILImage.Image, bool]:
    lo, _hi = rgba.getchannel("A").getextrema()
    if lo == 255:  # fully opaque after all: the background plays no part
        return rgba.convert("RGB"), False
    base = PILImage.new("RGBA", rgba.size, (*background, 255))
    base.alpha_composite(rgba)
    return base.convert("RGB"), True


def _high_depth_to_rgb(im: PILImage.Image, background: tuple[int, int, int]) -> tuple[PILImage.Image, bool]:
    arr = np.asarray(im)
    if im.mode in _SIXTEEN_BIT_MODES:
        grey = (arr.astype(np.uint16) >> 8).astype(np.uint8)
    elif im.mode == "I":
        grey = (np.clip(arr, 0, 65535).astype(np.uint16) >> 8).astype(np.uint8)
    else:  # "F"
        values = np.nan_to_num(arr.astype(np.float32), nan=0.0, posinf=0.0, neginf=0.0)
        top = float(values.max()) if values.size else 0.0
        scale = 255.0 if top <= 1.0 else (1.0 if top <= 255.0 else 1.0 / 257.0)
        grey = np.clip(np.rint(values * scale), 0, 255).astype(np.uint8)
    rgb = np.repeat(grey[:, :, None], 3, axis=2)
    composited = False
    transparent = im.info.get("transparency")
    if isinstance(transparent, int) and not isinstance(transparent, bool):
        mask = arr == transparent
        if mask.any():
            rgb[mask] = background
            composited = True
    return PILImage.fromarray(rgb), composited


# ---------------------------------------------------------------------- argument checks


def _check_limits(limits: MediaLimits | None) -> MediaLimits:
    if limits is None:
        return DEFAULT_LIMITS
    if not isinstance(limits, MediaLimits):
        raise InvalidRequestError(f"limits must be a MediaLimits, got {type(limits).__name__}", kind=KIND)
    return limits


def _check_background(background: Sequence[int]) -> tuple[int, int, int]:
    try:
        values = tuple(int(v) for v in background)
        ok = len(values) == 3 and all(0 <= v <= 255 for v in values) and not isinstance(background, str)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise InvalidRequestError(f"background must be three ints in 0..255, got {background!r}", kind=KIND)
    return values  # type: ignore[return-value]


def _check_reduce_to(reduce_to: tuple[int, int] | None) -> tuple[int, int] | None:
    if reduce_to is None:
        return None
    try:
        values = tuple(int(v) for v in reduce_to)
        ok = len(values) == 2 and all(v > 0 for v in values)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise InvalidRequestError(f"reduce_to must be two positive ints (w, h), got {reduce_to!r}", kind=KIND)
    return values  # type: ignore[return-value]


def _check_size(w: int, h: int, limits: MediaLimits, what: str) -> None:
    if w <= 0 or h <= 0:
        raise CorruptMediaError(f"{what} declares an empty size {w}x{h}", kind=KIND)
    side = max(w, h)
    if side > limits.max_image_side:
        raise MediaTooLargeError(
            f"{what} is {w}x{h}: its longest side {side} is over the limit of {limits.max_image_side}",
            limit=limits.max_image_side,
            actual=side,
            kind=KIND,
        )
    pixels = w * h
    if pixels > limits.max_image_pixels:
        raise MediaTooLargeError(
            f"{what} is {w}x{h} = {pixels} pixels, over the limit of {limits.max_image_pixels} pixels",
            limit=limits.max_image_pixels,
            actual=pixels,
            kind=KIND,
        )


def _too_large_from_pillow(err: Exception, limits: MediaLimits) -> MediaTooLargeError:
    return MediaTooLargeError(
        f"image refused by Pillow's decompression-bomb check: {err}", limit=limits.max_image_pixels, kind=KIND
    )


def _pixel_hash(rgb: np.ndarray) -> str:
    return content_hash(np.ascontiguousarray(rgb).data, "rgb-pixels", rgb.shape)


_HASH_BAND_ROWS = 256


def _pil_pixel_hash(rgb: PILImage.Image) -> str:
    """``_pixel_hash`` of an RGB PIL image's pixels (the same bytes, so the same hash as
    the array), packed a band of rows at a time: no full-size array (a 12 MP photo hashes
    in ~25 ms instead of ~55 ms through ``np.asarray``)."""
    w, h = rgb.size
    bands = (rgb.crop((0, y, w, min(h, y + _HASH_BAND_ROWS))).tobytes() for y in range(0, h, _HASH_BAND_ROWS))
    return content_hash_parts(bands, "rgb-pixels", (h, w, 3))


def _describe(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    if len(text) > 200:
        text = text[:200] + "..."
    return f"{type(err).__name__}: {text}" if not text.startswith(type(err).__name__) else text
