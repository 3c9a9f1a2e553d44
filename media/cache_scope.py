"""Whose caches a request may share: the scope that keys every cache of what media and
prompts become (prepared media and encoder outputs in ``encoders``, KV prefix pages in
the engine). It lives in the lowest room, beside the content hashes it qualifies, so every
room above reads one scope (and importing it loads no torch).

A hit in a shared cache is a timing signal: a faster answer tells the caller someone sent
that image, or that prompt, before. A serving process with several tenants sets the scope
per request (``api.http``: the caller's tenant, plus the request's ``cache_salt`` as in
vLLM), so reuse happens only within one scope. The empty scope (the default, a library
user, a single-tenant server) keys caches exactly as before.

A context variable, because the caches sit several rooms below the request: the scope
travels with the request's task and the threads ``asyncio.to_thread`` starts from it."""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

_scope: contextvars.ContextVar[str] = contextvars.ContextVar("pie_media_cache_scope", default="")


def cache_scope() -> str:
    """The scope caches are keyed under now ("" : shared by everyone)."""
    return _scope.get()


def set_cache_scope(scope: str) -> None:
    """Key caches under ``scope`` for the rest of this task (a request's dependency)."""
    _scope.set(scope)


@contextmanager
def use_cache_scope(scope: str) -> Iterator[str]:
    """Key caches under ``scope`` inside the block."""
    token = _scope.set(scope)
    try:
        yield scope
    finally:
        _scope.reset(token)
