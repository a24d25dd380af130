"""The ``python`` blocks of docs/*.md that a reader copies, run as written where they take
seconds on a CPU, and what the text around them says they give.

Covered elsewhere: the README's blocks and docs/inference.md's and docs/upcycling.md's
(``tests/test_readme.py``), the torchrun examples of docs/distributed.md and
docs/distributed-pipeline.md (``run_doc_example`` in ``tests/test_sequence_parallel.py`` and
``tests/test_pipeline.py``). Left out: blocks that need vLLM (docs/serving.md:
``tests/serve``), a GPU or the network (docs/hf.md's lm_eval examples, whose prefix token is
checked below), and docs/design.md's first block, the transformer loop written with an
unnamed ``sublayer_l``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")


def doc_blocks(name: str, language: str = "python") -> list[str]:
    """The ``language`` blocks of ``docs/NAME`` (of the README for ``README.md``), as written."""
    path = ROOT / name if name == "README.md" else ROOT / "docs" / name
    return re.findall(rf"```{language}\n(.*?)```", path.read_text(), re.S)


def own_residual_block() -> str:
    """docs/design.md's residual of one's own (the block that registers ``"scaled"``)."""
    (block,) = [b for b in doc_blocks("design.md") if '@register_residual("scaled")' in b]
    return block


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (a registered residual stays out of this process's
    registry), in ``cwd``, with ``cwd`` and the source tree importable; one thread, as the
    suite's other subprocesses."""
    path = os.pathsep.join([str(cwd), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def assert_ran_without_warning(done: subprocess.CompletedProcess, what: str) -> None:
    """``done`` exited 0, and no warning names a line of the copied code (``<string>:N:``, or
    ``my_residuals.py``): an example as written should not alarm its reader."""
    assert done.returncode == 0, f"{what}:\n{done.stderr[-3000:]}"
    warned = re.search(r"^(<string>|.*my_residuals\.py):\d+: \w+Warning: .*", done.stderr, re.M)
    assert not warned, f"{what} warns:\n{warned[0]}"


def test_the_design_doc_residual_runs_as_written_and_trains_its_scale(tmp_path):
    """The block builds its config; a model of it runs, its scales start at the option's 0.5
    and get gradients - what "works in AttnResLM ... with no other change" promises."""
    checks = """
from attnres import AttnResLM
model = AttnResLM(config)
assert isinstance(model.residual, ScaledResidual), type(model.residual)
assert torch.equal(model.residual.scale.detach(), torch.full((2 * config.n_layers,), 0.5))
ids = torch.randint(0, config.vocab_size, (2, 8))
model(ids, labels=ids).loss.backward()
assert model.residual.scale.grad.abs().min() > 0
"""
    assert_ran_without_warning(run_python(own_residual_block() + checks, tmp_path), "docs/design.md's residual")


@pytest.mark.slow
def test_the_experiments_doc_grid_with_one_s_own_residual_runs_as_written(tmp_path):
    """docs/experiments.md's ``compare`` grid with docs/design.md's residual added, the design
    block saved as the ``my_residuals.py`` it imports; at the ``tiny`` preset, not ``demo``
    (minutes): the grid's four runs and a report naming the added variant."""
    (block,) = [b for b in doc_blocks("experiments.md") if "import my_residuals" in b]
    assert 'get_experiment("compare", "demo")' in block
    (tmp_path / "my_residuals.py").write_text(own_residual_block())
    done = run_python(block.replace('"compare", "demo"', '"compare", "tiny"'), tmp_path)
    assert_ran_without_warning(done, "docs/experiments.md's grid")
    out = tmp_path / "runs" / "compare-scaled"
    assert (out / "scaled" / "seed0" / "result.json").is_file()
    assert "scaled" in (out / "report.md").read_text()


def save_export(out: Path) -> None:
    """A small export at ``out``, as ``attnres export`` writes one (the model and the
    exported byte tokenizer)."""
    from attnres import AttnResLM, ModelConfig
    from attnres.data import ByteTokenizer
    from attnres.hf import AttnResForCausalLM, make_hf_tokenizer

    torch.manual_seed(0)
    native = AttnResLM(ModelConfig.preset("tiny", vocab_size=256, residual="attnres_block")).eval()
    AttnResForCausalLM.from_native(native).save_pretrained(out)
    make_hf_tokenizer(ByteTokenizer(), native.config.max_seq_len).save_pretrained(out)


def test_the_hf_doc_python_blocks_run_as_written(tmp_path, monkeypatch):
    """docs/hf.md's conversion block on a native model, then its loading block and its batch
    block in one namespace on an export at ``hf-out``, as a reader runs them one after the other:
    the conversion keeps the logits, and each prompt of the left-padded batch continues as it
    does alone ("from its last token")."""
    pytest.importorskip("transformers")
    from attnres import AttnResLM, ModelConfig

    blocks = doc_blocks("hf.md")
    (convert,) = [b for b in blocks if "from_native(native_model)" in b]
    (load,) = [b for b in blocks if 'from_pretrained("hf-out")' in b]
    (batch,) = [b for b in blocks if "padding=True" in b]
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    scope: dict = {"native_model": AttnResLM(ModelConfig.preset("tiny", residual="attnres_block")).eval()}
    monkeypatch.chdir(tmp_path)
    save_export(tmp_path / "hf-out")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")
        exec(compile(convert, "docs/hf.md conversion", "exec"), scope)
        assert torch.equal(scope["hf"](ids).logits, scope["native_model"](ids).logits)
        assert torch.equal(scope["native_again"](ids).logits, scope["native_model"](ids).logits)
        exec(compile(load, "docs/hf.md loading", "exec"), scope)
        exec(compile(batch, "docs/hf.md batch", "exec"), scope)
    model, tok, new = scope["model"], scope["tok"], scope["new"]
    assert scope["out"].shape[1] == len(tok("the quick")["input_ids"]) + 20 and new.shape == (2, 20)
    for row, prompt in zip(new, ["the quick", "a"]):
        assert_greedy_alone(model, tok([prompt], return_tensors="pt")["input_ids"][0], row)


def assert_greedy_alone(model, prompt: torch.Tensor, continuation: torch.Tensor) -> None:
    """``continuation`` is what greedy decoding gives ``prompt`` alone: each token the argmax
    of the alone forward's logits at its position, up to float noise. (Not the alone run's
    tokens compared exactly: the batch's matmuls have other shapes, and a near-tie the BLAS
    or SIMD width breaks the other way would change every token after it.)"""
    with torch.no_grad():
        logits = model(torch.cat([prompt, continuation])[None]).logits[0, len(prompt) - 1:-1].float()
    chosen = logits.gather(1, continuation[:, None])[:, 0]
    assert torch.all(chosen >= logits.max(dim=1).values - 1e-4), (chosen, logits.max(dim=1).values)


def test_the_lm_eval_examples_start_documents_with_the_export_s_line_break():
    """docs/hf.md runs the harness on ``hf-out``, its export of a ``configs/train-cpu.yaml``
    run, whose BPE (``data.tokenizer: bpe``) puts the line break at 198 - its byte symbols come
    first, in character order, so every size puts it there - not at the byte tokenizer's 10:
    ``prefix_token_id=10`` started every rolling log-likelihood with ``+``."""
    pytest.importorskip("transformers")
    yaml = pytest.importorskip("yaml")
    from attnres.data.tokenizer import train_bpe
    from attnres.hf import make_hf_tokenizer

    doc = (ROOT / "docs" / "hf.md").read_text()
    assert 'attnres export --checkpoint runs/cpu/' in doc and "--out hf-out" in doc
    assert yaml.safe_load((ROOT / "configs" / "train-cpu.yaml").read_text())["data"]["tokenizer"] == "bpe"
    examples = [b for b in doc_blocks("hf.md", "bash") + doc_blocks("hf.md") if "lm_eval" in b and "hf-out" in b]
    given = {int(n) for b in examples for n in re.findall(r"""prefix_token_id["=:\s]+(\d+)""", b)}
    text = "It was a dark and stormy night;\nthe rain fell in torrents.\n" * 20
    line_breaks = {make_hf_tokenizer(train_bpe(text, size))("\n")["input_ids"][0] for size in (300, 400)}
    assert len(examples) == 2 and given == line_breaks == {198}, (given, line_breaks)


def test_the_committed_scaling_report_names_the_size_it_leaves_out():
    """docs/experiments.md: the committed scaling grid ran on four of the preset's five sizes,
    and "the report names a size with no finished run and leaves it out" - the report its
    ``--report-only`` command writes does; the committed one, written before that line
    existed, did not."""
    doc = " ".join((ROOT / "docs" / "experiments.md").read_text().split())
    assert "The report names a size with no finished run and leaves it out" in doc
    assert "attnres experiment scaling --out results/scaling --report-only" in doc
    report = (ROOT / "results" / "scaling" / "report.md").read_text()
    left_out = re.search(r"^Left out of this report: .*$", report, re.M)
    assert left_out and all(f"{v}_s5" in left_out[0] for v in ("baseline", "block", "full")), left_out


#: mypy's settings for the blocks: attnres read as an installed package is (PEP 561: its
#: ``py.typed``, without which every name it exports is ``Any``; no error inside it reported), and
#: the other modules a block imports (vLLM, lm_eval, xgrammar: untyped or absent) as ``Any``.
MYPY_CONFIG = """
[mypy]
ignore_missing_imports = True
[mypy-attnres.*]
ignore_missing_imports = False
follow_imports = silent
"""

#: Ends each block of docs/*.md, several of which continue another (``model``, ``tok``: named
#: before); the README's run as written (``tests/test_readme.py``), and are checked whole.
CONTINUED = '\n# mypy: disable-error-code="name-defined"\n'

#: What the fields that ``__post_init__`` converts give when read, and what they refuse: read as
#: ``Held | Given``, ``config.residual.kind`` was refused; typed ``Any``, ``residual=3`` passed.
READS = """# mypy: warn-unused-ignores
from pathlib import Path

from typing_extensions import assert_type

from attnres import ModelConfig, ResidualConfig
from attnres.train import TrainConfig
from attnres.train.config import DataConfig

config = TrainConfig(model={"residual": "attnres_full"}, data={"tokenizer": "byte"}, out_dir=Path("runs"))
assert_type(config.model, ModelConfig)
assert_type(config.model.residual, ResidualConfig)
assert_type(config.data, DataConfig)
assert_type(config.out_dir, str)
assert_type(config.resume_from, str | None)
ModelConfig(residual=3)  # type: ignore[arg-type]
TrainConfig(out_dir=3)  # type: ignore[arg-type]
"""


@pytest.mark.slow  # (about 30 s)
def test_the_python_blocks_type_check_against_the_package(tmp_path):
    """mypy on the README's ``python`` blocks and docs/*.md's, attnres found on ``PYTHONPATH``
    as a user's type checker finds it installed. The annotations said less than the code takes
    or gives: ``ModelConfig(residual={...})`` and ``TrainConfig(model="tiny", data={...},
    out_dir=Path(...))`` were refused (the fields' types, though ``__post_init__`` converts), the
    tokenizer ``load_tokenizer`` returns had no ``prefix_ids``, ``load_run(result.checkpoint)``
    took a ``Path | None``; and without ``py.typed`` mypy read none of it. With them, what those
    fields read and refuse (:data:`READS`)."""
    pytest.importorskip("mypy")  # (the dev extra's)
    blocks = {f"readme_{i}": b for i, b in enumerate(doc_blocks("README.md"))}
    for doc in sorted((ROOT / "docs").glob("*.md")):
        blocks.update({f"doc_{doc.stem.replace('-', '_')}_{i}": b + CONTINUED for i, b in enumerate(doc_blocks(doc.name))})
    blocks["reads"] = READS
    for name, block in blocks.items():
        (tmp_path / f"{name}.py").write_text(block)
    (tmp_path / "my_residuals.py").write_text(own_residual_block())  # (what docs/experiments.md's grid imports)
    (tmp_path / "mypy.ini").write_text(MYPY_CONFIG)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--no-incremental",
                           "--cache-dir", os.devnull, *(f"{name}.py" for name in blocks)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert len(blocks) > 6 and done.returncode == 0, done.stdout + done.stderr
