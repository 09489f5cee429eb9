"""The documentation site (docs/, mkdocs.yml): it builds with ``mkdocs build --strict``, offline,
and a broken link or anchor fails that build; no page loads anything from the internet; the
HTTP reference is the API's own description; the README is a short front page whose links
resolve; what the code and the container files point at in the docs exists."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, doc, doc_pages
from wm.ops import apireference

#: The README stays a front page (issue 29): what it is, the two commands, a tour, links.
README_MAX_LINES = 300
#: Longest a build may take: a guard against hangs, not a timing test (it takes about 1 s).
BUILD_GUARD_S = 120
#: An element that makes a browser fetch: a script, a style sheet, an image or a frame.
FETCHING = re.compile(
    r"<(?:script|link|img|iframe|source)\b[^>]*\b(?:src|href)=[\"']((?:https?:)?//[^\"']+)",
    re.IGNORECASE,
)
#: A style sheet's fetch: an import or a url() that is not the site's own.
CSS_FETCHING = re.compile(r"@import|url\(\s*[\"']?(?:https?:)?//", re.IGNORECASE)


def build(project: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """``mkdocs build --strict`` of the project at ``project`` into ``site``, offline: no
    proxy reaches anything, so a build that needed the network would fail here."""
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env |= {"NO_MKDOCS_2_WARNING": "1", "HTTPS_PROXY": "http://127.0.0.1:9", "NO_PROXY": ""}
    env["HTTP_PROXY"] = env["HTTPS_PROXY"]
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)]
    return subprocess.run(
        command,
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_GUARD_S,
        check=False,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site built from the work tree, once for the module."""
    into = tmp_path_factory.mktemp("site")
    started = time.monotonic()
    done = build(ROOT, into)
    took = time.monotonic() - started
    assert done.returncode == 0, done.stdout + done.stderr
    print(f"mkdocs build --strict took {took:.1f} s")
    return into


def project_copy(tmp_path: Path) -> Path:
    """A copy of mkdocs.yml and docs/, to break on purpose."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    return tmp_path


def test_the_site_builds_strictly_with_every_page(site: Path) -> None:
    built = {p.relative_to(site).with_suffix(".md") for p in site.rglob("*.html")}
    pages = {p.relative_to(ROOT / "docs") for p in (ROOT / "docs").rglob("*.md")}
    assert pages <= built, pages - built
    assert (site / "search" / "search_index.json").exists()  # search works without a server


@pytest.mark.parametrize(
    ("link", "named"),
    [
        ("[a page](guides/no-such-page.md)", "guides/no-such-page.md"),
        ("[an anchor](guides/tenants.md#no-such-part)", "#no-such-part"),
        ("[an anchor here](#nowhere)", "#nowhere"),
    ],
)
def test_a_broken_link_fails_the_build(tmp_path: Path, link: str, named: str) -> None:
    project = project_copy(tmp_path / "project")
    index = project / "docs" / "index.md"
    index.write_text(index.read_text() + f"\nSee {link}.\n")
    done = build(project, tmp_path / "site")
    assert done.returncode != 0, done.stdout + done.stderr
    assert named in done.stderr, done.stderr


def test_a_page_left_out_of_the_nav_fails_the_build(tmp_path: Path) -> None:
    project = project_copy(tmp_path / "project")
    (project / "docs" / "orphan.md").write_text("# Orphan\n\nNo link leads here.\n")
    done = build(project, tmp_path / "site")
    assert done.returncode != 0 and "orphan.md" in done.stderr, done.stderr


def test_no_page_loads_anything_from_the_internet(site: Path) -> None:
    """No font, script, style or image from a CDN: the site reads offline. Links a reader
    may follow (``<a href>``) are not fetches."""
    fetched = {
        f"{page.relative_to(site)}: {url}"
        for page in site.rglob("*.html")
        for url in FETCHING.findall(page.read_text(encoding="utf-8"))
    }
    assert not fetched, sorted(fetched)[:10]
    styles = [p for p in site.rglob("*.css") if CSS_FETCHING.search(p.read_text("utf-8"))]
    assert not styles, styles
    assert FETCHING.findall('<script src="https://unpkg.com/x"></script>')  # it can find one


def test_the_http_reference_is_the_api() -> None:
    """After a change to the API, ``python -m wm.ops.apireference`` renders it anew."""
    page = doc(apireference.PAGE)
    assert apireference.BEGIN in page
    assert apireference.replace(page) == page
    for path, operations in apireference.openapi()["paths"].items():
        for method in operations:
            assert f"### `{method.upper()} {path}`" in page


def test_the_readme_is_a_front_page_whose_links_resolve() -> None:
    readme = doc("README.md")
    assert len(readme.splitlines()) <= README_MAX_LINES
    assert "mkdocs serve" in readme and "mkdocs build --strict" in readme
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if not re.match(r"[a-z]+:", link)]
    assert any(link.startswith("docs/") for link in local)
    assert all((ROOT / link).exists() for link in local), [
        link for link in local if not (ROOT / link).exists()
    ]


def test_the_readme_tour_is_the_getting_started_one() -> None:
    def commands(text: str) -> list[str]:
        tour = text.split("## A 5-minute tour\n", 1)[1].split("\n## ", 1)[0]
        return re.findall(r"```bash\n(.*?)```", tour, re.DOTALL)

    assert commands(doc("README.md"))
    assert commands(doc("README.md")) == commands(doc("docs/getting-started.md"))


def _referenced() -> list[tuple[str, str, str]]:
    """(file, page, part) for each ``docs/….md "Part"`` named in the code and the container
    files (the part may be empty)."""
    files = [ROOT / "docker-compose.yml", ROOT / "Dockerfile", ROOT / "scripts" / "test"]
    files += [*ROOT.glob("wm/**/*.py"), *ROOT.glob("engines/**/*.py"), *ROOT.glob("tests/*.py")]
    found = []
    for path in files:
        text = re.sub(r"\n\s*(?:#|//)?\s*", " ", path.read_text(encoding="utf-8"))
        for page, part in re.findall(r"(docs/[\w/.-]+?\.md)(?:,?\s+\(?\"([^\"]+)\")?", text):
            found.append((str(path.relative_to(ROOT)), page, part))
    return found


def test_what_the_code_points_at_in_the_docs_exists() -> None:
    """Issue 29: docker-compose.yml pointed at a README section that did not exist."""
    found = _referenced()
    assert ("docker-compose.yml", "docs/guides/nodes.md", "Nodes and cores") in found
    for source, page, part in found:
        assert (ROOT / page).exists(), f"{source} names {page}, which does not exist"
        if part:
            text = doc(page)
            heading = re.search(rf"^#+ {re.escape(part)}", text, re.MULTILINE)
            assert heading or f"**{part}" in text, f"{source} names {page} {part!r}: not found"


def test_every_page_of_the_docs_is_read_by_the_doc_helpers() -> None:
    pages = doc_pages()
    assert pages[0] == ROOT / "README.md"
    assert ROOT / "docs" / "reference" / "configuration.md" in pages
