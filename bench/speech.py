"""Speech out: real-time factor and time to first audio, ours vs transformers, side by side.

``python bench/speech.py [--frames N] [--big]`` (or ``python -m bench.speech``) runs on the tiny CSM (and with ``--big`` also a random
CSM built in-process: backbone hidden 256, 4 layers; depth decoder hidden 128, 2 layers). Greedy, the
same suppression on both sides, no eos (random weights), ``N`` frames (default 25 = 2 s of audio).

- RTF = generated audio seconds / wall seconds (higher is better);
- first audio: ours = the first ``speak_stream`` chunk (2 frames); transformers has no streaming, so
  its first audio arrives with the whole clip from ``generate(output_audio=True)``;
- ``ours over HTTP``: the same clip from ``pie-media serve`` (``POST /v1/audio/speech``, pcm, streamed),
  first audio = the first response bytes at the client (``--no-http`` skips it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, this file's folder comes first on sys.path, and this file's name would
# shadow the ``speech`` package: the repository root goes first instead.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]

import numpy as np  # noqa: E402
import torch  # noqa: E402


def _build_big():
    import tempfile

    from transformers import CsmConfig, CsmForConditionalGeneration

    from fixtures.tiny_models import ensure_tiny_model

    tiny = ensure_tiny_model("tiny-csm")
    base = CsmConfig.from_pretrained(tiny).to_dict()
    base.update(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, head_dim=32
    )
    dd = dict(base["depth_decoder_config"])
    dd.update(
        backbone_hidden_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=4, head_dim=32
    )
    base["depth_decoder_config"] = dd
    torch.manual_seed(0)
    model = CsmForConditionalGeneration(CsmConfig(**base)).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for name, buf in model.codec_model.named_buffers():
            if name.endswith("codebook.embed_sum"):
                buf.copy_(torch.randn(buf.shape, generator=g))
    out = Path(tempfile.mkdtemp(prefix="csm-big-"))
    model.save_pretrained(out)
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "processor", "chat_template")):
            (out / f.name).write_bytes(f.read_bytes())
    return out


def _http_row(checkpoint: Path, name: str, text: str, seconds: float):
    """A server on 127.0.0.1 serving ``checkpoint`` and a function timing one streamed request."""
    import sys
    import tempfile

    import httpx

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.api.http.conftest import start_server, stop_server

    server = start_server(Path(tempfile.mkdtemp(prefix="pie-bench-speech-")), models=(str(checkpoint),))
    body = {
        "model": name,
        "input": text,
        "voice": "0",
        "response_format": "pcm",
        "max_duration": seconds,
        "temperature": 0,
    }

    def run_http():
        t0 = time.perf_counter()
        first, n = None, 0
        with httpx.stream("POST", f"{server.v1}/audio/speech", json=body, timeout=600) as r:
            r.raise_for_status()
            for piece in r.iter_bytes():
                if first is None and piece:
                    first = time.perf_counter() - t0
                n += len(piece)
        return time.perf_counter() - t0, first, n / 2 / 24000

    return run_http, lambda: stop_server(server)


def bench(checkpoint: Path, frames: int, repeats: int, http: bool = True) -> None:
    from transformers import AutoProcessor, CsmForConditionalGeneration

    from speech import SpeechModel

    ours = SpeechModel.load(checkpoint, device="cpu")
    ref = CsmForConditionalGeneration.from_pretrained(ours.path).eval()
    processor = AutoProcessor.from_pretrained(ours.path)
    text = "Hello there, how are you today?"
    inputs = processor.apply_chat_template(
        [{"role": "0", "content": [{"type": "text", "text": text}]}], tokenize=True, return_dict=True
    )
    non_codec = list(range(ours.codebook_size, ours.vocab_size))
    seconds = frames / ours.frame_rate

    def run_ref():
        t0 = time.perf_counter()
        audio = ref.generate(
            **inputs,
            do_sample=False,
            depth_decoder_do_sample=False,
            max_new_tokens=frames,
            suppress_tokens=non_codec,
            depth_decoder_suppress_tokens=non_codec,
            output_audio=True,
        )
        wall = time.perf_counter() - t0
        return wall, wall, len(audio[0]) / ours.sample_rate

    def run_speak():
        t0 = time.perf_counter()
        s = ours.speak(text, 0, max_duration=seconds, temperature=0)
        wall = time.perf_counter() - t0
        return wall, wall, s.duration

    def run_stream():
        t0 = time.perf_counter()
        first = None
        n = 0
        for chunk in ours.speak_stream(text, 0, max_duration=seconds, temperature=0, chunk_frames=2):
            if first is None:
                first = time.perf_counter() - t0
            n += len(chunk)
        return time.perf_counter() - t0, first, n / ours.sample_rate

    rows = {"transformers generate": run_ref, "ours speak": run_speak, "ours speak_stream": run_stream}
    stop = None
    if http:
        rows["ours over HTTP"], stop = _http_row(checkpoint, ours.name, text, seconds)
    try:
        for fn in rows.values():
            fn()  # warm-up
        results: dict[str, list[tuple[float, float, float]]] = {k: [] for k in rows}
        for _ in range(repeats):
            for k, fn in rows.items():
                results[k].append(fn())
    finally:
        if stop is not None:
            stop()
    print(f"\n{ours.name}: {frames} frames ({seconds:.2f} s of audio), median of {repeats}")
    print(
        f"{'':24s} {'wall s':>8s} {'RTF':>7s} {'first audio s':>14s} {'RTF ratio':>10s} {'TTFA ratio':>11s}"
    )
    base_wall = statistics.median(r[0] for r in results["transformers generate"])
    base_first = statistics.median(r[1] for r in results["transformers generate"])
    for k, rs in results.items():
        wall = statistics.median(r[0] for r in rs)
        first = statistics.median(r[1] for r in rs)
        audio = rs[-1][2]
        print(
            f"{k:24s} {wall:8.3f} {audio / wall:7.2f} {first:14.3f} {base_wall / wall:9.2f}x {base_first / first:10.2f}x"
        )
    assert np.isfinite(base_wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--frames", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--big", action="store_true", help="also a random CSM with hidden 256, 4 layers")
    parser.add_argument("--no-http", action="store_true", help="skip the row through pie-media serve")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from fixtures.tiny_models import ensure_tiny_model

    bench(ensure_tiny_model("tiny-csm"), args.frames, args.repeats, http=not args.no_http)
    if args.big:
        import shutil

        big = _build_big()
        try:
            bench(big, args.frames, args.repeats, http=not args.no_http)
        finally:
            shutil.rmtree(big, ignore_errors=True)


if __name__ == "__main__":
    main()
