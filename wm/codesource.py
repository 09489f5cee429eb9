"""Where worker code comes from: inline bytes (base64 in CLI/JSON) or a URL.

A code URL is attacker-controlled input that makes WorkManager open a connection, so every
URL -- and every redirect -- passes the same rules before any socket is opened: scheme,
syntax, host allowlist and the addresses the host resolves to. The connection then goes to
the address that was checked (no second DNS lookup), so a name cannot be re-bound to an
internal address between check and use. A refusal raises :class:`~wm.errors.SecurityError`
whose ``rule`` names the rule; its message names the setting that would admit the URL.
"""

from __future__ import annotations

import binascii
import hashlib
import http.client
import ipaddress
import logging
import re
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast
from urllib.parse import SplitResult, urljoin, urlsplit

from wm.config import Settings
from wm.errors import CodeSourceError, IntegrityError, SecurityError

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

__all__ = ["Connector", "FetchedCode", "Resolver", "decode_base64", "from_content", "from_url"]

_log = logging.getLogger(__name__)

#: ``resolver(host, port)`` returns the IP addresses (text form) the host resolves to.
Resolver = Callable[[str, int], list[str]]
#: ``connect(address, port, timeout_s)`` returns a TCP socket connected to that address.
Connector = Callable[[str, int, float], socket.socket]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

#: Bytes asked of the socket per read while streaming a body.
_CHUNK_BYTES = 64 * 1024
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_DEFAULT_PORTS = {"http": 80, "https": 443}
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_HOST_NAME = re.compile(r"[a-z0-9_-]+(?:\.[a-z0-9_-]+)*")
#: A last label that makes URL parsers (WHATWG, inet_aton) read the host as an IPv4 number.
_NUMERIC_LABEL = re.compile(r"0x[0-9a-f]*|[0-9]+")
#: RFC 6052 well-known NAT64 prefix: judged by the IPv4 address it embeds.
_NAT64_PREFIX = ipaddress.IPv6Network("64:ff9b::/96")
_WHITESPACE = re.compile(r"\s+")
#: Address properties that make an address unfit for a code fetch, with their names.
_REFUSED_PROPERTIES = (
    ("is_unspecified", "unspecified"),
    ("is_loopback", "loopback"),
    ("is_link_local", "link-local"),
    ("is_multicast", "multicast"),
    ("is_site_local", "site-local"),
    ("is_reserved", "reserved"),
    ("is_private", "private"),
)


@dataclass(frozen=True)
class FetchedCode:
    """Worker code as obtained, with the SHA-256 that is always recorded next to it."""

    code: bytes = field(repr=False)
    sha256: str
    size: int
    source_kind: str
    url: str | None = None


@dataclass(frozen=True)
class _Target:
    """One URL that passed every rule, with the only addresses it may be fetched from."""

    url: str
    scheme: str
    host: str
    port: int
    path: str
    addresses: tuple[str, ...]


@dataclass(frozen=True)
class _Redirect:
    location: str


# --- inline content -----------------------------------------------------------------------


def decode_base64(text: str) -> bytes:
    """Decode standard, padded base64; line breaks and spaces are tolerated, nothing else.

    Strict so that a truncated or url-safe payload fails loudly instead of decoding into
    different code.
    """
    compact = _WHITESPACE.sub("", text)
    try:
        if len(compact) % 4:
            raise binascii.Error("length is not a multiple of 4")
        return binascii.a2b_base64(compact, strict_mode=True)
    except (binascii.Error, ValueError) as exc:
        raise CodeSourceError(
            f"code is not valid base64 ({exc}); expected the standard alphabet with padding"
        ) from exc


def from_content(
    content: bytes | str,
    *,
    settings: Settings,
    base64_encoded: bool = False,
    sha256: str | None = None,
) -> FetchedCode:
    """Accept inline code under the same size limit and pin check as fetched code."""
    pin = _parse_pin(sha256)
    if base64_encoded:
        code = decode_base64(_ascii(content))
    else:
        code = content.encode("utf-8") if isinstance(content, str) else content
    return _finish(code, settings, pin, source_kind="inline", url=None)


def _ascii(content: bytes | str) -> str:
    if isinstance(content, str):
        return content
    try:
        return content.decode("ascii")
    except UnicodeDecodeError as exc:
        raise CodeSourceError("base64 code contains non-ASCII bytes") from exc


def _parse_pin(sha256: str | None) -> str | None:
    """Validate a pin up front so a typo fails before any download, not after."""
    if sha256 is None:
        return None
    pin = sha256.strip().lower()
    if not _SHA256_HEX.fullmatch(pin):
        raise CodeSourceError(
            f"SHA-256 pin {sha256!r} is malformed: expected 64 hexadecimal characters"
        )
    return pin


