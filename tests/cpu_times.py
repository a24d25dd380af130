"""``--cpu-times=DIR``: the CPU seconds each test spent, and where the suite's go.

CI runs on two cores kept busy by both suites, so its wall time follows the CPU seconds the
tests spend, not their ``--durations`` (wall time under load, which waits on the other
worker and the serving suite: two to three times the CPU time, unevenly). With this option
every process of the run appends, per test, the CPU seconds of its own (user + system) and of
the processes the test started and waited for (subprocesses, spawned ranks, compilers) to
``DIR/<worker>.jsonl``; at the end the run prints the tests and modules that spent the most.
A module's shared fixtures count in the test that first asks for them; a process killed
rather than waited for (a vLLM engine's) counts nowhere.

    make test PYTEST_ARGS=--cpu-times=/tmp/cpu-times
"""

from __future__ import annotations

import json
import os
import resource
from collections import defaultdict
from pathlib import Path

import pytest

#: How many tests and modules the summary lists.
SHOWN = 25


def pytest_addoption(parser):
    parser.addoption("--cpu-times", metavar="DIR", default=None,
                     help="write each test's CPU seconds (its own and its subprocesses') to DIR/<worker>.jsonl "
                          "and list the tests and modules that spent the most (tests/cpu_times.py)")


def _worker() -> str:
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


def pytest_configure(config):
    folder = config.getoption("--cpu-times")
    if folder and _worker() == "main":  # (the controller, or a run without workers: a fresh record)
        Path(folder).mkdir(parents=True, exist_ok=True)
        for old in Path(folder).glob("*.jsonl"):
            old.unlink()


def _cpu_seconds() -> tuple[float, float]:
    own, waited = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, waited.ru_utime + waited.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    folder = item.config.getoption("--cpu-times")
    if not folder:
        yield
        return
    own, waited = _cpu_seconds()
    yield
    own_after, waited_after = _cpu_seconds()
    with open(Path(folder) / f"{_worker()}.jsonl", "a") as out:
        out.write(json.dumps({"test": item.nodeid, "own": round(own_after - own, 3),
                              "subprocesses": round(waited_after - waited, 3)}) + "\n")


def read_cpu_times(folder: Path) -> list[dict]:
    """Every test's record in ``folder`` (all workers')."""
    return [json.loads(line) for path in sorted(folder.glob("*.jsonl")) for line in path.read_text().splitlines()]


def pytest_terminal_summary(terminalreporter, config):
    folder = config.getoption("--cpu-times")
    if not folder or _worker() != "main":
        return
    records = read_cpu_times(Path(folder))
    write = terminalreporter.write_line
    total = sum(r["own"] + r["subprocesses"] for r in records)
    terminalreporter.section(f"CPU seconds: {total:.0f} in {len(records)} tests (own + subprocesses; {folder})")
    modules: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in records:
        module = modules[r["test"].split("::")[0]]
        module[0] += r["own"]
        module[1] += r["subprocesses"]

    def table(label: str, rows: list[tuple[str, float, float]]) -> None:
        write(f"{'CPU s':>8} {'own':>8} {'subproc':>8}  {label}")
        for name, own, sub in sorted(rows, key=lambda row: -(row[1] + row[2]))[:SHOWN]:
            write(f"{own + sub:8.1f} {own:8.1f} {sub:8.1f}  {name}")

    table("module", [(name, own, sub) for name, (own, sub) in modules.items()])
    table("test", [(r["test"], r["own"], r["subprocesses"]) for r in records])
