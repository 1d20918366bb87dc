"""The one way the gateway fetches a client's media URL: SSRF-safe, bounded, pinned.

Every hop is parsed once (yarl, the same object aiohttp connects with), its
scheme allow-listed, and its host turned into addresses exactly once: IP
literals in any spelling (``2130706433``, ``0x7f.1``, ``0177.0.0.1``,
``127.1``, ``[::ffff:127.0.0.1]``) through ``inet_aton``/``ipaddress``, names
through :class:`GuardedResolver`, which the connector calls and whose checked
answer is the only address it connects to, so a name cannot re-resolve
somewhere else between check and connect (DNS rebinding). Redirects are
followed by hand, each hop checked the same way, up to a bound. The body is
streamed under a byte cap; ``Content-Length`` is only used to refuse early.

Refused addresses: everything that is not globally routable unicast (loopback,
private, link-local incl. 169.254.169.254, shared, multicast, reserved,
unspecified, documentation) and every IPv6 form that embeds an IPv4 address
(mapped, compatible, 6to4, Teredo, NAT64) whose IPv4 part is refused; IPv4-mapped
addresses are refused outright. An operator's ``internal_hosts`` allow-list
(names, IPs or networks, optionally with a port) opens specific internal hosts.

Its length: the address rules, the resolver pinned to the checked address and the bounded streaming
read are one guarantee (a URL reaches only what the rules allow); split, the pinning would sit away
from the check it pins.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import aiohttp
import structlog
from aiohttp.abc import AbstractResolver, ResolveResult
from pydantic import Field, field_validator
from yarl import URL

from core.errors import MediaFetchFailed, MediaTooLarge, MediaURLForbidden
from policies.base import PolicyConfig

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
log = structlog.get_logger(__name__)
#: What a client is told about any address the fetcher will not or cannot reach: the same words whether
#: the name does not resolve, resolves to an internal address, or its port is closed, so the answer cannot
#: map the inside of the network. The reason goes to the log.
REFUSED = "the media URL cannot be fetched"
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_COMPAT = ipaddress.IPv6Network("::/96")
_MiB = 1024 * 1024


class FetchConfig(PolicyConfig):
    """How media URLs are fetched. Byte caps are per part and enforced while streaming."""

    schemes: list[Literal["http", "https"]] = Field(
        default=["http", "https"], description="URL schemes fetched"
    )
    internal_hosts: list[str] = Field(
        default_factory=list,
        description="allow-list of internal hosts: 'name', 'name:port', '10.1.2.3', '[fd00::1]:8443', '10.0.0.0/8'",
    )
    max_redirects: Annotated[int, Field(ge=0, le=10)] = Field(
        default=3, description="redirect hops followed, each checked like the first"
    )
    connect_timeout_s: Annotated[float, Field(gt=0, le=60)] = Field(
        default=3.0, description="connect timeout of each hop"
    )
    total_timeout_s: Annotated[float, Field(gt=0, le=600)] = Field(
        default=20.0, description="the whole fetch: every hop and the body"
    )
    max_image_bytes: Annotated[int, Field(ge=1024)] = Field(
        default=20 * _MiB, description="an image part's byte cap (413 past it)"
    )
    max_audio_bytes: Annotated[int, Field(ge=1024)] = Field(
        default=100 * _MiB, description="an audio part's byte cap"
    )
    max_video_bytes: Annotated[int, Field(ge=1024)] = Field(
        default=100 * _MiB, description="a video part's byte cap"
    )
    max_connections: Annotated[int, Field(ge=1, le=4096)] = Field(
        default=64, description="connections of the fetcher's pool"
    )
    user_agent: str = Field(default="omnigate-media-fetch/0.1", description="User-Agent of media fetches")

    @field_validator("internal_hosts")
    @classmethod
    def _parse_hosts(cls, v: list[str]) -> list[str]:
        for entry in v:
            _parse_allow_entry(entry)  # raises ValueError naming the entry
        return v

    def cap(self, kind: str) -> int:
        return {"image": self.max_image_bytes, "audio": self.max_audio_bytes, "video": self.max_video_bytes}[
            kind
        ]


# -- address policy -----------------------------------------------------------------------------------------


def refusal(ip: IPAddress) -> str | None:
    """Why the fetcher will not connect to ``ip``, or None for a public unicast address."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return "ipv4-mapped"
        embedded = _embedded_v4(ip)
        if embedded is not None and refusal(embedded) is not None:
            return "embedded-ipv4"
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local"
    if isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local:
        return "site-local"  # fec0::/10: deprecated, but routed inside some networks still
    if ip.is_multicast:
        return "multicast"
    if ip.is_reserved:
        return "reserved"
    if ip.is_private:
        return "private"
    if not ip.is_global:
        return "not-global"
    return None


