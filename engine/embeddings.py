"""Embeddings from the language model's final hidden states, text and media alike.

``content`` is a string or a sequence of parts (strings and ``media`` Image / Audio /
Video objects, in order), filled raw (no chat template): text is tokenized, media
spans are placed exactly as ``Context.append_*`` places them. The rows' final hidden
states (after the model's final norm, as transformers' ``hidden_states[-1]``) are pooled:

- ``last``: the last row (decoder-only models summarise there);
- ``mean`` / ``max``: over every row, media placeholder rows included;
- ``cls``: the first row.

``normalize`` scales to unit L2 norm. Many contents embed concurrently: their prefills
share the model's forward passes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import torch

from engine.context import Context
from engine.errors import InvalidRequestError
from engine.model import Model

POOLINGS = ("last", "mean", "max", "cls")
_APPEND = {"image": "append_image", "audio": "append_audio", "video": "append_video"}


def _parts(content: Any) -> list[Any]:
    if isinstance(content, str):
        parts = [content]
    elif isinstance(content, Sequence):
        parts = list(content)
    else:
        parts = [content]
    if not parts or all(isinstance(p, str) and not p for p in parts):
        raise InvalidRequestError("nothing to embed: the content is empty")
    return parts


def pool(states: torch.Tensor, pooling: str, normalize: bool) -> torch.Tensor:
    """(rows, hidden) -> (hidden,) float32."""
    if pooling not in POOLINGS:
        raise InvalidRequestError(
            f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}", param="pooling"
        )
    states = states.float()
    if pooling == "last":
        out = states[-1]
    elif pooling == "cls":
        out = states[0]
    elif pooling == "mean":
        out = states.mean(dim=0)
    else:
        out = states.max(dim=0).values
    return torch.nn.functional.normalize(out, dim=0) if normalize else out


async def embed_async(
    model: Model, content: Any, *, pooling: str = "last", normalize: bool = True
) -> torch.Tensor:
    """The embedding of ``content`` (see the module docstring): (hidden,) float32."""
    vector, _rows = await embed_counted_async(model, content, pooling=pooling, normalize=normalize)
    return vector


def _token_ids(content: Any) -> list[int] | None:
    if (
        isinstance(content, list | tuple)
        and content
        and all(isinstance(t, int) and not isinstance(t, bool) for t in content)
    ):
        return list(content)
    return None


async def embed_counted_async(
    model: Model, content: Any, *, pooling: str = "last", normalize: bool = True
) -> tuple[torch.Tensor, int]:
    """(embedding, rows of context it took): ``content`` may also be a list of token ids."""
    if pooling not in POOLINGS:
        raise InvalidRequestError(
            f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}", param="pooling"
        )
    ids = _token_ids(content)
    parts = [] if ids is not None else _parts(content)
    prepared = [p if isinstance(p, str) else await asyncio.to_thread(model.prepare, p) for p in parts]
    async with Context(model) as ctx:
        if ids is not None:
            ctx.fill_tokens(ids)
        for p in prepared:
            if isinstance(p, str):
                ctx.fill(p)
            else:
                getattr(ctx, _APPEND[p.kind])(p)
        if not len(ctx):
            raise InvalidRequestError("nothing to embed: the content has no tokens")
        rows = len(ctx)
        states = await ctx.hidden_states()
    return pool(states, pooling, normalize), rows


async def embed_many_async(
    model: Model, contents: Sequence[Any], *, pooling: str = "last", normalize: bool = True
) -> torch.Tensor:
    """Embeddings of several contents, computed together: (n, hidden) float32."""
    if not contents:
        raise InvalidRequestError("nothing to embed: no contents given")
    rows = await asyncio.gather(
        *(embed_async(model, c, pooling=pooling, normalize=normalize) for c in contents)
    )
    return torch.stack(list(rows))
