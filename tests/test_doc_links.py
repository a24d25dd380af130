"""Every relative link of the README and docs/ reaches a file that exists, and every
``#anchor`` one of the target's headings (GitHub's slugs) or explicit ``<a id>`` anchors: the
README's '[Performance](#performance-cpu)' pointed at a heading that had been renamed. Every
table's rows have its header's number of cells (design.md's numerical policy had a separator
row of three under a header of two). Every path of the repository a doc names in prose or code
(``src/...``, ``benchmarks/results/...``, ``attnres/...`` for ``src/attnres/...``) exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "benchmarks" / "results").glob("*/README.md"))]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors a rendered markdown text has: its headings' (a repeated one gets ``-1``,
    ``-2``, ...) and its ``<a id="...">`` elements."""
    found: set[str] = set(re.findall(r'<a id="([^"]+)"', text))
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", text), re.M):
        base = slug(heading)
        found.add(f"{base}-{seen[base]}" if base in seen else base)
        seen[base] = seen.get(base, 0) + 1
    return found


def broken_links(doc: Path) -> list[str]:
    problems = []
    for target in LINK.findall(FENCE.sub("", doc.read_text())):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path) if path else doc
        if not file.exists():
            problems.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            problems.append(f"{target}: no such anchor in {file.name}")
    return problems


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_reaches_its_file_and_anchor(doc):
    assert broken_links(doc) == []


def test_the_link_check_finds_a_missing_file_and_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# A `code` heading, with punctuation!\n## Twice\n## Twice\n<a id=\"kept\"></a>\n")
    doc = tmp_path / "doc.md"
    doc.write_text("[a](other.md#a-code-heading-with-punctuation) [b](other.md#twice-1) [c](other.md#kept) "
                   "[d](other.md#gone) [e](missing.md) [f](#here)\n# Here\n```\n[g](in-a-fence.md)\n```\n")
    assert broken_links(doc) == ["other.md#gone: no such anchor in other.md", "missing.md: no such file"]


SEPARATOR = re.compile(r"^\|(\s*:?-+:?\s*\|)+\s*$")


def cells(row: str) -> int:
    """The number of cells of a markdown table row: ``|`` outside code spans and not
    escaped separates them."""
    count, code, prev = 0, False, ""
    for ch in row.strip().strip("|"):
        if ch == "`":
            code = not code
        elif ch == "|" and not code and prev != "\\":
            count += 1
        prev = ch
    return count + 1


def misshapen_tables(text: str) -> list[str]:
    """Rows of a table whose number of cells differs from its header's (GitHub drops a
    row's extra cells, and a separator row that differs from the header unmakes the table)."""
    problems, lines = [], FENCE.sub("", text).splitlines()
    for i, line in enumerate(lines):
        if i == 0 or not SEPARATOR.match(line):
            continue
        width = cells(lines[i - 1])
        for row in [line, *_body(lines, i + 1)]:
            if cells(row) != width:
                problems.append(f"{lines[i - 1][:60]!r}: {cells(row)} cells, not {width}, in {row[:60]!r}")
    return problems


def _body(lines: list[str], start: int):
    for row in lines[start:]:
        if not row.lstrip().startswith("|"):
            return
        yield row


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_table_row_has_its_header_s_cells(doc):
    assert misshapen_tables(doc.read_text()) == []


def test_the_table_check_counts_cells_outside_code_and_escapes():
    good = "| a | `x | y` | b \\| c |\n|---|---|---|\n| 1 | 2 | 3 |\n"
    assert misshapen_tables(good) == []
    assert misshapen_tables("| a | b |\n|---|---|---|\n| 1 | 2 |\n") == [
        "'| a | b |': 3 cells, not 2, in '|---|---|---|'"]
    assert len(misshapen_tables("| a | b |\n|---|---|\n| 1 | 2 | 3 |\n")) == 1


#: A path of the repository named in a doc: one of its top folders, or the package's own
#: ``attnres/...`` (under ``src/``), not part of a longer path (``runs/x/results/...``).
REPO_PATH = re.compile(r"(?<![\w./$-])((?:src|docs|benchmarks|results|tests|configs|studies|attnres)/[\w./-]*[\w/])")
#: Paths a doc names that are not files of this version, each for a reason the doc says.
NOT_FILES = {"benchmarks/results/gpu-h200-DATE",  # kernels.md: the directory of one's own next GPU run
             "benchmarks/results/kernels_gpu",  # kernels.md: bench_kernels_gpu.py's default --out
             "attnres/kernels/cpu_merge.c"}  # training-overhead.md: the C kernel's file before 18bf88c


def missing_paths(text: str, root: Path = ROOT) -> list[str]:
    """The repository paths ``text`` names that do not exist. A path without its suffix
    (``--out DIR/stem``, ``stem.{json,md}``) is found by its stem."""
    missing = []
    for named in REPO_PATH.findall(LINK.sub("", text)):  # (links: the check above)
        path = root / ("src/" + named if named.startswith("attnres/") else named)
        if named in NOT_FILES or path.exists() or any(path.parent.glob(path.name + ".*")):
            continue
        missing.append(named)
    return missing


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_repository_path_a_doc_names_exists(doc):
    assert missing_paths(doc.read_text()) == []


def test_the_path_check_finds_a_missing_path(tmp_path):
    (tmp_path / "src" / "attnres").mkdir(parents=True)
    (tmp_path / "src" / "attnres" / "a.py").write_text("")
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "r.json").write_text("")
    text = ("`src/attnres/a.py` and attnres/a.py, `benchmarks/r.{json,md}`, --out benchmarks/r, "
            "[a link](docs/gone.md), runs/x/results/y, `src/attnres/b.py` and benchmarks/gone.json")
    assert missing_paths(text, tmp_path) == ["src/attnres/b.py", "benchmarks/gone.json"]
