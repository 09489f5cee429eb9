"""Code sources: inline content, and URL fetches under the SSRF rules, limits and pin.

Every fetch goes to a real HTTP server on 127.0.0.1. Nothing ever connects anywhere else:
an autouse guard fails any connect to a non-loopback address, hostile URLs are fetched with
a ``connect`` hook that fails if it is called at all (refusals happen before connecting),
and names that must look public are resolved by a fake resolver to a documentation-style
public address whose connection a hook redirects to the loopback server. That hook is how
a redirect to a private address is tested end to end without admitting loopback.
"""

from __future__ import annotations

import base64
import hashlib
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import Exchange, Loopback, Route, http_server
from wm.codesource import Connector, FetchedCode, decode_base64, from_content, from_url
from wm.config import Settings
from wm.errors import CodeSourceError, CodeSourceRefused, PinMismatch

CODE = b"def handle(event):\n    return event\n"
CODE_SHA = hashlib.sha256(CODE).hexdigest()
#: What fake DNS answers for names that must pass the address rules; never dialled.
PUBLIC_ADDRESS = "93.184.216.34"
FAKE_DNS = {
    "public.example": [PUBLIC_ADDRESS],
    "internal.example": ["10.1.2.3"],
    "mixed.example": [PUBLIC_ADDRESS, "192.168.0.5"],
    "localhost": ["127.0.0.1", "::1"],
    "sixtofour.example": ["2002:a00:1::"],
}
LOOPBACK = ("127.0.0.1", "::1")
#: Gap between dripped bytes, far below the fetch time limit used against it.
DRIP_INTERVAL_S = 0.1


# --- loopback server ----------------------------------------------------------------------


def _drip(exchange: Exchange) -> None:
    for _ in range(200):
        if exchange.stopping.wait(DRIP_INTERVAL_S):
            return
        exchange.wfile.write(b"x")
        exchange.wfile.flush()


def _drip_body(exchange: Exchange) -> None:
    exchange.send_response(200)
    exchange.end_headers()
    _drip(exchange)


def _drip_headers(exchange: Exchange) -> None:
    exchange.wfile.write(b"HTTP/1.0 200 OK\r\nX-Slow: ")
    _drip(exchange)


def _endless(exchange: Exchange) -> None:
    exchange.send_response(200)
    exchange.end_headers()
    for _ in range(64):
        exchange.wfile.write(b"x" * 65536)


def _hop(exchange: Exchange) -> None:
    remaining = int(exchange.path.rsplit("/", 1)[1])
    if remaining == 0:
        exchange.reply(200, CODE)
    else:
        exchange.reply(302, Location=f"/hop/{remaining - 1}")


ROUTES: dict[str, Route] = {
    "/code.py": lambda x: x.reply(200, CODE, Content_Length=str(len(CODE))),
    "/missing": lambda x: x.reply(404, b"not here"),
    "/empty": lambda x: x.reply(200, b"", Content_Length="0"),
    "/announced-big": lambda x: x.reply(200, b"x" * 10, Content_Length=str(10**9)),
    "/truncated": lambda x: x.reply(200, b"x" * 10, Content_Length="100"),
    "/big": _endless,
    "/drip-body": _drip_body,
    "/drip-headers": _drip_headers,
    "/to-file": lambda x: x.reply(302, Location="file:///etc/passwd"),
    "/to-other-host": lambda x: x.reply(302, Location="http://evil.example/code.py"),
    "/to-private": lambda x: x.reply(302, Location="http://10.0.0.1/code.py"),
    "/hop": _hop,
}


def _route(exchange: Exchange) -> None:
    path = exchange.path
    (ROUTES.get(path) or ROUTES[path.rsplit("/", 1)[0]])(exchange)


def seen(server: Loopback) -> list[tuple[str, str | None]]:
    """(path, Host header) of each request the server got."""
    return [(request.path, request.host) for request in server.requests]


@pytest.fixture
def server() -> Iterator[Loopback]:
    with http_server(_route) as loopback:
        yield loopback


