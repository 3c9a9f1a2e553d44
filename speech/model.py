"""Speech out: CSM (backbone + depth decoder + Mimi codec) behind ``model.speak(text)``.

``SpeechModel.load(path)`` loads a ``CsmForConditionalGeneration`` checkpoint directory through the
engine's checkpoint loader (``api.model_ref.load_model`` dispatches here by the exact architecture
name; any other architecture is a ``NoSpeechHeadError``). The math is transformers' own modules; the
serving is the engine's: every request is a stream of steps on the model's KV pages and scheduler,
so many voices share batched passes.

1. ``prepare``: the prompt (context turns, then ``[speaker]text``) is rendered with the checkpoint's
   chat template and run through its ``CsmProcessor``; text ids and context audio (Mimi-encoded) are
   merged into backbone input embeddings by ``CsmForConditionalGeneration._merge_input_ids_with_input_values``
   (``speech.job``: keyed rows, so repeated context turns hit the prefix cache).
2. ``speech.frames``: the prompt is prefilled on pages (chunked); each frame is one backbone row;
   ``speech.frame_head`` picks codebook 0 with ``lm_head`` and codebooks 1..n-1 with the depth
   decoder, batched over every stream of the pass; the frame is fed back.
3. Stop rule (the reference's, ``CsmGenerationMixin._sample``): generation stops after a frame whose
   codebooks 0..n-2 all equal ``codebook_eos_token_id`` (the reference checks ``[:-1]``), or after
   ``ceil(max_duration * frame_rate)`` frames. The audio ends before the first frame whose codebooks
   are ALL eos (``generate(output_audio=True)``'s cutoff), so an all-eos end frame is not voiced.
4. Mimi decodes the codes to 24 kHz mono PCM. ``speak`` decodes once (bit-for-bit the reference's
   decode); ``speak_stream`` decodes every ``chunk_frames`` frames with a per-stream
   ``speech.mimi_stream`` state (each causal conv's input tail, each transposed conv's overlap, the
   decoder transformer's sliding-window KV cache), so each frame is decoded once and the chunks
   join to the whole-clip decode up to float reordering (relative ~2e-6 on the tiny codec, exact
   in float64); the chunks of concurrent streams are decoded together, a batch row each, on the
   decode worker. ``context_frames`` is used only for a non-causal codec, which cannot stream
   exactly: its chunks are re-decoded with that much left context.

Sampling: ``temperature == 0`` is greedy at both levels. ``temperature=None`` uses the checkpoint's
generation_config (``do_sample``, ``temperature``, ``top_k`` and the ``depth_decoder_*`` ones; a
silent checkpoint means greedy, as ``generate`` does). ``temperature > 0`` samples both levels with
that temperature and ``top_k`` (given, else the checkpoint's, else transformers' 50). A ``seed`` gives
the request its own generator: the same frames alone or batched with others.

Suppression: ids ``>= codebook_size`` of the audio vocabulary (the 3 specials past the Mimi codes:
real CSM 2048..2050, tiny 64..66) are never Mimi codes; random weights can pick them and Mimi's
dequantiser would index out of range. They are masked in BOTH the backbone head and the depth
decoder. Id 0 (the eos code) is a valid Mimi code and is NOT suppressed: the stop rule needs it.
Trained checkpoints never emit the specials, so this changes nothing for them.

Capacity (``speech.admission``): a request runs with the pages it can ever need promised, and, with
``realtime_safety`` set (a server's default), a streamed one only if the frame time measured at the
resulting batch size (``speech.frame_timing``: every pass of frame steps is timed; ``load`` seeds the
table with a short warm-up) keeps every stream at or above real time (a whole clip has no real-time
deadline: it joins the batch unless streams are running that it would put behind); ``max_streams``
is an optional cap ("auto": none).
``admit(wait=False)`` refuses past any bound (HTTP 429); ``admit`` / ``admit_async`` with ``wait``
queue (bounded, FIFO) up to a deadline (``capacity.wait_s``, 30 s), then refuse. ``speak`` /
``speak_async`` / ``clip_async`` are whole clips (``streamed=False``), ``speak_stream`` /
``stream_async`` streams. Each stream's real-time margin (audio seconds per wall second) is kept by
``pace`` for /metrics.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine import (
    GREEDY_BELOW,
    ForwardRunner,
    KVPool,
    Scheduler,
    architecture_name,
    bytes_per_page,
    check_attention_choice,
    check_weights,
    default_device,
    load_part,
    load_pretrained,
    place_model,
    read_config,
    register_attention,
    resolve_checkpoint,
    run_sync,
    select_backend,
)
from engine.load_quantization import check_quantization, quantize_at_load
from engine.quantization import quantize_modules
from media import InvalidRequestError, check_int, check_number
from speech.admission import SpeechCapacity, SpeechTicket
from speech.backbone import CSM_ARCHITECTURE, CsmBackbone
from speech.clip import Speech
from speech.codecs import SPEECH_FORMATS
from speech.errors import (
    EmptyTextError,
    InvalidDurationError,
    NoSpeechHeadError,
    TextTooLongError,
    UnsupportedVoiceError,
)
from speech.frame_head import GREEDY, FrameHead, FrameRequest, Sampling
from speech.frame_timing import WARM_UP_MAX_BATCH, FrameTiming, StreamPace, TimedRunner, warm_up
from speech.frames import frames as run_frames
from speech.frames import is_end_frame
from speech.job import SpeechJob, audio_identity, prompt_rows
from speech.mimi_stream import StreamDecodeQueue, stream_decoder_for

# The text to speak may hold at most this many tokens (not counting context turns).
MAX_SPEECH_TEXT_TOKENS = 1024
# Speaker ids are the digits CSM sees as ``[N]``; allowed: 0..MAX_SPEAKER_ID.
MAX_SPEAKER_ID = 9
SPEAKER_PRESETS = {"default": 0, "alternate": 1}
# Without max_duration a clip stops at eos or after this many seconds (CSM's reference generator: 90 s).
DEFAULT_MAX_DURATION = 90.0
DEFAULT_CHUNK_FRAMES = 2
DEFAULT_CONTEXT_FRAMES = 64
FALLBACK_TOP_K = 50  # transformers' top_k default when sampling
DEFAULT_MAX_STREAMS = "auto"
DEFAULT_CPU_KV_BYTES = 256 * 1024 * 1024
TYPICAL_PROMPT_ROWS = 64
"""Prompt rows of a typical request, for counting how many fit in the pages (``headroom``)."""
DEFAULT_CUDA_KV_FRACTION = 0.25

__all__ = ["SpeechModel", "audio_cutoff", "is_end_frame"]


def audio_cutoff(codes: np.ndarray, eos_id: int) -> int:
    """Frames voiced: up to the first frame whose codebooks are all eos (reference's audio cutoff)."""
    if len(codes) == 0:
        return 0
    hits = np.nonzero((np.asarray(codes) == eos_id).all(axis=-1))[0]
    return int(hits[0]) if len(hits) else len(codes)


@dataclass
class SpeechStats:
    """Counters of a speech model's work (read by /metrics, tests and benches)."""

    requests: int = 0
    prompt_rows: int = 0
    reused_rows: int = 0
    """Prompt rows taken from the prefix cache instead of computed."""
    frames: int = 0


class SpeechModel:
    """A loaded CSM checkpoint. ``speak`` returns a ``Speech``; ``speak_stream`` yields PCM chunks;
    ``speak_async`` / ``stream_async`` are the same inside an event loop (batched with the other
    requests of that loop)."""

    def __init__(
        self,
        *,
        path: Path,
        config: dict[str, Any],
        hf: Any,
        processor: Any,
        generation_config: Any,
        pool: KVPool,
        attention: Any,
        max_streams: int | str | None = DEFAULT_MAX_STREAMS,
        max_prefill_rows: int = 2048,
        realtime_safety: float | None = None,
    ):
        self.path = path
        self.config = config
        self.hf = hf
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.generation_config = generation_config
        self.device = next(hf.parameters()).device
        self.dtype = next(hf.parameters()).dtype
        cfg = hf.config
        self.num_codebooks = int(cfg.num_codebooks)
        self.codebook_size = int(cfg.codec_config.codebook_size)
        self.vocab_size = int(cfg.vocab_size)
        self.eos_id = int(cfg.codebook_eos_token_id)
        self.frame_token_id = int(cfg.audio_token_id)
        self.sample_rate = int(cfg.codec_config.sampling_rate)
        self.frame_rate = float(cfg.codec_config.frame_rate)
        self.samples_per_frame = int(round(self.sample_rate / self.frame_rate))
        self.max_positions = int(cfg.max_position_embeddings)
        self.suppress = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
        self.suppress[self.codebook_size :] = True
        self.pool = pool
        self.max_prefill_rows = max_prefill_rows
        self.arch = CsmBackbone(hf)
        self.head = FrameHead(hf, self.suppress)
        self.runner = ForwardRunner(self.arch, pool, device=self.device, backend=attention)
        self.runner.head = self.head
        self.attention_backend: str = getattr(attention, "name", "torch")
        self.timing = FrameTiming(1.0 / self.frame_rate)
        """Measured seconds of a frame pass per batch size (admission's real-time rule)."""
        self.scheduler = Scheduler(TimedRunner(self.runner, self.timing))
        self.capacity = SpeechCapacity(
            num_pages=pool.num_pages,
            page_size=pool.page_size,
            max_streams=_max_streams(max_streams),
            timing=self.timing,
            safety=_safety(realtime_safety),
            stream_rows=min(self.max_positions, TYPICAL_PROMPT_ROWS + self.max_frames(None)),
        )
        self.pace = StreamPace(self.timing.frame_seconds)
        """Real-time margin of each stream (audio seconds per wall second), for /metrics."""
        self.stats = SpeechStats()
        self.quantization: str | None = None
        """The weight quantization ``load`` applied ("int8" / "int4"), None: ``dtype`` weights."""
        self._decoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pie-mimi")
        """Mimi decodes of the async paths, one at a time beside the forward worker."""
        stream_decoder = stream_decoder_for(hf.codec_model)
        self.mimi_stream = StreamDecodeQueue(stream_decoder, self._decoder) if stream_decoder else None
        """Streams decode each frame once, batched on the decode worker (None: a non-causal
        codec; its chunks are re-decoded with left context)."""

    # -- loading ----------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        kv_pages: int | None = None,
        kv_memory: int | None = None,
        page_size: int = 32,
        max_streams: int | str | None = DEFAULT_MAX_STREAMS,
        realtime_safety: float | None = None,
        warm_up_frames: bool = True,
        attention: str = "auto",
        cuda_graphs: int = 0,
        quantization: str | None = None,
        **_ignored: Any,
    ) -> SpeechModel:
        """Load the CSM checkpoint directory ``path`` (typed ``ModelLoadError``s from the engine's
        checkpoint loader; ``NoSpeechHeadError`` for a checkpoint of another architecture).
        device: default CUDA when available, else CPU. kv_pages / kv_memory: the backbone's page
        pool (default 256 MiB on the CPU, a quarter of the free GPU memory on CUDA). max_streams:
        a cap on requests generating at once ("auto", the default: none; pages and measured frame
        times bound them, ``speech.admission``). realtime_safety: a new stream is admitted only if
        the predicted frame time stays within this share of a frame's audio length (None, the
        default: no real-time rule, batches as big as the pages allow; a server passes 0.8).
        warm_up_frames: with the real-time rule on, seed the frame-time table with a few real
        passes at load (``speech.frame_timing.warm_up``; off: the first requests' passes do).
        attention: as ``engine.Model.load``. cuda_graphs: replay the depth decoder's steps for passes of up to this many streams from CUDA graphs
        (``speech.depth_graphs``: a whole frame per replay), and the backbone's frame passes too
        where the engine's graphs run the model (``speech.backbone.backbone_graphs``: flashinfer,
        float16/bfloat16; 0, the default: off; CUDA only). quantization: "int8" /
        "int4" weight-only layers of ``engine.quantization`` for the backbone, its codebook-0
        head and the depth decoder's layers (embeddings, the depth decoder's per-codebook
        heads and Mimi stay in ``dtype``); ``QuantizationUnavailableError`` for a method the
        device cannot run, before any weight loads. Other keywords of
        ``Model.load`` (a served model's load options) are accepted and ignored."""
        import transformers

        check_attention_choice(attention)
        if cuda_graphs < 0:
            raise InvalidRequestError(f"cuda_graphs must be >= 0 (0: off), got {cuda_graphs}")
        path = resolve_checkpoint(path)
        config = read_config(path)
        arch = architecture_name(config)
        if arch != CSM_ARCHITECTURE:
            raise NoSpeechHeadError(
                f"model {path.name!r} ({arch}) has no speech head; load a CSM checkpoint to speak",
                model=path.name,
                architecture=arch,
            )
        check_weights(path)
        dev = torch.device(device) if device is not None else default_device()
        if cuda_graphs and dev.type != "cuda":
            raise InvalidRequestError(f"cuda_graphs needs a CUDA device; this model is on {dev}")
        backend = select_backend(attention, device=dev, dtype=dtype)
        if quantization is not None:
            check_quantization(quantization, config, dev)
        hf = load_pretrained(path, CSM_ARCHITECTURE, dtype=dtype)
        processor = load_part(path, "CSM processor", transformers.AutoProcessor.from_pretrained)
        hf = place_model(hf, dev)
        if quantization is not None:
            _quantize(hf, path, config, quantization, dev, dtype)
        # The backbone attends over the engine's pages; the depth decoder and Mimi keep theirs.
        _page_backbone_attention(hf)
        layouts = CsmBackbone(hf).layer_layouts()
        if kv_pages is None:
            budget = kv_memory if kv_memory is not None else _default_kv_bytes(dev)
            kv_pages = max(1, budget // bytes_per_page(layouts, page_size, dtype))
        pool = KVPool(layouts, num_pages=int(kv_pages), page_size=page_size, dtype=dtype, device=dev)
        model = cls(
            path=path,
            config=config,
            hf=hf,
            processor=processor,
            generation_config=hf.generation_config,
            pool=pool,
            attention=backend,
            max_streams=max_streams,
            realtime_safety=realtime_safety,
        )
        model.quantization = quantization
        if cuda_graphs:
            from speech.backbone import backbone_graphs
            from speech.depth_graphs import DepthGraphs

            model.head.graphs = DepthGraphs(hf, cuda_graphs, capture=True, suppress=model.suppress)
            model.head.graphs.warm()  # every bucket's frame captured before the first request
            model.runner.graphs = backbone_graphs(model.runner, cuda_graphs, capture=True)
            if model.runner.graphs is not None:
                model.capacity.num_pages -= 1  # the graphs' scratch page is no request's
        if warm_up_frames and realtime_safety is not None:
            cap = model.capacity.max_streams or WARM_UP_MAX_BATCH
            warm_up(
                model, max_batch=min(cap, WARM_UP_MAX_BATCH), budget_seconds=model.capacity.budget_seconds
            )
        return model

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def architecture(self) -> str:
        return CSM_ARCHITECTURE

    @property
    def media_kinds(self) -> frozenset[str]:
        return frozenset()

    @property
    def frames_generated(self) -> int:
        """Frames generated so far, all requests together."""
        return self.stats.frames

    formats = SPEECH_FORMATS

    def pool_stats(self) -> Any:
        return self.pool.stats()

    def __repr__(self) -> str:
        return (
            f"SpeechModel({CSM_ARCHITECTURE}, {self.path}, device={self.device}, {self.sample_rate} Hz, "
            + (f"quantization={self.quantization}, " if self.quantization else "")
            + f"{self.capacity})"
        )

    # -- request checks ---------------------------------------------------------------------
    def speaker_id(self, speaker: Any) -> int:
        """``speaker`` as a CSM speaker id: an int 0..MAX_SPEAKER_ID, a digit string, or a preset."""
        if isinstance(speaker, str):
            if speaker in SPEAKER_PRESETS:
                return SPEAKER_PRESETS[speaker]
            if speaker.isdigit() and int(speaker) <= MAX_SPEAKER_ID:
                return int(speaker)
        elif isinstance(speaker, int | np.integer) and not isinstance(speaker, bool):
            if 0 <= int(speaker) <= MAX_SPEAKER_ID:
                return int(speaker)
        raise UnsupportedVoiceError(
            f"unsupported voice {speaker!r}: use a speaker id 0..{MAX_SPEAKER_ID} or one of "
            f"{', '.join(sorted(SPEAKER_PRESETS))}",
            voice=repr(speaker),
            presets=sorted(SPEAKER_PRESETS),
            max_speaker_id=MAX_SPEAKER_ID,
        )

    def max_frames(self, max_duration: float | None) -> int:
        if max_duration is None:
            max_duration = DEFAULT_MAX_DURATION
        try:
            seconds = check_number("max_duration (seconds)", max_duration, min=0, min_open=True)
        except InvalidRequestError as e:
            raise InvalidDurationError(e.message, **e.details) from e
        return max(1, math.ceil(seconds * self.frame_rate - 1e-9))

    def _check_text(self, text: Any) -> int:
        if not isinstance(text, str) or not text.strip():
            raise EmptyTextError("there is no text to speak")
        n = len(self.tokenizer.encode(text, add_special_tokens=False))
        if n > MAX_SPEECH_TEXT_TOKENS:
            raise TextTooLongError(
                f"the text is {n} tokens; MAX_SPEECH_TEXT_TOKENS is {MAX_SPEECH_TEXT_TOKENS}",
                tokens=n,
                limit=MAX_SPEECH_TEXT_TOKENS,
            )
        return n

    def _audio_array(self, audio: Any) -> np.ndarray:
        if isinstance(audio, Speech):
            if audio.sample_rate != self.sample_rate:
                raise InvalidRequestError(
                    f"context speech is {audio.sample_rate} Hz, expected {self.sample_rate}"
                )
            return np.asarray(audio.pcm, dtype=np.float32)
        mono_at = getattr(audio, "mono_at", None)
        if callable(mono_at):  # media.Audio
            return np.asarray(mono_at(self.sample_rate), dtype=np.float32)
        raise InvalidRequestError(
            f"context audio must be a media.Audio or a Speech, got {type(audio).__name__}"
        )

    def conversation(self, text: str, speaker: Any = 0, context: Sequence[Any] = ()) -> tuple[list, list]:
        """The CsmProcessor conversation (list of messages) and the context audio arrays."""
        messages, audios = [], []
        for i, turn in enumerate(context):
            try:
                turn_speaker, turn_text, turn_audio = turn
            except (TypeError, ValueError) as e:
                raise InvalidRequestError(f"context turn {i} must be (speaker, text, audio)") from e
            if not isinstance(turn_text, str) or not turn_text.strip():
                raise EmptyTextError(f"context turn {i} has no text")
            content: list[dict[str, Any]] = [{"type": "text", "text": turn_text}]
            if turn_audio is not None:
                array = self._audio_array(turn_audio)
                audios.append(array)
                content.append({"type": "audio", "path": array})
            messages.append({"role": str(self.speaker_id(turn_speaker)), "content": content})
        messages.append({"role": str(self.speaker_id(speaker)), "content": [{"type": "text", "text": text}]})
        return messages, audios

    @torch.no_grad()
    def _prompt(
        self, text: str, speaker: Any, context: Sequence[Any]
    ) -> tuple[list[int], torch.Tensor, list[str]]:
        """Prompt ids, backbone input embeddings (T, hidden) and each context audio's key."""
        messages, audios = self.conversation(text, speaker, context)
        try:
            rendered = self.processor.apply_chat_template(messages, tokenize=False)
        except Exception as e:  # jinja raise_exception in the template
            raise InvalidRequestError(f"the context does not fit CSM's conversation format: {e}") from e
        inputs = self.processor(text=rendered, audio=audios or None, return_tensors="pt")
        ids = inputs["input_ids"].to(self.device)
        values = inputs.get("input_values")
        cutoffs = inputs.get("input_values_cutoffs")
        merged = self.hf._merge_input_ids_with_input_values(
            input_ids=ids,
            input_values=values.to(self.device, self.dtype) if values is not None else None,
            input_values_cutoffs=cutoffs.to(self.device) if cutoffs is not None else None,
        )
        keys = [audio_identity(a, self.sample_rate) for a in audios]
        return ids[0].tolist(), merged["inputs_embeds"][0], keys

    def prompt_embeds(self, text: str, speaker: Any = 0, context: Sequence[Any] = ()) -> torch.Tensor:
        """Backbone input embeddings (1, T, hidden) for the conversation ending in ``[speaker]text``."""
        return self._prompt(text, speaker, context)[1][None]

    def _sampling(self, temperature: float | None, top_k: int | None) -> tuple[Sampling, Sampling]:
        if temperature is not None:
            temperature = check_number("temperature", temperature, min=0)
        if top_k is not None:
            top_k = check_int("top_k", top_k, min=1)
        if temperature is not None and temperature < GREEDY_BELOW:
            return GREEDY, GREEDY  # as the text engine does: a tinier T only overflows
        levels = []
        for cfg in (self.generation_config, self.hf.depth_decoder.generation_config):
            do_sample = True if temperature is not None else bool(cfg.do_sample)
            temp = float(temperature if temperature is not None else (cfg.temperature or 1.0))
            k = top_k if top_k is not None else (cfg.top_k if cfg.top_k is not None else FALLBACK_TOP_K)
            levels.append(Sampling(do_sample, temp, k))
        return levels[0], levels[1]

    def prepare(
        self,
        text: str,
        speaker: Any = 0,
        *,
        max_duration: float | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        context: Sequence[Any] = (),
        seed: int | None = None,
    ) -> SpeechJob:
        """Check a request and embed its prompt (blocking: Mimi encodes the context audio)."""
        text_tokens = self._check_text(text)
        self.speaker_id(speaker)
        frames = self.max_frames(max_duration)
        backbone, depth = self._sampling(temperature, top_k)
        if seed is not None:
            seed = check_int("seed", seed, min=0, max=2**64 - 1)
        ids, embeds, keys = self._prompt(text, speaker, context or ())
        room = self.max_positions - len(ids)
        if room < 1:
            raise TextTooLongError(
                f"the prompt with its context is {len(ids)} positions; the model holds {self.max_positions}",
                tokens=len(ids),
                limit=self.max_positions,
            )
        gen = torch.Generator(device=self.device).manual_seed(seed) if seed is not None else None
        return SpeechJob(
            rows=prompt_rows(ids, self.frame_token_id, keys),
            embeds=embeds,
            max_frames=min(frames, room),
            request=FrameRequest(backbone, depth, gen),
            text_tokens=text_tokens,
        )

    async def prepare_async(self, text: str, speaker: Any = 0, **options: Any) -> SpeechJob:
        """``prepare`` from an event loop: inline when no context turn carries audio, else on
        a thread (Mimi encodes that audio).

        A text-only prepare is a tokenization and an embedding lookup (~0.2 ms for a sentence
        on the tiny CSM, capped by ``MAX_SPEECH_TEXT_TOKENS``). Done inline, requests that
        arrive together reach the scheduler in the same loop iteration and move as one
        cohort: one prefill pass, frames in step, their first chunks in one batched Mimi
        decode. Sent to threads, they came back staggered under the GIL and split into
        cohorts a pass apart whose first-chunk decodes queued behind each other (8 at once:
        time to first audio p99 2.6x a lone request's; inline 1.5-1.9x, bench/speech.py)."""
        if any(_has_audio(turn) for turn in options.get("context") or ()):
            return await asyncio.to_thread(self.prepare, text, speaker, **options)
        return self.prepare(text, speaker, **options)

    def admit(
        self,
        job: SpeechJob,
        *,
        wait: bool = True,
        timeout: float | None = None,
        streamed: bool = True,
        queue_size: int | None = None,
    ) -> SpeechTicket:
        """A slot for ``job`` (``SpeechBusyError`` past capacity; ``wait``: block for one, up to
        ``timeout`` seconds (default ``capacity.wait_s``), instead). ``streamed``: its audio is
        played as it comes, so the real-time rule applies (``speech.admission``)."""
        return self.capacity.admit(
            job.total_rows,
            wait=wait,
            timeout=timeout,
            streamed=streamed,
            frames=job.max_frames,
            queue_size=queue_size,
        )

    async def admit_async(
        self,
        job: SpeechJob,
        *,
        wait: bool = True,
        timeout: float | None = None,
        streamed: bool = True,
        queue_size: int | None = None,
    ) -> SpeechTicket:
        """``admit`` from an event loop: a wait suspends only this task, and cancelling it
        leaves the queue (no ticket outlives its waiter)."""
        return await self.capacity.admit_async(
            job.total_rows,
            wait=wait,
            timeout=timeout,
            streamed=streamed,
            frames=job.max_frames,
            queue_size=queue_size,
        )

    # -- generation -------------------------------------------------------------------------
    async def frames_async(
        self, job: SpeechJob, ticket: SpeechTicket | None = None
    ) -> AsyncIterator[list[int]]:
        """The frames of an admitted ``job`` (``speech.frames``), counted on its ``ticket``
        (the admission's Retry-After estimate reads the frame budget left)."""
        self.stats.requests += 1
        clock = self.pace.start()
        try:
            async with aclosing(run_frames(self, job)) as frames:  # closing this closes that: pages back
                async for codes in frames:
                    clock.frame()
                    if ticket is not None:
                        ticket.frame()
                    yield codes
        finally:
            clock.close()

    @torch.no_grad()
    def decode(self, codes: np.ndarray | torch.Tensor) -> np.ndarray:
        """Mimi decode of (frames, codebooks) codes to float32 PCM (not clipped)."""
        codes = torch.as_tensor(np.asarray(codes), dtype=torch.long, device=self.device)
        if codes.shape[0] == 0:
            return np.zeros(0, dtype=np.float32)
        audio = self.hf.codec_model.decode(codes.transpose(0, 1).unsqueeze(0)).audio_values
        return audio[0, 0].float().cpu().numpy()

    def clip(self, codes: np.ndarray) -> Speech:
        """The ``Speech`` of a request's frames (the last one may be the end frame)."""
        codes = np.asarray(codes, dtype=np.int64).reshape(-1, self.num_codebooks)
        stop = "eos" if len(codes) and is_end_frame(list(codes[-1]), self.eos_id) else "max_duration"
        pcm = self.decode(codes[: audio_cutoff(codes, self.eos_id)])
        return Speech(
            np.clip(pcm, -1.0, 1.0).astype(np.float32), self.sample_rate, codes=codes, stop_reason=stop
        )

    async def speak_async(self, text: str, speaker: Any = 0, *, wait: bool = True, **options: Any) -> Speech:
        """``speak`` inside an event loop: requests of the same loop share passes. ``wait=False``:
        ``SpeechBusyError`` at once when the model is full; else it queues up to
        ``capacity.wait_s`` (on this loop: cancelling the call leaves the queue)."""
        job = await self.prepare_async(text, speaker, **options)
        ticket = await self.admit_async(job, wait=wait, streamed=False)
        return await self.clip_async(job, ticket)

    async def clip_async(self, job: SpeechJob, ticket: SpeechTicket) -> Speech:
        """The whole ``Speech`` of an admitted ``job`` (one Mimi decode, as ``speak``); the
        ticket is released when the frames are done."""
        with ticket:
            codes = [c async for c in self.frames_async(job, ticket)]
        return await asyncio.get_running_loop().run_in_executor(
            self._decoder, self.clip, np.asarray(codes, dtype=np.int64)
        )

    async def stream_async(
        self,
        job: SpeechJob,
        ticket: SpeechTicket | None = None,
        *,
        chunk_frames: int = DEFAULT_CHUNK_FRAMES,
        context_frames: int = DEFAULT_CONTEXT_FRAMES,
    ) -> AsyncIterator[np.ndarray]:
        """PCM chunks of a prepared ``job`` as its frames come (see ``speak_stream``); the
        ``ticket`` from ``admit`` is released when the stream ends (taken here, waiting, if None)."""
        chunk_frames = check_int("chunk_frames", chunk_frames, min=1)
        context_frames = check_int("context_frames", context_frames, min=0)
        if ticket is None:
            ticket = await self.admit_async(job)
        # The frames run ahead of the Mimi decode (a task of their own), so this stream's
        # next backbone step joins the next pass while a chunk decodes; chunks still cover
        # exactly ``chunk_frames`` frames each. Decodes of every stream share one worker
        # thread, beside the forward worker, instead of competing for the cores.
        codes: list[list[int]] = []
        more = asyncio.Event()
        ended = False
        gen = self.frames_async(job, ticket)

        async def produce() -> None:
            nonlocal ended
            try:
                async for ids in gen:
                    if all(c == self.eos_id for c in ids):  # the reference's audio cutoff
                        break
                    codes.append(ids)
                    more.set()
            finally:
                ended = True
                more.set()

        loop = asyncio.get_running_loop()
        producer = asyncio.create_task(produce())
        done = 0  # frames already voiced
        mimi = self.mimi_stream.start() if self.mimi_stream is not None else None
        try:
            while True:
                while len(codes) - done < chunk_frames and not ended:
                    more.clear()
                    await more.wait()
                if len(codes) == done:
                    break
                end = min(len(codes), done + chunk_frames)
                if mimi is not None:  # the stream's decoder state: only the new frames, each once
                    pcm = await asyncio.wrap_future(self.mimi_stream.submit(mimi, codes[done:end]))
                    yield np.clip(pcm, -1.0, 1.0).astype(np.float32)
                else:
                    yield await loop.run_in_executor(
                        self._decoder, self._chunk, codes[:end], done, context_frames
                    )
                done = end
            await producer  # a failed pass is the stream's error
        finally:
            try:
                if not producer.done():
                    producer.cancel()
                with suppress(asyncio.CancelledError, Exception):  # its error was raised above
                    await producer
                await gen.aclose()
            finally:  # however the closing goes (cancelled again, a generator still running)
                ticket.release()

    def speak(
        self,
        text: str,
        speaker: Any = 0,
        *,
        max_duration: float | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        context: Sequence[Any] = (),
        seed: int | None = None,
    ) -> Speech:
        """Speak ``text`` as ``speaker`` after the ``context`` turns ((speaker, text, audio) each).
        Blocking (waits for a slot); ``speak_async`` inside an event loop."""
        job = self.prepare(
            text,
            speaker,
            max_duration=max_duration,
            temperature=temperature,
            top_k=top_k,
            context=context,
            seed=seed,
        )
        with self.admit(job, streamed=False) as ticket:
            codes = run_sync(_collect(self.frames_async(job, ticket)))
        return self.clip(np.asarray(codes, dtype=np.int64))

    def speak_stream(
        self,
        text: str,
        speaker: Any = 0,
        *,
        max_duration: float | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        context: Sequence[Any] = (),
        seed: int | None = None,
        chunk_frames: int = DEFAULT_CHUNK_FRAMES,
        context_frames: int = DEFAULT_CONTEXT_FRAMES,
    ) -> Iterator[np.ndarray]:
        """Yield float32 PCM chunks of ``chunk_frames`` codec frames as they are generated.

        Each frame is decoded once by the stream's Mimi state (``context_frames``: left context
        re-decoded per chunk, only for a non-causal codec); the chunks joined equal ``speak``'s
        clip (see the module docstring for the tolerance). Checks run
        at the call, before the first ``next()``; the slot is taken at the first ``next()``.
        """
        chunk_frames = check_int("chunk_frames", chunk_frames, min=1)
        context_frames = check_int("context_frames", context_frames, min=0)
        job = self.prepare(
            text,
            speaker,
            max_duration=max_duration,
            temperature=temperature,
            top_k=top_k,
            context=context,
            seed=seed,
        )
        return _blocking(self._stream_admitted(job, chunk_frames, context_frames))

    async def _stream_admitted(
        self, job: SpeechJob, chunk_frames: int, context_frames: int
    ) -> AsyncIterator[np.ndarray]:
        ticket = self.admit(job)  # blocking callers run on their own thread: waiting is fine
        stream = self.stream_async(job, ticket, chunk_frames=chunk_frames, context_frames=context_frames)
        async with aclosing(stream):  # closing this closes that: pages back
            async for pcm in stream:
                yield pcm

    def _chunk(self, codes: list[list[int]], done: int, context_frames: int) -> np.ndarray:
        start = max(0, done - context_frames)  # a non-causal codec: re-decode left context
        pcm = self.decode(np.asarray(codes[start:], dtype=np.int64))
        new = (len(codes) - done) * self.samples_per_frame
        return np.clip(pcm[-new:], -1.0, 1.0).astype(np.float32)


def _has_audio(turn: Any) -> bool:
    """Whether a context turn ((speaker, text, audio); checked later by ``prepare``) has audio."""
    try:
        return turn[2] is not None
    except (TypeError, IndexError, KeyError):
        return False  # malformed: ``prepare`` raises its typed error inline


async def _collect(frames: AsyncIterator[list[int]]) -> list[list[int]]:
    return [c async for c in frames]


def _blocking(agen: AsyncIterator[np.ndarray]) -> Iterator[np.ndarray]:
    """An async generator driven from a thread without an event loop (``run_sync`` per item);
    closing the iterator closes the generator (its pages come back)."""
    try:
        while True:
            try:
                item = run_sync(agen.__anext__())
            except StopAsyncIteration:
                return
            yield item
    finally:
        run_sync(agen.aclose())


def _page_backbone_attention(hf: Any) -> None:
    """Wire only the backbone's attention to the engine's pages: transformers' setter also
    reaches Mimi's encoder/decoder configs, which keep their own implementation."""
    before = {
        id(m.config): (m.config, m.config._attn_implementation) for m in hf.modules() if hasattr(m, "config")
    }
    hf.set_attn_implementation({"": register_attention()})
    for config, impl in before.values():
        if config is not hf.config and config._attn_implementation != impl:
            config._attn_implementation = impl


def _quantize(
    hf: Any, path: Path, config: dict[str, Any], method: str, device: torch.device, dtype: torch.dtype
) -> None:
    """Weight-only ``method`` layers for the depth decoder's layers (and its input projection),
    then, as ``engine.Model.load`` does for a language model, the backbone and its codebook-0
    head (that step also copies the float weights that stay out of the checkpoint's memory map
    on the CPU, and checks the CUDA kernels). A frame reads the depth decoder's layers once per
    codebook step, so they are most of its bytes (CSM-1B: 31 x 0.44 GB of 18 GB in float32)."""
    quantize_modules(hf.depth_decoder.model, method, prefix="depth_decoder.model")
    quantize_at_load(hf, hf.backbone_model, path, config, method, device=device, dtype=dtype)


def _safety(value: float | None) -> float | None:
    if value is None:
        return None
    return check_number("realtime_safety", value, min=0, max=1, min_open=True)


def _max_streams(value: int | str | None) -> int | None:
    """``max_streams`` as a cap (None: "auto", no cap beyond pages and real time)."""
    if value is None or value == "auto":
        return None
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    return check_int("max_streams", value, min=1)


def _default_kv_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * DEFAULT_CUDA_KV_FRACTION)
    return DEFAULT_CPU_KV_BYTES
