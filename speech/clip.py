"""``Speech``: a generated mono clip (float32 PCM, its codes and why it stopped)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from speech.codecs import encode_pcm


@dataclass
class Speech:
    """A mono speech clip: float32 PCM in [-1, 1] at ``sample_rate`` Hz."""

    pcm: np.ndarray
    sample_rate: int
    codes: np.ndarray | None = None  # (codec frames, codebooks) as generated, end frame included
    stop_reason: str = "eos"  # "eos" | "max_duration"
    channels: int = field(default=1, init=False)

    @property
    def duration(self) -> float:
        return len(self.pcm) / self.sample_rate

    @property
    def num_samples(self) -> int:
        """PCM samples in the clip (not codec frames: those are ``len(codes)``)."""
        return len(self.pcm)

    def to_wav(self) -> bytes:
        """16-bit PCM WAV bytes."""
        return encode_pcm(self.pcm, self.sample_rate, "wav")

    def encode(self, format: str = "wav") -> bytes:  # noqa: A002 - the public name
        """Bytes in ``format``: one of ``SPEECH_FORMATS`` (see ``speech.codecs``)."""
        return encode_pcm(self.pcm, self.sample_rate, format)

    def __repr__(self) -> str:
        return f"Speech({self.duration:.3f} s, {self.sample_rate} Hz, mono, stop={self.stop_reason})"
