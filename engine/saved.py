"""Saved contexts: a model's named snapshots of contexts, pinned with their pages.

``model.saved.save(name, ctx)`` keeps a fork of ``ctx`` (its pages by reference, so a
saved prefix costs no copy and stays in the pool while it is saved);
``model.saved.open(name)`` returns a new context forked from it; ``model.saved.delete``
unpins it; ``model.saved.import_(name, data, model=model)`` saves a context rebuilt from
snapshot bytes (attached by ``engine.conveniences``: it needs ``engine.context``). ``Context.save`` / ``Context.open`` and ``Model.saved_names`` /
``Model.delete_saved`` are the same operations.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from engine.errors import InvalidRequestError, SavedContextExistsError, SavedContextNotFoundError


class Context(Protocol):
    """What a saved context must do here (``engine.context.Context`` does; this file does
    not import it, so that ``engine.model``, which holds a ``SavedContexts``, stays below it)."""

    def fork(self) -> Any: ...

    def close(self) -> None: ...

    def snapshot(self) -> bytes: ...


class SavedContexts:
    """Named context snapshots of one model (``model.saved``)."""

    def __init__(self) -> None:
        self._by_name: dict[str, Context] = {}

    def save(self, name: str, ctx: Context, *, overwrite: bool = False) -> None:
        """Pin a fork of ``ctx`` under ``name``; ``SavedContextExistsError`` when the name
        is taken, unless ``overwrite`` (the old snapshot is then closed)."""
        if not name:
            raise InvalidRequestError("a saved context needs a non-empty name")
        if name in self._by_name and not overwrite:
            raise SavedContextExistsError(f"a context is already saved as {name!r}", name=name)
        snapshot = ctx.fork()
        old = self._by_name.pop(name, None)
        if old is not None:
            old.close()
        self._by_name[name] = snapshot

    def open(self, name: str) -> Context:
        """A new context forked from the one saved as ``name``."""
        return self._get(name).fork()

    def export(self, name: str) -> bytes:
        """The context saved as ``name`` as portable snapshot bytes (``engine.snapshot``'s
        format), so a saved prefix can leave the process."""
        return self._get(name).snapshot()

    def delete(self, name: str) -> None:
        """Unpin ``name`` (its pages go back to the pool unless others hold them)."""
        ctx = self._by_name.pop(name, None)
        if ctx is None:
            raise SavedContextNotFoundError(f"no context saved as {name!r}", name=name)
        ctx.close()

    def names(self) -> list[str]:
        """The saved names, sorted."""
        return sorted(self._by_name)

    def _get(self, name: str) -> Context:
        ctx = self._by_name.get(name)
        if ctx is None:
            raise SavedContextNotFoundError(f"no context saved as {name!r}", name=name)
        return ctx

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._by_name)

    def __repr__(self) -> str:
        return f"SavedContexts({', '.join(map(repr, self.names()))})"
