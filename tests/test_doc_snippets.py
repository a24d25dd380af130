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
    """The ``language`` blocks of ``docs/NAME``, as written."""
    return re.findall(rf"```{language}\n(.*?)```", (ROOT / "docs" / name).read_text(), re.S)


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