# --- guards and hooks ---------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail any connect that would leave this machine, whatever the code under test does."""
    real_connect = socket.socket.connect

    def guarded(sock: socket.socket, address: Any) -> None:
        assert address[0] in LOOPBACK, f"test tried to connect to {address!r}"
        real_connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)


def fake_dns(host: str, port: int) -> list[str]:
    if host not in FAKE_DNS:
        raise AssertionError(f"unexpected DNS lookup of {host!r}")
    return FAKE_DNS[host]


def no_dns(host: str, port: int) -> list[str]:
    raise AssertionError(f"unexpected DNS lookup of {host!r}")


def never_connect(address: str, port: int, timeout_s: float) -> socket.socket:
    raise AssertionError(f"connected to {address}:{port} although the URL must be refused")


def public_to_loopback(port: int, calls: list[tuple[str, int]]) -> Connector:
    """Dial the loopback server whenever the checked public address is asked for."""

    def connect(address: str, _port: int, timeout_s: float) -> socket.socket:
        calls.append((address, _port))
        assert address == PUBLIC_ADDRESS, f"connected to unchecked address {address}"
        return socket.create_connection(("127.0.0.1", port), timeout=timeout_s)

    return connect


@pytest.fixture
def settings() -> Settings:
    return Settings().replace(code_url_timeout_s=5.0)


@pytest.fixture
def loopback_settings(settings: Settings) -> Settings:
    return settings.replace(code_url_allow_private=True, code_url_allow_http=True)


# --- hostile URLs -------------------------------------------------------------------------

PRIVATE = "WM_CODE_URL_ALLOW_PRIVATE"
HOSTILE = [
    ("https://10.0.0.1/code.py", "private-address", PRIVATE, {}),
    ("https://172.16.0.1/", "private-address", PRIVATE, {}),
    ("https://192.168.1.1/", "private-address", PRIVATE, {}),
    ("https://169.254.169.254/latest/meta-data/", "private-address", PRIVATE, {}),
    ("http://169.254.169.254/", "private-address", PRIVATE, {"code_url_allow_http": True}),
    ("https://100.64.0.1/", "private-address", "not globally routable", {}),
    ("https://224.0.0.1/", "private-address", "multicast", {}),
    ("https://240.0.0.1/", "private-address", "reserved", {}),
    ("https://255.255.255.255/", "private-address", PRIVATE, {}),
    ("https://localhost/", "private-address", "loopback", {}),
    ("https://LOCALHOST./", "private-address", "loopback", {}),
    ("https://0.0.0.0/", "private-address", "unspecified", {}),
    ("https://127.0.0.1:8443/", "private-address", "loopback", {}),
    ("https://[::1]/", "private-address", "loopback", {}),
    ("https://[::]/", "private-address", "unspecified", {}),
    ("https://[::ffff:127.0.0.1]/", "private-address", "IPv4-mapped", {}),
    ("https://[::ffff:7f00:1]/", "private-address", "IPv4-mapped", {}),
    ("https://[::ffff:8.8.8.8]/", "private-address", "IPv4-mapped", {}),
    ("https://[fe80::1]/", "private-address", "link-local", {}),
    ("https://[fc00::1]/", "private-address", "private", {}),
    ("https://[fec0::1]/", "private-address", "site-local", {}),
    ("https://[ff02::1]/", "private-address", "multicast", {}),
    ("https://[2002:7f00:1::]/", "private-address", "6to4/Teredo", {}),
    ("https://[2001:0:4136:e378:8000:63bf:80ff:fffe]/", "private-address", PRIVATE, {}),
    ("https://[64:ff9b::7f00:1]/", "private-address", "NAT64", {}),
    ("https://[64:ff9b::a00:1]/", "private-address", "NAT64", {}),
    ("https://internal.example/", "private-address", "10.1.2.3", {}),
    ("https://mixed.example/", "private-address", "192.168.0.5", {}),
    ("https://sixtofour.example/", "private-address", "10.0.0.1", {}),
    ("https://10.0.0.1/", "private-address", PRIVATE, {"code_url_allowed_hosts": ("10.0.0.1",)}),
    ("https://2130706433/", "ip-literal-form", "four decimal octets", {}),
    ("https://0177.0.0.1/", "ip-literal-form", "four decimal octets", {}),
    ("https://0x7f.1/", "ip-literal-form", "four decimal octets", {}),
    ("https://0x7f000001/", "ip-literal-form", "four decimal octets", {}),
    ("https://127.1/", "ip-literal-form", "four decimal octets", {}),
    ("https://010.0.0.1/", "ip-literal-form", "four decimal octets", {}),
    ("https://public.example.0x7f/", "ip-literal-form", "four decimal octets", {}),
    ("file:///etc/passwd", "scheme", "WM_CODE_URL_ALLOW_HTTP", {}),
    ("ftp://public.example/code.py", "scheme", "'ftp'", {}),
    ("gopher://public.example:70/_GET", "scheme", "'gopher'", {}),
    ("data:text/plain,print(1)", "scheme", "'data'", {}),
    ("//public.example/code.py", "scheme", "(none)", {}),
    ("http://public.example/code.py", "scheme", "WM_CODE_URL_ALLOW_HTTP=true", {}),
    ("https://public.example@10.0.0.1/", "userinfo", "no setting", {}),
    ("https://user:secret@public.example/", "userinfo", "no setting", {}),
    ("https://public.example\\@10.0.0.1/", "userinfo", "no setting", {}),
    ("https://@public.example/", "userinfo", "no setting", {}),
    ("https://public.example%40evil.example/", "host-syntax", "xn--", {}),
    ("https://[fe80::1%25eth0]/", "host-syntax", "xn--", {}),
    ("https:///etc/passwd", "empty-host", "no host", {}),
    ("https://:443/", "empty-host", "no host", {}),
    ("https://public.example:99999/", "url-syntax", "port", {}),
    ("https://public.example:ab/", "url-syntax", "port", {}),
    ("https://public.example/a b", "url-syntax", "percent-encode", {}),
    ("https://public.example/\r\nHost: x", "url-syntax", "percent-encode", {}),
    ("https://bücher.example/", "url-syntax", "xn--", {}),
    ("https://[::1/", "url-syntax", "malformed", {}),
    *[
        (
            url,
            "host-allowlist",
            "WM_CODE_URL_ALLOWED_HOSTS",
            {"code_url_allowed_hosts": ("code.example", "*.trusted.example")},
        )
        for url in (
            "https://public.example/",
            "https://trusted.example/",
            "https://eviltrusted.example/",
            "https://trusted.example.public.example/",
            "https://93.184.216.34/",
        )
    ],
]


