"""``--cpu-times`` (tests/cpu_times.py): each test's CPU seconds, its own and its subprocesses',
and the summary of where they went."""

from __future__ import annotations

import textwrap

import pytest

from cpu_times import read_cpu_times

#: A quarter of a CPU second of this process's, whatever the CPU's speed: a fixed amount of work
#: (3 million squares: 0.22 s on the project's machine) took under the 0.1 s asserted below on
#: a CPU a little over twice as fast.
BURN = "import time; t = time.process_time()\nwhile time.process_time() - t < 0.25: pass"


def test_each_test_records_its_own_and_its_subprocesses_cpu_seconds(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # (the inner run is a run of its own)
    (tmp_path / "test_probe.py").write_text(textwrap.dedent(f"""
        import subprocess, sys

        def test_idle():
            pass

        def test_burns_here():
            exec({BURN!r})

        def test_burns_in_a_subprocess():
            subprocess.run([sys.executable, "-c", {BURN!r}], check=True)
    """))
    folder = tmp_path / "cpu"
    folder.mkdir()
    (folder / "stale.jsonl").write_text('{"test": "an earlier run", "own": 99, "subprocesses": 0}\n')
    assert pytest.main([str(tmp_path / "test_probe.py"), "-q", "-p", "no:cacheprovider", "-p", "cpu_times",
                        f"--cpu-times={folder}"]) == 0
    records = {r["test"].split("::")[1]: r for r in read_cpu_times(folder)}
    assert set(records) == {"test_idle", "test_burns_here", "test_burns_in_a_subprocess"}  # (the stale record gone)
    here, there, idle = records["test_burns_here"], records["test_burns_in_a_subprocess"], records["test_idle"]
    assert here["own"] > 0.1 and here["subprocesses"] == 0
    assert there["subprocesses"] > 0.1 and there["own"] < there["subprocesses"]
    assert idle["own"] < 0.05 and idle["subprocesses"] == 0
    out = capsys.readouterr().out
    assert "CPU seconds:" in out and "in 3 tests" in out
    listed = [line.split()[-1].split("::")[-1] for line in out.splitlines() if "test_probe.py::" in line]
    assert listed[0] in ("test_burns_here", "test_burns_in_a_subprocess") and listed[-1] == "test_idle"
