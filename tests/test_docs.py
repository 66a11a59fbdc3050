"""The documentation stays true to the code: the stabilizer tables list the registry, every anchor a
docstring points to exists, and nothing in the package refers to files outside the repository."""
import re

import pytest

from stability.docs import ROOT, TABLES, synced


@pytest.mark.parametrize("name", sorted(TABLES))
def test_methods_tables_list_every_registered_stabilizer(name):
    text = (ROOT / name).read_text()
    assert synced(text, TABLES[name]) == text, f"{name} is out of date: run python -m stability.docs"


def headings_anchors(markdown: str) -> set[str]:
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", markdown, re.M):
        anchor = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchors.add(anchor)
    return anchors


def test_every_docs_anchor_in_the_package_exists():
    anchors = headings_anchors((ROOT / "docs" / "methods.md").read_text())
    for path in (ROOT / "stability").rglob("*.py"):
        for anchor in re.findall(r"docs/methods\.md#([\w-]+)", path.read_text()):
            where = path.relative_to(ROOT)
            assert anchor in anchors, f"{where} points to docs/methods.md#{anchor}, which is no heading"


def test_nothing_in_the_package_points_outside_the_repository():
    for path in [*(ROOT / "stability").rglob("*.py"), ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        text = path.read_text()
        assert "METHODS.md" not in text and "../shared" not in text, path