@pytest.mark.parametrize(("url", "rule", "hint", "changes"), HOSTILE)
def test_hostile_url_is_refused_before_connecting(
    settings: Settings, url: str, rule: str, hint: str, changes: dict[str, Any]
) -> None:
    with pytest.raises(CodeSourceRefused) as refused:
        from_url(
            url, settings=settings.replace(**changes), resolver=fake_dns, connect=never_connect
        )
    assert refused.value.rule == rule
    assert hint in str(refused.value)
    assert "secret" not in str(refused.value)


def test_localhost_through_the_system_resolver_is_refused(settings: Settings) -> None:
    with pytest.raises(CodeSourceRefused) as refused:
        from_url("https://localhost/code.py", settings=settings, connect=never_connect)
    assert refused.value.rule == "private-address"


@pytest.mark.parametrize(
    ("url", "rule"),
    [
        ("http://2130706433/", "ip-literal-form"),
        ("http://good.example@127.0.0.1/", "userinfo"),
        ("file:///etc/passwd", "scheme"),
        ("http://127.0.0.1/", "host-allowlist"),
    ],
)
def test_allowing_private_addresses_keeps_the_other_rules(
    loopback_settings: Settings, url: str, rule: str
) -> None:
    settings = loopback_settings.replace(code_url_allowed_hosts=("code.example",))
    with pytest.raises(CodeSourceRefused) as refused:
        from_url(url, settings=settings, resolver=no_dns, connect=never_connect)
    assert refused.value.rule == rule


# --- fetching from the loopback server ------------------------------------------------------


def test_good_url_with_matching_pin_is_accepted(
    server: Loopback, loopback_settings: Settings
) -> None:
    url = server.url("/code.py")
    fetched = from_url(url, settings=loopback_settings, sha256=CODE_SHA.upper())
    assert fetched == FetchedCode(CODE, CODE_SHA, len(CODE), "url", url)


