"""Remote images: fetched only from the hosts `--allowed-media-domains` lists (docs/images.md).

A server that fetched any URL a request named would be an open proxy into its own
network (SSRF), so every fetch, and every redirect it follows, must name a listed host
exactly. A listed host name must also resolve to public addresses only: a name that
points at a loopback, private, link-local or otherwise non-global address (a DNS
rebinding, or a typo) is refused unless the list names that address itself as an IP
literal (`--allowed-media-domains 127.0.0.1`). The connection goes to the address that
was checked, never to a second lookup's answer. The body is capped in bytes (the
Content-Length is checked first, the bytes as they arrive too) and the whole fetch,
redirects included, in seconds. Every refusal is a ValueError the server answers 400.
"""
from __future__ import annotations

import http.client
import ipaddress
import socket
import time
from dataclasses import dataclass
from urllib.parse import SplitResult, urljoin, urlsplit

FLAG = "--allowed-media-domains"
DEFAULT_FETCH_TIMEOUT_S = 5.0
MAX_REDIRECTS = 3
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_CHUNK = 64 << 10
# A Content-Type that says nothing about the bytes: the format allow-list alone decides.
_UNDECLARED = frozenset({"application/octet-stream", "binary/octet-stream"})


@dataclass(frozen=True, slots=True)
class FetchPolicy:
    allowed_domains: frozenset[str]
    max_bytes: int
    timeout_s: float = DEFAULT_FETCH_TIMEOUT_S


@dataclass(frozen=True, slots=True)
class _Target:
    url: str
    parts: SplitResult
    host: str
    port: int
    address: str  # the checked address the connection goes to


def normalize_domains(domains: list[str] | tuple[str, ...] | frozenset[str]) -> frozenset[str]:
    """The listed hosts as URLs spell them after parsing: lower case, IPv6 without brackets."""
    out = set()
    for domain in domains:
        host = domain.strip().lower().removeprefix("[").removesuffix("]")
        if not host or "/" in host or ":" in host and not _is_ip(host):
            raise ValueError(f"allowed_media_domains takes host names or IP addresses (no scheme, port or path), "
                             f"got {domain!r}")
        out.add(host)
    return frozenset(out)


def fetch(url: str, policy: FetchPolicy) -> tuple[bytes, str | None]:
    """The body of `url` and the image media type it was served as (None: not declared)."""
    deadline = time.monotonic() + policy.timeout_s
    for _ in range(MAX_REDIRECTS + 1):
        target = _target(url, policy)
        try:
            status, location, content_type, body = _get(target, policy, deadline)
        except (TimeoutError, socket.timeout):
            raise ValueError(f"fetching {_short(url)} took longer than {policy.timeout_s:g} s") from None
        except (OSError, http.client.HTTPException) as e:
            raise ValueError(f"fetching {_short(url)} failed: {type(e).__name__}: {e}") from None
        if status in _REDIRECTS:
            if location is None:
                raise ValueError(f"{_short(url)} answered a redirect without a Location")
            url = urljoin(url, location)
            continue
        if status != 200:
            raise ValueError(f"fetching {_short(url)} answered HTTP {status}")
        return body, _declared_type(url, content_type)
    raise ValueError(f"fetching the image followed more than {MAX_REDIRECTS} redirects")


def _target(url: str, policy: FetchPolicy) -> _Target:
    """`url` checked against the policy, with the address to connect to."""
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as e:
        raise ValueError(f"the image URL {_short(url)} is malformed: {e}") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"the image URL's scheme must be data, http or https, got {parts.scheme!r}")
    if parts.username is not None or parts.password is not None:
        raise ValueError("image URLs may not carry credentials")
    host = (parts.hostname or "").lower()
    if host not in policy.allowed_domains:
        raise ValueError(f"the image URL's host {host!r} is not in {FLAG}: this server fetches images only from "
                         f"the hosts that flag lists")
    return _Target(url, parts, host, port, _checked_address(host, port))


def _checked_address(host: str, port: int) -> str:
    if _is_ip(host):
        return host  # listed as an address: the operator allowed that address itself
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise ValueError(f"the image host {host!r} does not resolve: {e}") from None
    addresses = [info[4][0] for info in infos]
    for address in addresses:
        if not ipaddress.ip_address(address.split("%")[0]).is_global:
            raise ValueError(f"the image host {host!r} resolves to {address}, a loopback, private or link-local "
                             f"address; list that address itself in {FLAG} to allow it")
    if not addresses:
        raise ValueError(f"the image host {host!r} does not resolve")
    return addresses[0]


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class _PinnedHTTP(http.client.HTTPConnection):
    """HTTP to the checked address, whatever the name would resolve to now."""

    def __init__(self, target: _Target, timeout: float):
        super().__init__(target.host, target.port, timeout=timeout)
        self._address = target.address

    def connect(self) -> None:
        self.sock = socket.create_connection((self._address, self.port), self.timeout)


class _PinnedHTTPS(http.client.HTTPSConnection):
    """HTTPS to the checked address; the certificate is checked against the host name."""

    def __init__(self, target: _Target, timeout: float):
        super().__init__(target.host, target.port, timeout=timeout)
        self._address = target.address

    def connect(self) -> None:
        sock = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)


def _get(target: _Target, policy: FetchPolicy, deadline: float) -> tuple[int, str | None, str | None, bytes]:
    """(status, Location, Content-Type, body); the body is read only for a 200."""
    kind = _PinnedHTTPS if target.parts.scheme == "https" else _PinnedHTTP
    conn = kind(target, timeout=_remaining(deadline))
    try:
        path = target.parts.path or "/"
        conn.request("GET", f"{path}?{target.parts.query}" if target.parts.query else path,
                     headers={"Accept": "image/*", "User-Agent": "pagedserve"})
        sock = conn.sock  # getresponse may hand the socket to the response and forget it
        response = conn.getresponse()
        if response.status != 200:
            return response.status, response.getheader("Location"), None, b""
        return 200, None, response.getheader("Content-Type"), _read(sock, response, policy, deadline)
    finally:
        conn.close()


def _read(sock: socket.socket | None, response: http.client.HTTPResponse, policy: FetchPolicy,
          deadline: float) -> bytes:
    """The body, capped in bytes; each read waits only for the time the fetch has left, and
    returns what one receive brought (a server dripping bytes cannot stretch the deadline)."""
    length = response.getheader("Content-Length")
    if length is not None and length.strip().isdigit() and int(length) > policy.max_bytes:
        raise ValueError(f"the image is {int(length)} bytes, over the limit of {policy.max_bytes}")
    chunks, size = [], 0
    while True:
        left = _remaining(deadline)
        if sock is not None:
            sock.settimeout(left)
        chunk = response.read1(_CHUNK)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > policy.max_bytes:
            raise ValueError(f"the image is more than {policy.max_bytes} bytes, the limit")
        chunks.append(chunk)


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def _declared_type(url: str, content_type: str | None) -> str | None:
    """The image media type the server declared; None when it declared none."""
    kind = (content_type or "").split(";")[0].strip().lower()
    if not kind or kind in _UNDECLARED:
        return None
    if not kind.startswith("image/"):
        raise ValueError(f"{_short(url)} was served as {kind!r}, not an image")
    return kind


def _short(url: str) -> str:
    """A URL for an error message: long ones cut."""
    return url if len(url) <= 200 else url[:200] + "..."
