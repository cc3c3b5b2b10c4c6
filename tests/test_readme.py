"""The README's results table: short, one line per figure, and every figure backed by docs/results.md.

The README is the product page; ``docs/results.md`` holds the method behind each figure. A figure
edited in one and not the other is the drift this test catches: every decimal number and every
percentage or ratio in the table's "measured" column must appear in ``docs/results.md`` as written.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_README_LINES = 150
MAX_RESULT_ROWS = 20
HOST_WORDS = re.compile(r"\b(Zen ?\d|EPYC|Xeon|Sapphire Rapids)\b")
FIGURE = re.compile(r"[-+]?\d+(?:,\d{3})*(?:\.\d+)?(?=\s*(?:%|x\b))|[-+]?\d+\.\d+")


def results_rows(readme: str) -> list[list[str]]:
    """The cells of every row of the table whose header starts ``| stage | figure | measured``."""
    lines = readme.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| stage | figure | measured"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def figures(cell: str) -> list[str]:
    """The numbers a reader takes as measured: decimals, and integers given as % or x."""
    return [m.lstrip("+-") for m in FIGURE.findall(cell)]


def test_figure_extraction() -> None:
    assert figures("**1.58x** sampled, 1.37x greedy") == ["1.58", "1.37"]
    assert figures("+44.4% / +33.4% / +0.0%") == ["44.4", "33.4", "0.0"]
    assert figures("100 / 100 / 100 / 87%") == ["87"]
    assert figures("0 / 0 / 0") == []


def test_readme_is_a_product_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= MAX_README_LINES
    rows = results_rows(readme)
    assert 0 < len(rows) <= MAX_RESULT_ROWS
    hosts = [row[0] + ": " + row[2] for row in rows if HOST_WORDS.search(" ".join(row))]
    assert not hosts, f"host names belong in docs/results.md, not in table rows: {hosts}"


def test_every_readme_figure_is_in_results_md() -> None:
    results = (ROOT / "docs" / "results.md").read_text()
    missing = [
        f"{row[0]} / {row[1]}: {value}"
        for row in results_rows((ROOT / "README.md").read_text())
        for value in figures(row[2])
        if value not in results
    ]
    assert not missing, f"README figures absent from docs/results.md: {missing}"
