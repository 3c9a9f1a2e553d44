"""Speech out: CSM (backbone + depth decoder + Mimi codec) behind ``model.speak(text)``.

``SpeechModel.load(path)`` loads a ``CsmForConditionalGeneration`` checkpoint directory through the
engine's checkpoint loader (``api.model_ref.load_model`` dispatches here by the exact architecture
name; any other architecture is a ``NoSpeechHeadError``). No pages, contexts or scheduler: the math
is transformers' own modules, and this room owns the frame loop so that it can stream:

1. The prompt (context turns, then ``[speaker]text``) is rendered with the checkpoint's chat template
   and run through its ``CsmProcessor``; text ids and context audio (Mimi-encoded) are merged into
   backbone input embeddings by ``CsmForConditionalGeneration._merge_input_ids_with_input_values``.
2. Per frame: the backbone (with a transformers ``DynamicCache``) gives the last hidden state;
   ``lm_head`` picks codebook 0; the depth decoder (fresh ``DynamicCache`` per frame, seeded with
   the backbone hidden state at position 0) picks codebooks 1..n-1; the frame is fed back.
3. Stop rule (the reference's, ``CsmGenerationMixin._sample``): generation stops after a frame whose
   codebooks 0..n-2 all equal ``codebook_eos_token_id`` (the reference checks ``[:-1]``), or after
   ``ceil(max_duration * frame_rate)`` frames. The audio ends before the first frame whose codebooks
   are ALL eos (``generate(output_audio=True)``'s cutoff), so an all-eos end frame is not voiced.
4. Mimi decodes the codes to 24 kHz mono PCM. ``speak`` decodes once (bit-for-bit the reference's
   decode); ``speak_stream`` decodes every ``chunk_frames`` frames with up to ``context_frames`` of
   left context (Mimi's decoder is causal: with the whole prefix in the window the chunk equals the
   full decode up to float reordering, ~1e-6; past the window the decoder transformer loses far
   context and chunks drift slightly).

Sampling: ``temperature == 0`` is greedy at both levels. ``temperature=None`` uses the checkpoint's
generation_config (``do_sample``, ``temperature``, ``top_k`` and the ``depth_decoder_*`` ones; a
silent checkpoint means greedy, as ``generate`` does). ``temperature > 0`` samples both levels with
that temperature and ``top_k`` (given, else the checkpoint's, else transformers' 50). Logits
processing follows transformers' order: suppress, temperature, top-k, softmax, multinomial.

Suppression: ids ``>= codebook_size`` of the audio vocabulary (the 3 specials past the Mimi codes:
real CSM 2048..2050, tiny 64..66) are never Mimi codes; random weights can pick them and Mimi's
dequantiser would index out of range. They are masked in BOTH the backbone head and the depth
decoder. Id 0 (the eos code) is a valid Mimi code and is NOT suppressed: the stop rule needs it.
Trained checkpoints never emit the specials, so this changes nothing for them.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine import (
    architecture_name,
    check_weights,
    default_device,
    load_part,
    load_pretrained,
    place_model,
    read_config,
    resolve_checkpoint,
)
from media import InvalidRequestError, check_int, check_number
from speech.clip import Speech
from speech.codecs import SPEECH_FORMATS
from speech.errors import (
    EmptyTextError,
    InvalidDurationError,
    NoSpeechHeadError,
    TextTooLongError,
    UnsupportedVoiceError,
)

CSM_ARCHITECTURE = "CsmForConditionalGeneration"
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


@dataclass(frozen=True)
class _Sampling:
    do_sample: bool
    temperature: float
    top_k: int | None


def _pick(
    logits: torch.Tensor, suppress: torch.Tensor, s: _Sampling, gen: torch.Generator | None
) -> torch.Tensor:
    """Next id per row of ``logits`` (B, V), as transformers' processors + greedy/sample do."""
    scores = logits.float().masked_fill(suppress, float("-inf"))
    if not s.do_sample:
        return scores.argmax(-1)
    scores = scores / s.temperature
    if s.top_k is not None and 0 < s.top_k < scores.shape[-1]:
        kth = torch.topk(scores, s.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


def is_end_frame(frame: Sequence[int], eos_id: int) -> bool:
    """The reference's stop rule: codebooks 0..n-2 all equal the codebook eos id."""
    return all(int(c) == eos_id for c in list(frame)[:-1])


def audio_cutoff(codes: np.ndarray, eos_id: int) -> int:
    """Frames voiced: up to the first frame whose codebooks are all eos (reference's audio cutoff)."""
    if len(codes) == 0:
        return 0
    hits = np.nonzero((np.asarray(codes) == eos_id).all(axis=-1))[0]
    return int(hits[0]) if len(hits) else len(codes)


class SpeechModel:
    """A loaded CSM checkpoint. ``speak`` returns a ``Speech``; ``speak_stream`` yields PCM chunks."""

    def __init__(
        self, *, path: Path, config: dict[str, Any], hf: Any, processor: Any, generation_config: Any
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
        self.sample_rate = int(cfg.codec_config.sampling_rate)
        self.frame_rate = float(cfg.codec_config.frame_rate)
        self.samples_per_frame = int(round(self.sample_rate / self.frame_rate))
        self.max_positions = int(cfg.max_position_embeddings)
        self.suppress = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
        self.suppress[self.codebook_size :] = True
        self._lock = threading.Lock()
        # Frames generated so far by the running call (tests and benches read it).
        self.frames_generated = 0

    # -- loading ----------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> SpeechModel:
        """Load the CSM checkpoint directory ``path`` (typed ``ModelLoadError``s from the engine's
        checkpoint loader; ``NoSpeechHeadError`` for a checkpoint of another architecture).
        device: default CUDA when available, else CPU."""
        import transformers

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
        hf = load_pretrained(path, CSM_ARCHITECTURE, dtype=dtype)
        processor = load_part(path, "CSM processor", transformers.AutoProcessor.from_pretrained)
        hf = place_model(hf, dev)
        return cls(
            path=path, config=config, hf=hf, processor=processor, generation_config=hf.generation_config
        )

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def architecture(self) -> str:
        return CSM_ARCHITECTURE

    @property
    def media_kinds(self) -> frozenset[str]:
        return frozenset()

    formats = SPEECH_FORMATS

    def __repr__(self) -> str:
        return f"SpeechModel({CSM_ARCHITECTURE}, {self.path}, device={self.device}, {self.sample_rate} Hz)"

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

    def _check_text(self, text: Any) -> None:
        if not isinstance(text, str) or not text.strip():
            raise EmptyTextError("there is no text to speak")
        n = len(self.tokenizer.encode(text, add_special_tokens=False))
        if n > MAX_SPEECH_TEXT_TOKENS:
            raise TextTooLongError(
                f"the text is {n} tokens; MAX_SPEECH_TEXT_TOKENS is {MAX_SPEECH_TEXT_TOKENS}",
                tokens=n,
                limit=MAX_SPEECH_TEXT_TOKENS,
            )

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
    def prompt_embeds(self, text: str, speaker: Any = 0, context: Sequence[Any] = ()) -> torch.Tensor:
        """Backbone input embeddings (1, T, hidden) for the conversation ending in ``[speaker]text``."""
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
        return merged["inputs_embeds"]

    def _sampling(self, temperature: float | None, top_k: int | None) -> tuple[_Sampling, _Sampling]:
        if temperature is not None:
            temperature = check_number("temperature", temperature, min=0)
        if top_k is not None:
            top_k = check_int("top_k", top_k, min=1)
        if temperature == 0:
            greedy = _Sampling(False, 1.0, None)
            return greedy, greedy
        levels = []
        for cfg in (self.generation_config, self.hf.depth_decoder.generation_config):
            do_sample = True if temperature is not None else bool(cfg.do_sample)
            temp = float(temperature if temperature is not None else (cfg.temperature or 1.0))
            k = top_k if top_k is not None else (cfg.top_k if cfg.top_k is not None else FALLBACK_TOP_K)
            levels.append(_Sampling(do_sample, temp, k))
        return levels[0], levels[1]

    # -- generation -------------------------------------------------------------------------
    @torch.no_grad()
    def _frames(
        self,
        embeds: torch.Tensor,
        max_frames: int,
        backbone: _Sampling,
        depth: _Sampling,
        gen: torch.Generator | None,
    ) -> Iterator[list[int]]:
        """Yield frames (lists of num_codebooks ids); the last is the end frame or the max_frames-th."""
        from transformers import DynamicCache

        hf = self.hf
        cache = DynamicCache(config=hf.config)
        out = hf.backbone_model(inputs_embeds=embeds, past_key_values=cache, use_cache=True)
        self.frames_generated = 0
        for _ in range(max_frames):
            hidden = out.last_hidden_state[:, -1, :]
            first = _pick(hf.lm_head(hidden), self.suppress, backbone, gen)
            depth_cache = DynamicCache(config=hf.depth_decoder.config)
            step_ids = torch.stack([torch.zeros_like(first), first], dim=-1)
            frame = [first]
            for i in range(self.num_codebooks - 1):
                d = hf.depth_decoder(
                    input_ids=step_ids,
                    backbone_last_hidden_state=hidden if i == 0 else None,
                    past_key_values=depth_cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                code = _pick(d.logits[:, -1, :], self.suppress, depth, gen)
                frame.append(code)
                step_ids = code[:, None]
            codes = torch.stack(frame, dim=-1)  # (1, num_codebooks)
            self.frames_generated += 1
            ids = [int(c) for c in codes[0].tolist()]
            yield ids
            if is_end_frame(ids, self.eos_id):
                return
            out = hf.backbone_model(input_ids=codes[:, None, :], past_key_values=cache, use_cache=True)

    def _start(
        self,
        text: str,
        speaker: Any,
        max_duration: float | None,
        temperature: float | None,
        top_k: int | None,
        context: Sequence[Any],
        seed: int | None,
    ) -> tuple[Iterator[list[int]], int]:
        self._check_text(text)
        self.speaker_id(speaker)
        frames = self.max_frames(max_duration)
        backbone, depth = self._sampling(temperature, top_k)
        embeds = self.prompt_embeds(text, speaker, context or ())
        room = self.max_positions - embeds.shape[1]
        if room < 1:
            raise TextTooLongError(
                f"the prompt with its context is {embeds.shape[1]} positions; the model holds {self.max_positions}",
                tokens=int(embeds.shape[1]),
                limit=self.max_positions,
            )
        limited = min(frames, room)
        gen = None
        if seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(int(seed))
        return self._frames(embeds, limited, backbone, depth, gen), limited

    @torch.no_grad()
    def decode(self, codes: np.ndarray | torch.Tensor) -> np.ndarray:
        """Mimi decode of (frames, codebooks) codes to float32 PCM (not clipped)."""
        codes = torch.as_tensor(np.asarray(codes), dtype=torch.long, device=self.device)
        if codes.shape[0] == 0:
            return np.zeros(0, dtype=np.float32)
        audio = self.hf.codec_model.decode(codes.transpose(0, 1).unsqueeze(0)).audio_values
        return audio[0, 0].float().cpu().numpy()

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
        """Speak ``text`` as ``speaker`` after the ``context`` turns ((speaker, text, audio) each)."""
        with self._lock:
            frames, limit = self._start(text, speaker, max_duration, temperature, top_k, context, seed)
            codes = np.asarray(list(frames), dtype=np.int64).reshape(-1, self.num_codebooks)
            stop = "eos" if len(codes) and is_end_frame(codes[-1], self.eos_id) else "max_duration"
            pcm = self.decode(codes[: audio_cutoff(codes, self.eos_id)])
        return Speech(
            np.clip(pcm, -1.0, 1.0).astype(np.float32), self.sample_rate, codes=codes, stop_reason=stop
        )

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

        Each chunk is decoded with up to ``context_frames`` frames of left context; the chunks
        joined equal ``speak``'s clip (see the module docstring for the tolerance).
        """
        chunk_frames = check_int("chunk_frames", chunk_frames, min=1)
        context_frames = check_int("context_frames", context_frames, min=0)
        # Checks run now, before the first next(): errors surface at the call.
        with self._lock:
            frames, _ = self._start(text, speaker, max_duration, temperature, top_k, context, seed)
        return self._stream(frames, chunk_frames, context_frames)

    def _stream(
        self, frames: Iterator[list[int]], chunk_frames: int, context_frames: int
    ) -> Iterator[np.ndarray]:
        codes: list[list[int]] = []
        done = 0  # frames already voiced
        with self._lock:
            for ids in frames:
                if all(c == self.eos_id for c in ids):  # the reference's audio cutoff
                    break
                codes.append(ids)
                if len(codes) - done >= chunk_frames:
                    yield self._chunk(codes, done, context_frames)
                    done = len(codes)
            if len(codes) > done:
                yield self._chunk(codes, done, context_frames)

    def _chunk(self, codes: list[list[int]], done: int, context_frames: int) -> np.ndarray:
        start = max(0, done - context_frames)
        pcm = self.decode(np.asarray(codes[start:], dtype=np.int64))
        new = (len(codes) - done) * self.samples_per_frame
        return np.clip(pcm[-new:], -1.0, 1.0).astype(np.float32)
