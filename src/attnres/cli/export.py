"""``attnres export``: a training checkpoint as a Hugging Face directory (model + tokenizer)."""

from __future__ import annotations

from .common import add_checkpoint_argument


def add_parser(sub) -> None:
    xp = sub.add_parser(
        "export", help="write a training checkpoint as a Hugging Face directory (model + tokenizer)",
        description="Write a training checkpoint (a step-* directory, or a run directory: its newest checkpoint that "
        "verifies) as a Hugging Face directory: config.json, model.safetensors and the tokenizer, which "
        "AutoModelForCausalLM.from_pretrained loads after `import attnres.hf`, attnres generate continues and the "
        "vLLM plugin serves (docs/hf.md, docs/serving.md).")
    add_checkpoint_argument(xp)
    xp.add_argument("--out", required=True, help="output directory for save_pretrained (created if missing)")
    xp.add_argument("--tokenizer", help="tokenizer.json to use instead of the one stored in the checkpoint")


def run(args, parser) -> int:
    return run_export(args.checkpoint, args.out, args.tokenizer)


def run_export(checkpoint: str, out: str, tokenizer: str | None) -> int:
    """``attnres export``: checkpoint -> Hugging Face directory."""
    from .. import hf

    try:
        path = hf.export_checkpoint(checkpoint, out, tokenizer)
    except ValueError as e:
        raise SystemExit(f"attnres export: error: {e}") from None
    print(f"attnres export: wrote {path} (load with transformers.AutoModelForCausalLM.from_pretrained after `import attnres.hf`)")
    return 0
