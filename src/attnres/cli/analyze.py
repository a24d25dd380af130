"""``attnres analyze``: the depth mixing matrix, its semiseparable rank and the depth-wise
attention sinks of a checkpoint (report §6.2, §5.4.2)."""

from __future__ import annotations

import os

from ..validation import check_optional_count, missing_path_hint
from .common import add_checkpoint_argument


def add_parser(sub) -> None:
    an = sub.add_parser(
        "analyze",
        help="depth mixing matrix, semiseparable rank and depth-wise attention sinks of a checkpoint (report §6.2, §5.4.2)",
        description="Run the model of --checkpoint on windows of its validation split and write report.md, mixing.png "
        "(Fig.-9-style panels of the depth mixing matrix M) and mixing.json to --out: M averaged over the tokens, its "
        "semiseparable rank, the sink table and, with --compare, the second checkpoint beside it and the difference. "
        "A transformers directory (an export, an upcycled model) or a Hugging Face Hub id of an AttnRes model "
        "(ORG/NAME: fetched into the Hugging Face cache; the report into ./analysis-ORG--NAME) is read with its own "
        "tokenizer, on --text or the built-in corpus's validation split.",
    )
    add_checkpoint_argument(an, transformers=True)
    an.add_argument("--compare", metavar="DIR", help="a second checkpoint, run or transformers directory (or Hub id) to "
                    "compare with")
    an.add_argument("--out", help="output directory (default: <run>/analysis/step-N for a run's step-N directory, kept when the run "
                         "rotates its checkpoints; <run>/analysis for its checkpoints folder; <dir>-analysis beside a "
                         "transformers directory; else <checkpoint>/analysis; "
                         "not a folder holding a compare / experiment grid)")
    an.add_argument("--rows", type=int, help="windows of the validation split analysed, none overlapping (default 8; "
                    "never more than the split holds)")
    an.add_argument("--seq-len", type=int, help="tokens per window (default min(128, the model's max_seq_len))")
    an.add_argument("--text", help="a text file to analyse instead of the run's validation split")
    an.add_argument("--device", default="auto", help="auto (CUDA when available; default), cpu, cuda or cuda:N")


def run(args, parser) -> int:
    return run_analyze(args)


def run_analyze(args) -> int:
    """``attnres analyze``: the depth mixing report of one checkpoint (or two)."""
    from ..experiments.job.analyze import DEFAULT_ROWS, write_analysis
    from ..checkpoint import CheckpointError
    from ..hub import is_hub_id, local_folder
    from ..inference.loading import pick_device

    try:
        device = pick_device(args.device)  # (named as the option; the Python functions name their argument)
        check_optional_count("--rows", args.rows, f"{DEFAULT_ROWS}, or as many windows as the text holds")
        check_optional_count("--seq-len", args.seq_len, "min(128, the model's max_seq_len)")
        if args.text is not None and not os.path.isfile(args.text):
            raise ValueError(f"--text {args.text!r} is not a file{missing_path_hint(args.text)}")
        if args.text is not None and os.path.getsize(args.text) == 0:  # (said before the model loads)
            raise ValueError(f"--text {args.text!r} is empty: there is no text to analyse")
        out = args.out
        if out is None and is_hub_id(args.checkpoint):  # here, not into the Hugging Face cache
            out = f"analysis-{args.checkpoint.replace('/', '--')}"
        checkpoint = local_folder(args.checkpoint, "CHECKPOINT")  # a Hub id: fetched into the Hugging Face cache
        compare = None if args.compare is None else local_folder(args.compare, "--compare")
        path = write_analysis(checkpoint, compare, out, args.rows, args.seq_len, args.text, device)
    except (ValueError, OSError, CheckpointError, NotImplementedError) as e:
        raise SystemExit(f"attnres analyze: error: {e}") from None
    print(f"attnres analyze: report {path}")
    return 0
