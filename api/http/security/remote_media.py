"""Media named by URL: the SSRF-checked remote fetcher and the ``file://`` policy.

``MediaFetcher.fetch(url)`` fetches ``https://`` (and ``http://`` when allowed) media:

- the URL may not carry credentials (``user:pass@``); any port is fine, the check is on
  addresses;
- the host must be in ``allowed_domains`` (exact host or a subdomain, case-insensitive,
  IDNA-normalised) when that list is given;
- every address the host resolves to must be public (see ``address_refusal``): one
  loopback/private/link-local/... answer refuses the whole URL, because DNS may hand a
  different answer to the next lookup;
- the connection goes to the checked IP itself (the ``Host`` header and, for https, the
  SNI and certificate check keep the hostname), from a fresh client with no keep-alive
  and ``trust_env=False``, so no pooled connection verified for another hostname and no
  proxy from the environment is ever used;
- redirects are followed by hand (``max_redirects``), each hop checked like the first;
- connect and read timeouts bound each step and ``total_timeout`` bounds the whole fetch
  (DNS, every hop, the body), so a server that drip-feeds bytes cannot hold it open;
- the body may not pass ``max_bytes``: a larger ``Content-Length`` is refused before
  reading, and a body without one is stopped as soon as it passes the cap.

``LocalMediaPolicy.read(url)`` reads ``file://`` media only from under one folder.

Every refusal is a typed ``PieMediaError`` (codes below); messages never repeat URL
credentials or query strings.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import os
import re
import socket
import ssl
import stat
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx
import idna

from media import DEFAULT_LIMITS, PieMediaError

__all__ = [
    "METADATA_ADDRESSES",
    "FetchedMedia",
    "LocalMediaPolicy",
    "MediaFetcher",
    "RemoteMediaFetchError",
    "RemoteMediaForbiddenError",
    "RemoteMediaTimeoutError",
    "RemoteMediaTooLargeError",
    "address_refusal",
    "normalize_domain",
    "system_resolve",
]


# ---------------------------------------------------------------------------------------
# Errors


class RemoteMediaForbiddenError(PieMediaError):
    """The URL (or a redirect hop, or a ``file://`` path) breaks the media URL rules.
    ``details["reason"]`` is one of ``invalid_url``, ``scheme``, ``credentials``,
    ``domain``, ``address``, ``redirects``, ``local_disabled``, ``path``."""

    code = "remote_media_forbidden"


class RemoteMediaTimeoutError(PieMediaError):
    """A connect/read timeout or the total deadline passed."""

    code = "remote_media_timeout"


class RemoteMediaTooLargeError(PieMediaError):
    """The body is over ``max_bytes`` (``details``: ``limit``, ``actual``; ``actual`` is the
    announced Content-Length, or the bytes read when the body was stopped)."""

    code = "remote_media_too_large"


class RemoteMediaFetchError(PieMediaError):
    """DNS failure, refused connection, TLS failure, broken response, non-2xx status
    (``details["status"]``) or a missing local file."""

    code = "remote_media_unreachable"


# ---------------------------------------------------------------------------------------
# Addresses

METADATA_ADDRESSES = frozenset(
    ipaddress.ip_address(a)
    for a in (
        "169.254.169.254",  # AWS, GCP, Azure, OpenStack, ...
        "169.254.170.2",  # AWS ECS task metadata
        "fd00:ec2::254",  # AWS IMDS over IPv6
        "100.100.100.200",  # Alibaba Cloud
    )
)
"""Cloud metadata endpoints: refused even with ``allow_private_networks``."""

_SHARED = ipaddress.ip_network("100.64.0.0/10")  # RFC 6598 carrier-grade NAT
_NAT64 = ipaddress.ip_network("64:ff9b::/96")  # RFC 6052 well-known prefix, embeds IPv4
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")  # RFC 8215 local-use NAT64

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> tuple[ipaddress.IPv4Address, str] | None:
    """The IPv4 address an IPv6 address stands for, if any, and how it is embedded."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped, "IPv4-mapped"
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF), "NAT64"
    if ip.sixtofour is not None:
        return ip.sixtofour, "6to4"
    if int(ip) >> 32 == 0 and int(ip) > 1:  # ::a.b.c.d, deprecated IPv4-compatible
        return ipaddress.IPv4Address(int(ip)), "IPv4-compatible"
    return None