def _finish(
    code: bytes, settings: Settings, pin: str | None, *, source_kind: str, url: str | None
) -> FetchedCode:
    where = _shown(url) if url else "inline code"
    if not code:
        raise CodeSourceError(f"{where} is empty; a worker needs code")
    if len(code) > settings.code_max_bytes:
        raise SecurityError(
            "size-limit",
            f"{where} is {len(code)} bytes, more than WM_CODE_MAX_BYTES={settings.code_max_bytes}",
        )
    digest = hashlib.sha256(code).hexdigest()
    if pin is not None and digest != pin:
        raise IntegrityError(f"{where} has SHA-256 {digest}, but the pin is {pin}")
    return FetchedCode(code=code, sha256=digest, size=len(code), source_kind=source_kind, url=url)


# --- URL rules ------------------------------------------------------------------------------


def _check_url(url: str, settings: Settings, resolver: Resolver) -> _Target:
    """Apply every rule to ``url``; return where it may be fetched from or refuse it."""
    parts = _split(url, settings)
    host = _checked_host(parts)
    _check_allowlist(host, settings)
    port = _port(parts)
    addresses = _resolve(host, port, resolver)
    if not settings.code_url_allow_private:
        _check_addresses(host, addresses)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return _Target(url, parts.scheme, host, port, path, tuple(str(a) for a in addresses))


def _split(url: str, settings: Settings) -> SplitResult:
    if not url.isascii() or any(ch <= " " or ch == "\x7f" for ch in url):
        raise SecurityError(
            "url-syntax",
            "the URL contains whitespace, control or non-ASCII characters; percent-encode "
            "the path and write international host names in their xn-- form",
        )
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise SecurityError("url-syntax", f"the URL is malformed: {exc}") from exc
    _check_scheme(parts.scheme, settings)
    if "@" in parts.netloc:
        raise SecurityError(
            "userinfo",
            "the URL carries user information before '@' (user@host); no setting admits it",
        )
    return parts


def _check_scheme(scheme: str, settings: Settings) -> None:
    if scheme == "https" or (scheme == "http" and settings.code_url_allow_http):
        return
    hint = "set WM_CODE_URL_ALLOW_HTTP=true to admit it" if scheme == "http" else (
        "only https:// (and http:// with WM_CODE_URL_ALLOW_HTTP=true) is fetched"
    )
    raise SecurityError("scheme", f"scheme {scheme or '(none)'!r} is refused; {hint}")


def _checked_host(parts: SplitResult) -> str:
    raw = parts.hostname or ""
    if not raw.rstrip("."):
        raise SecurityError("empty-host", "the URL names no host")
    host = _normalise_host(raw)
    if _ip_or_none(host) is None and ("%" in raw or not _HOST_NAME.fullmatch(host)):
        raise SecurityError(
            "host-syntax",
            f"host {raw!r} is neither a DNS name nor an IP address "
            "(write international names in their xn-- form)",
        )
    if _is_ambiguous_ipv4(host):
        raise SecurityError(
            "ip-literal-form",
            f"host {raw!r} is a decimal, octal, hex or shortened IPv4 form that parsers "
            "read differently; write the address as four decimal octets",
        )
    return host


def _normalise_host(host: str) -> str:
    """Lower-case, without brackets or trailing dot; IP literals in canonical text."""
    host = host.strip().lower().removeprefix("[").removesuffix("]").rstrip(".")
    literal = _ip_or_none(host)
    return host if literal is None else str(literal)


def _ip_or_none(host: str) -> IPAddress | None:
    if "%" in host:
        return None
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _is_ambiguous_ipv4(host: str) -> bool:
    last_label = host.rsplit(".", 1)[-1]
    return bool(_NUMERIC_LABEL.fullmatch(last_label)) and _ip_or_none(host) is None


def _check_allowlist(host: str, settings: Settings) -> None:
    entries = [_normalise_host(entry) for entry in settings.code_url_allowed_hosts]
    if not entries or any(_host_matches(host, entry) for entry in entries):
        return
    raise SecurityError(
        "host-allowlist",
        f"host {host!r} is not in WM_CODE_URL_ALLOWED_HOSTS (exact names or *.suffix entries)",
    )


def _host_matches(host: str, entry: str) -> bool:
    """``*.example.com`` admits names below example.com, not example.com itself."""
    if entry.startswith("*."):
        return host.endswith(entry[1:])
    return host == entry


def _port(parts: SplitResult) -> int:
    try:
        port = parts.port
    except ValueError as exc:
        raise SecurityError("url-syntax", f"the URL's port is invalid: {exc}") from exc
    return _DEFAULT_PORTS[parts.scheme] if port is None else port


