"""``attnres status``: where the training runs under some folders stand, one line each."""

from __future__ import annotations


def add_parser(sub) -> None:
    st = sub.add_parser("status", help="where the training runs under some folders stand: step, losses, tokens/s, "
                        "newest checkpoint, running or not",
                        description="Find the training runs at or under each DIR (a run or one of its checkpoints, "
                        "a grid's --out, a folder of runs; default runs/) and print one line each: the residual and "
                        "size, the step reached of the run's steps, the latest train and validation losses, "
                        "tokens/s of the last logging window (its steps named), the newest checkpoint, and whether a process is training it now (its run.lock). Reads only.")
    st.add_argument("dirs", nargs="*", default=["runs"], metavar="DIR", help="folders to look in (default: runs)")
    st.add_argument("--json", action="store_true", help="one JSON object per run, one per line (strict JSON: a value that is not a "
                    "finite number, such as a NaN loss, is null)")


def run(args, parser) -> int:
    from ..output_paths import strict_json
    from ..train.status import run_status
    from .common import runs_under

    runs = [run_status(path, warn=True) for path in runs_under("status", args.dirs)]
    if args.json:
        for status in runs:
            print(strict_json(status.to_dict()))
        return 0
    if not runs:
        print(f"attnres status: no training runs under {', '.join(args.dirs)} (a run's directory holds config.json "
              "and metrics.jsonl or checkpoints/)")
        return 0
    print(render(runs))
    for status in runs:  # (the table's model and steps for such a run: its checkpoint's, or "?")
        if status.config_error is not None:
            print(f"\n{status.path}: {status.config_error}")
    for status in runs:  # (one run's validation losses across a resume onto other text: two texts')
        if status.data_changes:
            print(f"\n{status.path} was resumed onto other text (allow_data_change) at step "
                  f"{', '.join(map(str, status.data_changes))}: its validation loss before and after is of two "
                  "texts' validation splits, which do not compare")
    tokenizers = {s.tokenizer for s in runs if s.tokenizer is not None}
    if len(tokenizers) > 1:  # (a byte run's 1.6 beside a BPE run's 4.1: nats per byte against per word piece)
        print(f"\nthe losses are per token of different tokenizers ({', '.join(sorted(tokenizers))}), which do not "
              "compare; attnres eval gives each run's bits per byte, which do")
    else:  # (one tokenizer: a baseline and a variant on other text looked like a comparison)
        texts: dict[str, str] = {}
        for s in runs:
            if s.data is not None:
                texts.setdefault(s.data, s.path)
        if len(texts) > 1:
            named = ", ".join(f"{data} ({path})" for data, path in texts.items())
            print(f"\nthe runs trained on different text (data fingerprints {named}), so their losses do not compare")
    stopped = [s.path for s in runs if s.state == "stopped" and s.checkpoint_step is not None]
    if stopped:
        print(f"\ncontinue a stopped run with {_continue_command(stopped[0])}")
    return 0


def _continue_command(run: str) -> str:
    """How to continue the stopped ``run``: the command of the grid holding it (its
    ``experiment.json`` two folders up, ``<out>/<variant>/seed<k>``; resuming the run alone
    would leave the grid without its record), with the ``--variants`` that limits it to this
    run, else ``attnres train --resume`` launched as its
    newest checkpoint was written (:func:`_launch_command`). The run's path is made absolute
    first: ``attnres status .`` from inside a grid's run looked for the grid in ``./..`` of
    ``.`` (``.`` again) and gave the resume of the run alone, and a relative ``--out`` named
    another folder, or none, once pasted elsewhere."""
    import os
    import shlex
    from pathlib import Path

    from ..experiments.layout import grid_overrides, read_experiment_header
    from ..shell_words import path_argument

    run = os.path.abspath(run)  # (not resolve(): a path through a symbolic link stays the one the user knows)
    grid, seed = Path(run).parent.parent, Path(run).name.removeprefix("seed")
    header = read_experiment_header(grid)
    if header is None or not seed.isdigit() or not isinstance(header.get("experiment"), str):
        return f"`{_launch_command(run)}` (its own config)"
    name = header["experiment"]
    words = ["attnres", "compare"] if name == "compare" else ["attnres", "experiment", name]
    words += ["--preset", str(header.get("preset")), "--out", path_argument(grid), "--seeds", seed,
              *grid_overrides(map(str, header.get("overrides") or []))]  # (stop_after, progress, parallel.*: per launch)
    # (the grid's command trains every variant of the grid for this seed: a grid split among processes by
    # --variants, which experiment.json does not record, would train the other processes' variants too)
    return (f"`{shlex.join(words)}` (its grid's command, for this seed: it also trains the grid's other variants "
            f"not finished for it; `--variants {shlex.quote(Path(run).parent.name)}` after `--seeds {seed}` continues this "
            "run alone)")


