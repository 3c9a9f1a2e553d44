"""Methods of low classes that need higher files, attached once here.

``model.embed`` needs ``engine.embeddings`` (which builds contexts), ``ctx.snapshot()`` /
``Context.resume`` need ``engine.snapshot``, ``ctx.beam_search`` needs ``engine.beam``, and
``model.saved.import_`` needs ``Context.resume``, ``ctx.forward()`` needs ``engine.forward_pass``: written in ``model.py``, ``context.py`` or
``saved.py`` they would make those files import modules that import them back. They live
here instead, at the top of the room, and the room's door (``engine/__init__.py``) imports
this module, so every ``import engine...`` has them. Who owns what: ``model.py`` loading and
the pool, ``context.py`` a context's rows and steps, ``beam.py`` / ``snapshot.py`` /
``embeddings.py`` / ``sync.py`` the work built on contexts, this file only the binding.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from engine.beam import beam_search
from engine.context import Context
from engine.embeddings import embed_async, embed_many_async
from engine.forward_pass import ForwardPass
from engine.model import Model
from engine.saved import SavedContexts
from engine.snapshot import resume, snapshot
from engine.sync import run_sync


def _embed(self: Model, content: Any, *, pooling: str = "last", normalize: bool = True) -> torch.Tensor:
    """Blocking: the embedding of text and/or media ``content`` (``engine.embeddings``);
    await ``engine.embed_async`` inside an event loop."""
    return run_sync(embed_async(self, content, pooling=pooling, normalize=normalize))


def _embed_many(
    self: Model, contents: Sequence[Any], *, pooling: str = "last", normalize: bool = True
) -> torch.Tensor:
    """Blocking: (n, hidden) embeddings of several contents, computed together."""
    return run_sync(embed_many_async(self, contents, pooling=pooling, normalize=normalize))


async def _beam_search(
    self: Context,
    width: int,
    max_tokens: int,
    *,
    length_penalty: float = 1.0,
    eos: Iterable[int] | None = None,
    num_return: int = 1,
) -> list[Any]:
    """Beam search continuing this context (left unchanged): ``engine.beam.Hypothesis``
    values, best first; beams are forks sharing pages (see ``engine.beam``)."""
    return await beam_search(
        self, width, max_tokens, length_penalty=length_penalty, eos=eos, num_return=num_return
    )


def _snapshot(self: Context, *, include_kv: bool = False) -> bytes:
    """Portable bytes of this context (rows, media spans, chat, sampling state, model
    fingerprint; with ``include_kv`` also the committed rows' K/V, so a resume computes
    nothing again): ``Context.resume(model, data)`` rebuilds it."""
    self._check_open()
    return snapshot(self, include_kv=include_kv)


def _resume(cls: type[Context], model: Model, data: bytes) -> Context:
    """A context rebuilt from ``snapshot()`` bytes; its rows are pending (computed on the
    next pass), so it continues greedy generation exactly as the original would."""
    return resume(model, data)


def _import(self: SavedContexts, name: str, data: bytes, *, model: Model, overwrite: bool = False) -> None:
    """Save, under ``name``, the context that ``export`` (or ``Context.snapshot``) bytes
    describe, rebuilt on ``model`` (the typed snapshot errors apply)."""
    ctx = Context.resume(model, data)
    try:
        self.save(name, ctx, overwrite=overwrite)
    finally:
        ctx.close()


Model.embed = _embed  # type: ignore[attr-defined]
Model.embed_many = _embed_many  # type: ignore[attr-defined]


def _forward(self: Context) -> ForwardPass:
    """One forward pass built by hand (Pie's ``forward-pass``; ``engine.forward_pass``)."""
    return ForwardPass(self)


Context.forward = _forward  # type: ignore[attr-defined]
Context.beam_search = _beam_search  # type: ignore[attr-defined]
Context.snapshot = _snapshot  # type: ignore[attr-defined]
Context.resume = classmethod(_resume)  # type: ignore[attr-defined,assignment]
SavedContexts.import_ = _import  # type: ignore[attr-defined]