def test_sha256_is_recorded_without_a_pin(server: Loopback, loopback_settings: Settings) -> None:
    fetched = from_url(server.url("/code.py"), settings=loopback_settings)
    assert fetched.sha256 == CODE_SHA


def test_mismatching_pin_is_refused_naming_both_digests(
    server: Loopback, loopback_settings: Settings
) -> None:
    with pytest.raises(PinMismatch) as refused:
        from_url(server.url("/code.py"), settings=loopback_settings, sha256="0" * 64)
    assert CODE_SHA in str(refused.value)
    assert "0" * 64 in str(refused.value)


@pytest.mark.parametrize("pin", ["", "abc", "g" * 64, CODE_SHA + "0"])
def test_malformed_pin_is_refused_before_fetching(loopback_settings: Settings, pin: str) -> None:
    with pytest.raises(CodeSourceError, match="64 hexadecimal"):
        from_url(
            "http://127.0.0.1:9/code.py",
            settings=loopback_settings,
            sha256=pin,
            connect=never_connect,
        )


def test_connection_is_pinned_to_the_checked_address(server: Loopback, settings: Settings) -> None:
    lookups: list[tuple[str, int]] = []
    dials: list[tuple[str, int]] = []

    def resolver(host: str, port: int) -> list[str]:
        lookups.append((host, port))
        return [PUBLIC_ADDRESS]

    fetched = from_url(
        server.url("/code.py", host="Code.Example."),
        settings=settings.replace(code_url_allow_http=True),
        resolver=resolver,
        connect=public_to_loopback(server.port, dials),
    )
    assert fetched.code == CODE
    assert lookups == [("code.example", server.port)]
    assert dials == [(PUBLIC_ADDRESS, server.port)]
    assert seen(server) == [("/code.py", f"code.example:{server.port}")]


@pytest.mark.parametrize("entry", ["code.example", "CODE.example.", "*.example"])
def test_allowlisted_host_is_admitted(server: Loopback, settings: Settings, entry: str) -> None:
    allowed = settings.replace(code_url_allow_http=True, code_url_allowed_hosts=(entry,))
    fetched = from_url(
        server.url("/code.py", host="code.example"),
        settings=allowed,
        resolver=lambda host, port: [PUBLIC_ADDRESS],
        connect=public_to_loopback(server.port, []),
    )
    assert fetched.code == CODE


def test_body_over_the_limit_is_refused(server: Loopback, loopback_settings: Settings) -> None:
    with pytest.raises(CodeSourceRefused) as refused:
        from_url(server.url("/big"), settings=loopback_settings.replace(code_max_bytes=1000))
    assert refused.value.rule == "size-limit"
    assert "WM_CODE_MAX_BYTES=1000" in str(refused.value)


def test_announced_content_length_over_the_limit_is_refused(
    server: Loopback, loopback_settings: Settings
) -> None:
    with pytest.raises(CodeSourceRefused, match="Content-Length 1000000000") as refused:
        from_url(server.url("/announced-big"), settings=loopback_settings)
    assert refused.value.rule == "size-limit"


@pytest.mark.parametrize("path", ["/drip-body", "/drip-headers"])
def test_slow_server_hits_the_whole_fetch_deadline(
    server: Loopback, loopback_settings: Settings, path: str
) -> None:
    started = time.monotonic()
    with pytest.raises(CodeSourceRefused) as refused:
        from_url(server.url(path), settings=loopback_settings.replace(code_url_timeout_s=1.0))
    assert refused.value.rule == "time-limit"
    assert "WM_CODE_URL_TIMEOUT_S" in str(refused.value)
    assert time.monotonic() - started < 2.5


def test_http_error_status_is_a_clear_error(server: Loopback, loopback_settings: Settings) -> None:
    with pytest.raises(CodeSourceError, match="HTTP 404") as failed:
        from_url(server.url("/missing"), settings=loopback_settings)
    assert not isinstance(failed.value, CodeSourceRefused)


