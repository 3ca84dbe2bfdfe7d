"""README's headline figures stay those of docs/BENCHMARKS.md, and BENCHMARKS stays a page.

README's headline table (the first table, above its first `##` section) quotes figures whose
date, commit, machine and command live in docs/BENCHMARKS.md. A figure edited in one and not
the other is caught here: every number in the table's "figure" and "against" columns must
appear in BENCHMARKS.md exactly as written ("8,674", "2.77"), not inside a longer number.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BENCHMARKS = ROOT / "docs" / "BENCHMARKS.md"
MAX_LINES = 300

NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
LINK = re.compile(r"\]\(docs/BENCHMARKS\.md(?:#([\w-]+))?\)")


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def headline_table() -> list[dict[str, str]]:
    """README's first table before its first `##` heading, as one dict per row."""
    head = README.read_text(encoding="utf-8").split("\n## ", 1)[0]
    lines = [line for line in head.splitlines() if line.startswith("|")]
    assert len(lines) >= 3, "README has no headline table above its first section"
    header = _cells(lines[0])
    return [dict(zip(header, _cells(line))) for line in lines[2:]]


def figures(row: dict[str, str]) -> list[str]:
    """The numbers a row quotes, as written (thousands separators kept, a trailing comma not)."""
    text = " ".join(row.get(column, "") for column in ("figure", "against"))
    return [n.rstrip(",") for n in NUMBER.findall(text)]


def appears(number: str, text: str) -> bool:
    """`number` occurs in `text` on its own: not as part of 12.77 or 2.775 or 8,6745."""
    return re.search(rf"(?<![\d.,]){re.escape(number)}(?!\d|[.,]\d)", text) is not None


def anchor(heading: str) -> str:
    """GitHub's anchor for a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_headline_figure_is_in_benchmarks() -> None:
    rows = headline_table()
    benchmarks = BENCHMARKS.read_text(encoding="utf-8")
    quoted = [(row["measure"], n) for row in rows for n in figures(row)]
    assert len(quoted) >= len(rows), rows  # every row quotes at least one figure
    missing = [(measure, n) for measure, n in quoted if not appears(n, benchmarks)]
    assert not missing, f"README headline figures not in docs/BENCHMARKS.md: {missing}"


def test_headline_links_reach_benchmarks_sections() -> None:
    readme = README.read_text(encoding="utf-8").split("\n## ", 1)[0]
    headings = {
        anchor(line.lstrip("#"))
        for line in BENCHMARKS.read_text(encoding="utf-8").splitlines()
        if line.startswith("## ")
    }
    targets = [m.group(1) for m in LINK.finditer(readme) if m.group(1)]
    assert len(targets) >= len(headline_table()), "each headline row links to its section"
    assert set(targets) <= headings, set(targets) - headings


def test_benchmarks_is_a_page() -> None:
    lines = BENCHMARKS.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_LINES, f"docs/BENCHMARKS.md has {len(lines)} lines"


def test_a_number_inside_a_longer_one_does_not_count() -> None:
    assert appears("2.77", "TPOT **2.77 ms**")
    assert appears("8,674", "| **8,674** |")
    assert not appears("2.77", "12.77 ms")
    assert not appears("2.77", "2.775 ms")
    assert not appears("8,674", "18,674")
    assert figures({"figure": "8,674 tok/s, TTFT 216 ms", "against": "1.02x"}) == [
        "8,674",
        "216",
        "1.02",
    ]
