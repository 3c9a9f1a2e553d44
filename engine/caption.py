"""Captioning convenience: one image (or several, batched) in, text out."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from typing import Any

from engine.context import Context
from engine.model import Model
from engine.sampling import Sampler
from engine.sync import run_sync

DEFAULT_PROMPT = "Describe this image."


def _as_image(image: Any) -> Any:
    """A ``media.Image`` (or ``Prepared``) from an Image, raw bytes or a file path."""
    from media import Image

    if isinstance(image, bytes | bytearray | memoryview):
        return Image.from_bytes(bytes(image))
    if isinstance(image, str | os.PathLike):
        return Image.from_path(image)
    return image


async def caption_async(
    model: Model,
    image: Any,
    *,
    prompt: str = DEFAULT_PROMPT,
    max_tokens: int = 64,
    sampler: Sampler | None = None,
) -> str:
    async with Context(model) as ctx:
        ctx.user(_as_image(image), prompt).cue()
        out = await ctx.generate(sampler or Sampler.greedy(), max_tokens=max_tokens)
        return out.text


async def caption_many_async(
    model: Model,
    images: Sequence[Any],
    *,
    prompt: str = DEFAULT_PROMPT,
    max_tokens: int = 64,
    sampler: Sampler | None = None,
) -> list[str]:
    """Caption several images concurrently (their decode steps share forward passes)."""
    return list(
        await asyncio.gather(
            *(
                caption_async(model, im, prompt=prompt, max_tokens=max_tokens, sampler=sampler)
                for im in images
            )
        )
    )


def caption(
    model: Model,
    image: Any,
    *,
    prompt: str = DEFAULT_PROMPT,
    max_tokens: int = 64,
    sampler: Sampler | None = None,
) -> str:
    """Blocking: the model's answer to ``prompt`` about ``image`` (Image, bytes or path)."""
    return run_sync(caption_async(model, image, prompt=prompt, max_tokens=max_tokens, sampler=sampler))


def caption_many(
    model: Model,
    images: Sequence[Any],
    *,
    prompt: str = DEFAULT_PROMPT,
    max_tokens: int = 64,
    sampler: Sampler | None = None,
) -> list[str]:
    return run_sync(caption_many_async(model, images, prompt=prompt, max_tokens=max_tokens, sampler=sampler))
