"""docs/architecture.md's module map names every module of the product packages, and only those: a
module added, moved or removed without its line in the map fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("pipeline", "events", "storage")
HEADING = "## Module map"
#: A map line: "- `pipeline/index/plan.py` — what it is".
ENTRY = re.compile(r"^\s*[-*] `(?P<path>[\w/]+\.py)`")


def mapped(text: str) -> list[str]:
    """The module paths listed under the module map heading (up to the next ``## `` heading)."""
    start = text.index(HEADING)
    end = text.find("\n## ", start + len(HEADING))
    section = text[start : end if end != -1 else len(text)]
    return [m["path"] for line in section.splitlines() if (m := ENTRY.match(line))]


def modules(root: Path) -> list[str]:
    return sorted(
        str(p.relative_to(root))
        for package in PACKAGES
        for p in (root / package).rglob("*.py")
        if p.name != "__init__.py"
    )


def test_the_module_map_names_every_module_once_and_nothing_else() -> None:
    listed = mapped(DOC.read_text())
    repeated = sorted({p for p in listed if listed.count(p) > 1})
    assert repeated == [], f"listed more than once in the module map: {repeated}"
    missing = sorted(set(modules(ROOT)) - set(listed))
    stale = sorted(set(listed) - set(modules(ROOT)))
    assert missing == [], f"modules without a line in docs/architecture.md's module map: {missing}"
    assert stale == [], f"the module map lists modules that don't exist: {stale}"


def test_the_map_reader_sees_only_its_section() -> None:
    text = "# t\n## Module map\n- `pipeline/a.py` — a\n  - `pipeline/b/c.py` — c\n## Next\n- `pipeline/d.py` — d\n"
    assert mapped(text) == ["pipeline/a.py", "pipeline/b/c.py"]