def address_refusal(address: str | IPAddress) -> str | None:
    """Why a media URL may not reach ``address`` (e.g. ``"loopback"``), or None when it is
    a public address. IPv6 forms that embed an IPv4 address (mapped, compatible, NAT64,
    6to4) are judged by the IPv4 address inside."""
    ip = ipaddress.ip_address(address) if isinstance(address, str) else address
    if isinstance(ip, ipaddress.IPv6Address) and ip.scope_id:
        ip = ipaddress.IPv6Address(str(ip).split("%", 1)[0])
    if ip in METADATA_ADDRESSES:
        return "cloud metadata endpoint"
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(ip)
        if embedded is not None:
            inner, how = embedded
            reason = address_refusal(inner)
            return f"{how} {reason}" if reason else None
        if ip in _NAT64_LOCAL:
            return "local-use NAT64"
        if ip.is_site_local:
            return "site-local"
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local"
    if ip.is_multicast:
        return "multicast"
    if ip in _SHARED:
        return "shared (carrier-grade NAT)"
    if ip.is_private:
        return "private"
    if ip.is_reserved:
        return "reserved"
    if not ip.is_global:
        return "not globally routable"
    return None


_HOSTNAME = re.compile(r"[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*")


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def system_resolve(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (``getaddrinfo``, all families, in its order)."""
    out: list[str] = []
    for *_, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        if sockaddr[0] not in out:
            out.append(sockaddr[0])
    return out


def normalize_domain(domain: str) -> str:
    """``"Bücher.Example."`` -> ``"xn--bcher-kva.example"`` (lower case, IDNA/UTS-46,
    no trailing dot; a leading ``*.`` or ``.`` is dropped: subdomains always match)."""
    d = domain.strip().lower().rstrip(".")
    for prefix in ("*.", "."):
        if d.startswith(prefix):
            d = d[len(prefix) :]
    if d.startswith("[") and d.endswith("]"):
        d = d[1:-1]
    if _is_ip(d):
        return str(ipaddress.ip_address(d))
    if not d or any(c in d for c in "/:@?#[] \\"):
        raise ValueError(f"{domain!r} is not a domain name (expected e.g. 'images.example.com')")
    try:
        return d if d.isascii() else idna.encode(d, uts46=True).decode("ascii")
    except idna.IDNAError as e:
        raise ValueError(f"{domain!r} is not a valid domain name: {e}") from None


# ---------------------------------------------------------------------------------------
# The remote fetcher


@dataclass(frozen=True)
class FetchedMedia:
    data: bytes
    content_type: str | None
    final_url: str
    """The URL the bytes came from, after redirects (hostname form, not the pinned IP)."""


_REDIRECTS = (301, 302, 303, 307, 308)
Resolver = Callable[[str, int], Sequence[str]]


def _shown(url: httpx.URL) -> str:
    """The URL for messages: no credentials, no query, no fragment."""
    port = f":{url.port}" if url.port is not None else ""
    host = f"[{url.host}]" if ":" in url.host else url.host
    query = "?..." if url.query else ""
    return f"{url.scheme}://{host}{port}{url.path}{query}"


class MediaFetcher:
    """Fetches remote media under the SSRF rules in the module docstring.

    ``allowed_domains``: None/empty for any public host, else only these hosts and their
    subdomains. ``allow_http``: also fetch ``http://``. ``allow_private_networks``: UNSAFE
    (tests, closed networks): skip the address check (cloud metadata addresses stay
    refused). ``max_bytes``: body cap. ``connect_timeout`` / ``read_timeout`` (default:
    ``total_timeout``) per step, ``total_timeout`` for the whole fetch. ``ssl_context``:
    the CAs to trust (default: certifi's).

    Injection points, for tests and closed networks only: ``resolve(host, port)`` returns
    the addresses of a hostname (default ``system_resolve``, run on a worker thread);
    ``trusted_addresses`` are addresses that pass the address check though not public.
    """

    def __init__(
        self,
        *,
        allowed_domains: Iterable[str] | None = None,
        allow_http: bool = False,
        allow_private_networks: bool = False,
        max_bytes: int = DEFAULT_LIMITS.max_bytes,
        max_redirects: int = 3,
        connect_timeout: float = 3.0,
        read_timeout: float | None = None,
        total_timeout: float = 10.0,
        ssl_context: ssl.SSLContext | None = None,
        user_agent: str = "pie-media",
        resolve: Resolver = system_resolve,
        trusted_addresses: Iterable[str] = (),
    ):
        if max_bytes < 1 or max_redirects < 0 or min(connect_timeout, total_timeout) <= 0:
            raise ValueError("max_bytes and the timeouts must be positive, max_redirects >= 0")
        self.allowed_domains = tuple(sorted({normalize_domain(d) for d in allowed_domains or ()}))
        self.schemes = ("http", "https") if allow_http else ("https",)
        self.allow_private_networks = allow_private_networks
        self.max_bytes = max_bytes
        self.max_redirects = max_redirects
        self.total_timeout = total_timeout
        read = total_timeout if read_timeout is None else read_timeout
        self.timeout = httpx.Timeout(connect=connect_timeout, read=read, write=read, pool=connect_timeout)
        self.ssl_context = ssl_context if ssl_context is not None else httpx.create_ssl_context()
        self.user_agent = user_agent
        self.resolve = resolve
        self.trusted_addresses = frozenset(ipaddress.ip_address(a) for a in trusted_addresses)

    # -- checks (no network) ------------------------------------------------------------

    def check_url(self, url: str | httpx.URL) -> httpx.URL:
        """The parsed URL when its scheme, credentials and host pass the rules (no DNS)."""
        try:
            parsed = url if isinstance(url, httpx.URL) else httpx.URL(url)
        except (httpx.InvalidURL, TypeError, ValueError) as e:
            why = f": {e}" if "@" not in str(url) else ""
            raise RemoteMediaForbiddenError(
                f"the media URL is not a valid URL{why}", reason="invalid_url"
            ) from None
        if parsed.scheme not in self.schemes:
            allowed = " or ".join(f"{s}://" for s in self.schemes)
            hint = " (the server was not started with --allow-http-media)" if parsed.scheme == "http" else ""
            raise RemoteMediaForbiddenError(
                f"media URL scheme {parsed.scheme or '(none)'!r} is not allowed; use {allowed}{hint}",
                reason="scheme",
                scheme=parsed.scheme,
            )
        if parsed.userinfo:
            raise RemoteMediaForbiddenError(
                "media URLs may not carry credentials (user:password@host); "
                "use a URL that needs none, or upload the file",
                reason="credentials",
            )
        host = parsed.raw_host.decode("ascii").lower().rstrip(".")
        if not host:
            raise RemoteMediaForbiddenError("the media URL has no host", reason="invalid_url")
        if not (_HOSTNAME.fullmatch(host) or (":" in host and _is_ip(host))):
            raise RemoteMediaForbiddenError(
                f"media host {parsed.host!r} is not a valid host name", reason="invalid_url"
            )
        is_ip = _is_ip(host)
        key = str(ipaddress.ip_address(host)) if is_ip else host
        if self.allowed_domains and not any(
            key == d or (not is_ip and key.endswith("." + d)) for d in self.allowed_domains
        ):
            raise RemoteMediaForbiddenError(
                f"media host {parsed.host!r} is not allowed; allowed: "
                f"{', '.join(self.allowed_domains)} (and their subdomains)",
                reason="domain",
                host=parsed.host,
            )
        return parsed

    async def addresses(self, url: httpx.URL) -> list[IPAddress]:
        """Every address ``url``'s host resolves to, each checked (raises on the first
        refused one; ``RemoteMediaFetchError`` when the name does not resolve)."""
        host = url.raw_host.decode("ascii")
        port = url.port or (443 if url.scheme == "https" else 80)
        try:
            answers: Sequence[str] = [str(ipaddress.ip_address(host))]
        except ValueError:
            try:
                answers = await asyncio.to_thread(self.resolve, host, port)
            except (OSError, UnicodeError) as e:
                raise RemoteMediaFetchError(
                    f"media host {url.host!r} could not be resolved: {e}", host=url.host
                ) from None
        ips: list[IPAddress] = []
        for a in answers:
            try:
                ip = ipaddress.ip_address(a)
            except ValueError:
                raise RemoteMediaFetchError(
                    f"media host {url.host!r} resolved to {a!r}, which is not an IP address",
                    host=url.host,
                ) from None
            if ip not in ips:
                ips.append(ip)
        if not ips:
            raise RemoteMediaFetchError(f"media host {url.host!r} has no addresses", host=url.host)
        for ip in ips:
            if ip in self.trusted_addresses:
                continue
            reason = address_refusal(ip)
            if reason is None or (self.allow_private_networks and "metadata" not in reason):
                continue
            where = f"media address {ip}" if str(ip) == host else f"media host {url.host!r} resolves to {ip}"
            raise RemoteMediaForbiddenError(
                f"{where} ({reason}); media URLs may only reach public internet addresses",
                reason="address",
                host=url.host,
                address=str(ip),
            )
        return ips

    # -- fetching -----------------------------------------------------------------------

    async def fetch(self, url: str) -> FetchedMedia:
        """The body of ``url`` (after at most ``max_redirects`` checked redirects)."""
        current = self.check_url(url)  # malformed / forbidden URLs fail before the clock starts
        try:
            async with asyncio.timeout(self.total_timeout):
                for hop in range(self.max_redirects + 1):
                    result = await self._hop(current)
                    if isinstance(result, FetchedMedia):
                        return result
                    if hop == self.max_redirects:
                        break
                    try:
                        nxt = current.join(result)
                    except (httpx.InvalidURL, ValueError):
                        raise RemoteMediaFetchError(
                            f"{_shown(current)} redirected to an invalid URL", url=_shown(current)
                        ) from None
                    current = self.check_url(nxt)  # scheme, credentials, domain: every hop
                raise RemoteMediaForbiddenError(
                    f"media URL redirected more than {self.max_redirects} times (the limit)",
                    reason="redirects",
                    limit=self.max_redirects,
                )
        except TimeoutError:
            raise RemoteMediaTimeoutError(
                f"fetching {_shown(current)} took longer than the {self.total_timeout:g} s limit",
                limit=self.total_timeout,
                url=_shown(current),
            ) from None

    async def _hop(self, url: httpx.URL) -> FetchedMedia | str:
        """One request to ``url``, pinned to its checked addresses (tried in order):
        the body, or the ``Location`` of a redirect."""
        ips = await self.addresses(url)
        headers = {
            "Host": url.netloc.decode("ascii"),
            "User-Agent": self.user_agent,
            "Accept": "*/*",
            "Accept-Encoding": "identity",
            "Connection": "close",
        }
        extensions = {"sni_hostname": url.raw_host.decode("ascii")} if url.scheme == "https" else {}
        last: Exception | None = None
        for ip in ips:
            try:
                target = url.copy_with(host=str(ip))
            except httpx.InvalidURL as e:
                last = e
                continue
            # A fresh client per connection: nothing pooled, nothing from the environment.
            async with httpx.AsyncClient(
                verify=self.ssl_context,
                trust_env=False,
                follow_redirects=False,
                timeout=self.timeout,
                limits=httpx.Limits(max_connections=1, max_keepalive_connections=0),
            ) as client:
                request = client.build_request("GET", target, headers=headers, extensions=extensions)
                try:
                    response = await client.send(request, stream=True)
                except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                    last = e  # try the next checked address
                    continue
                except httpx.TimeoutException:
                    raise self._timeout(url) from None
                except httpx.HTTPError as e:
                    raise self._unreachable(url, e) from None
                try:
                    return await self._read(url, response)
                except httpx.TimeoutException:
                    raise self._timeout(url) from None
                except httpx.HTTPError as e:
                    raise self._unreachable(url, e) from None
                finally:
                    await response.aclose()
        if isinstance(last, httpx.ConnectTimeout):
            raise self._timeout(url)
        raise self._unreachable(url, last)

    async def _read(self, url: httpx.URL, response: httpx.Response) -> FetchedMedia | str:
        status = response.status_code
        if status in _REDIRECTS:
            location = response.headers.get("location")
            if location:
                return location
        if not 200 <= status < 300:
            raise RemoteMediaFetchError(
                f"{_shown(url)} answered HTTP {status}; media URLs must answer 2xx",
                status=status,
                url=_shown(url),
            )
        length = response.headers.get("content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_bytes:
            raise self._too_large(url, int(length), announced=True)
        body = bytearray()
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > self.max_bytes:
                raise self._too_large(url, len(body), announced=False)
        return FetchedMedia(bytes(body), response.headers.get("content-type"), str(url))

    def _too_large(self, url: httpx.URL, actual: int, *, announced: bool) -> RemoteMediaTooLargeError:
        what = f"announces {actual} bytes" if announced else f"sent more than {self.max_bytes} bytes"
        return RemoteMediaTooLargeError(
            f"{_shown(url)} {what}, over the media limit of {self.max_bytes} bytes",
            limit=self.max_bytes,
            actual=actual,
            url=_shown(url),
        )

    def _timeout(self, url: httpx.URL) -> RemoteMediaTimeoutError:
        t = self.timeout
        return RemoteMediaTimeoutError(
            f"{_shown(url)} did not answer in time (connect limit {t.connect:g} s, "
            f"read limit {t.read:g} s, total limit {self.total_timeout:g} s)",
            url=_shown(url),
        )

    def _unreachable(self, url: httpx.URL, error: Exception | None) -> RemoteMediaFetchError:
        why = f"{type(error).__name__}: {error}" if error is not None else "no address answered"
        return RemoteMediaFetchError(f"could not fetch {_shown(url)}: {why}", url=_shown(url))


# ---------------------------------------------------------------------------------------
# file:// media


class LocalMediaPolicy:
    """``file://`` media, read only from under ``allowed_root`` (off when None).

    The path is resolved (``..`` and symlinks) before the check, the file is opened
    without following a final symlink and checked again on the open descriptor
    (regular file, at most ``max_bytes``), and at most ``max_bytes + 1`` bytes are read.
    """

    def __init__(self, allowed_root: Path | str | None, *, max_bytes: int = DEFAULT_LIMITS.max_bytes):
        self.allowed_root = Path(allowed_root).resolve() if allowed_root is not None else None
        self.max_bytes = max_bytes

    @property
    def enabled(self) -> bool:
        return self.allowed_root is not None

    def path_for(self, url: str) -> Path:
        """The real path a ``file://`` URL names, when it is under the allowed root."""
        if self.allowed_root is None:
            raise RemoteMediaForbiddenError(
                "file:// media URLs are disabled on this server (start it with "
                "--allowed-local-media-path DIR to serve files from one folder)",
                reason="local_disabled",
            )
        parts = urlsplit(url)
        if parts.scheme.lower() != "file":
            raise RemoteMediaForbiddenError(f"not a file:// URL: scheme {parts.scheme!r}", reason="scheme")
        if parts.netloc not in ("", "localhost"):
            raise RemoteMediaForbiddenError(
                "file:// URLs must name a local path (file:///path), not a host", reason="invalid_url"
            )
        if parts.query or parts.fragment:
            raise RemoteMediaForbiddenError(
                "file:// URLs may not have a query or fragment (percent-encode '?' and '#')",
                reason="invalid_url",
            )
        raw = unquote(parts.path)
        if not raw.startswith("/") or "\x00" in raw:
            raise RemoteMediaForbiddenError(
                "file:// URLs must name an absolute path (file:///path)", reason="invalid_url"
            )
        try:
            real = Path(raw).resolve()
        except (OSError, RuntimeError):  # a symlink loop
            raise RemoteMediaForbiddenError("file:// media path does not resolve", reason="path") from None
        if not real.is_relative_to(self.allowed_root):
            raise RemoteMediaForbiddenError(
                f"file:// media must be under {self.allowed_root} (after resolving '..' and symlinks)",
                reason="path",
                limit=str(self.allowed_root),
            )
        return real

    def read(self, url: str) -> bytes:
        """The bytes of the file a ``file://`` URL names (see the class docstring)."""
        path = self.path_for(url)
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            raise RemoteMediaFetchError(f"no such file under {self.allowed_root}: {path.name}") from None
        except OSError as e:
            if e.errno == errno.ELOOP:  # the last component turned into a symlink meanwhile
                raise RemoteMediaForbiddenError(
                    "file:// media path changed into a symlink while opening it", reason="path"
                ) from None
            raise RemoteMediaFetchError(f"cannot open {path.name}: {e.strerror}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise RemoteMediaForbiddenError(
                f"file:// media must be a regular file; {path.name} is not", reason="path"
            )
        with os.fdopen(fd, "rb") as f:
            if st.st_size > self.max_bytes:
                raise self._too_large(path, st.st_size)
            data = f.read(self.max_bytes + 1)
        if len(data) > self.max_bytes:
            raise self._too_large(path, len(data))
        return data

    def _too_large(self, path: Path, actual: int) -> RemoteMediaTooLargeError:
        return RemoteMediaTooLargeError(
            f"{path.name} is {actual} bytes, over the media limit of {self.max_bytes} bytes",
            limit=self.max_bytes,
            actual=actual,
        )
