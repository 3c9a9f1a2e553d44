"""Speech out: real-time factor, time to first audio and concurrency, ours vs transformers.

``python bench/speech.py [--frames N] [--concurrency 1,4,8,16] [--wide] [--out FILE]`` (or
``python -m bench.speech``) runs on the tiny CSM and, with ``--wide``, on a random wider CSM built
in-process by ``fixtures.tiny_csm.build_variant`` (backbone hidden 512, 4 layers; depth decoder
hidden 256). ``--shape csm-1b`` runs instead on a random checkpoint of sesame/csm-1b's shape
(``fixtures.csm_1b_shape``: Llama-3.2-1B backbone, ~100 M depth decoder, 32 codebooks, Mimi as
transformers builds it; built once into the fixture cache, ~6.5 GB) and first checks that greedy
codes equal transformers' on the same weights (``--parity-texts`` texts of ``--frames`` frames).
On a CPU keep it small: ``--shape csm-1b --frames 3 --concurrency 1,8 --no-single`` (a frame
costs seconds there). Greedy, the same suppression on both sides (ids >= codebook size, as
tests/speech/test_speech.py ``_reference``), no eos (random weights), ``N`` frames per request
(default 25 = 2 s of audio), the same frames on every side.

Single request (``--no-single`` skips it), median of ``--repeats``:

- RTF = generated audio seconds / wall seconds (higher is better);
- first audio: ours = the first ``speak_stream`` chunk (2 frames); transformers has no streaming, so
  its first audio arrives with the whole clip from ``generate(output_audio=True)``;
- ``ours over HTTP``: the same clip from ``pie-media serve`` (``POST /v1/audio/speech``, pcm, streamed),
  first audio = the first response bytes at the client (``--no-http`` skips it).

Concurrency C (each of ``--concurrency``): C different texts arrive together at t0.

- ``batched``: ours, all C in one event loop (``asyncio.gather`` of ``prepare`` + ``stream_async``
  consumers): their frames share the engine's passes;
- ``serial``: ours, the same C requests one after another (same code path, one at a time);
- ``transformers``: ``generate(output_audio=True)`` one by one (processor included, as ours
  includes ``prepare``).

Two diagnostic rows show where the streamed batched path loses (JSON: ``batched_whole``,
``batched_pipelined``): ``batched_whole`` = the same C batched through ``speak_async`` (frames
only, one Mimi decode per clip: what a whole wav/flac response costs; its TTFA is the whole
clip); ``batched_pipelined`` = a bench-side prototype of streaming whose frame loop does not wait
for its chunk's Mimi decode and whose decodes share one thread.

``agg`` = all requests' audio seconds / wall seconds from t0 to the last sample. Time to first
audio (TTFA) is measured from t0, the common arrival: a request served after others waited for
them, as a client of a server without batching does (``ttfa_own_*`` in the JSON: from the
request's own start). Ratios: ``batched/serial`` and ``batched/transformers`` of ``agg``; the
TTFA ratios are ``other p99 / batched p99`` (above 1: batched answers sooner). Aims (issue 21):
at C=8, batched agg >= 4x serial agg, and batched TTFA p99 <= 2x a lone request's (batched, C=1,
p50). Each cell also gives ``real_time_factor`` (wall seconds per second of one request's
audio: below 1 is faster than real time; issue 32's measure) and ``x_real_time_per_stream``
(agg / C: each voice's audio seconds per wall second; C voices keep up when it is >= 1). Each batched/serial cell also records where its time went (timers around the runner's pass,
the frame head = lm_head + depth decoder + frame embedding, and the Mimi chunk decodes; backbone
= pass - head; the rest = event loop, threads, Python).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Run as a script, this file's folder comes first on sys.path, and this file's name would
# shadow the ``speech`` package: the repository root goes first instead.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent]

import engine  # noqa: E402, F401, I001 - first: its OpenMP wait settings precede torch
import numpy as np  # noqa: E402
import torch  # noqa: E402

# C different texts (of different lengths, so prompts differ as in real traffic).
TEXTS = [
    "Hello there, how are you today?",
    "The train to the coast leaves at nine.",
    "Please remember to water the plants.",
    "A quick brown fox jumps over the lazy dog.",
    "Our meeting moved to Thursday afternoon.",
    "It is going to rain later this evening, so take an umbrella.",
    "Thank you for calling.",
    "The museum opens its new wing next spring.",
    "Could you read the last paragraph again, slowly?",
    "Seven hundred people signed the letter.",
    "Turn left at the bakery and walk two blocks.",
    "The soup needs a little more salt.",
    "We found the keys under the sofa.",
    "Every morning she runs along the river before work.",
    "Is this seat taken?",
    "The results will be published on Monday.",
]

# The wide CSM of the concurrency table: backbone hidden >= 512 (issue 21).
WIDE_SHAPE = {
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
}
WIDE_DEPTH = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}


def build_wide(out: Path) -> Path:
    """The random wide CSM (``WIDE_SHAPE`` / ``WIDE_DEPTH``) written into ``out``."""
    from fixtures.tiny_csm import build_variant
    from fixtures.tiny_models import ensure_tiny_model

    return build_variant(out, ensure_tiny_model("tiny-csm"), depth=dict(WIDE_DEPTH), **WIDE_SHAPE)


def _http_row(checkpoint: Path, name: str, text: str, seconds: float):
    """A server on 127.0.0.1 serving ``checkpoint`` and a function timing one streamed request."""
    import httpx

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


class Side:
    """One model loaded on both sides: ours (``SpeechModel``) and transformers' reference."""

    def __init__(
        self,
        checkpoint: Path,
        device: str,
        cuda_graphs: int = 0,
        dtype: torch.dtype = torch.float32,
        quantization: str | None = None,
    ):
        from transformers import AutoProcessor, CsmForConditionalGeneration

        from speech import SpeechModel

        self.checkpoint = checkpoint
        # On the CPU, --cuda-graphs rehearses the frame-head graphs (capture=False: the same
        # static-buffer frame run eagerly; there is nothing to capture without CUDA).
        rehearse = bool(cuda_graphs) and torch.device(device).type != "cuda"
        load: dict[str, Any] = {"cuda_graphs": cuda_graphs} if cuda_graphs and not rehearse else {}
        if quantization:
            load["quantization"] = quantization
        self.quantization = quantization
        self.ours = SpeechModel.load(checkpoint, device=device, dtype=dtype, **load)
        if rehearse:
            from speech.depth_graphs import DepthGraphs

            self.ours.head.graphs = DepthGraphs(
                self.ours.hf, cuda_graphs, capture=False, suppress=self.ours.suppress
            )
            self.ours.head.graphs.warm()
        self.cuda_graphs = getattr(self.ours.head, "graphs", None) is not None
        self.backbone_graphs = getattr(self.ours.runner, "graphs", None) is not None
        # On the CPU both sides map the same float32 file: its pages are shared, not held twice.
        self.ref = (
            CsmForConditionalGeneration.from_pretrained(self.ours.path, dtype=dtype)
            .eval()
            .to(self.ours.device)
        )
        self.processor = AutoProcessor.from_pretrained(self.ours.path)
        self.non_codec = list(range(self.ours.codebook_size, self.ours.vocab_size))

    def shape(self) -> dict[str, Any]:
        cfg = self.ours.hf.config
        dd = cfg.depth_decoder_config
        return {
            "backbone": {"hidden": cfg.hidden_size, "layers": cfg.num_hidden_layers},
            "depth_decoder": {"hidden": dd.hidden_size, "layers": dd.num_hidden_layers},
            "num_codebooks": cfg.num_codebooks,
            "parameters_m": round(sum(p.numel() for p in self.ours.hf.parameters()) / 1e6, 2),
            "dtype": str(self.ours.dtype).removeprefix("torch."),
            "quantization": self.quantization,
            "depth_decoder_cuda_graphs": self.cuda_graphs,  # the whole frame head, one replay a pass
            "backbone_cuda_graphs": self.backbone_graphs,  # flashinfer models only (speech.backbone)
        }

    def ref_inputs(self, text: str, speaker: int) -> Any:
        return self.processor.apply_chat_template(
            [{"role": str(speaker), "content": [{"type": "text", "text": text}]}],
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
        ).to(self.ours.device)

    def ref_generate(self, inputs: Any, frames: int) -> np.ndarray:
        """transformers' greedy clip, suppression as tests/speech/test_speech.py ``_reference``."""
        return self._ref(inputs, frames).audio[0].float().cpu().numpy()

    def ref_codes(self, inputs: Any, frames: int) -> np.ndarray:
        """transformers' greedy codes (frames, codebooks)."""
        return self._ref(inputs, frames).sequences[0].cpu().numpy()

    def _ref(self, inputs: Any, frames: int) -> Any:
        return self.ref.generate(
            **inputs,
            do_sample=False,
            depth_decoder_do_sample=False,
            max_new_tokens=frames,
            suppress_tokens=self.non_codec,
            depth_decoder_suppress_tokens=self.non_codec,
            output_audio=True,
            return_dict_in_generate=True,
        )


