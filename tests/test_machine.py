"""What names the computer a CPU timing was taken on (:mod:`attnres.machine`)."""

import platform

from attnres import machine
from attnres.ops.depth_attention import cpu_kernel

X86 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7R13 Processor\nflags\t\t: fpu sse avx2\n\n"


def arm(part: str) -> str:
    """A ``/proc/cpuinfo`` of Linux on aarch64, two cores of CPU part ``part``: it names no model."""
    core = ("processor\t: {}\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd sve\nCPU implementer\t: 0x41\n"
            "CPU architecture: 8\nCPU variant\t: 0x1\nCPU part\t: {}\nCPU revision\t: 1\n\n")
    return core.format(0, part) + core.format(1, part)


def test_an_arm_cpu_is_named_by_its_implementer_and_part(monkeypatch, tmp_path):
    """Linux on aarch64 has no "model name" line: every ARM CPU was named "aarch64", so a
    finished grid copied from one ARM server to another of as many cores (Neoverse N1 to V1)
    kept the first one's step times (overhead.json's machine). Its implementer, variant, part
    and revision name it now; an x86 CPU is named by its model name, as before."""
    named = {}
    for name, text in (("n1", arm("0xd0c")), ("v1", arm("0xd40")), ("x86", X86)):
        (tmp_path / name).write_text(text)
        monkeypatch.setattr(machine, "CPUINFO", tmp_path / name)  # (read as this machine's /proc/cpuinfo)
        named[name] = machine.cpu_name()
    assert named["x86"] == "AMD EPYC 7R13 Processor"
    assert named["n1"] != named["v1"]
    assert "CPU implementer 0x41" in named["n1"] and "CPU part 0xd0c" in named["n1"], named
    assert "CPU part 0xd40" in named["v1"], named


def test_a_mac_is_named_by_its_cpus_brand_string(monkeypatch, tmp_path):
    """macOS has no /proc/cpuinfo, and platform.processor() there is "arm" (or "i386"): two
    Macs of as many cores (an M1 Pro and an M2 Pro) were one machine to compare's re-use of
    overhead.json. sysctl's machdep.cpu.brand_string names it now; where sysctl fails or
    hangs, what platform knows, as before."""
    import subprocess

    monkeypatch.setattr(machine, "CPUINFO", tmp_path / "no-cpuinfo")
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    monkeypatch.setattr(platform, "processor", lambda: "arm")
    asked = []

    def sysctl(brand):
        def run(command, **kwargs):
            asked.append((list(command), kwargs.get("timeout")))
            if isinstance(brand, Exception):
                raise brand
            return subprocess.CompletedProcess(command, 0, stdout=brand, stderr="")
        return run

    named = {}
    for name, brand in (("m1", "Apple M1 Pro\n"), ("m2", "Apple M2 Pro\n"), ("hangs", subprocess.TimeoutExpired(
            "sysctl", 2)), ("missing", FileNotFoundError("sysctl")), ("fails", subprocess.CalledProcessError(1, "x")),
            ("empty", "\n")):
        monkeypatch.setattr(subprocess, "run", sysctl(brand))
        named[name] = machine.cpu_name()
    assert named == {"m1": "Apple M1 Pro", "m2": "Apple M2 Pro", "hangs": "arm", "missing": "arm", "fails": "arm",
                     "empty": "arm"}
    assert all(command == ["sysctl", "-n", "machdep.cpu.brand_string"] and 0 < timeout <= 5
               for command, timeout in asked), asked
    monkeypatch.setattr(platform, "system", lambda: "Linux")  # (sysctl is asked on a Mac only)
    asked.clear()
    assert machine.cpu_name() == "arm" and asked == []


def test_one_reader_of_proc_cpuinfo_names_the_machine_and_keys_the_kernel(monkeypatch, tmp_path):
    """/proc/cpuinfo was read twice, by cpu_name (compare's overhead re-use) and by the CPU
    kernel's build key, each its own way. Both read machine.CPUINFO now, each keeping its own
    output: an x86 CPU's model name and its model and flags lines; an ARM CPU's implementer
    and part and its implementer, part and features lines; without the file (macOS,
    Windows) what platform knows."""
    monkeypatch.setattr(platform, "system", lambda: "Linux")  # (no Mac's sysctl for the missing file)
    monkeypatch.setattr(platform, "processor", lambda: "x86_64-cpu")
    seen = {}
    for name, text in (("x86", X86), ("arm", arm("0xd40")), ("missing", None)):
        if text is not None:
            (tmp_path / name).write_text(text)
        monkeypatch.setattr(machine, "CPUINFO", tmp_path / name)
        seen[name] = machine.cpu_name(), cpu_kernel._cpu_id()
    assert seen["x86"] == ("AMD EPYC 7R13 Processor",
                           "flags\t\t: fpu sse avx2\nmodel name\t: AMD EPYC 7R13 Processor")
    assert seen["arm"] == ("CPU implementer 0x41, CPU variant 0x1, CPU part 0xd40, CPU revision 1",
                           "CPU architecture: 8\nCPU implementer\t: 0x41\nCPU part\t: 0xd40\nCPU variant\t: 0x1\n"
                           "Features\t: fp asimd sve")
    assert seen["missing"] == ("x86_64-cpu", "x86_64-cpu")
