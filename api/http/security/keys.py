"""The service's security rules in one place: API keys (constant-time bearer check,
keys required off loopback) and, re-exported from ``api.http.security.remote_media``, the
SSRF-checked remote media fetcher and the ``file://`` folder policy."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import tomllib
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any

from cryptography.exceptions import UnsupportedAlgorithm
from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic import Field as PydField

from api.http.security.remote_media import (
    METADATA_ADDRESSES,
    FetchedMedia,
    LocalMediaPolicy,
    MediaFetcher,
    RemoteMediaFetchError,
    RemoteMediaForbiddenError,
    RemoteMediaTimeoutError,
    RemoteMediaTooLargeError,
    address_refusal,
)
from api.http.security.tenancy import ANONYMOUS, Caller, KeyLimits, Role, enter
from media import PieMediaError

__all__ = [
    "METADATA_ADDRESSES",
    "ApiKeys",
    "ApiKeysRequiredError",
    "KeyEntry",
    "KeyFileError",
    "PublicKey",
    "admin_only",
    "load_public_key",
    "parse_key_file",
    "FetchedMedia",
    "LocalMediaPolicy",
    "MediaFetcher",
    "RemoteMediaFetchError",
    "RemoteMediaForbiddenError",
    "RemoteMediaTimeoutError",
    "RemoteMediaTooLargeError",
    "address_refusal",
    "bearer_auth",
    "is_loopback_host",
    "require_keys_or_loopback",
]

API_KEYS_ENV = "PIE_MEDIA_API_KEYS"


class ApiKeysRequiredError(PieMediaError, ValueError):
    """The server would listen beyond loopback with no API key configured."""

    code = "api_keys_required"


def _digest(token: str) -> bytes:
    # Comparing fixed-size digests keeps the comparison constant-time in the key's length too.
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


class KeyFileError(PieMediaError, ValueError):
    """The key file cannot be read as keys (a named entry's field, a duplicate name)."""

    code = "invalid_key_file"


class KeyEntry(BaseModel):
    """One named key of a TOML (``[[keys]]``) or JSON key file."""

    model_config = ConfigDict(extra="forbid")

    name: str = PydField(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.@-]*$")
    key: str | None = PydField(default=None, min_length=8)
    sha256: str | None = PydField(default=None, pattern=r"^[0-9a-fA-F]{64}$")
    role: Role = "user"
    tenant: str | None = PydField(default=None, min_length=1, max_length=64)
    requests_per_minute: int | None = PydField(default=None, ge=1)
    tokens_per_minute: int | None = PydField(default=None, ge=1)
    max_concurrent_streams: int | None = PydField(default=None, ge=1)
    max_stored_bytes: int | None = PydField(default=None, ge=0)
    public_key: str | None = PydField(default=None, min_length=16)
    """For Pie's WebSocket protocol (``auth_identify`` with this entry's name, then
    ``auth_prove``): an OpenSSH public key line (``ssh-ed25519 AAAA...``, ``ecdsa-sha2-nistp256``
    / ``nistp384``, ``ssh-rsa`` of 2048 bits or more) or a PEM public key. An entry may
    carry only this (no bearer key): it then signs in over that protocol only."""

    def caller(self) -> Caller:
        limits = KeyLimits(
            requests_per_minute=self.requests_per_minute,
            tokens_per_minute=self.tokens_per_minute,
            max_concurrent_streams=self.max_concurrent_streams,
            max_stored_bytes=self.max_stored_bytes,
        )
        return Caller(name=self.name, tenant=self.tenant or self.name, role=self.role, limits=limits)

    def digest(self) -> bytes | None:
        """The bearer key's digest; None for an entry with only a public key."""
        if self.key is None and self.sha256 is None and self.public_key is not None:
            return None
        if (self.key is None) == (self.sha256 is None):
            raise ValueError(
                f"key {self.name!r}: give exactly one of 'key' and 'sha256' "
                "(or only 'public_key', for Pie's protocol)"
            )
        return _digest(self.key) if self.key is not None else bytes.fromhex(self.sha256 or "")


PublicKey = Any
"""A ``cryptography`` public key: Ed25519, ECDSA (P-256, P-384) or RSA (>= 2048 bits)."""


def load_public_key(text: str) -> PublicKey:
    """An OpenSSH public key line or a PEM public key, checked to be a kind Pie's client
    signs with (``ValueError`` otherwise)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

    data = text.strip().encode()
    try:
        if data.startswith(b"-----BEGIN"):
            key = serialization.load_pem_public_key(data)
        else:
            key = serialization.load_ssh_public_key(data)
    except (ValueError, TypeError, UnsupportedAlgorithm) as e:
        raise ValueError(f"not an OpenSSH or PEM public key: {e}") from None
    if isinstance(key, ed25519.Ed25519PublicKey):
        return key
    if isinstance(key, rsa.RSAPublicKey):
        if key.key_size < 2048:
            raise ValueError(f"an RSA key of {key.key_size} bits; at least 2048")
        return key
    if isinstance(key, ec.EllipticCurvePublicKey) and key.curve.name in ("secp256r1", "secp384r1"):
        return key
    raise ValueError(f"a {type(key).__name__}; Ed25519, ECDSA P-256/P-384 or RSA >= 2048 bits")


def _plain_caller(digest: bytes, role: Role) -> Caller:
    tenant = "key-" + digest.hex()[:12]
    return Caller(name=tenant, tenant=tenant, role=role)


def parse_key_file(text: str, source: str = "key file") -> tuple[list[tuple[bytes, Caller]], list[str]]:
    """(named entries as (digest, caller), plain keys) of a key file's text: TOML with
    ``[[keys]]`` tables, JSON (a list of entries or ``{"keys": [...]}``), or one key per
    line (blank lines and ``#`` comments skipped)."""
    named, plain, _ = _parse_key_file(text, source)
    return named, plain


def _parse_key_file(
    text: str, source: str
) -> tuple[list[tuple[bytes, Caller]], list[str], dict[str, tuple[PublicKey, Caller]]]:
    """``parse_key_file``'s answer and the named entries' public keys (name -> (key, caller))."""
    stripped = text.lstrip()
    raw: Any = None
    if stripped.startswith("{") or (stripped.startswith("[") and not stripped.startswith("[[")):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise KeyFileError(f"{source}: not valid JSON: {e}") from None
    elif "[[keys]]" in text:
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise KeyFileError(f"{source}: not valid TOML: {e}") from None
    if raw is None:
        plain = [ln.strip() for ln in text.splitlines()]
        return [], [k for k in plain if k and not k.startswith("#")], {}
    entries = raw.get("keys") if isinstance(raw, dict) else raw
    if not isinstance(entries, list):
        raise KeyFileError(f"{source}: expected a list of keys ([[keys]] tables or a JSON list)")
    named: list[tuple[bytes, Caller]] = []
    public: dict[str, tuple[PublicKey, Caller]] = {}
    names: set[str] = set()
    for i, item in enumerate(entries):
        try:
            entry = KeyEntry.model_validate(item)
            digest = entry.digest()
            key = load_public_key(entry.public_key) if entry.public_key is not None else None
        except (ValidationError, ValueError) as e:
            raise KeyFileError(f"{source}: entry {i + 1}: {e}") from None
        if entry.name in names:
            raise KeyFileError(f"{source}: the name {entry.name!r} is given twice; names must be unique")
        names.add(entry.name)
        if digest is not None:
            named.append((digest, entry.caller()))
        if key is not None:
            public[entry.name] = (key, entry.caller())
    return named, [], public


class ApiKeys:
    """The accepted bearer tokens and who each one is (a ``Caller``). ``identify``
    compares against every key with ``hmac.compare_digest`` and never stops at the first
    match. ``reload`` re-reads the sources (SIGHUP): a removed key stops working at once.

    Plain keys (one per line, or the environment variable) are users, each its own tenant,
    except a lone plain key with no named ones: that server is single-tenant and its key an
    admin, exactly as before keys isolated."""

    def __init__(self, keys: Iterable[str] = (), *, named: Iterable[tuple[bytes, Caller]] = ()):
        self._entries: tuple[tuple[bytes, Caller], ...] = ()
        self._public: dict[str, tuple[PublicKey, Caller]] = {}
        self._sources: tuple[Path | None, str, Mapping[str, str] | None] | None = None
        self._set(list(named), keys)

    def _set(
        self,
        named: list[tuple[bytes, Caller]],
        plain: Iterable[str],
        public: dict[str, tuple[PublicKey, Caller]] | None = None,
    ) -> None:
        cleaned = sorted({k.strip() for k in plain if k and k.strip()})
        role: Role = "admin" if len(cleaned) == 1 and not named else "user"
        entries = list(named) + [(_digest(k), _plain_caller(_digest(k), role)) for k in cleaned]
        digests = [d for d, _ in entries]
        if len(set(digests)) != len(digests):
            raise KeyFileError(
                "the same key is given twice (as a key or its sha256); each key names one caller"
            )
        self._entries = tuple(entries)
        self._public = dict(public or {})

    @classmethod
    def from_sources(
        cls,
        key_file: Path | str | None = None,
        env_var: str = API_KEYS_ENV,
        *,
        environ: Mapping[str, str] | None = None,
    ) -> ApiKeys:
        """Keys from ``key_file`` (see ``parse_key_file``; a missing file raises ``OSError``)
        and from the environment variable ``env_var`` (comma-separated plain keys).
        ``environ`` defaults to ``os.environ``."""
        keys = cls()
        keys._sources = (Path(key_file) if key_file is not None else None, env_var, environ)
        keys.reload()
        return keys

    def reload(self) -> None:
        """Read the sources again (a key file edited while serving). A file that no longer
        parses leaves the keys as they were and raises."""
        if self._sources is None:
            return
        key_file, env_var, environ = self._sources
        named: list[tuple[bytes, Caller]] = []
        plain: list[str] = []
        public: dict[str, tuple[PublicKey, Caller]] = {}
        if key_file is not None:
            named, plain, public = _parse_key_file(key_file.read_text(encoding="utf-8"), str(key_file))
        env = os.environ if environ is None else environ
        plain += [k for k in (env.get(env_var) or "").split(",") if k.strip()]
        self._set(named, plain, public)

    @property
    def enabled(self) -> bool:
        return bool(self._entries or self._public)

    @property
    def has_admin(self) -> bool:
        return any(c.is_admin for c in self.callers)

    @property
    def callers(self) -> list[Caller]:
        bearer = [c for _, c in self._entries]
        return bearer + [c for _, c in self._public.values() if c not in bearer]

    def public_key(self, name: str) -> tuple[PublicKey, Caller] | None:
        """The public key a named entry carries (``public_key``) and its caller, or None."""
        return self._public.get(name)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        roles = sorted(c.role for _, c in self._entries)
        return f"ApiKeys({len(self)} keys: {roles.count('admin')} admin, {roles.count('user')} user)"

    def identify_token(self, token: str) -> Caller | None:
        """The caller ``token`` is the key of (None when it is none of them)."""
        candidate = _digest(token)
        found: Caller | None = None
        for digest, caller in self._entries:  # no early exit: every key is compared
            if hmac.compare_digest(candidate, digest):
                found = caller
        return found

    def check_token(self, token: str) -> bool:
        """Whether ``token`` is one of the keys (False when there are none)."""
        return self.identify_token(token) is not None

    def identify(self, authorization_header: str | None) -> Caller | None:
        """The caller of an ``Authorization: Bearer <key>`` header value (scheme
        case-insensitive), or None."""
        if not authorization_header:
            return None
        scheme, _, token = authorization_header.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return None
        return self.identify_token(token)

    def check(self, authorization_header: str | None) -> bool:
        """Whether an ``Authorization`` header value is ``Bearer <one of the keys>``.
        False when there are no keys: the service simply installs no check then (see
        ``bearer_auth``)."""
        return self.identify(authorization_header) is not None


def is_loopback_host(host: str) -> bool:
    """``localhost``, 127.0.0.0/8 and ::1 (also bracketed or IPv4-mapped)."""
    h = host.strip().lower().rstrip(".")
    if h.startswith("[") and h.endswith("]"):
        h = h[1:-1]
    if h == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def require_keys_or_loopback(keys: ApiKeys, host: str) -> None:
    """Raise ``ApiKeysRequiredError`` (a ``ValueError``) when there are no API keys and
    ``host`` is not a loopback address."""
    if keys.enabled or is_loopback_host(host):
        return
    raise ApiKeysRequiredError(
        f"refusing to listen on {host!r} without API keys: anyone who can reach it could use "
        f"the models. Give --api-key-file FILE (one key per line) or set {API_KEYS_ENV} "
        "(comma-separated), or bind to 127.0.0.1",
        host=host,
    )


def _unauthorized(message: str) -> HTTPException:
    return HTTPException(
        status_code=401,
        detail={
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            }
        },
        headers={"WWW-Authenticate": "Bearer"},
    )


_bearer_scheme = HTTPBearer(auto_error=False, description="One of the server's API keys")


def bearer_auth(keys: ApiKeys, *, share_caches: bool = False) -> Callable[..., Awaitable[Caller]]:
    """A FastAPI dependency: 401 (OpenAI error shape, ``WWW-Authenticate: Bearer``)
    unless the request carries ``Authorization: Bearer <key>``; the key's ``Caller`` becomes
    the current one (``api.http.security.tenancy``) and ``request.state.caller``. With no keys
    configured every request is the anonymous admin (``require_keys_or_loopback`` guards
    that case). The caches (prefix pages, encoder outputs) are scoped to the key's tenant
    unless ``share_caches`` (``--share-prefix-cache``)."""

    async def require_api_key(
        request: Request,
        _: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer_scheme)],
    ) -> Caller:
        if not keys.enabled:
            request.state.caller = ANONYMOUS
            return ANONYMOUS
        header = request.headers.get("authorization")
        caller = keys.identify(header)
        if caller is not None:
            enter(caller, shared_caches=share_caches)
            request.state.caller = caller
            return caller
        if not header:
            raise _unauthorized(
                "Missing API key: send the header 'Authorization: Bearer <key>' "
                "(the server's keys come from --api-key-file or PIE_MEDIA_API_KEYS)"
            )
        raise _unauthorized("Incorrect API key provided (expected 'Authorization: Bearer <key>')")

    return require_api_key


def admin_only(keys: ApiKeys, *, open_to_keys: bool = False) -> Callable[..., Awaitable[None]]:
    """A dependency for operator surfaces (``/metrics``): an admin key is needed when the
    server has one; with keys but no admin (a plain multi-key file) any key will do, and
    ``open_to_keys`` (``--metrics-open``) lets every request through."""
    check = bearer_auth(keys)

    async def require_admin(
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer_scheme)],
    ) -> None:
        if open_to_keys or not keys.enabled:
            return
        caller = await check(request, credentials)
        if keys.has_admin and not caller.is_admin:
            raise HTTPException(
                status_code=403,
                detail={
                    "error": {
                        "message": f"this needs an admin key; the key {caller.name!r} is a user key",
                        "type": "invalid_request_error",
                        "param": None,
                        "code": "admin_key_required",
                    }
                },
            )

    return require_admin
