"""A speech request checked and embedded, ready to run on the engine (``SpeechModel.prepare``).

Its prompt rows carry what a KV page's key is made of (``engine.PageTable``): the text
token id and position of a text row; for a context-audio row, the audio token id plus the
identity of that turn's audio (a hash of the samples the codec encodes) and the row's
offset in it, because its K/V comes from the Mimi codes of that audio, not from the id.
So a second request with the same context turns (text and audio) reuses the first one's
prompt pages (the prefix cache), and two different clips never share a page.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine import MediaRow
from speech.frame_head import FrameRequest


@dataclass(frozen=True, slots=True)
class PromptRow:
    token: int
    pos: tuple[int, ...]
    media: MediaRow | None = None


@dataclass(eq=False)
class SpeechJob:
    rows: list[PromptRow]
    embeds: torch.Tensor
    """(len(rows), hidden) backbone input embeddings of the prompt."""
    max_frames: int
    """Frames at most (``max_duration``, capped by the model's positions)."""
    request: FrameRequest
    text_tokens: int
    """Tokens of the text to speak (usage)."""

    @property
    def prompt_rows(self) -> int:
        return len(self.rows)

    @property
    def total_rows(self) -> int:
        """KV rows the request holds at most: the prompt and every frame but the last."""
        return len(self.rows) + self.max_frames - 1

    def __repr__(self) -> str:
        return f"SpeechJob(prompt_rows={len(self.rows)}, max_frames={self.max_frames})"


def audio_identity(array: np.ndarray, sample_rate: int) -> str:
    """Content key of one context turn's audio as the codec sees it."""
    h = hashlib.blake2b(np.ascontiguousarray(array, dtype=np.float32).tobytes(), digest_size=16)
    return f"csm-audio:{sample_rate}:{h.hexdigest()}"


def prompt_rows(ids: Sequence[int], audio_token_id: int, audio_keys: Sequence[str]) -> list[PromptRow]:
    """Keyed rows of a prompt: each run of ``audio_token_id`` rows is the next turn's audio."""
    rows: list[PromptRow] = []
    turn, offset, prev_audio = -1, 0, False
    for i, tok in enumerate(ids):
        is_audio = tok == audio_token_id
        if is_audio and not prev_audio:
            turn, offset = turn + 1, 0
        media = None
        if is_audio:
            if turn >= len(audio_keys):
                raise ValueError("the prompt has more audio runs than context audio clips")
            media = MediaRow(audio_keys[turn], offset)
            offset += 1
        rows.append(PromptRow(int(tok), (i,), media))
        prev_audio = is_audio
    return rows