def _resolve(host: str, port: int, resolver: Resolver) -> list[IPAddress]:
    literal = _ip_or_none(host)
    if literal is not None:
        return [literal]
    try:
        answers = resolver(host, port)
    except OSError as exc:
        raise CodeSourceError(f"cannot resolve host {host!r}: {exc}") from exc
    if not answers:
        raise CodeSourceError(f"host {host!r} resolved to no address")
    try:
        return [ipaddress.ip_address(answer) for answer in answers]
    except ValueError as exc:
        raise CodeSourceError(f"resolver gave a non-address for {host!r}: {exc}") from exc


def _system_resolver(host: str, port: int) -> list[str]:
    """The addresses a plain connect would try, each once, in the system's order."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _check_addresses(host: str, addresses: list[IPAddress]) -> None:
    """Every address must be public: an attacker controls which one a client would pick."""
    for address in addresses:
        reason = _address_refusal(address)
        if reason is not None:
            raise SecurityError(
                "private-address",
                f"host {host!r} resolves to {address}, {reason}; only "
                "WM_CODE_URL_ALLOW_PRIVATE=true admits it (tests and closed networks only)",
            )


def _address_refusal(address: IPAddress) -> str | None:
    """Why ``address`` must not be contacted, or None when it is globally routable."""
    if isinstance(address, ipaddress.IPv6Address):
        return _ipv6_refusal(address)
    return _plain_refusal(address)


def _ipv6_refusal(address: ipaddress.IPv6Address) -> str | None:
    if address.ipv4_mapped is not None:
        return "an IPv4-mapped IPv6 address"
    if address in _NAT64_PREFIX:
        inner = ipaddress.IPv4Address(int(address) & 0xFFFF_FFFF)
        reason = _plain_refusal(inner)
        return None if reason is None else f"a NAT64 embedding of {inner}, which is {reason}"
    for inner in (address.sixtofour, *(address.teredo or ())):
        reason = None if inner is None else _plain_refusal(inner)
        if reason is not None:
            return f"a 6to4/Teredo embedding of {inner}, which is {reason}"
    return _plain_refusal(address)


def _plain_refusal(address: IPAddress) -> str | None:
    for attribute, name in _REFUSED_PROPERTIES:
        if getattr(address, attribute, False):
            return name
    return None if address.is_global else "not globally routable"


# --- fetching -------------------------------------------------------------------------------


def from_url(
    url: str,
    *,
    settings: Settings,
    sha256: str | None = None,
    resolver: Resolver | None = None,
    connect: Connector | None = None,
) -> FetchedCode:
    """Fetch worker code under the SSRF rules, the size and time limits, and the pin.

    ``resolver`` and ``connect`` replace DNS and the TCP connect; tests use them to make a
    name resolve to a chosen address and to reach a loopback server without admitting
    loopback. The connection is only ever asked for an address that passed the checks.
    """
    pin = _parse_pin(sha256)
    deadline = time.monotonic() + settings.code_url_timeout_s
    fetch = _Fetch(settings, resolver or _system_resolver, connect or _system_connect, deadline)
    try:
        code = fetch.run(url)
    except TimeoutError as exc:
        raise SecurityError(
            "time-limit",
            f"fetching {_shown(url)} took longer than "
            f"WM_CODE_URL_TIMEOUT_S={settings.code_url_timeout_s}",
        ) from exc
    fetched = _finish(code, settings, pin, source_kind="url", url=url)
    _log.info("fetched %d bytes of code from %s (sha256 %s)", fetched.size, _shown(url),
              fetched.sha256)
    return fetched


def _system_connect(address: str, port: int, timeout_s: float) -> socket.socket:
    return socket.create_connection((address, port), timeout=timeout_s)


def _shown(url: str) -> str:
    """The URL without user information, query or fragment, which may hold secrets."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "the code URL"
    return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("code fetch deadline passed")
    return left


class _Fetch:
    """One fetch: a redirect chain whose every hop is re-checked, under one deadline."""

    def __init__(
        self, settings: Settings, resolver: Resolver, connect: Connector, deadline: float
    ) -> None:
        self._settings = settings
        self._resolver = resolver
        self._connect = connect
        self._deadline = deadline

    def run(self, url: str) -> bytes:
        current = url
        for _ in range(self._settings.code_url_max_redirects + 1):
            target = _check_url(current, self._settings, self._resolver)
            result = self._get(target)
            if isinstance(result, bytes):
                return result
            _log.debug("code URL %s redirects to %s", _shown(current), _shown(result.location))
            current = urljoin(current, result.location)
        raise SecurityError(
            "redirect-limit",
            f"{_shown(url)} redirected more than "
            f"WM_CODE_URL_MAX_REDIRECTS={self._settings.code_url_max_redirects} times",
        )

    def _get(self, target: _Target) -> bytes | _Redirect:
        kind = _PinnedHTTPSConnection if target.scheme == "https" else _PinnedHTTPConnection
        connection = kind(target, self._deadline, self._connect)
        response: http.client.HTTPResponse | None = None
        try:
            connection.request("GET", target.path, headers=_REQUEST_HEADERS)
            response = connection.getresponse()
            return _read_response(response, target, self._settings.code_max_bytes)
        except TimeoutError:
            raise
        except (OSError, http.client.HTTPException) as exc:
            raise CodeSourceError(f"could not fetch {_shown(target.url)}: {exc!r}") from exc
        finally:
            # With "Connection: close" the response owns the socket; closing only the
            # connection would leave it open while the caller holds the traceback.
            if response is not None:
                response.close()
            connection.close()