def parity(side: Side, frames: int, texts: int) -> dict[str, Any]:
    """Greedy codes of ours (``speak``) against transformers' ``generate`` on the same weights:
    ``texts`` different texts of ``frames`` frames each."""
    ours = side.ours
    equal = total = 0
    rows = []
    for i, text in enumerate(TEXTS[:texts]):
        mine = ours.speak(text, i % 2, max_duration=frames / ours.frame_rate, temperature=0).codes
        ref = side.ref_codes(side.ref_inputs(text, i % 2), frames)
        n = min(len(mine), len(ref))
        same = int((mine[:n] == ref[:n]).sum())
        equal, total = equal + same, total + ref.size
        rows.append(
            {"text": text, "codes_equal": same, "codes": int(ref.size), "frames": [len(mine), len(ref)]}
        )
    out = {"codes_equal": equal, "codes": total, "all_equal": equal == total, "texts": rows}
    print(f"\n{ours.name}: greedy codes equal to transformers generate: {equal}/{total}")
    return out


def single(side: Side, frames: int, repeats: int, http: bool) -> dict[str, Any]:
    """The single-request rows (RTF, first audio), median of ``repeats``."""
    ours = side.ours
    text = TEXTS[0]
    inputs = side.ref_inputs(text, 0)
    seconds = frames / ours.frame_rate

    def run_ref():
        t0 = time.perf_counter()
        audio = side.ref_generate(inputs, frames)
        wall = time.perf_counter() - t0
        return wall, wall, len(audio) / ours.sample_rate

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
        rows["ours over HTTP"], stop = _http_row(side.checkpoint, ours.name, text, seconds)
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
    print(f"\n{ours.name}: one request, {frames} frames ({seconds:.2f} s of audio), median of {repeats}")
    print(
        f"{'':24s} {'wall s':>8s} {'RTF':>7s} {'first audio s':>14s} {'RTF ratio':>10s} {'TTFA ratio':>11s}"
    )
    base_wall = statistics.median(r[0] for r in results["transformers generate"])
    base_first = statistics.median(r[1] for r in results["transformers generate"])
    out: dict[str, Any] = {}
    for k, rs in results.items():
        wall = statistics.median(r[0] for r in rs)
        first = statistics.median(r[1] for r in rs)
        audio = rs[-1][2]
        print(
            f"{k:24s} {wall:8.3f} {audio / wall:7.2f} {first:14.3f} {base_wall / wall:9.2f}x {base_first / first:10.2f}x"
        )
        out[k] = {"wall_s": round(wall, 4), "rtf": round(audio / wall, 3), "first_audio_s": round(first, 4)}
    assert np.isfinite(base_wall)
    return out