def _embedded_v4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    if ip in _NAT64 or (ip in _COMPAT and int(ip) > 1):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def literal_ip(host: str) -> IPAddress | None:
    """The address an IP literal in any spelling means (decimal, hex, octal, short IPv4; IPv6), else None."""
    h = host.strip("[]")
    if ":" in h:
        try:
            return ipaddress.IPv6Address(h.split("%", 1)[0])
        except ValueError:
            return None
    try:
        return ipaddress.IPv4Address(h)
    except ValueError:
        pass
    # inet_aton accepts what the C resolver accepts: '2130706433', '0x7f.1', '0177.0.0.1', '127.1'.
    if h and all(c in "0123456789abcdefxABCDEFX." for c in h) and h[0].isdigit():
        try:
            return ipaddress.IPv4Address(socket.inet_aton(h.rstrip(".")))
        except OSError:
            return None
    return None


@dataclass(frozen=True, slots=True)
class _Allow:
    name: str | None
    network: ipaddress.IPv4Network | ipaddress.IPv6Network | None
    port: int | None


def _parse_allow_entry(entry: str) -> _Allow:
    raw = entry.strip()
    try:
        return _Allow(None, ipaddress.ip_network(raw, strict=False), None)
    except ValueError:
        pass
    host, port = raw, None
    if raw.startswith("["):
        close = raw.find("]")
        host, rest = raw[1:close], raw[close + 1 :]
        if rest:
            if not rest.startswith(":") or not rest[1:].isdigit():
                raise ValueError(f"internal_hosts entry {entry!r}: expected [ipv6]:port")
            port = int(rest[1:])
    elif raw.count(":") == 1:
        host, p = raw.split(":")
        if not p.isdigit():
            raise ValueError(f"internal_hosts entry {entry!r}: the port must be a number")
        port = int(p)
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"internal_hosts entry {entry!r}: port out of range")
    try:
        return _Allow(None, ipaddress.ip_network(host, strict=False), port)
    except ValueError:
        pass
    name = host.lower().rstrip(".")
    if not name or any(c in name for c in "/@ \t"):
        raise ValueError(f"internal_hosts entry {entry!r} is not a host name, address or network")
    return _Allow(name, None, port)


class AddressPolicy:
    """Decides whether (host, port, address) may be contacted, honouring the allow-list."""

    def __init__(self, internal_hosts: list[str]) -> None:
        self._allow = [_parse_allow_entry(e) for e in internal_hosts]

    def name_allowed(self, host: str, port: int) -> bool:
        name = host.lower().rstrip(".")
        return any(a.name == name and a.port in (None, port) for a in self._allow)

    def check(self, host: str, port: int, ip: IPAddress) -> str | None:
        """The refusal reason, or None when the address may be contacted."""
        if self.name_allowed(host, port):
            return None
        for a in self._allow:
            if (
                a.network is not None
                and a.port in (None, port)
                and ip.version == a.network.version
                and ip in a.network
            ):
                return None
        return refusal(ip)


class AddressRefused(OSError):
    """Raised inside the resolver; aiohttp chains it, the fetcher turns it into MediaURLForbidden."""

    def __init__(self, host: str, ip: str, reason: str) -> None:
        super().__init__(f"{host} resolves to {ip} ({reason})")
        self.host, self.ip, self.reason = host, ip, reason


