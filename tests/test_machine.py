"""What names the computer a CPU timing was taken on (:mod:`attnres.machine`)."""

import io

from attnres import machine

X86 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7R13 Processor\nflags\t\t: fpu sse avx2\n\n"


def arm(part: str) -> str:
    """A ``/proc/cpuinfo`` of Linux on aarch64, two cores of CPU part ``part``: it names no model."""
    core = ("processor\t: {}\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd sve\nCPU implementer\t: 0x41\n"
            "CPU architecture: 8\nCPU variant\t: 0x1\nCPU part\t: {}\nCPU revision\t: 1\n\n")
    return core.format(0, part) + core.format(1, part)


def test_an_arm_cpu_is_named_by_its_implementer_and_part(monkeypatch):
    """Linux on aarch64 has no "model name" line: every ARM CPU was named "aarch64", so a
    finished grid copied from one ARM server to another of as many cores (Neoverse N1 to V1)
    kept the first one's step times (overhead.json's machine). Its implementer, variant, part
    and revision name it now; an x86 CPU is named by its model name, as before."""
    named = {}
    for name, text in (("n1", arm("0xd0c")), ("v1", arm("0xd40")), ("x86", X86)):
        opened = []
        # (the module's open: /proc/cpuinfo read as this machine's)
        monkeypatch.setattr(machine, "open", lambda path, *a, text=text, **k: opened.append(path) or io.StringIO(text),
                            raising=False)
        named[name] = machine.cpu_name()
        assert opened == ["/proc/cpuinfo"]
    assert named["x86"] == "AMD EPYC 7R13 Processor"
    assert named["n1"] != named["v1"]
    assert "CPU implementer 0x41" in named["n1"] and "CPU part 0xd0c" in named["n1"], named
    assert "CPU part 0xd40" in named["v1"], named


def test_a_mac_is_named_by_its_cpus_brand_string(monkeypatch):
    """macOS has no /proc/cpuinfo, and platform.processor() there is "arm" (or "i386"): two
    Macs of as many cores (an M1 Pro and an M2 Pro) were one machine to compare's re-use of
    overhead.json. sysctl's machdep.cpu.brand_string names it now; where sysctl fails or
    hangs, what platform knows, as before."""
    import platform
    import subprocess

    def no_cpuinfo(path, *args, **kwargs):
        raise FileNotFoundError(path)

    monkeypatch.setattr(machine, "open", no_cpuinfo, raising=False)
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
