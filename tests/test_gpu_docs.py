"""The GPU figures the docs quote say which card and which commit measured them, and that the
current kernels' are still to be measured: the committed GPU runs (benchmarks/results/gpu-*/)
measured earlier kernels, and docs/kernels.md said "with the kernels above" of the H200's
numbers, above a table of kernels that run had never seen."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "docs" / "kernels.md"
STILL_TO_MEASURE = "the current kernels' GPU figures are still to be measured"


def section(text: str, heading: str) -> str:
    """The text under ``heading`` up to the next heading of its level or above."""
    level = heading.split(" ", 1)[0]
    body = text.split(f"\n{heading}\n", 1)[1]
    return re.split(rf"\n#{{1,{len(level)}}} ", body, maxsplit=1)[0]


def unqualified_gpu_docs(texts: dict[str, str], commits: dict[str, str]) -> list[str]:
    """The docs of ``texts`` that do not say the current kernels' GPU figures are still to be
    measured, and each GPU run (card: commit) whose commit none of them names."""
    flat = {name: " ".join(text.split()) for name, text in texts.items()}
    problems = [name for name, text in flat.items() if STILL_TO_MEASURE not in text]
    return problems + [f"{card}: {commit}" for card, commit in commits.items()
                       if not any(commit in text for text in flat.values())]


def run_commits() -> dict[str, str]:
    """Each committed GPU run's card and the commit its README says the code was at."""
    found = {}
    for readme in sorted((ROOT / "benchmarks" / "results").glob("gpu-*/README.md")):
        found[readme.parent.name] = re.search(r"\bat `?([0-9a-f]{7})\b", readme.read_text()).group(1)
    return found


def test_the_gpu_docs_name_each_run_s_commit_and_that_today_s_kernels_are_unmeasured():
    kernels = KERNELS.read_text()
    texts = {"kernels.md: The prepared GPU check": section(kernels, "## The prepared GPU check"),
             "kernels.md: GPU benchmark": section(kernels, "## GPU benchmark"),
             "performance.md": (ROOT / "docs" / "performance.md").read_text()}
    assert run_commits() == {"gpu-h100": "ef83901", "gpu-h200": "94ed36a"}
    assert unqualified_gpu_docs(texts, run_commits()) == []


def test_the_check_finds_a_doc_that_reads_as_today_s_kernels_measured():
    texts = {"a": "measured at `94ed36a`; the current kernels' GPU\nfigures are still to be measured",
             "b": "With the kernels above (one H200): training 1.158x"}
    assert unqualified_gpu_docs(texts, {"gpu-h200": "94ed36a", "gpu-h100": "ef83901"}) == ["b", "gpu-h100: ef83901"]