class GuardedResolver(AbstractResolver):
    """Resolves once and hands the connector only addresses that passed the check."""

    def __init__(self, policy: AddressPolicy) -> None:
        self._policy = policy

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, family=socket.AF_UNSPEC)
        out: list[ResolveResult] = []
        for fam, _, proto, _, sockaddr in infos:
            ip = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
            reason = self._policy.check(host, port, ip)
            if reason is not None:
                # One refused answer refuses the name: a mixed answer is how rebinding attacks start.
                raise AddressRefused(host, str(ip), reason)
            out.append(
                {
                    "hostname": host,
                    "host": str(ip),
                    "port": port,
                    "family": fam,
                    "proto": proto,
                    "flags": socket.AI_NUMERICHOST | socket.AI_NUMERICSERV,
                }
            )
        if not out:
            raise OSError(f"{host} has no address")
        return out

    async def close(self) -> None:
        return None


# -- the fetcher --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fetched:
    data: bytes
    content_type: str | None
    host: str
    redirects: int


class SafeFetcher:
    """One pooled aiohttp session; no proxies from the environment, no cookies, no decompression."""

    def __init__(self, config: FetchConfig, metrics: Any | None = None) -> None:
        self.config = config
        self.policy = AddressPolicy(config.internal_hosts)
        self._metrics = metrics
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            resolver=GuardedResolver(self.policy),
            use_dns_cache=False,
            limit=self.config.max_connections,
            family=socket.AF_UNSPEC,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s),
            trust_env=False,
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def check_url(self, url: URL, param: str) -> None:
        """Refuse a hop before any socket is opened: scheme, host, and IP literals in any spelling."""
        if url.scheme not in self.config.schemes:
            raise MediaURLForbidden(
                f"{param}: the scheme {url.scheme or '(none)'!r} is not fetched", param=param
            )
        host = url.raw_host
        if not host:
            raise MediaURLForbidden(f"{param}: the URL has no host", param=param)
        port = url.port or (443 if url.scheme == "https" else 80)
        ip = literal_ip(host)
        if ip is not None:
            reason = self.policy.check(host, port, ip)
            if reason is None and ":" not in host and str(ip) != host:
                reason = "ipv4-not-dotted-decimal"
            if reason is not None:
                raise refused(param, host, reason)

    async def fetch(self, raw_url: str, kind: str, param: str, budget: Any = None) -> Fetched:
        """Fetch one part; ``budget`` (a RequestBudget) is charged as the body streams in."""
        outcome = "failed"
        try:
            result = await self._fetch(raw_url, kind, param, budget)
            outcome = "ok"
            if self._metrics is not None:
                self._metrics.media_fetch_bytes.observe(len(result.data))
            return result
        except MediaURLForbidden as exc:
            outcome = getattr(exc, "outcome", "forbidden")
            raise
        except MediaTooLarge:
            outcome = "too_large"
            raise
        except MediaFetchFailed as exc:
            outcome = getattr(exc, "outcome", "failed")
            raise
        finally:
            if self._metrics is not None:
                self._metrics.media_fetches.labels(outcome).inc()

    async def _fetch(self, raw_url: str, kind: str, param: str, budget: Any = None) -> Fetched:
        if self._session is None:
            raise RuntimeError("SafeFetcher.start() was not awaited")
        cap = self.config.cap(kind)
        try:
            url = URL(raw_url)
        except (ValueError, TypeError) as exc:
            raise MediaURLForbidden(f"{param}: not a valid URL ({exc})", param=param) from None
        try:
            async with asyncio.timeout(self.config.total_timeout_s):
                for hop in range(self.config.max_redirects + 1):
                    self.check_url(url, param)
                    location = await self._one_hop(url, cap, param, budget)
                    if isinstance(location, Fetched):
                        return Fetched(location.data, location.content_type, url.host or "", hop)
                    try:
                        url = url.join(URL(location))
                    except (ValueError, TypeError) as exc:
                        raise MediaFetchFailed(
                            f"{param}: bad redirect location ({exc})", param=param
                        ) from None
        except TimeoutError:
            raise _failed(
                f"{param}: fetching the media took longer than {self.config.total_timeout_s} s",
                param,
                "timeout",
            ) from None
        raise MediaFetchFailed(f"{param}: more than {self.config.max_redirects} redirects", param=param)

    async def _one_hop(self, url: URL, cap: int, param: str, budget: Any = None) -> Fetched | str:
        assert self._session is not None
        headers = {"User-Agent": self.config.user_agent, "Accept-Encoding": "identity"}
        try:
            async with self._session.get(url, allow_redirects=False, headers=headers) as resp:
                if resp.status in _REDIRECTS:
                    location = resp.headers.get("Location")
                    if not location:
                        raise MediaFetchFailed(f"{param}: redirect without a Location", param=param)
                    return location
                if resp.status != 200:
                    raise _failed(f"{param}: the media server answered {resp.status}", param, "http_error")
                encoding = resp.headers.get("Content-Encoding", "identity").strip().lower()
                if encoding not in ("", "identity"):
                    raise MediaFetchFailed(
                        f"{param}: the media server sent Content-Encoding {encoding!r}; only identity is read",
                        param=param,
                    )
                if resp.content_length is not None and resp.content_length > cap:
                    raise MediaTooLarge(
                        f"{param}: the media is {resp.content_length} bytes; the limit is {cap}", param=param
                    )
                data = await _read_capped(resp, cap, param, budget)
                return Fetched(data, resp.headers.get("Content-Type"), url.host or "", 0)
        except aiohttp.ClientConnectorError as exc:
            cause = _refused_cause(exc)
            # Not resolving, resolving inside, refused or unanswered: all one answer to the client.
            reason = (
                f"{cause.ip} {cause.reason}"
                if cause is not None
                else f"connect: {type(exc.os_error).__name__}"
            )
            raise refused(param, url.raw_host or "", reason, outcome=None if cause else "failed") from exc
        except aiohttp.InvalidURL as exc:
            raise MediaURLForbidden(f"{param}: not a valid URL", param=param) from exc
        except aiohttp.ConnectionTimeoutError as exc:
            # A port that does not answer must read like one that refuses, or one never tried.
            raise refused(param, url.raw_host or "", "connect timeout", outcome="timeout") from exc
        except (aiohttp.ClientError, OSError) as exc:
            cause = _refused_cause(exc)
            if cause is not None:
                raise refused(param, url.raw_host or "", f"{cause.ip} {cause.reason}") from exc
            raise MediaFetchFailed(f"{param}: fetching failed ({type(exc).__name__})", param=param) from exc


