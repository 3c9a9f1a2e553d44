"""The service's security rules in one place: API keys (constant-time bearer check,
keys required off loopback) and, re-exported from ``api.http.remote_media``, the
SSRF-checked remote media fetcher and the ``file://`` folder policy."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.http.remote_media import (
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
from media import PieMediaError

__all__ = [
    "METADATA_ADDRESSES",
    "ApiKeys",
    "ApiKeysRequiredError",
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


class ApiKeys:
    """The accepted bearer tokens. ``check`` compares against every key with
    ``hmac.compare_digest`` and never stops at the first match."""

    def __init__(self, keys: Iterable[str] = ()):
        cleaned = {k.strip() for k in keys if k and k.strip()}
        self._digests = tuple(_digest(k) for k in sorted(cleaned))

    @classmethod
    def from_sources(
        cls,
        key_file: Path | str | None = None,
        env_var: str = API_KEYS_ENV,
        *,
        environ: Mapping[str, str] | None = None,
    ) -> ApiKeys:
        """Keys from ``key_file`` (one per line; blank lines and lines starting with ``#``
        are skipped; a missing file raises ``OSError``) and from the environment variable
        ``env_var`` (comma-separated). ``environ`` defaults to ``os.environ``."""
        keys: list[str] = []
        if key_file is not None:
            for line in Path(key_file).read_text(encoding="utf-8").splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    keys.append(line)
        env = os.environ if environ is None else environ
        keys += [k for k in (env.get(env_var) or "").split(",") if k.strip()]
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def check_token(self, token: str) -> bool:
        """Whether ``token`` is one of the keys (False when there are none)."""
        candidate = _digest(token)
        matched = False
        for key in self._digests:  # no early exit: every key is compared
            matched |= hmac.compare_digest(candidate, key)
        return matched

    def check(self, authorization_header: str | None) -> bool:
        """Whether an ``Authorization`` header value is ``Bearer <one of the keys>``
        (scheme case-insensitive). False when there are no keys: the service simply
        installs no check then (see ``bearer_auth``)."""
        if not authorization_header:
            return False
        scheme, _, token = authorization_header.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return False
        return self.check_token(token)


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


def bearer_auth(keys: ApiKeys) -> Callable[..., Awaitable[None]]:
    """A FastAPI dependency: 401 (OpenAI error shape, ``WWW-Authenticate: Bearer``)
    unless the request carries ``Authorization: Bearer <key>``. With no keys configured
    it lets every request through (``require_keys_or_loopback`` guards that case)."""

    async def require_api_key(
        request: Request,
        _: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer_scheme)],
    ) -> None:
        if not keys.enabled:
            return
        header = request.headers.get("authorization")
        if keys.check(header):
            return
        if not header:
            raise _unauthorized(
                "Missing API key: send the header 'Authorization: Bearer <key>' "
                "(the server's keys come from --api-key-file or PIE_MEDIA_API_KEYS)"
            )
        raise _unauthorized("Incorrect API key provided (expected 'Authorization: Bearer <key>')")

    return require_api_key