def _launch_command(run: str) -> str:
    """``attnres train out_dir=RUN --resume``, under torchrun with the ranks and ``parallel.*``
    settings its newest checkpoint records (``launch``, ``config.parallel``) where it was
    trained on several: the stored config leaves the layout to the launch, and a run that
    needed 4 GPUs resumed in one process (docs/scale-out.md); with the ``--import`` of a
    residual of the user's own that it records (``imports``)."""
    from ..checkpoint.locate import newest_state
    from ..nn.residual.imports import recorded_import_flags
    from .common import resume_command

    found = newest_state(run)
    state = found[1] if found is not None else {}
    launch = state.get("launch") if isinstance(state.get("launch"), dict) else {}
    parallel = (state.get("config") or {}).get("parallel") if isinstance(state.get("config"), dict) else None
    world, per_node = launch.get("world_size"), launch.get("local_world_size")
    if not isinstance(world, int) or not isinstance(parallel, dict):
        world, parallel = 1, {}
    # a residual of the user's own: the resume cannot build the model without its module imported
    attnres = " ".join(filter(None, ("attnres", recorded_import_flags(state.get("imports")))))
    return resume_command(run, attnres, parallel, world, per_node if isinstance(per_node, int) else None)


def render(runs) -> str:
    """The runs as an aligned table."""
    speed, speeds = _tokens_per_s_column(runs)
    header = ("run", "model", "step", "train loss", "val loss (at step)", speed, "checkpoint", "state")
    rows = [header]
    for s, tokens_per_s in zip(runs, speeds):
        # (S: the runs of a block-size sweep, or runs/block4 beside runs/block8, read alike without it)
        residual = (s.residual or "?") + (f" S={s.block_size}" if s.block_size else "")
        model = ", ".join(x for x in (residual, f"{s.n_layers} layers" if s.n_layers else "",
                                      f"d {s.d_model}" if s.d_model else "") if x)
        rows.append((
            s.path, model, f"{s.step}/{s.steps if s.steps is not None else '?'}",
            _number(s.train_loss), f"{_number(s.val_loss)} ({s.val_step})" if s.val_loss is not None else "-",
            tokens_per_s,
            f"step {s.checkpoint_step}" if s.checkpoint_step is not None else "-",
            s.state + (f" ({s.holder})" if s.holder else ""),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _tokens_per_s_column(runs):
    """The tokens/s column's header and cells: each run's last logging window, which the header
    names with its steps where every run's window is as long (``tok/s (last 10 steps)``), each
    cell otherwise (a lone ``tok/s`` read as the run's mean, or as the same window for all)."""
    spans = {s.tokens_per_s_steps for s in runs if s.tokens_per_s is not None}
    one = next(iter(spans)) if len(spans) == 1 else None

    def cell(s) -> str:
        if s.tokens_per_s is None:
            return "-"
        return f"{s.tokens_per_s:,.0f}" + ("" if one is not None else f" ({_steps(s.tokens_per_s_steps)})")
    header = f"tok/s (last {_steps(one)})" if one is not None else "tok/s (last window)"
    return header, [cell(s) for s in runs]


def _steps(n: int | None) -> str:
    return "? steps" if n is None else f"{n} step" + ("" if n == 1 else "s")


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"