def refused(param: str, host: str, reason: str, outcome: str | None = None) -> MediaURLForbidden:
    """The one refusal a client sees for an address; what was refused, and why, is logged."""
    log.info("media_fetch_refused", param=param, host=host, reason=reason)
    exc = MediaURLForbidden(f"{param}: {REFUSED}", param=param)
    if outcome is not None:
        exc.outcome = outcome  # type: ignore[attr-defined]  # metric label only
    return exc


def _failed(message: str, param: str, outcome: str) -> MediaFetchFailed:
    exc = MediaFetchFailed(message, param=param)
    exc.outcome = outcome  # type: ignore[attr-defined]  # metric label only
    return exc


def _refused_cause(exc: BaseException) -> AddressRefused | None:
    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None:
            return None
        if isinstance(seen, AddressRefused):
            return seen
        inner = getattr(seen, "os_error", None)
        if isinstance(inner, AddressRefused):
            return inner
        seen = seen.__cause__ or seen.__context__
    return None


async def _read_capped(resp: aiohttp.ClientResponse, cap: int, param: str, budget: Any = None) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_chunked(256 * 1024):
        size += len(chunk)
        if size > cap:
            raise MediaTooLarge(f"{param}: the media exceeds the limit of {cap} bytes", param=param)
        if budget is not None:
            # Counted as it arrives, so parts fetched side by side cannot together pass the request's budget.
            await budget.take(len(chunk), param)
        chunks.append(chunk)
    return b"".join(chunks)
