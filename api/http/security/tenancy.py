"""Who is calling: the key a request authenticated with, as a ``Caller`` (name, tenant,
role, limits), and the tenant every stored object belongs to.

A **tenant** is the stable id objects are recorded under: a named key's ``tenant`` (its
name unless the key file says otherwise, so a rotated key keeps its objects), or
``key-<first 12 hex digits of the key's sha256>`` for a plain one-key-per-line file. The
key itself is never stored. A **user** sees only its tenant's objects; any other object is
a 404, as if it did not exist. An **admin** sees and manages every object. State written
before tenants existed has the tenant ``""``: only admins see it.

The caller travels in a context variable set by the bearer check, so code below the routes
(media references, batch lines, inferlet runs) reads the same identity without every
signature naming it; ``use_caller`` sets it for work that runs outside a request (a batch
job's lines run as the batch's creator).
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

from media import set_cache_scope

Role = Literal["admin", "user"]
LEGACY_TENANT = ""
"""The tenant of objects stored before keys isolated (and of a server without keys)."""


@dataclass(frozen=True)
class KeyLimits:
    """Per-key limits (None: unlimited). Over one, the request is a 429 with Retry-After."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_streams: int | None = None
    max_stored_bytes: int | None = None

    @property
    def any(self) -> bool:
        return any(
            v is not None
            for v in (
                self.requests_per_minute,
                self.tokens_per_minute,
                self.max_concurrent_streams,
                self.max_stored_bytes,
            )
        )


@dataclass(frozen=True)
class Caller:
    """One authenticated key: ``name`` (metrics, audit lines), ``tenant`` (what its objects
    are recorded under), ``role`` and ``limits``."""

    name: str
    tenant: str
    role: Role = "user"
    limits: KeyLimits = field(default_factory=KeyLimits)

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    @property
    def scope(self) -> str | None:
        """The tenant a store filters by: None (every object) for an admin."""
        return None if self.is_admin else self.tenant

    def owns(self, tenant: str | None) -> bool:
        """Whether an object recorded under ``tenant`` is visible to this caller."""
        return self.is_admin or tenant == self.tenant


ANONYMOUS = Caller(name="anonymous", tenant=LEGACY_TENANT, role="admin")
"""The caller of a server without keys (loopback only): everything, as before keys."""

_current: contextvars.ContextVar[Caller] = contextvars.ContextVar("pie_media_caller", default=ANONYMOUS)


def current_caller() -> Caller:
    """The caller of the request (or the work) running now."""
    return _current.get()


def set_caller(caller: Caller) -> None:
    """Make ``caller`` the current one for the rest of this task (the bearer check)."""
    _current.set(caller)


@contextmanager
def use_caller(caller: Caller) -> Iterator[Caller]:
    """Run a block as ``caller`` (a batch line as its batch's creator)."""
    token = _current.set(caller)
    try:
        yield caller
    finally:
        _current.reset(token)


def owner_of_tenant(tenant: str) -> Caller:
    """A user caller standing for ``tenant``: work a tenant started, resumed without its key
    (a batch job after a restart) sees exactly that tenant's objects; the legacy tenant is
    an admin's, as its objects are."""
    if tenant == LEGACY_TENANT:
        return ANONYMOUS
    return Caller(name=tenant, tenant=tenant, role="user")


def cache_scope_for(caller: Caller, salt: str | None = None, *, shared: bool = False) -> str:
    """The cache scope of a request (``encoders.cache_scope``): its tenant (unless the
    deployment shares caches, ``--share-prefix-cache``) and its ``cache_salt`` (vLLM's:
    only requests with the same salt share prefix pages). "" shares with everyone."""
    tenant = "" if shared else caller.tenant
    if not tenant and not salt:
        return ""
    return f"tenant={tenant};salt={salt or ''}"


def enter(caller: Caller, *, shared_caches: bool = False, salt: str | None = None) -> None:
    """Make ``caller`` the current one for the rest of this task, with its cache scope."""
    set_caller(caller)
    set_cache_scope(cache_scope_for(caller, salt, shared=shared_caches))
