"""Preparation benchmarks: ours vs the transformers processors, side by side in one run.

    python bench/preprocess.py [--repeats N]

Each row times the whole path from encoded bytes to model inputs on both sides
(decode + prepare; the reference side decodes with PIL/librosa/load_video as a user of
transformers would) and checks parity of the outputs it compares. Encoder caches are
bypassed (a fresh cache per call) so every call does the work. Ratios > 1 mean ours is
faster. The aims (issue 3): >= 3x on the large JPEG and on video, >= 2x on audio.

Video: the reference Qwen3-VL video processor needs torchvision, which is not a
dependency, so the reference side is ``transformers.video_utils.load_video(backend="pyav")``
for the same 16 frames followed by the reference image processor applied to those
frames (the same resize + normalise work per frame); ours is media.Video +
Qwen3VLEncoder.prepare(num_frames=16).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image as PILImage  # noqa: E402

from bench.timing import interleaved, median_ms  # noqa: E402
from encoders import EncoderCache, encoder_for  # noqa: E402
from fixtures.samples import ensure_bench_media, ensure_samples  # noqa: E402
from fixtures.tiny_models import ensure_tiny_model  # noqa: E402
from media import Audio, Image, Video  # noqa: E402


def _fresh(encoder):
    encoder.cache = EncoderCache()
    return encoder


def row(label: str, ours: float, ref: float, parity: str) -> None:
    print(f"  {label:<44}{ours * 1e3:>10.1f}{ref * 1e3:>10.1f}{ref / ours:>8.2f}x  {parity}")


def bench_images(label: str, enc, ref_proc, samples: Path, repeats: int) -> None:
    """Decode + prepare of two photos, ours vs ``ref_proc`` (PIL decode + the processor)."""
    for rel in ("images/photo_4032x3024.jpg", "images/photo_1024x768.png"):
        data = (samples / rel).read_bytes()

        def ours(data=data):
            return _fresh(enc).prepare(Image.from_bytes(data)).inputs["pixel_values"]

        def ref(data=data):
            pil = PILImage.open(io.BytesIO(data)).convert("RGB")
            return ref_proc(images=[pil], return_tensors="pt")["pixel_values"]

        res = interleaved({"ours": ours, "ref": ref}, repeats)
        a, b = res["ours"][1], res["ref"][1]
        parity = (
            f"max|diff| {(a - b.reshape(a.shape)).abs().max().item():.1e}"
            if a.numel() == b.numel()
            else (f"SHAPE MISMATCH {tuple(a.shape)} vs {tuple(b.shape)}")
        )
        row(f"{label} image {Path(rel).name}", res["ours"][0], res["ref"][0], parity)

        # The processors alone, both given the decoded picture (a transformers user decodes
        # first, then calls the processor; the figure users compare processors by).
        pil = PILImage.open(io.BytesIO(data)).convert("RGB")
        pil.load()

        def ours_decoded(pil=pil):
            return _fresh(enc).prepare(Image.from_pil(pil)).inputs["pixel_values"]

        def ref_decoded(pil=pil):
            return ref_proc(images=[pil], return_tensors="pt")["pixel_values"]

        res = interleaved({"ours": ours_decoded, "ref": ref_decoded}, repeats)
        a, b = res["ours"][1], res["ref"][1]
        same = a.numel() == b.numel() and bool((a - b.reshape(a.shape)).abs().max() == 0)
        row("  same, from decoded pixels", res["ours"][0], res["ref"][0], "equal" if same else "DIFFERENT")


def bench_qwen_images(samples: Path, repeats: int) -> None:
    from transformers import AutoImageProcessor

    model_dir = ensure_tiny_model("tiny-qwen3-vl")
    ref = AutoImageProcessor.from_pretrained(model_dir)
    bench_images("Qwen3-VL", encoder_for(model_dir, load_weights=False), ref, samples, repeats)


def bench_gemma_image(samples: Path, repeats: int) -> None:
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    model_dir = ensure_tiny_model("tiny-gemma4")
    ref = Gemma4ImageProcessorPil.from_pretrained(model_dir)
    bench_images("Gemma-4", encoder_for(model_dir, load_weights=False), ref, samples, repeats)


def bench_request_of_four(samples: Path, repeats: int) -> None:
    """Four photos in one request: ours prepares a request's media concurrently (one worker
    thread each, as ``engine.Completion`` does; Pillow and torch release the GIL); the
    reference processor takes the list and works through it in turn."""
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoImageProcessor

    model_dir = ensure_tiny_model("tiny-qwen3-vl")
    enc = encoder_for(model_dir, load_weights=False)
    ref_proc = AutoImageProcessor.from_pretrained(model_dir)
    names = ["photo_1024x768.png", "photo_640x480.jpg", "cmyk.jpg", "lossy.webp"]
    blobs = [(samples / "images" / n).read_bytes() for n in names]
    pool = ThreadPoolExecutor(len(blobs))

    def ours():
        _fresh(enc)
        return [
            f.result() for f in [pool.submit(lambda b=b: enc.prepare(Image.from_bytes(b))) for b in blobs]
        ]

    def ref():
        pils = [PILImage.open(io.BytesIO(b)).convert("RGB") for b in blobs]
        return ref_proc(images=pils, return_tensors="pt")["pixel_values"]

    res = interleaved({"ours": ours, "ref": ref}, repeats)
    mine = torch.cat([p.inputs["pixel_values"] for p in res["ours"][1]])
    theirs = res["ref"][1]
    same = mine.shape == theirs.shape and bool((mine - theirs).abs().max() == 0)
    row(
        "Qwen3-VL request of 4 images (concurrent)",
        res["ours"][0],
        res["ref"][0],
        "equal" if same else "DIFFERENT",
    )
    pool.shutdown()


def bench_gemma_audio(samples: Path, repeats: int) -> None:
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    model_dir = ensure_tiny_model("tiny-gemma4")
    ref_fe = Gemma4AudioFeatureExtractor.from_pretrained(model_dir)
    for exact in (True, False):
        _bench_gemma_audio_one(
            samples, repeats, encoder_for(model_dir, load_weights=False, exact_audio=exact), ref_fe, exact
        )


def _bench_gemma_audio_one(samples: Path, repeats: int, enc, ref_fe, exact: bool) -> None:
    import librosa

    data = (samples / "audio/speechlike_30s_16k.wav").read_bytes()
    librosa.load(io.BytesIO(data), sr=16000)  # JIT warm-up outside the timing

    def ours():
        return _fresh(enc).prepare(Audio.from_bytes(data)).inputs

    def ref():
        wav, _ = librosa.load(io.BytesIO(data), sr=16000, mono=True)
        return ref_fe([wav], sampling_rate=16000, return_tensors="pt")

    res = interleaved({"ours": ours, "ref": ref}, repeats)
    o, r = res["ours"][1], res["ref"][1]
    of = next(v for k, v in o.items() if "feature" in k and v.is_floating_point())
    rf = r["input_features"]
    n = min(of.shape[-2], rf.shape[-2])
    diff = (of.reshape(-1, n, of.shape[-1])[0, :n] - rf[0, :n]).abs().max().item()
    row(
        f"Gemma-4 log-mel 30 s ({'float64 mel, exact' if exact else 'float32 mel'})",
        res["ours"][0],
        res["ref"][0],
        f"max|diff| {diff:.1e}",
    )


def image_stages(samples: Path, repeats: int) -> None:
    """Where the time of an image goes, stage by stage, ours beside the reference's:
    decode (bytes -> RGB pixels: Pillow's for JPEG on both sides, ours for plain PNGs), resize (Pillow's
    arithmetic on both sides, bit for bit: ours in media/fast_resample.py's vectorised,
    threaded kernels), and rescale+normalise+patchify (the reference: its processor minus
    its resize)."""
    from transformers import AutoImageProcessor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from encoders.gemma4.vision import patchify

    qwen_dir, gemma_dir = ensure_tiny_model("tiny-qwen3-vl"), ensure_tiny_model("tiny-gemma4")
    sides = {
        "Qwen3-VL": (encoder_for(qwen_dir, load_weights=False), AutoImageProcessor.from_pretrained(qwen_dir)),
        "Gemma-4": (
            encoder_for(gemma_dir, load_weights=False),
            Gemma4ImageProcessorPil.from_pretrained(gemma_dir),
        ),
    }
    print("\n  stages, ms (ours / reference)           decode          resize   normalise+patchify")
    for rel in ("images/photo_4032x3024.jpg", "images/photo_1024x768.png"):
        data = (samples / rel).read_bytes()
        img = Image.from_bytes(data)
        pil = PILImage.open(io.BytesIO(data)).convert("RGB")
        dec_ours = median_ms(lambda d=data: Image.from_bytes(d), repeats)
        dec_ref = median_ms(lambda d=data: PILImage.open(io.BytesIO(d)).convert("RGB"), repeats)
        for label, (enc, ref_proc) in sides.items():
            s = enc.image_settings
            if label == "Qwen3-VL":
                size = enc.image_size_for(img.width, img.height)
                resized = img.resized_array(size, PILImage.Resampling(s.resample))
                pix = median_ms(lambda r=resized, e=enc: e._image_pixels(r), repeats)
            else:
                size = enc.image_size_for(img.width, img.height)
                arr = img.resized_array(size, s.resample)
                budget = s.max_patches(s.max_soft_tokens)
                pix = median_ms(
                    lambda a=arr, e=enc, b=budget, ps=s.patch_size: patchify(a[None], ps, e._image_table, b),
                    repeats,
                )
            res_ours = median_ms(lambda sz=size, r=s.resample, im=img: im.resized_array(sz, r), repeats)
            res_ref = median_ms(lambda sz=size, r=s.resample, p=pil: p.resize(sz, resample=r), repeats)
            whole_ref = median_ms(lambda p=ref_proc, im=pil: p(images=[im], return_tensors="pt"), repeats)
            print(
                f"  {label + ' ' + Path(rel).name:<36}{dec_ours:7.1f} /{dec_ref:6.1f}"
                f"{res_ours:8.1f} /{res_ref:6.1f}{pix:10.1f} /{whole_ref - res_ref:6.1f}"
            )
    print(
        "  (JPEG decode is the same Pillow call on both sides; PNG is lossless, ours media/png_fast.py."
        " The resize is Pillow's arithmetic on both sides, ours vectorised and threaded:"
        " media/fast_resample.py)"
    )


def bench_video(bench: Path, repeats: int) -> None:
    from transformers import AutoImageProcessor
    from transformers.video_utils import load_video

    model_dir = ensure_tiny_model("tiny-qwen3-vl")
    enc = encoder_for(model_dir, load_weights=False)
    ref_proc = AutoImageProcessor.from_pretrained(model_dir)
    for name in ("long_gop_60s_720p.mp4", "short_gop_60s_720p.mp4"):
        path = bench / name
        data = path.read_bytes()

        def ours(data=data):
            return _fresh(enc).prepare(Video.from_bytes(data), num_frames=16).inputs["pixel_values_videos"]

        def ref(path=path):
            frames, _meta = load_video(str(path), num_frames=16, backend="pyav")
            pils = [PILImage.fromarray(np.asarray(f)) for f in frames]
            return ref_proc(images=pils, return_tensors="pt")["pixel_values"]

        indices = _fresh(enc).prepare(Video.from_bytes(data), num_frames=16).meta["frame_indices"]

        def decode_only(data=data, indices=indices):
            return Video.from_bytes(data).sample_indices(indices)

        res = interleaved({"ours": ours, "ref": ref, "decode": decode_only}, repeats)
        row(f"Qwen3-VL 16 frames {name}", res["ours"][0], res["ref"][0], "frames: see tests")
        # The floor: no preparation can be faster than decoding the frames it needs (every
        # frame from the keyframe before each target is decoded; FFmpeg has no shortcut).
        sampled = res["decode"][1]
        floor = res["ref"][0] / res["decode"][0]
        print(
            f"    (decoding alone: {res['decode'][0] * 1e3:.0f} ms for {sampled.frames_decoded} frames "
            f"decoded, {sampled.seeks} seeks -> at most {floor:.2f}x here)"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--skip-video", action="store_true", help="skip the 60 s clips (slow to build the first time)"
    )
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    samples = ensure_samples()
    print(
        f"preprocess bench: cores={os.cpu_count()} torch threads={torch.get_num_threads()} median of {args.repeats}"
    )
    print(f"  {'case':<44}{'ours ms':>10}{'ref ms':>10}{'ratio':>9}  parity")
    bench_qwen_images(samples, args.repeats)
    bench_gemma_image(samples, args.repeats)
    bench_request_of_four(samples, args.repeats)
    image_stages(samples, args.repeats)
    bench_gemma_audio(samples, args.repeats)
    if not args.skip_video:
        bench_video(ensure_bench_media(), args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
