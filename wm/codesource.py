"""Where worker code comes from: inline bytes (base64 in CLI/JSON) or a URL.

Every URL -- and every redirect -- first passes the rules in :mod:`wm.urlguard`. The
connection then goes to the address that was checked (no second DNS lookup), so a name cannot
be re-bound to an internal address between check and use.
"""

from __future__ import annotations

import binascii
import hashlib
import http.client
import logging
import re
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast
from urllib.parse import urljoin, urlsplit

from wm.config import Settings
from wm.errors import CodeSourceError, CodeSourceRefused, PinMismatch
from wm.urlguard import Resolver, Target, check_url, system_resolver

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

__all__ = ["Connector", "FetchedCode", "Resolver", "decode_base64", "from_content", "from_url"]

_log = logging.getLogger(__name__)

#: ``connect(address, port, timeout_s)`` returns a TCP socket connected to that address.
Connector = Callable[[str, int, float], socket.socket]

#: Bytes asked of the socket per read while streaming a body.
_CHUNK_BYTES = 64 * 1024
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_WHITESPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class FetchedCode:
    """Worker code as obtained, with the SHA-256 that is always recorded next to it."""

    code: bytes = field(repr=False)
    sha256: str
    size: int
    source_kind: str
    url: str | None = None


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
        raise CodeSourceRefused(
            "size-limit",
            f"{where} is {len(code)} bytes, more than WM_CODE_MAX_BYTES={settings.code_max_bytes}",
        )
    digest = hashlib.sha256(code).hexdigest()
    if pin is not None and digest != pin:
        raise PinMismatch(f"{where} has SHA-256 {digest}, but the pin is {pin}")
    return FetchedCode(code=code, sha256=digest, size=len(code), source_kind=source_kind, url=url)


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
    fetch = _Fetch(settings, resolver or system_resolver, connect or _system_connect, deadline)
    try:
        code = fetch.run(url)
    except TimeoutError as exc:
        raise CodeSourceRefused(
            "time-limit",
            f"fetching {_shown(url)} took longer than "
            f"WM_CODE_URL_TIMEOUT_S={settings.code_url_timeout_s}",
        ) from exc
    fetched = _finish(code, settings, pin, source_kind="url", url=url)
    _log.info(
        "fetched %d bytes of code from %s (sha256 %s)", fetched.size, _shown(url), fetched.sha256
    )
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
            target = check_url(current, self._settings, self._resolver)
            result = self._get(target)
            if isinstance(result, bytes):
                return result
            _log.debug("code URL %s redirects to %s", _shown(current), _shown(result.location))
            current = urljoin(current, result.location)
        raise CodeSourceRefused(
            "redirect-limit",
            f"{_shown(url)} redirected more than "
            f"WM_CODE_URL_MAX_REDIRECTS={self._settings.code_url_max_redirects} times",
        )

    def _get(self, target: Target) -> bytes | _Redirect:
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
    response: http.client.HTTPResponse, target: Target, limit: int
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


def _read_body(response: http.client.HTTPResponse, target: Target, limit: int) -> bytes:
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


def _too_large(target: Target, what: str, limit: int) -> CodeSourceRefused:
    return CodeSourceRefused(
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

    def __init__(self, target: Target, deadline: float, connect: Connector) -> None:
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