_REQUEST_HEADERS = {"Accept": "*/*", "User-Agent": "WorkManager-codesource", "Connection": "close"}


def _read_response(
    response: http.client.HTTPResponse, target: _Target, limit: int
) -> bytes | _Redirect:
    status = response.status
    if status in _REDIRECT_STATUSES:
        location = response.getheader("Location")
        if not location:
            raise CodeSourceError(f"{_shown(target.url)} redirected without a Location")
        return _Redirect(location)
    if not 200 <= status < 300:
        raise CodeSourceError(
            f"{_shown(target.url)} answered HTTP {status} {response.reason}; expected 2xx"
        )
    return _read_body(response, target, limit)


def _read_body(response: http.client.HTTPResponse, target: _Target, limit: int) -> bytes:
    """Stream the body and stop the moment it exceeds ``limit``, announced or not."""
    if response.length is not None and response.length > limit:
        raise _too_large(target, f"announces Content-Length {response.length}", limit)
    chunks: list[bytes] = []
    total = 0
    while chunk := response.read1(_CHUNK_BYTES):
        total += len(chunk)
        if total > limit:
            raise _too_large(target, f"sent more than {limit} bytes", limit)
        chunks.append(chunk)
    if response.length:
        raise CodeSourceError(
            f"{_shown(target.url)} closed the connection {response.length} bytes short"
        )
    return b"".join(chunks)


def _too_large(target: _Target, what: str, limit: int) -> SecurityError:
    return SecurityError(
        "size-limit", f"{_shown(target.url)} {what}; WM_CODE_MAX_BYTES={limit} bounds code"
    )


# --- pinned connections ---------------------------------------------------------------------


class _DeadlineSocket(socket.socket):
    """A TCP socket whose every wait ends at the fetch deadline, so a server dripping one
    byte at a time cannot stretch the fetch (a plain timeout restarts on every read)."""

    __slots__ = ("deadline",)
    deadline: float

    def recv_into(self, buffer: WriteableBuffer, nbytes: int = 0, flags: int = 0) -> int:
        self.settimeout(_remaining(self.deadline))
        return super().recv_into(buffer, nbytes, flags)

    def sendall(self, data: ReadableBuffer, flags: int = 0, /) -> None:
        self.settimeout(_remaining(self.deadline))
        super().sendall(data, flags)


class _DeadlineSSLSocket(ssl.SSLSocket):
    """The TLS counterpart of :class:`_DeadlineSocket`."""

    deadline: float

    def recv_into(self, buffer: WriteableBuffer, nbytes: int | None = None, flags: int = 0) -> int:
        self.settimeout(_remaining(self.deadline))
        return super().recv_into(buffer, nbytes, flags)

    def sendall(self, data: ReadableBuffer, flags: int = 0) -> None:
        self.settimeout(_remaining(self.deadline))
        super().sendall(data, flags)


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """Connects to the addresses that passed the checks; the host name only fills Host."""

    def __init__(self, target: _Target, deadline: float, connect: Connector) -> None:
        super().__init__(target.host, target.port)
        self._target = target
        self._deadline = deadline
        self._dial = connect

    def connect(self) -> None:
        self.sock = self._open_tcp()

    def _open_tcp(self) -> _DeadlineSocket:
        failure: OSError = OSError(f"no address to connect to for {self._target.host!r}")
        for address in self._target.addresses:
            try:
                raw = self._dial(address, self._target.port, _remaining(self._deadline))
            except OSError as exc:
                failure = exc
                continue
            tcp = _DeadlineSocket(fileno=raw.detach())
            tcp.deadline = self._deadline
            return tcp
        raise failure


class _PinnedHTTPSConnection(_PinnedHTTPConnection):
    """TLS to the checked address, with SNI and certificate verification for the URL's host."""

    default_port = http.client.HTTPS_PORT

    def connect(self) -> None:
        context = ssl.create_default_context()
        context.sslsocket_class = _DeadlineSSLSocket
        tcp = self._open_tcp()
        tcp.settimeout(_remaining(self._deadline))
        try:
            tls = cast(
                _DeadlineSSLSocket,
                context.wrap_socket(tcp, server_hostname=self._target.host),
            )
        except BaseException:
            tcp.close()
            raise
        tls.deadline = self._deadline
        self.sock = tls
