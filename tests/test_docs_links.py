"""The docs hold together: every relative link in the README, the docs, the service and plugin
READMEs and the benchmarks' pages resolves; the README links every docs page and folder README;
every service folder has its README; and the README stays short enough to read in ten minutes.

A link is `[text](target)` or `![alt](target)` outside code (fenced blocks and inline code spans
are skipped, since they show markdown rather than link). Targets that leave the repository
(`http:`, `https:`, `mailto:`) are not checked. A relative target must name an existing file or
folder, taken from the linking file's own folder; a `#anchor` into a markdown file (or into the
linking file itself) must name one of its headings, slugged as GitHub slugs them: lowercased,
punctuation other than `-` and `_` dropped, each space a `-`, a repeated heading suffixed `-1`,
`-2`, ...
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) and ![alt](target); the text may hold one level of brackets (`[a [b] c](x)`).
_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]"  # the text
    r"\(\s*<?([^)\s>]+)>?(?:\s+[\"'][^)]*[\"'])?\s*\)"  # (target "optional title")
)
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_EXTERNAL = ("http://", "https://", "mailto:")


def doc_files(root: Path = ROOT) -> list[Path]:
    """The markdown files whose links are checked."""
    found = [root / "README.md"]
    found += sorted((root / "docs").rglob("*.md"))
    found += sorted(root.glob("services/*/README.md"))
    found += sorted(root.glob("benchmarks/*.md"))
    found += [
        path
        for path in (
            root / "trainer_plugin" / "README.md",
            root / "tests" / "README.md",
            root / "deploy" / "slime" / "README.md",
        )
        if path.is_file()
    ]
    return [path for path in found if path.is_file()]


def _prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks, inline code blanked."""
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, _INLINE_CODE.sub("", line)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading's text (before de-duplication)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w keeps letters, digits and `_`
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, duplicates numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else _HEADING.match(line)
        if match is None:
            continue
        slug = github_slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


@dataclass(frozen=True)
class BrokenLink:
    source: Path
    line: int
    target: str
    why: str

    def __str__(self) -> str:
        where = self.source.relative_to(ROOT) if self.source.is_relative_to(ROOT) else self.source
        return f"{where}:{self.line}: ({self.target}) {self.why}"


def broken_links(path: Path) -> list[BrokenLink]:
    """The relative links of one markdown file that do not resolve."""
    broken: list[BrokenLink] = []
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        for match in _LINK.finditer(line):
            target = match.group(1)
            if target.startswith(_EXTERNAL):
                continue
            file_part, _, anchor = target.partition("#")
            resolved = (path.parent / file_part).resolve() if file_part else path
            if not resolved.exists():
                broken.append(BrokenLink(path, number, target, "no such file"))
                continue
            if anchor and resolved.suffix == ".md" and resolved.is_file():
                if anchor not in anchors(resolved):
                    broken.append(BrokenLink(path, number, target, "no such heading"))
    return broken


def test_every_relative_link_in_the_docs_resolves() -> None:
    files = doc_files()
    assert ROOT / "README.md" in files and len(files) > 5
    broken = [str(link) for path in files for link in broken_links(path)]
    assert broken == [], "links that do not resolve:\n" + "\n".join(broken)


def readme_targets(root: Path = ROOT) -> set[Path]:
    """The files the README links to, resolved."""
    readme = root / "README.md"
    found: set[Path] = set()
    for _, line in _prose_lines(readme.read_text(encoding="utf-8")):
        for match in _LINK.finditer(line):
            target = match.group(1).partition("#")[0]
            if target and not target.startswith(_EXTERNAL):
                found.add((root / target).resolve())
    return found


def test_the_readme_links_every_docs_page_and_every_folder_readme() -> None:
    pages = sorted((ROOT / "docs").glob("*.md"))
    pages += [*sorted(ROOT.glob("services/*/README.md")), ROOT / "trainer_plugin" / "README.md"]
    pages += sorted((ROOT / "benchmarks").glob("*.md"))
    linked = readme_targets()
    missing = [str(page.relative_to(ROOT)) for page in pages if page.resolve() not in linked]
    assert missing == [], f"pages the README does not link: {missing}"


def test_every_service_folder_has_a_readme() -> None:
    folders = [
        path for path in sorted((ROOT / "services").iterdir()) if (path / "__init__.py").is_file()
    ]
    assert folders, "no service folders found"
    missing = [
        str(path.relative_to(ROOT)) for path in folders if not (path / "README.md").is_file()
    ]
    assert missing == [], f"service folders without a README.md: {missing}"


def test_the_readme_is_short() -> None:
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


def test_a_missing_file_and_a_missing_heading_are_reported(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## Its 2nd part: details\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n"
        "[fine](other.md) [fine too](other.md#its-2nd-part-details) [here](#page)\n"
        "[gone](missing.md)\n"
        "[no heading](other.md#not-there)\n"
        "`[in code](ignored.md)` and [web](https://example.invalid/x.md)\n"
        "```\n[in a block](ignored.md)\n```\n"
    )
    found = [(link.line, link.target, link.why) for link in broken_links(page)]
    assert found == [
        (3, "missing.md", "no such file"),
        (4, "other.md#not-there", "no such heading"),
    ]


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        ("7. Where the code lives, and its layers", "7-where-the-code-lives-and-its-layers"),
        ("Node image cache: `--image-disk-budget`", "node-image-cache---image-disk-budget"),
        ("In-sandbox CLI harness: `claude-code`", "in-sandbox-cli-harness-claude-code"),
        ("snake_case stays", "snake_case-stays"),
    ],
)
def test_headings_are_slugged_as_github_slugs_them(heading: str, slug: str) -> None:
    assert github_slug(heading) == slug


def test_a_repeated_heading_gets_a_numbered_anchor(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Run\n\n## Run\n\n```\n# Run (a comment in code)\n```\n")
    assert anchors(page) == {"run", "run-1"}