@pytest.mark.parametrize(("path", "message"), [("/empty", "empty"), ("/truncated", "short")])
def test_empty_or_truncated_body_is_refused(
    server: Loopback, loopback_settings: Settings, path: str, message: str
) -> None:
    with pytest.raises(CodeSourceError, match=message):
        from_url(server.url(path), settings=loopback_settings)


def test_unreachable_server_is_a_clear_error(loopback_settings: Settings) -> None:
    # Bound but not listening: the port refuses connections while the probe holds it, and
    # no other program can take it meanwhile.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        with pytest.raises(CodeSourceError, match="could not fetch"):
            from_url(f"http://127.0.0.1:{port}/code.py", settings=loopback_settings)


def test_unresolvable_host_is_a_clear_error(settings: Settings) -> None:
    def failing(host: str, port: int) -> list[str]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    with pytest.raises(CodeSourceError, match=r"cannot resolve host 'nowhere\.example'"):
        from_url(
            "https://nowhere.example/", settings=settings, resolver=failing, connect=never_connect
        )


def test_https_to_a_plain_http_server_fails_clearly(
    server: Loopback, loopback_settings: Settings
) -> None:
    with pytest.raises(CodeSourceError, match="could not fetch") as failed:
        from_url(server.url("/code.py", scheme="https"), settings=loopback_settings)
    assert isinstance(failed.value.__cause__, ssl.SSLError)


# --- redirects ------------------------------------------------------------------------------


def test_redirects_are_followed_up_to_the_limit(
    server: Loopback, loopback_settings: Settings
) -> None:
    settings = loopback_settings.replace(code_url_max_redirects=2)
    assert from_url(server.url("/hop/2"), settings=settings).code == CODE
    assert [path for path, _ in seen(server)] == ["/hop/2", "/hop/1", "/hop/0"]


@pytest.mark.parametrize(("hops", "limit"), [(3, 2), (1, 0)])
def test_redirects_beyond_the_limit_are_refused(
    server: Loopback, loopback_settings: Settings, hops: int, limit: int
) -> None:
    settings = loopback_settings.replace(code_url_max_redirects=limit)
    with pytest.raises(CodeSourceRefused) as refused:
        from_url(server.url(f"/hop/{hops}"), settings=settings)
    assert refused.value.rule == "redirect-limit"
    assert len(seen(server)) == limit + 1


@pytest.mark.parametrize(
    ("path", "rule"), [("/to-file", "scheme"), ("/to-other-host", "host-allowlist")]
)
def test_each_redirect_is_rechecked(
    server: Loopback, loopback_settings: Settings, path: str, rule: str
) -> None:
    settings = loopback_settings.replace(code_url_allowed_hosts=("127.0.0.1",))
    with pytest.raises(CodeSourceRefused) as refused:
        from_url(server.url(path), settings=settings, resolver=no_dns)
    assert refused.value.rule == rule


def test_redirect_to_a_private_address_is_refused_before_connecting(
    server: Loopback, settings: Settings
) -> None:
    dials: list[tuple[str, int]] = []
    with pytest.raises(CodeSourceRefused) as refused:
        from_url(
            server.url("/to-private", host="public.example"),
            settings=settings.replace(code_url_allow_http=True),
            resolver=fake_dns,
            connect=public_to_loopback(server.port, dials),
        )
    assert refused.value.rule == "private-address"
    assert "10.0.0.1" in str(refused.value)
    assert dials == [(PUBLIC_ADDRESS, server.port)]


# --- TLS: SNI and certificate verification against the URL's host ------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A throw-away CA and a server certificate for code.example."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make test certificates")
    path = tmp_path_factory.mktemp("tls")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl(
        "req",
        "-x509",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=wm-test-ca",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign",
        cwd=path,
    )
    _openssl(
        "req", *ec, "-keyout", "leaf.key", "-out", "leaf.csr", "-subj", "/CN=code.example", cwd=path
    )
    (path / "leaf.ext").write_text(
        "subjectAltName=DNS:code.example\nbasicConstraints=CA:FALSE\n"
        "extendedKeyUsage=serverAuth\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n"
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        "leaf.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "leaf.pem",
        "-days",
        "2",
        "-extfile",
        "leaf.ext",
        cwd=path,
    )
    return path


