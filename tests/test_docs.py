"""The docs a newcomer reads: every option they name exists, the option table is complete, every page is
reachable, and the pages stay short enough to read (issue 58)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from embodied.config import config_groups
from tests.conftest import REPO

DOCS = sorted((REPO / "docs").rglob("*.md"))
PAGES = [REPO / "README.md", *DOCS]
# `env=maniskill_pickcube` and the like; not `env=1` (placement counts) nor `env=libero_<suite>` (a pattern)
OPTION = re.compile(r"(?<![\w.])(env|policy|algorithm)=([A-Za-z][\w]*)(?![\w<*])")
LINK = re.compile(r"\]\(([\w./-]+)[)#]")  # a relative link: [text](path) or [text](path#anchor)


def _named_options(page: Path) -> list[tuple[str, str]]:
    """The ``group=option`` a page names, leaving out lines a command printed (``note: policy=<family> ...``)."""
    lines = [line for line in page.read_text().splitlines() if not line.startswith("note:")]
    return [m.groups() for m in OPTION.finditer("\n".join(lines))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_group_option_a_page_names_exists(page):
    groups = config_groups()
    missing = sorted({f"{g}={o}" for g, o in _named_options(page) if o not in groups[g]})
    assert not missing, f"{page.relative_to(REPO)} names options configs/ does not have: {missing}"


def test_the_option_table_lists_every_group_option():
    table = (REPO / "docs/config.md").read_text()
    unlisted = sorted(f"{g}={o}" for g, options in config_groups().items() for o in options if f"`{o}`" not in table)
    assert not unlisted, f"docs/config.md's option tables leave out {unlisted}"


def test_every_docs_page_is_linked_from_the_readme_or_another_page():
    linked = {(page.parent / target).resolve() for page in PAGES for target in LINK.findall(page.read_text())}
    assert [str(p.relative_to(REPO)) for p in DOCS if p.resolve() not in linked] == []


def test_every_relative_link_points_at_a_file():
    broken = [f"{page.relative_to(REPO)} -> {target}" for page in PAGES for target in LINK.findall(page.read_text())
              if not (page.parent / target).exists()]
    assert broken == []


def test_the_front_pages_stay_short():
    """README: what the project is, two commands, results, commands, where next; the rest is in docs/."""
    sizes = {"README.md": 12_000, "docs/architecture.md": 15_000}
    assert {name: (REPO / name).stat().st_size for name in sizes if (REPO / name).stat().st_size > sizes[name]} == {}
    results = {str(p.relative_to(REPO)): p.stat().st_size for p in (REPO / "docs/results").rglob("*.md")}
    assert {name: size for name, size in results.items() if size > 15_000} == {}
