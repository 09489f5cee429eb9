"""The rules a code URL must pass before WorkManager opens a socket to it.

A code URL is attacker-controlled input, so every URL -- and every redirect -- passes these
rules before any socket is opened: scheme, syntax, host allowlist and the addresses the host
resolves to. Keeping them in one module, apart from the HTTP client, keeps the whole SSRF
boundary readable in one place. A refusal raises :class:`~wm.errors.CodeSourceRefused` whose
``rule`` names the rule; its message names the setting that would admit the URL.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

from wm.config import Settings
from wm.errors import CodeSourceError, CodeSourceRefused

__all__ = ["Resolver", "Target", "check_url", "system_resolver"]

#: ``resolver(host, port)`` returns the IP addresses (text form) the host resolves to.
Resolver = Callable[[str, int], list[str]]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_DEFAULT_PORTS = {"http": 80, "https": 443}
_HOST_NAME = re.compile(r"[a-z0-9_-]+(?:\.[a-z0-9_-]+)*")
#: A last label that makes URL parsers (WHATWG, inet_aton) read the host as an IPv4 number.
_NUMERIC_LABEL = re.compile(r"0x[0-9a-f]*|[0-9]+")
#: RFC 6052 well-known NAT64 prefix: judged by the IPv4 address it embeds.
_NAT64_PREFIX = ipaddress.IPv6Network("64:ff9b::/96")
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
class Target:
    """One URL that passed every rule, with the only addresses it may be fetched from."""

    url: str
    scheme: str
    host: str
    port: int
    path: str
    addresses: tuple[str, ...]


def check_url(url: str, settings: Settings, resolver: Resolver) -> Target:
    """Apply every rule to ``url``; return where it may be fetched from or refuse it."""
    parts = _split(url, settings)
    host = _checked_host(parts)
    _check_allowlist(host, settings)
    port = _port(parts)
    addresses = _resolve(host, port, resolver)
    if not settings.code_url_allow_private:
        _check_addresses(host, addresses)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Target(url, parts.scheme, host, port, path, tuple(str(a) for a in addresses))


def _split(url: str, settings: Settings) -> SplitResult:
    if not url.isascii() or any(ch <= " " or ch == "\x7f" for ch in url):
        raise CodeSourceRefused(
            "url-syntax",
            "the URL contains whitespace, control or non-ASCII characters; percent-encode "
            "the path and write international host names in their xn-- form",
        )
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise CodeSourceRefused("url-syntax", f"the URL is malformed: {exc}") from exc
    _check_scheme(parts.scheme, settings)
    if "@" in parts.netloc:
        raise CodeSourceRefused(
            "userinfo",
            "the URL carries user information before '@' (user@host); no setting admits it",
        )
    return parts


def _check_scheme(scheme: str, settings: Settings) -> None:
    if scheme == "https" or (scheme == "http" and settings.code_url_allow_http):
        return
    hint = (
        "set WM_CODE_URL_ALLOW_HTTP=true to admit it"
        if scheme == "http"
        else ("only https:// (and http:// with WM_CODE_URL_ALLOW_HTTP=true) is fetched")
    )
    raise CodeSourceRefused("scheme", f"scheme {scheme or '(none)'!r} is refused; {hint}")


def _checked_host(parts: SplitResult) -> str:
    raw = parts.hostname or ""
    if not raw.rstrip("."):
        raise CodeSourceRefused("empty-host", "the URL names no host")
    host = _normalise_host(raw)
    if _ip_or_none(host) is None and ("%" in raw or not _HOST_NAME.fullmatch(host)):
        raise CodeSourceRefused(
            "host-syntax",
            f"host {raw!r} is neither a DNS name nor an IP address "
            "(write international names in their xn-- form)",
        )
    if _is_ambiguous_ipv4(host):
        raise CodeSourceRefused(
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
    raise CodeSourceRefused(
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
        raise CodeSourceRefused("url-syntax", f"the URL's port is invalid: {exc}") from exc
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


def system_resolver(host: str, port: int) -> list[str]:
    """The addresses a plain connect would try, each once, in the system's order."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _check_addresses(host: str, addresses: list[IPAddress]) -> None:
    """Every address must be public: an attacker controls which one a client would pick."""
    for address in addresses:
        reason = _address_refusal(address)
        if reason is not None:
            raise CodeSourceRefused(
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