@pytest.fixture
def tls_server(certificates: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Loopback]:
    monkeypatch.setenv("SSL_CERT_FILE", str(certificates / "ca.pem"))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certificates / "leaf.pem", certificates / "leaf.key")
    with http_server(_route, tls=context) as loopback:
        yield loopback


def test_https_verifies_the_url_host_on_the_pinned_address(
    tls_server: Loopback, settings: Settings
) -> None:
    dials: list[tuple[str, int]] = []
    fetched = from_url(
        tls_server.url("/code.py", host="code.example", scheme="https"),
        settings=settings,
        sha256=CODE_SHA,
        resolver=lambda host, port: [PUBLIC_ADDRESS],
        connect=public_to_loopback(tls_server.port, dials),
    )
    assert fetched.code == CODE
    assert tls_server.server_names == ["code.example"]
    assert dials == [(PUBLIC_ADDRESS, tls_server.port)]


def test_https_certificate_for_another_host_is_refused(
    tls_server: Loopback, settings: Settings
) -> None:
    with pytest.raises(CodeSourceError, match="could not fetch") as failed:
        from_url(
            tls_server.url("/code.py", host="public.example", scheme="https"),
            settings=settings,
            resolver=fake_dns,
            connect=public_to_loopback(tls_server.port, []),
        )
    assert isinstance(failed.value.__cause__, ssl.SSLCertVerificationError)
    assert seen(tls_server) == []


# --- inline content -----------------------------------------------------------------------

ENCODED = base64.b64encode(CODE).decode("ascii")


@pytest.mark.parametrize(
    ("content", "encoded"),
    [
        (CODE, False),
        (CODE.decode("utf-8"), False),
        (ENCODED, True),
        (ENCODED.encode("ascii"), True),
        ("\n".join(ENCODED[i : i + 8] for i in range(0, len(ENCODED), 8)) + "\n", True),
    ],
)
def test_inline_code_is_accepted_with_its_digest(
    settings: Settings, content: bytes | str, encoded: bool
) -> None:
    fetched = from_content(content, settings=settings, base64_encoded=encoded, sha256=CODE_SHA)
    assert fetched == FetchedCode(CODE, CODE_SHA, len(CODE), "inline")


@pytest.mark.parametrize(
    "text", ["not base64!", "YWJj=", "YWJjZA", "-_-_", "YWJj\x00", "YWJjZA==YWJj"]
)
def test_bad_base64_is_a_clear_error(settings: Settings, text: str) -> None:
    with pytest.raises(CodeSourceError, match="not valid base64"):
        decode_base64(text)
    with pytest.raises(CodeSourceError, match="not valid base64"):
        from_content(text, settings=settings, base64_encoded=True)


def test_base64_round_trips() -> None:
    assert decode_base64(ENCODED) == CODE


def test_non_ascii_base64_bytes_are_a_clear_error(settings: Settings) -> None:
    with pytest.raises(CodeSourceError, match="non-ASCII"):
        from_content("é".encode(), settings=settings, base64_encoded=True)


@pytest.mark.parametrize(("content", "encoded"), [(b"", False), ("", True), ("\n", True)])
def test_empty_inline_code_is_refused(
    settings: Settings, content: bytes | str, encoded: bool
) -> None:
    with pytest.raises(CodeSourceError, match="empty"):
        from_content(content, settings=settings, base64_encoded=encoded)


def test_inline_code_over_the_limit_is_refused(settings: Settings) -> None:
    with pytest.raises(CodeSourceRefused) as refused:
        from_content(b"x" * 11, settings=settings.replace(code_max_bytes=10))
    assert refused.value.rule == "size-limit"
    assert "WM_CODE_MAX_BYTES=10" in str(refused.value)


def test_inline_pin_mismatch_and_malformed_pin(settings: Settings) -> None:
    with pytest.raises(PinMismatch, match=CODE_SHA):
        from_content(CODE, settings=settings, sha256="f" * 64)
    with pytest.raises(CodeSourceError, match="64 hexadecimal"):
        from_content(CODE, settings=settings, sha256="sha256:" + CODE_SHA)
