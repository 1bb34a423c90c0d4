"""The documentation site: mkdocs (Material) builds docs/ with --strict, and a headless Chromium renders the start
page and the reference pages with every internal link resolving."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import pytest

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium")
needs_mkdocs = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
    reason="mkdocs and mkdocs-material missing: they are in the dev extras (pip install -e '.[dev]', scripts/setup)",
)
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium missing: scripts/setup installs Debian's chromium package"
)
ENV = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}


def build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    # Not --quiet: it hides warnings from --strict, so a broken link would pass.
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True, text=True, timeout=120, env=ENV, cwd=config.parent,
    )  # fmt: skip


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs and mkdocs-material missing: they are in the dev extras (pip install -e '.[dev]')")
    out = tmp_path_factory.mktemp("site")
    built = build(REPO / "mkdocs.yml", out)
    assert built.returncode == 0, f"mkdocs build --strict failed:\n{built.stdout}{built.stderr}"
    yield out


class Page(HTMLParser):
    """The ids, links, headings and tables of an HTML document."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.hrefs: list[str] = []
        self.h1: list[str] = []
        self.tables = 0
        self.html_class = ""
        self._in_h1 = False
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if found.get("id"):
            self.ids.add(str(found["id"]))
        if tag == "a" and found.get("href") is not None:
            self.hrefs.append(str(found["href"]))
        if tag == "html":
            self.html_class = found.get("class") or ""
        self.tables += tag == "table"
        self._in_h1 = self._in_h1 or tag == "h1"

    def handle_endtag(self, tag: str) -> None:
        if tag == "h1":
            self._in_h1 = False

    def handle_data(self, data: str) -> None:
        if self._in_h1 and data.strip():
            self.h1.append(data.strip())


def rendered(url: str, profile: Path) -> str:
    """The DOM Chromium holds once the page has loaded and its scripts have run."""
    assert CHROMIUM is not None
    result = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}", "--dump-dom", url],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0 and "<html" in result.stdout, result.stderr[-2000:]
    return result.stdout


def broken_links(page: Path, dom: Page, site: Path) -> list[str]:
    """The internal links of a page whose target file, or whose #fragment in it, does not exist in the site."""
    base = page.as_uri()
    broken = []
    for href in dom.hrefs:
        target = urlsplit(urljoin(base, href))
        if target.scheme != "file":
            continue  # external: not checked here
        path = Path(unquote(target.path))
        if path.is_dir():
            path /= "index.html"
        if site not in path.parents or not path.is_file():
            broken.append(f"{href}: no file {path}")
            continue
        if target.fragment:
            ids = dom.ids if path == page else Page(path.read_text()).ids
            if unquote(target.fragment) not in ids:
                broken.append(f"{href}: no id {target.fragment!r} in {path.name}")
    return broken


@needs_mkdocs
def test_a_broken_link_fails_the_strict_build(tmp_path: Path) -> None:
    """The strict build refuses a page linking to a page or an anchor that does not exist."""
    docs = tmp_path / "docs"
    shutil.copytree(REPO / "docs", docs)
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    start = docs / "index.md"
    start.write_text(
        start.read_text() + "\n[gone](no-such-page.md) and [nowhere](reference/configuration.md#no-such-key)\n"
    )
    built = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert built.returncode != 0
    assert "no-such-page.md" in built.stderr and "no-such-key" in built.stderr, built.stderr


@needs_chromium
@pytest.mark.parametrize(
    ("page", "expected"),
    [
        ("index.html", ("nodeguard", 1, ["Getting started", "Configuration reference"])),
        ("reference/configuration.html", ("Configuration reference", 15, ["tickSeconds", "protected_cpu_stall"])),
        ("reference/commands.html", ("Commands", 20, ["--semaphore", "--if-unavailable"])),
        ("reference/events.html", ("Kubernetes Events", 2, ["NodeguardThrottled", "NodeguardWeightLowered"])),
    ],
)
def test_chromium_renders_the_page_and_its_internal_links_resolve(
    site: Path, tmp_path: Path, page: str, expected: tuple[str, int, list[str]]
) -> None:
    """In headless Chromium the page loads with the theme's scripts run, shows its title, tables and key terms,
    and every internal link in the rendered DOM points at a page and anchor the built site has."""
    title, min_tables, must_show = expected
    path = site / page
    text = rendered(path.as_uri(), tmp_path / "chromium")
    dom = Page(text)
    classes = dom.html_class.split()
    assert "js" in classes and "no-js" not in classes, f"the theme's scripts did not run: <html class={classes}>"
    assert title in dom.h1, dom.h1
    assert dom.tables >= min_tables
    for term in must_show:
        assert term in text
    internal = [h for h in dom.hrefs if urlsplit(urljoin(path.as_uri(), h)).scheme == "file"]
    assert len(internal) >= 10, internal
    assert broken_links(path, dom, site) == []
