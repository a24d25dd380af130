"""Every citation of the report in the README, docs/ and the package's docstrings names a part
the report has: a section (``report §4.2``), a figure, a table, an equation or an appendix.
The report's own numbering is written out below (its table of contents, Figures 1-9, Tables
1-5, Eqs. 1-17, Appendices A-B): the report's text is not part of the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "src").rglob("*.py"))]

SECTIONS = {"1", "2", "2.1", "3", "3.1", "3.2", "4", "4.1", "4.2", "5", "5.1", "5.2", "5.3", "5.4", "5.4.1",
            "5.4.2", "6", "6.1", "6.2", "7"}
NUMBERED = {"Fig": range(1, 10), "Table": range(1, 6), "Eq": range(1, 18)}
APPENDICES = {"A", "B"}
CITATION = re.compile(r"§ ?(\d+(?:\.\d+)*)|\b(Fig|Table|Eq)(?:ure|\.)?[- ]?(\d+)\b|\bAppendix ([A-Z])\b")


def unknown_citations(text: str) -> list[str]:
    """The citations of ``text`` that name no part of the report."""
    unknown = []
    for match in CITATION.finditer(text):
        section, kind, number, appendix = match.groups()
        known = (section in SECTIONS if section else int(number) in NUMBERED[kind] if kind
                 else appendix in APPENDICES)
        if not known:
            unknown.append(match.group(0))
    return unknown


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_report_citation_names_a_part_the_report_has(path):
    assert unknown_citations(path.read_text()) == []


def test_the_citation_check_finds_a_part_the_report_lacks():
    text = ("report §4.2 and §5.4.2, Fig. 9, the Fig.-6 sweep, Figure 4, Table 2, Table-4, Eq. 10, Appendix B; "
            "report §4.3, Fig. 10, Table 6, Eq. 18, Appendix C")
    assert unknown_citations(text) == ["§4.3", "Fig. 10", "Table 6", "Eq. 18", "Appendix C"]
