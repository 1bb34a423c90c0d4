"""The README is the front door: the two commands first, short, every link resolving, and the writer's allow-list
stated as the code has it wherever the docs list it."""

from __future__ import annotations

import re
from pathlib import Path

from markdown.extensions.toc import slugify

from nodeguard.actuators.cgroup_writer import writable_files

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
QUICK_START = [
    "scripts/nodeguard demo         # set up, then watch nodeguard protect a workload from burners on this machine (~30 s)",
    "scripts/test                   # set up, then run the whole test suite",
]
MAX_LINES = 250  # issue 25: a front door of about 150-250 lines; the manual lives in docs/
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
NUMBERS = {"six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12}


def code_blocks(text: str) -> list[list[str]]:
    blocks: list[list[str]] = []
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def anchors(markdown: str) -> set[str]:
    """The ids mkdocs gives the headings of a page (the toc extension's slugify), outside code blocks."""
    found: set[str] = set()
    fenced = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (match := re.match(r"#{1,6}\s+(.*?)\s*$", line)):
            text = re.sub(r"[`*]", "", match.group(1))
            found.add(slugify(text, "-"))
    return found


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.is_file():
            broken.append(f"{target}: no file {resolved}")
        elif anchor and anchor not in anchors(resolved.read_text(encoding="utf-8")):
            broken.append(f"{target}: no heading with id {anchor!r} in {resolved.name}")
    return broken


def test_the_two_commands_come_first() -> None:
    """The README's first code block is the two commands, exactly: the demo and the whole suite (what .ci/run calls)."""
    blocks = code_blocks(README.read_text(encoding="utf-8"))
    assert blocks and blocks[0] == QUICK_START, blocks[:1]


def test_the_readme_is_a_front_door_not_the_manual() -> None:
    """The README stays short: reference, rationale and figures belong in docs/."""
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"README.md has {lines} lines (at most {MAX_LINES}): move the detail into docs/"


def test_every_readme_link_resolves() -> None:
    """Each relative link of the README names a file of the repository, and each anchor a heading of that file."""
    assert broken_links(README) == []


def test_link_check_can_fail(tmp_path: Path) -> None:
    """A missing file and a missing heading are both reported."""
    (tmp_path / "a.md").write_text("# Title\n\n## A section\n")
    page = tmp_path / "README.md"
    page.write_text("[ok](a.md#a-section) [no file](b.md) [no heading](a.md#nowhere) [web](https://example.org)\n")
    assert [b.split(":")[0] for b in broken_links(page)] == ["b.md", "a.md#nowhere"]


def test_the_writers_allow_list_is_stated_as_the_code_has_it() -> None:
    """Where the README and the docs list the single writer's files, they list exactly what it accepts."""
    files = writable_files()
    for page in (README, REPO / "docs/reference/safety.md", REPO / "docs/protect.md"):
        text = re.sub(r"\s+", " ", page.read_text(encoding="utf-8"))
        listed = re.search(r"allow-list (.*?)(?:refuses any path|it refuses)", text)
        assert listed, f"{page.name}: no allow-list sentence"
        named = set(re.findall(r"`((?:cpu|cgroup|memory)\.[a-z_]+)`", listed.group(1)))
        assert named == files, f"{page.name}: lists {sorted(named)}, the writer accepts {sorted(files)}"
        count = re.search(r"\b(" + "|".join(NUMBERS) + r") files\b", listed.group(1))
        if count:
            assert NUMBERS[count.group(1)] == len(files), f"{page.name}: says {count.group(1)} files"