# -- concurrency ---------------------------------------------------------------------------------


class Timers:
    """Seconds spent in the runner's passes, the frame head and the Mimi chunk decodes of one
    ``SpeechModel`` (decode: every Mimi decode, chunk or whole clip; instance wrappers: nothing in ``speech/`` or ``engine/`` changes)."""

    def __init__(self, model: Any):
        self.model = model
        self.reset()
        self._wrap(model.runner, "run", "pass")
        self._wrap(model.head, "run", "head")
        self._wrap(model, "decode", "mimi")
        if getattr(model, "mimi_stream", None) is not None:  # streamed chunks: a batch per call
            self._wrap(model.mimi_stream.decoder, "decode_many", "mimi")

    def reset(self) -> None:
        self.seconds = {"pass": 0.0, "head": 0.0, "mimi": 0.0}
        self.calls = {"pass": 0, "head": 0, "mimi": 0}
        self.head_rows = 0
        self.replays_at_reset = self.replays()

    def replays(self) -> tuple[int, int]:
        """CUDA-graph replays so far: frames (the frame head, one per pass it takes) and
        backbone frame passes (0 when the model has no such graphs)."""
        head, runner = self.model.head.graphs, self.model.runner.graphs
        return (head.replays if head is not None else 0, runner.replays if runner is not None else 0)

    def _wrap(self, obj: Any, attr: str, key: str) -> None:
        inner: Callable[..., Any] = getattr(obj, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - t0
                self.calls[key] += 1
                if key == "head":
                    self.head_rows += len(args[1])

        setattr(obj, attr, timed)

    def split(self, wall: float) -> dict[str, Any]:
        s, c = self.seconds, self.calls
        passes = max(1, c["pass"])
        frame_replays, backbone_replays = (
            now - then for now, then in zip(self.replays(), self.replays_at_reset, strict=True)
        )
        return {
            "passes": c["pass"],
            "frame_graph_replays": frame_replays,
            "backbone_graph_replays": backbone_replays,
            "frames_per_head_call": round(self.head_rows / max(1, c["head"]), 2),
            "ms_per_pass": round(1000 * s["pass"] / passes, 3),
            "backbone_ms_per_pass": round(1000 * (s["pass"] - s["head"]) / passes, 3),
            "head_ms_per_pass": round(1000 * s["head"] / passes, 3),
            "backbone_s": round(s["pass"] - s["head"], 4),
            "head_s": round(s["head"], 4),
            "mimi_decodes": c["mimi"],
            "mimi_s": round(s["mimi"], 4),
            "mimi_ms_per_decode": round(1000 * s["mimi"] / max(1, c["mimi"]), 3),
            "wall_s": round(wall, 4),
            # Mimi decodes run on threads beside the forward worker: parts may overlap.
            "rest_s": round(wall - s["pass"] - s["mimi"], 4),
        }


async def _ours_one(model: Any, text: str, speaker: int, seconds: float) -> tuple[float, float, float, float]:
    """(start, first audio, end) perf_counter times and audio seconds of one streamed request."""
    start = time.perf_counter()
    job = await model.prepare_async(text, speaker, max_duration=seconds, temperature=0)
    ticket = model.admit(job, wait=False)
    first, n = None, 0
    async for pcm in model.stream_async(job, ticket):
        if first is None:
            first = time.perf_counter()
        n += len(pcm)
    assert first is not None
    return start, first, time.perf_counter(), n / model.sample_rate


def _cell(t0: float, runs: list[tuple[float, float, float, float]]) -> dict[str, Any]:
    end = max(r[2] for r in runs)
    ttfa = np.array([r[1] - t0 for r in runs])
    own = np.array([r[1] - r[0] for r in runs])
    audio = sum(r[3] for r in runs)
    wall = end - t0
    return {
        "wall_s": round(wall, 4),
        "audio_s": round(audio, 4),
        "agg": round(audio / wall, 4),
        "x_real_time_per_stream": round(audio / wall / len(runs), 4),
        "real_time_factor": round(wall / (audio / len(runs)), 4) if audio else None,
        "ttfa_p50_s": round(float(np.percentile(ttfa, 50)), 4),
        "ttfa_p99_s": round(float(np.percentile(ttfa, 99)), 4),
        "ttfa_own_p50_s": round(float(np.percentile(own, 50)), 4),
        "ttfa_own_p99_s": round(float(np.percentile(own, 99)), 4),
        "audio_s_per_request": [round(r[3], 4) for r in runs],
    }


def ours_batched(side: Side, texts: list[str], seconds: float, timers: Timers) -> dict[str, Any]:
    model = side.ours

    async def go():
        t0 = time.perf_counter()
        runs = await asyncio.gather(*(_ours_one(model, t, i % 2, seconds) for i, t in enumerate(texts)))
        return t0, list(runs)

    passes0 = model.scheduler.stats.passes
    timers.reset()
    t0, runs = asyncio.run(go())
    cell = _cell(t0, runs)
    cell["profile"] = timers.split(cell["wall_s"])
    cell["scheduler_passes"] = model.scheduler.stats.passes - passes0
    return cell


def ours_batched_whole(side: Side, texts: list[str], seconds: float, timers: Timers) -> dict[str, Any]:
    """Ours batched without streaming: ``speak_async`` (one Mimi decode per clip, as a whole
    wav/flac response): the frames' share of the batched cost, without the chunk decodes."""
    model = side.ours

    async def one(text: str, speaker: int) -> tuple[float, float, float, float]:
        start = time.perf_counter()
        clip = await model.speak_async(text, speaker, max_duration=seconds, temperature=0)
        done = time.perf_counter()
        return start, done, done, clip.duration

    async def go():
        t0 = time.perf_counter()
        runs = await asyncio.gather(*(one(t, i % 2) for i, t in enumerate(texts)))
        return t0, list(runs)

    timers.reset()
    t0, runs = asyncio.run(go())
    cell = _cell(t0, runs)
    cell["profile"] = timers.split(cell["wall_s"])
    return cell


def ours_batched_pipelined(side: Side, texts: list[str], seconds: float, timers: Timers) -> dict[str, Any]:
    """A prototype, bench-side only (public API: ``frames_async``, ``decode``): the same batched
    streams, but each request's frame loop runs ahead of its PCM (frames queue up while a chunk
    decodes, so a stream never misses a pass), and one decode thread serves every stream's
    chunks (all frames that arrived, >= 2, with up to 64 frames of left context as
    ``stream_async``). Shows what decoupling the Mimi decode from the frame loop would give."""
    from concurrent.futures import ThreadPoolExecutor
    from contextlib import aclosing

    model = side.ours
    chunk_frames, context_frames = 2, 64
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-mimi")

    def pcm_of(codes: list[list[int]], done: int) -> np.ndarray:
        start = max(0, done - context_frames)
        pcm = model.decode(np.asarray(codes[start:], dtype=np.int64))
        return np.clip(pcm[-(len(codes) - done) * model.samples_per_frame :], -1.0, 1.0)

    async def one(text: str, speaker: int) -> tuple[float, float, float, float]:
        start = time.perf_counter()
        job = await model.prepare_async(text, speaker, max_duration=seconds, temperature=0)
        ticket = model.admit(job, wait=False)
        queue: asyncio.Queue[list[int] | None] = asyncio.Queue()

        async def produce() -> None:
            try:
                with ticket:
                    async with aclosing(model.frames_async(job)) as frames:
                        async for ids in frames:
                            if all(c == model.eos_id for c in ids):
                                break
                            queue.put_nowait(ids)
            finally:
                queue.put_nowait(None)

        producer = asyncio.create_task(produce())
        loop = asyncio.get_running_loop()
        codes: list[list[int]] = []
        done, ended, first, n = 0, False, None, 0
        while not ended:
            items = [await queue.get()]
            while not queue.empty():
                items.append(queue.get_nowait())
            for item in items:
                if item is None:
                    ended = True
                else:
                    codes.append(item)
            if len(codes) - done >= chunk_frames or (ended and len(codes) > done):
                pcm = await loop.run_in_executor(pool, pcm_of, list(codes), done)
                first = first or time.perf_counter()
                n += len(pcm)
                done = len(codes)
        await producer
        assert first is not None
        return start, first, time.perf_counter(), n / model.sample_rate

    async def go():
        t0 = time.perf_counter()
        runs = await asyncio.gather(*(one(t, i % 2) for i, t in enumerate(texts)))
        return t0, list(runs)

    timers.reset()
    try:
        t0, runs = asyncio.run(go())
    finally:
        pool.shutdown()
    cell = _cell(t0, runs)
    cell["profile"] = timers.split(cell["wall_s"])
    return cell


def ours_serial(side: Side, texts: list[str], seconds: float, timers: Timers) -> dict[str, Any]:
    model = side.ours

    async def go():
        t0 = time.perf_counter()
        return t0, [await _ours_one(model, t, i % 2, seconds) for i, t in enumerate(texts)]

    timers.reset()
    t0, runs = asyncio.run(go())
    cell = _cell(t0, runs)
    cell["profile"] = timers.split(cell["wall_s"])
    return cell


def transformers_serial(side: Side, texts: list[str], frames: int) -> dict[str, Any]:
    runs = []
    t0 = time.perf_counter()
    for i, text in enumerate(texts):
        start = time.perf_counter()
        audio = side.ref_generate(side.ref_inputs(text, i % 2), frames)
        done = time.perf_counter()
        runs.append((start, done, done, len(audio) / side.ours.sample_rate))  # no streaming
    return _cell(t0, runs)


def concurrency(
    side: Side, frames: int, levels: list[int], cell_repeats: int = 5, diagnostics: bool = True
) -> dict[str, Any]:
    """The concurrency table of one model (see the module doc). The ``batched`` cell runs
    ``cell_repeats`` times (well under a second each) and keeps the run of median TTFA p99:
    one run's millisecond TTFAs swing by a third on a shared 2-core machine. Every run's p99
    and agg are kept in the cell."""
    ours = side.ours
    seconds = frames / ours.frame_rate
    timers = Timers(ours)
    # Warm-up: both of ours' paths and transformers', so no cell pays first-call costs.
    ours_batched(side, TEXTS[:2], seconds, timers)
    transformers_serial(side, TEXTS[:1], frames)
    table: dict[str, Any] = {}
    print(f"\n{ours.name}: {frames} frames per request ({seconds:.2f} s of audio), C different texts at once")
    head = f"{'C':>3s} {'side':18s} {'wall s':>8s} {'agg audio s/s':>14s} {'TTFA p50':>9s} {'TTFA p99':>9s}"
    print(head + f" {'batched x':>10s} {'TTFA p99 /batched':>18s}")
    for c in levels:
        texts = [TEXTS[i % len(TEXTS)] for i in range(c)]  # past 16 they repeat
        runs = [ours_batched(side, texts, seconds, timers) for _ in range(max(1, cell_repeats))]
        batched = sorted(runs, key=lambda r: r["ttfa_p99_s"])[len(runs) // 2]
        batched["ttfa_p99_runs_s"] = [r["ttfa_p99_s"] for r in runs]
        batched["agg_runs"] = [r["agg"] for r in runs]
        cells = {
            "batched": batched,
            "serial": ours_serial(side, texts, seconds, timers),
            "transformers": transformers_serial(side, texts, frames),
        }
        if diagnostics:  # where the streamed batched path loses (see the module doc)
            cells["batched_whole"] = ours_batched_whole(side, texts, seconds, timers)
            cells["batched_pipelined"] = ours_batched_pipelined(side, texts, seconds, timers)
        b = cells["batched"]
        same = all(cells[k]["audio_s_per_request"] == b["audio_s_per_request"] for k in cells)
        ratios = {
            "batched_over_serial": round(b["agg"] / cells["serial"]["agg"], 3),
            "batched_over_transformers": round(b["agg"] / cells["transformers"]["agg"], 3),
            "serial_over_transformers": round(cells["serial"]["agg"] / cells["transformers"]["agg"], 3),
            **{
                f"{k}_over_serial": round(cells[k]["agg"] / cells["serial"]["agg"], 3)
                for k in ("batched_whole", "batched_pipelined")
                if k in cells
            },
            "ttfa_p99_serial_over_batched": round(cells["serial"]["ttfa_p99_s"] / b["ttfa_p99_s"], 3),
            "ttfa_p99_transformers_over_batched": round(
                cells["transformers"]["ttfa_p99_s"] / b["ttfa_p99_s"], 3
            ),
        }
        for k, cell in cells.items():
            x = {"serial": "batched_over_serial", "transformers": "batched_over_transformers"}.get(k, "")
            t = {"serial": "ttfa_p99_serial_over_batched"}.get(k, "")
            if k == "transformers":
                t = "ttfa_p99_transformers_over_batched"
            print(
                f"{c:3d} {k:18s} {cell['wall_s']:8.3f} {cell['agg']:14.3f} {cell['ttfa_p50_s']:9.3f} "
                f"{cell['ttfa_p99_s']:9.3f} {(f'{ratios[x]:.2f}x' if x else ''):>10s} "
                f"{(f'{ratios[t]:.2f}x' if t else ''):>18s}"
            )
        print(
            "    agg over serial: "
            + ", ".join(
                f"{k} {cells[k]['agg'] / cells['serial']['agg']:.2f}x" for k in cells if k != "serial"
            )
        )
        print(
            "    real-time factor (wall s per audio s of one voice): "
            + ", ".join(f"{k} {cells[k]['real_time_factor']:.2f}" for k in cells)
        )
        for k in ("batched", "serial", "batched_whole", "batched_pipelined"):
            if k not in cells:
                continue
            p = cells[k]["profile"]
            print(
                f"    {k}: {p['passes']} passes ({p['frames_per_head_call']} frames each; graph replays: "
                f"{p['frame_graph_replays']} frame, {p['backbone_graph_replays']} backbone): backbone "
                f"{p['backbone_ms_per_pass']:.1f} ms + head {p['head_ms_per_pass']:.1f} ms per pass; Mimi "
                f"decodes {p['mimi_decodes']}, {p['mimi_s']:.2f} s; wall {p['wall_s']:.2f} s"
            )
        if not same:
            print("    note: the sides made different amounts of audio (see audio_s_per_request)")
        table[str(c)] = {**cells, "ratios": ratios, "same_audio_per_request": same}
    return {"shape": side.shape(), "frames": frames, "concurrency": table, "aims": _aims(table)}


def _aims(table: dict[str, Any]) -> dict[str, Any]:
    """Issue 21's aims at C=8 (when both C=1 and C=8 ran)."""
    if "8" not in table:
        return {}
    at8 = table["8"]
    out: dict[str, Any] = {
        "batched_over_serial_at_8": at8["ratios"]["batched_over_serial"],
        "throughput_aim_4x_met": at8["ratios"]["batched_over_serial"] >= 4.0,
    }
    if "1" in table:
        lone = table["1"]["batched"]["ttfa_p50_s"]
        out["lone_ttfa_s"] = lone
        out["ttfa_p99_at_8_s"] = at8["batched"]["ttfa_p99_s"]
        out["ttfa_p99_at_8_over_lone"] = round(at8["batched"]["ttfa_p99_s"] / lone, 3)
        out["ttfa_aim_2x_met"] = at8["batched"]["ttfa_p99_s"] <= 2 * lone
    return out


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--concurrency takes integers like 1,4,8,16: {e}") from e
    if not levels or min(levels) < 1 or max(levels) > MAX_CONCURRENCY:
        raise argparse.ArgumentTypeError(f"--concurrency levels must be 1..{MAX_CONCURRENCY}")
    return levels


MAX_CONCURRENCY = 64
"""Past ``len(TEXTS)`` the texts repeat (with alternating speakers)."""


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--frames", type=int, default=25)
    parser.add_argument("--repeats", type=int, default=3, help="of the single-request rows")
    parser.add_argument(
        "--cell-repeats", type=int, default=5, help="runs of each batched cell (the median TTFA p99 kept)"
    )
    parser.add_argument("--concurrency", type=_levels, default=[1, 4, 8, 16], help="e.g. 1,4,8,16")
    parser.add_argument(
        "--wide", "--big", action="store_true", help="also a random CSM with backbone hidden 512, 4 layers"
    )
    parser.add_argument("--no-http", action="store_true", help="skip the row through pie-media serve")
    parser.add_argument("--no-single", action="store_true", help="skip the single-request rows")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (CPU)")
    parser.add_argument(
        "--cuda-graphs",
        type=int,
        default=0,
        help="SpeechModel.load(cuda_graphs=N): each frame head (codebook 0 + depth decoder) as one "
        "CUDA-graph replay, and the backbone's frame passes from graphs where flashinfer runs it "
        "(on the CPU: the frame-head graphs rehearsed with capture=False)",
    )
    parser.add_argument(
        "--shape",
        choices=("tiny", "csm-1b"),
        default="tiny",
        help="tiny: the fixture CSM (and --wide); csm-1b: a random checkpoint of sesame/csm-1b's shape",
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument(
        "--quantization", choices=("int8", "int4"), default=None, help="SpeechModel.load(quantization=)"
    )
    parser.add_argument(
        "--parity-texts", type=int, default=None, help="texts of the greedy-codes check (csm-1b: 2; tiny: 0)"
    )
    parser.add_argument(
        "--no-diagnostics", action="store_true", help="skip the batched_whole / batched_pipelined rows"
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    from fixtures.tiny_models import ensure_tiny_model

    results: dict[str, Any] = {
        "bench": "speech",
        "machine": {
            "device": torch.cuda.get_device_name(0) if device.startswith("cuda") else _cpu_name(),
            "torch_threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
        },
        "greedy": True,
        "frames": args.frames,
        "note": "random weights, no eos; agg = audio seconds per wall second; TTFA from the common arrival",
        "models": {},
    }
    t_start = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    big = args.shape == "csm-1b"
    parity_texts = args.parity_texts if args.parity_texts is not None else (2 if big else 0)
    if big:
        from fixtures.csm_1b_shape import ensure_csm_1b_shape

        checkpoints = [("csm-1b", ensure_csm_1b_shape())]
    else:
        checkpoints = [("fixture", ensure_tiny_model("tiny-csm"))]
    tmp = None
    if args.wide and not big:
        tmp = Path(tempfile.mkdtemp(prefix="csm-wide-"))
        checkpoints.append(("wide", build_wide(tmp / "tiny-csm-wide")))
    try:
        for label, checkpoint in checkpoints:
            side = Side(checkpoint, device, args.cuda_graphs, dtype=dtype, quantization=args.quantization)
            entry: dict[str, Any] = {"model": side.ours.name}
            if parity_texts:
                entry["parity"] = parity(side, args.frames, parity_texts)
            if not args.no_single:
                entry["single"] = single(side, args.frames, args.repeats, http=not args.no_http)
            entry.update(
                concurrency(
                    side,
                    args.frames,
                    args.concurrency,
                    args.cell_repeats,
                    diagnostics=not args.no_diagnostics,
                )
            )
            results["models"][label] = entry
            del side
    finally:
        if tmp is not None:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    results["total_s"] = round(time.perf_counter() - t_start, 1)
    print("\naims (issue 21, at 8 concurrent): batched >= 4x serial agg; TTFA p99 <= 2x a lone request's")
    for label, entry in results["models"].items():
        print(f"  {label}: {json.dumps(entry.get('aims', {}))}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
