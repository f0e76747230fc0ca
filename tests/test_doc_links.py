"""Every file README.md and docs/*.md point to exists: relative Markdown links (``[text](path#anchor)``)
repository paths quoted in backticks (```scripts/demo```, ```tests/helpers/waiting.py```) and Markdown files
named in prose, so a doc cannot cite a file that was renamed, removed or never added."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A quoted path inside the repository: a top-level directory of ours, then plain path characters only
# (no placeholders such as <room> or NAME, no globs).
_QUOTED_PATH = re.compile(
    r"`((?:docs|scripts|tests|benchmarks|kvnet|relay|proto|publisher|subscriber)/[A-Za-z0-9_./-]*[A-Za-z0-9_])`"
)

_MARKDOWN_NAME = re.compile(r"(?<![\w/.-])([A-Za-z][\w-]*\.md)\b")


def _targets(doc: Path) -> list[tuple[str, Path]]:
    text = doc.read_text(encoding="utf-8")
    found: list[tuple[str, Path]] = []
    for link in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link) or link.startswith("#"):
            continue  # a URL (https:, mailto:) or an anchor within the page
        found.append((link, (doc.parent / link.split("#", 1)[0]).resolve()))
    found.extend((quoted, REPO / quoted) for quoted in _QUOTED_PATH.findall(text))
    # A Markdown file named in prose ("see DESIGN.md"): next to the doc, at the top or in docs/.
    prose = re.sub(r"`[^`]*`|\]\([^)]*\)", " ", text)  # not code (output files) nor link targets
    for name in sorted(set(_MARKDOWN_NAME.findall(prose))):
        places = [doc.parent / name, REPO / name, REPO / "docs" / name]
        found.append((name, next((p for p in places if p.exists()), places[0])))
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: doc.relative_to(REPO).as_posix())
def test_every_file_a_doc_links_exists(doc: Path) -> None:
    missing = [link for link, path in _targets(doc) if not path.exists()]
    assert not missing, f"{doc.relative_to(REPO)} points to files that do not exist: {missing}"


def test_the_checker_sees_links_and_quoted_paths(tmp_path: Path) -> None:
    doc = tmp_path / "page.md"
    doc.write_text("see [a](other.md#part), [web](https://x.org), [here](#top), `scripts/demo`, DESIGN.md\n")
    assert [link for link, _ in _targets(doc)] == ["other.md#part", "scripts/demo", "DESIGN.md"]
