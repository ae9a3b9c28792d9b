"""The README is the newcomer's index: it links every page in docs/, and every relative link in
it (and in docs/install.md, the page it sends a cluster's installer to) names a file that
exists."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.builders import ROOT

LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def relative_links(path: Path) -> list[str]:
    return [t for t in LINK.findall(path.read_text()) if "://" not in t]


def test_the_readme_links_every_page_in_docs() -> None:
    linked = {(ROOT / t).resolve() for t in relative_links(ROOT / "README.md")}
    pages = sorted(p.resolve() for p in (ROOT / "docs").iterdir() if p.is_file())
    assert [p.name for p in pages if p not in linked] == []


def test_every_relative_link_of_the_readme_and_the_install_page_exists() -> None:
    for page in (ROOT / "README.md", ROOT / "docs" / "install.md"):
        missing = [t for t in relative_links(page) if not (page.parent / t).exists()]
        assert missing == [], page.name


def test_the_readme_points_nowhere_outside_the_repository() -> None:
    for target in relative_links(ROOT / "README.md"):
        assert (ROOT / target).resolve().is_relative_to(ROOT), target
