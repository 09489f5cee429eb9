"""The admin API's pages, ``/docs`` (Swagger UI) and ``/redoc`` (ReDoc), with no network: a
real ``wm api`` process serves every file they load, and a real headless browser (Debian's
chromium), whose every request off this machine goes to a proxy that is not there, renders
the operations. Chromium missing is a skip locally and a failure in CI."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import httpx
import pytest

from tests.conftest import need
from tests.helpers import artefacts, free_port
from tests.test_api import start_api, stop
from wm import Settings

#: Operations every rendering must show (method, path as Swagger UI writes it).
KNOWN = [
    ("GET", "/v1/workers"),
    ("POST", "/v1/workers"),
    ("DELETE", "/v1/workers/{ref}"),
    ("PUT", "/v1/workers/{ref}/code"),
    ("POST", "/v1/deadletters/replay"),
    ("GET", "/health/live"),
]
#: The content type each kind of file the pages load must be served with.
CONTENT_TYPES = {
    ".js": ("text/javascript", "application/javascript"),
    ".css": ("text/css",),
    ".png": ("image/png",),
}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
#: Where Swagger UI came from before: a page loading it must not get it under the browser's
#: flags below (the proof that they leave the page nothing but this machine).
CDN_SCRIPT = "https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"


class _Loads(HTMLParser):
    """The addresses a page loads: each ``<script src>`` and ``<link href>``."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        wanted = {"script": "src", "link": "href"}.get(tag)
        self.found += [v for k, v in attrs if k == wanted and v]


@pytest.fixture
def api_url(pg_settings: Settings) -> Iterator[str]:
    url, process = start_api(pg_settings)
    yield url
    out = stop(process)
    assert "Traceback" not in out, out


@pytest.fixture
def chromium() -> str:
    found = shutil.which("chromium")
    if found is None:
        need("chromium", FileNotFoundError("apt-get install -y chromium"))
    assert found is not None
    return found


def _browse(chromium: str, profile: Path, url: str, *action: str) -> str:
    """Open ``url`` in headless chromium offline: every request but to 127.0.0.1 goes to a
    proxy on a port nothing listens on, so it fails. Returns what it printed."""
    command = [
        chromium,
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        f"--proxy-server=http://127.0.0.1:{free_port()}",
        "--proxy-bypass-list=127.0.0.1",
        "--virtual-time-budget=10000",
        *action,
        url,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _raw_get(url: str, path: str) -> str:
    """The status line of ``GET path`` sent as written (HTTP clients resolve ``..``)."""
    address = urlsplit(url)
    with socket.create_connection((address.hostname, address.port), timeout=30) as conn:
        conn.sendall(f"GET {path} HTTP/1.1\r\nHost: {address.netloc}\r\n\r\n".encode())
        return conn.makefile("rb").readline().decode().strip()


def _operations(dom: str) -> set[tuple[str, str]]:
    """The (method, path) of each operation block Swagger UI rendered."""
    blocks = re.findall(r'opblock-summary-method">(\w+)</span>.*?data-path="([^"]+)"', dom, re.S)
    return set(blocks)


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_the_pages_load_only_files_the_api_serves_itself_without_a_token(
    api_url: str, page: str
) -> None:
    reply = httpx.get(f"{api_url}{page}")
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/html")
    parser = _Loads()
    parser.feed(reply.text)
    assert any(a.endswith(".js") for a in parser.found), parser.found
    for address in parser.found:
        absolute = urljoin(f"{api_url}{page}", address)
        assert urlsplit(absolute).netloc == urlsplit(api_url).netloc, address
        served = httpx.get(absolute)
        assert served.status_code == 200, (address, served.status_code)
        kind = served.headers["content-type"].split(";")[0]
        assert kind in CONTENT_TYPES[Path(urlsplit(absolute).path).suffix], (address, kind)
        assert len(served.content) > 100, address
    assert "googleapis" not in reply.text and "cdn." not in reply.text


def test_the_files_route_serves_files_only(api_url: str) -> None:
    """Paths under the files' prefix need no token, so none may reach another route."""
    for escape in ("/docs/assets/../v1/workers", "/docs/assets/%2e%2e/%2e%2e/v1/workers"):
        status = _raw_get(api_url, escape)
        assert status.startswith("HTTP/1.1 404"), (escape, status)
    assert httpx.get(f"{api_url}/docs/assets/nothing.js").status_code == 404
    assert httpx.get(f"{api_url}/v1/workers").status_code == 401


def test_a_headless_browser_renders_the_operations_with_no_network(
    api_url: str, chromium: str, tmp_path: Path
) -> None:
    cdn_page = tmp_path / "cdn.html"
    cdn_page.write_text(
        f'<html><body><script src="{CDN_SCRIPT}"></script>'
        "<script>document.body.dataset.loaded = typeof SwaggerUIBundle</script></body></html>"
    )
    control = _browse(chromium, tmp_path / "p0", cdn_page.as_uri(), "--dump-dom")
    assert 'data-loaded="undefined"' in control, control[-500:]

    dom = _browse(chromium, tmp_path / "p1", f"{api_url}/docs", "--dump-dom")
    rendered = _operations(dom)
    assert set(KNOWN) <= rendered, (sorted(rendered), dom[-1000:])
    assert "WorkManager admin API" in dom

    shot = artefacts("docs") / "docs.png"
    _browse(
        chromium,
        tmp_path / "p2",
        f"{api_url}/docs",
        f"--screenshot={shot}",
        "--window-size=1280,2000",
    )
    print(f"screenshot: {shot}")
    picture = shot.read_bytes()
    assert picture.startswith(PNG_MAGIC) and len(picture) > 50_000, len(picture)

    redoc = _browse(chromium, tmp_path / "p3", f"{api_url}/redoc", "--dump-dom")
    assert redoc.count("/v1/workers/{ref}/rollback") >= 1, redoc[-1000:]
    assert "List Workers" in redoc
