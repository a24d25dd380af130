"""``attnres analyze``: the depth mixing matrix, its rank and the sink table of trained
checkpoints (report §6.2, Fig. 9, §5.4.2), and the same section of the ``attnres compare``
report.

Tokens: ``rows`` windows of ``seq_len`` tokens spread evenly over the run's validation split
(read again from its data settings, encoded with the checkpoint's tokenizer), or over a text
file given instead; no two windows overlap, so there are at most as many as the text holds,
and the report's token count is that of distinct tokens. The windows are fixed by the text,
so two checkpoints trained on the same data are analysed on the same tokens.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ...analysis.mixing import DepthMixing, depth_mixing_from_logged, depth_mixing_matrix
from ...data.corpus import TEXT_FIELD, is_json_lines, json_lines_text, read_text_file
from ...migrations import stored_config
from ...output_paths import OutputPathError, check_output_dir, strict_json, write_text_atomically
from ...analysis.mixing_report import (
    method_note,
    mixing_findings,
    plot_mixing_panels,
    rank_expectation,
    rank_table,
    sink_table,
    uniform_weights,
)
from ...user_warning import warn_user
from ...validation import check_optional_count

__all__ = ["analysis_tokens", "analyze_checkpoint", "write_analysis", "mixing_section", "moe_layers",
           "expert_load_section", "DEFAULT_ROWS"]

#: Windows analysed per checkpoint by default (of the model's ``seq_len``, at most 128), or
#: as many as the text holds when it holds fewer.
DEFAULT_ROWS = 8


def analysis_tokens(run, rows: int | None = None, seq_len: int | None = None, text: str | None = None) -> torch.Tensor:
    """``[rows, seq_len]`` token ids from the run's validation split (or ``text``), windows
    spread evenly from its start to its end that do not overlap (:func:`token_windows`); the
    text starts with what the tokenizer's template puts before one (a ``<s>``), as in the run's
    export, whose analysis is then the run's."""
    from ...data.tokenizer import text_ids
    from ...inference.loading import load_tokenizer

    if text is None:
        text = run.validation_text()
    ids = text_ids(load_tokenizer(run), text)
    device = next(run.model.parameters()).device
    return token_windows(ids, run.run_config["model"]["max_seq_len"], rows, seq_len).to(device)


def token_windows(ids: list[int], limit: int, rows: int | None = None, seq_len: int | None = None) -> torch.Tensor:
    """``[rows, seq_len]`` windows of ``ids`` spread evenly from its start to its end that do
    not overlap, ``seq_len`` (``None``: ``min(128, limit)``) at most the model's context
    ``limit``. ``rows`` (``None``: :data:`DEFAULT_ROWS`) is capped at the number of windows the
    text holds, with a warning when it was given."""
    seq_len = seq_len or min(128, limit)
    if seq_len > limit:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's max_seq_len {limit}: use --seq-len {limit} or less")
    if len(ids) < seq_len:
        fix = f"--seq-len {len(ids)} or less, or a longer text" if ids else "a text that is not empty"
        raise ValueError(f"the text has {len(ids)} token{'' if len(ids) == 1 else 's'}, fewer than one window of "
                         f"{seq_len}: use {fix}")
    holds = len(ids) // seq_len
    if rows is not None and rows > holds:  # (overlapping windows would count the same tokens again)
        warn_user(f"--rows {rows} is more than the text holds: its {len(ids)} tokens make {holds} window(s) of "
                  f"{seq_len} that do not overlap; analysing {holds}")
    rows = min(DEFAULT_ROWS if rows is None else rows, holds)
    span = len(ids) - seq_len
    # (the gap between starts is span / (rows - 1) >= seq_len: the windows do not overlap)
    starts = [round(k * span / max(rows - 1, 1)) for k in range(rows)]
    return torch.tensor([ids[s : s + seq_len] for s in starts])


def analyze_checkpoint(path: str | Path, rows: int | None = None, seq_len: int | None = None,
                       text: str | None = None, device: str | torch.device = "cpu") -> tuple[DepthMixing, dict]:
    """The :class:`DepthMixing` of the checkpoint (or run directory) ``path`` on its
    validation tokens - or of the transformers directory ``path`` (an export, an upcycle,
    an AttnRes model from the Hub) on the built-in corpus's validation split - unless
    ``text`` is given, and a description of the model (``residual``, ``L``, ``S``, ``m``)."""
    from ...checkpoint import is_hf_directory
    from ...inference.loading import load_run

    if is_hf_directory(path):
        model, tokens, step, family = _directory_model_and_tokens(path, rows, seq_len, text, device)
        where = path
    else:
        run = load_run(path, device)
        model, tokens, step = run.model, analysis_tokens(run, rows, seq_len, text), run.state.get("step")
        family, where = run.run_config["model"].get("hf_architecture") is not None, run.checkpoint
    result = depth_mixing_matrix(model, tokens)
    residual = model.residual
    info = {"checkpoint": str(where), "residual": residual.name, "L": residual.n_sublayers,
            "block_size": getattr(residual, "block_size", None), "n_streams": getattr(residual, "n_streams", None),
            "step": step}
    if family:
        info["expert_load"] = moe_layers(model, tokens)
    return result, info


def _directory_model_and_tokens(path: str | Path, rows: int | None, seq_len: int | None, text: str | None,
                                device: str | torch.device | None) -> tuple[torch.nn.Module, torch.Tensor, None, bool]:
    """``(model, tokens, step, family)`` of a transformers directory: attnres's own model as
    its native :class:`~attnres.AttnResLM` (the same weights), a transformers family's
    (``attnres upcycle``) as it loads; its tokenizer's windows of ``text`` (or of the built-in
    corpus's validation split). A directory of a model without AttnRes is refused by name."""
    from ...data.corpus import load_corpus
    from ...hf.directory import load_directory
    from ...hf.modeling import AttnResForCausalLM
    from ...inference.loading import pick_device
    from ...models.factory import check_tokenizer_ids, context_limit

    from ...progress import redraws_in_place, transformers_bars

    device = pick_device(device, "device")
    with transformers_bars(redraws_in_place()):  # (its "Loading weights" bar: not in a log, as eval has it)
        model, tokenizer = load_directory(path, device)
    native = isinstance(model, AttnResForCausalLM)
    if native:
        model = model.to_native().eval()
    elif not hasattr(model, "depth_mixing"):
        raise ValueError(_plain_model(path, type(model).__name__))
    ids = tokenizer.encode(load_corpus().val if text is None else text)
    check_tokenizer_ids(model, ids, f"the text analysed with {str(path)!r}")
    return model, token_windows(ids, context_limit(model), rows, seq_len).to(device), None, not native


def _plain_model(path: str | Path, held: str) -> str:
    return (f"{str(path)!r} holds a {held}, which has no residual of attnres to analyse: upcycle it first (attnres "
            "upcycle --model DIR --out NEW), or give an attnres run or export")


def _refuse_plain_directory(path: str | Path, option: str) -> None:
    """Refuse, from its ``config.json`` alone, a transformers directory whose model is no
    AttnRes one (its ``model_type`` is not ``attnres`` or ``attnres_<family>``); a config that
    does not read is left to the model's load, which names the fault."""
    try:
        config = json.loads((Path(path).expanduser() / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if isinstance(model_type, str) and not (model_type == "attnres" or model_type.startswith("attnres_")):
        held = (config.get("architectures") or [None])[0]
        raise ValueError(option + _plain_model(path, held if isinstance(held, str) else f"{model_type!r} model"))


@torch.no_grad()
def moe_layers(model, tokens: torch.Tensor) -> list[dict]:
    """Per MoE layer of a ``transformers`` family model (``attnres.upcycle``; ``[]`` for dense
    ones), on ``tokens``: its expert load (:class:`~attnres.analysis.experts.ExpertLoad` as a
    mapping) and ``depth_weights``, the mean depth-attention weight of each source of its
    MLP sublayer's input (``None`` for a residual without depth attention)."""
    from ...analysis.experts import recorded_expert_load
    from ...hf.families.moe import RouterRecorder

    with RouterRecorder(model) as rec:
        weights = model.depth_weights_if_any(tokens, use_cache=False)
    return [{**x.to_dict(), "depth_weights": weights[2 * x.layer + 1].float().mean(dim=(1, 2)).tolist() if weights else None}
            for x in recorded_expert_load(rec)]


def expert_load_section(models: list[tuple[str, list[dict]]]) -> str:
    """The report's expert-load section: per model and MoE layer, the load summaries, the
    depth weights into the layer's MLP and the load of every expert."""
    from ...analysis.experts import ExpertLoad, expert_load_table

    loads = [(name, [ExpertLoad(d["layer"], d["fraction"], d["tokens"], d["top_k"]) for d in layers]) for name, layers in models]
    weights = {name: {d["layer"]: d["depth_weights"] for d in layers} for name, layers in models}
    return ("## Expert load (mixture of experts)\n\nPer MoE layer, over the analysed tokens: the share of the top-k "
            "routing assignments each expert received, its normalised entropy (1: even), the busiest expert's load "
            "relative to an even one, the experts that got no token, and the mean depth-attention weight of each "
            "source of the layer's MLP input (the embedding first, then earlier outputs or blocks, then the current "
            "block's partial sum).\n\n" + expert_load_table(loads, weights) + "\n")


def _expect(info: dict, results: list[DepthMixing]) -> tuple[str, int | None, int | None]:
    """Report §6.2's rank for the model of ``info``, measured as ``results`` (one per seed):
    rank 1 where every seed's weights are uniform (zero queries: an upcycle at conversion)."""
    return rank_expectation(info["residual"], info["L"], info["block_size"], info["n_streams"],
                            uniform=all(uniform_weights(r) for r in results), measured=max(r.rank for r in results))


def _label(info: dict) -> str:
    words = [info["residual"], f"L={info['L']}"]
    if info["block_size"]:
        words.append(f"S={info['block_size']}, N={math.ceil(info['L'] / info['block_size'])}")
    if info["n_streams"]:
        words.append(f"m={info['n_streams']}")
    return " ".join(words)


def default_analysis_dir(checkpoint: str | Path) -> Path:
    """Where ``attnres analyze`` writes without ``--out``: ``<run>/analysis/step-N`` for a
    ``step-N`` directory of a run (inside the checkpoint, the run's ``keep_checkpoints``
    rotation would delete it with the checkpoint), ``<run>/analysis`` for the run's
    ``checkpoints`` folder (which holds checkpoints only), ``<dir>-analysis`` beside a
    transformers directory, else ``<checkpoint>/analysis``."""
    from ...checkpoint import is_hf_directory
    from ...checkpoint.locate import run_of_checkpoint

    path = Path(checkpoint).expanduser()
    if is_hf_directory(path):  # beside it: a file inside would be uploaded and shipped with the model
        return path.parent / f"{path.name}-analysis"
    if (found := run_of_checkpoint(path)) is not None:
        run, step = found
        return run / "analysis" / step if step else run / "analysis"
    return path / "analysis"


def check_analysis_out(out: str | Path) -> Path:
    """``--out`` of ``attnres analyze``, checked before any work: a directory to write into
    that does not hold an experiment grid (``attnres compare`` / ``experiment``), whose
    ``report.md``, ``mixing.png`` and ``mixing.json`` the analysis would replace."""
    from ..layout import EXPERIMENT_FILE

    out = check_output_dir(out, "--out")
    if (out / EXPERIMENT_FILE).is_file():
        raise OutputPathError(f"--out {str(out)!r} holds an experiment grid ({EXPERIMENT_FILE}): its report.md, "
                              "mixing.png and mixing.json would be replaced; pick another --out, e.g. "
                              f"{str(out / 'analysis')!r}")
    return out


def _plot_if_possible(panels, path: Path, diff) -> str:
    """Draw ``mixing.png`` and return the report's line for it; without matplotlib (the
    ``experiments`` extra) the tables and ``mixing.json`` are still worth having: say what
    installs the picture, in the report and as a warning, and leave any older picture out."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        from ...extras import install_command

        path.unlink(missing_ok=True)  # (an older analysis's picture would be taken for this one's)
        note = f"mixing.png is not drawn: matplotlib is not installed ({install_command('experiments')})"
        warn_user(f"attnres analyze: {note}; the tables and mixing.json are written")
        return f"*{note}; the matrices are in mixing.json.*"
    plot_mixing_panels(panels, path, diff, one_scale=len(panels) > 1)  # (A beside B: one colour, one weight)
    return "![depth mixing matrices](mixing.png)"


def _trained_text_field(checkpoint: str | Path) -> str:
    """The ``data.text_field`` the run of ``checkpoint`` was trained on (``"text"`` for a
    transformers directory, or a run that records none)."""
    from ...checkpoint.locate import newest_state

    found = newest_state(Path(checkpoint).expanduser()) if Path(checkpoint).expanduser().is_dir() else None
    data = ((found[1].get("config") or {}).get("data") or {}) if found is not None else {}
    return data.get("text_field") or TEXT_FIELD


def _analysed_model(path: str | Path) -> Path:
    """The directory whose model ``path`` names: a run's newest checkpoint (a run, its
    ``checkpoints`` folder and that ``step-*`` directory are one model), else ``path``."""
    from ...checkpoint.locate import newest_state

    location = Path(path).expanduser()
    found = newest_state(location) if location.is_dir() else None
    return (found[0] if found is not None else location).resolve()


def _refuse_comparing_with_itself(checkpoint: str | Path, compare: str | Path) -> None:
    """Raise ``ValueError`` where ``compare`` names the model ``checkpoint`` does: a report of a
    model beside itself (a zero difference, the same rank and sinks twice) is a mistake, said
    before two analyses of it are run."""
    model = _analysed_model(checkpoint)
    if _analysed_model(compare) == model:
        raise ValueError(f"--compare {str(compare)!r} is the model analysed ({model}): a comparison with itself shows "
                         "no difference; give another run's checkpoint, or an earlier step-N directory of this run "
                         "(its checkpoints/), or leave --compare out")


def write_analysis(checkpoint: str | Path, compare: str | Path | None = None, out: str | Path | None = None,
                   rows: int | None = None, seq_len: int | None = None, text_path: str | None = None,
                   device: str | torch.device = "cpu") -> Path:
    """``attnres analyze``: write ``report.md``, ``mixing.png`` (Fig.-9-style panels, and the
    difference when ``compare`` is given) and ``mixing.json`` into ``out`` (default
    :func:`default_analysis_dir`); returns the report's path."""
    from ...checkpoint import CheckpointError, is_hf_directory, no_checkpoint_at
    from ...checkpoint.locate import newest_state

    # (the command checks these first too, before a Hub download; in Python, rows=0 reached
    # torch as an empty float tensor and seq_len=0 meant the default)
    check_optional_count("--rows", rows, f"{DEFAULT_ROWS}, or as many windows as the text holds")
    check_optional_count("--seq-len", seq_len, "min(128, the model's max_seq_len)")
    text = None if text_path is None else read_text_file(text_path, "--text")
    for path in (checkpoint, compare) if compare is not None else (checkpoint,):  # what they are, before --out
        # (its state.json only: loading verifies the checkpoint, reading every file's hash once)
        found = Path(path).expanduser().is_dir() and newest_state(Path(path).expanduser()) is not None
        if not found and not is_hf_directory(path):  # (--compare's named: the first is the command's argument)
            raise CheckpointError(("--compare: " if path is compare else "") + no_checkpoint_at(path))
        if not found:  # (a plain model as --compare was found only after the first model's whole analysis)
            _refuse_plain_directory(path, "--compare: " if path is compare else "")
    if compare is not None:
        _refuse_comparing_with_itself(checkpoint, compare)
    if text_path is not None and is_json_lines(text_path):  # (its records' text, as eval reads it: not its JSON)
        text = json_lines_text(text_path, "--text", _trained_text_field(checkpoint))
    out = check_analysis_out(out if out is not None else default_analysis_dir(checkpoint))
    items = [analyze_checkpoint(checkpoint, rows, seq_len, text, device)]
    if compare is not None:
        items.append(analyze_checkpoint(compare, rows, seq_len, text, device))
    names = ["A", "B"][: len(items)]
    panels = [(f"{n}: {_label(info)}", r.matrix, r.source_groups) for n, (r, info) in zip(names, items)]
    diff = None
    if len(items) == 2 and items[0][0].matrix.shape == items[1][0].matrix.shape:
        diff = ("A − B", items[0][0].matrix - items[1][0].matrix)
    out.mkdir(parents=True, exist_ok=True)
    picture = _plot_if_possible(panels, out / "mixing.png", diff)
    parts = ["# Depth mixing matrices (report §6.2, Fig. 9) and depth-wise attention sinks (report §5.4.2)\n",
             method_note({n: r.n_tokens for n, (r, _) in zip(names, items)}) + "\n"]
    for n, (r, info) in zip(names, items):
        step = f" (step {info['step']})" if info["step"] is not None else ""  # (a transformers directory: none)
        parts.append(f"- **{n}**: `{info['checkpoint']}`{step}: {_label(info)}"
                     + (f"; vectors reduced by {r.reduction}" if r.reduction else ""))
    parts.append(f"\n{picture}\n")
    parts.append("## Semiseparable rank\n\n" + rank_table([(f"{n}: {_label(i)}", [r], _expect(i, [r])[0])
                                                            for n, (r, i) in zip(names, items)]) + "\n")
    parts.append("## Sink table\n\n" + "\n\n".join(sink_table(f"{n}: {_label(i)}", [r]) for n, (r, i) in zip(names, items))
                 + "\n")
    if any(info.get("expert_load") for _, info in items):
        parts.append(expert_load_section([(n, info["expert_load"]) for n, (_, info) in zip(names, items)
                                          if info.get("expert_load")]))
    if len(items) == 2:
        parts.append(_comparison_section(items[0][0], items[1][0], diff))
    findings = []
    for n, (r, info) in zip(names, items):
        _, low, high = _expect(info, [r])
        findings += mixing_findings(f"{n} ({info['residual']})", [r], low, high)
    parts.append("## Findings (computed)\n\nOne checkpoint per model: the report's claims need at least 3 seeds "
                 "(`attnres compare --seeds 0 1 2` reports them over seeds).\n\n" + "\n".join(f"- {f}" for f in findings))
    write_text_atomically(out / "mixing.json", strict_json([{**info, **r.to_dict()} for r, info in items], indent=1),
                          "the analysis")
    path = out / "report.md"
    write_text_atomically(path, "\n".join(parts) + "\n", "the analysis")
    return path


def _comparison_section(a, b, diff) -> str:
    """The report's "Comparison" of checkpoints A and B: where their matrices differ most (not
    for models of different depth, whose matrices do not line up: said so), their ranks and sinks."""
    if diff is None:
        where = (f"- No difference of the matrices: A's M is {a.matrix.shape[0]}×{a.matrix.shape[1]} and B's "
                 f"{b.matrix.shape[0]}×{b.matrix.shape[1]} (models of different depth; their rows do not line up).\n")
    else:
        d = diff[1]
        r_, c_ = divmod(int(d.abs().argmax()), d.shape[1])
        where = (f"- Largest difference A − B: {float(d[r_, c_]):+.4f} at row {r_ + 1 if r_ < d.shape[0] - 1 else 'out'}, "
                 f"source v{c_}; mean absolute difference on and below the diagonal "
                 f"{float(d.abs().tril().sum()) / (d.shape[0] * (d.shape[0] + 1) / 2):.4f}.\n")
    sinks = [", ".join(f"v{i}" for i in m.sinks()) or "none" for m in (a, b)]
    return ("## Comparison\n\n" + where + f"- Rank: A {a.rank} (averaged {a.rank_of_mean}), B {b.rank} "
            f"(averaged {b.rank_of_mean}).\n- Sinks: A {sinks[0]}, B {sinks[1]}.\n")


def logged_mixing(run_dir: Path) -> tuple[DepthMixing, dict] | None:
    """A run without checkpoint: its token-averaged ``M`` from the depth weights its last
    diagnostics record logged (AttnRes; see
    :func:`~attnres.analysis.mixing.depth_mixing_from_logged`), the standard residual's from
    its definition; ``None`` otherwise."""
    from ...models.config import ModelConfig
    from ...train.metrics import read_metrics

    config_path = Path(run_dir) / "config.json"
    metrics_path = Path(run_dir) / "metrics.jsonl"
    if not config_path.exists() or not metrics_path.exists():
        return None
    cfg = json.loads(config_path.read_text())
    with stored_config():  # (a run of an earlier version: no warning about the old keys it stored)
        model_config = ModelConfig.from_dict(cfg["model"])
    residual = model_config.build_residual()
    info = {"checkpoint": None, "residual": residual.name, "L": residual.n_sublayers,
            "block_size": getattr(residual, "block_size", None), "n_streams": getattr(residual, "n_streams", None),
            "step": None, "run": str(run_dir)}
    if residual.name == "standard":
        from ...models.lm import AttnResLM

        model = AttnResLM(model_config)  # the standard residual's M has no parameters
        result = depth_mixing_matrix(model, torch.zeros(1, 2, dtype=torch.long))
        result.n_tokens = 0
        return result, info
    diags = [m for m in read_metrics(metrics_path) if m["kind"] == "diagnostics" and m.get("depth_weights")]
    if not diags or not hasattr(residual, "source_members"):
        return None
    info["step"] = diags[-1]["step"]
    return depth_mixing_from_logged(residual, diags[-1]["depth_weights"]), info


def mixing_section(groups: dict[str, list[Path]], out: Path, labels: dict[str, str] | None = None) -> str | None:
    """The ``attnres compare`` report's section: for every model (``groups``: variant name ->
    its run directories, one per seed) the depth mixing matrix of each seed's last
    checkpoint, panels of the first seed in ``out/mixing.png``, the rank and sink tables and
    findings over seeds. ``None`` when no run kept a checkpoint."""
    from ...checkpoint import find_valid_checkpoint

    results: dict[str, list[tuple[DepthMixing, dict]]] = {}
    missing, logged, undescribed = [], [], {}
    for name, dirs in groups.items():
        for d in dirs:
            if find_valid_checkpoint(d) is not None:
                try:
                    with stored_config():  # (the grid's runs, maybe of an earlier version: not the user's keys)
                        item = analyze_checkpoint(d)
                except NotImplementedError as e:  # a registered variant without _mixing_matrix: the others still
                    undescribed[name] = str(e)
                    break
                results.setdefault(name, []).append(item)
                continue
            item = logged_mixing(d)
            if item is None:
                missing.append(str(d))
            else:
                logged.append(str(d))
                results.setdefault(name, []).append(item)
    if not results:
        return None
    labels = labels or {}
    panels = [(f"{labels.get(n, n)}\n{_label(rs[0][1])}", rs[0][0].matrix, rs[0][0].source_groups)
              for n, rs in results.items()]
    plot_mixing_panels(panels, out / "mixing.png")
    write_text_atomically(out / "mixing.json", strict_json({n: [{**i, **r.to_dict()} for r, i in rs]
                                                            for n, rs in results.items()}, indent=1), "the grid's analysis")
    first = next(iter(results.values()))[0][0]
    n_tokens = max(r.n_tokens for rs in results.values() for r, _ in rs)
    note = " Each seed's last checkpoint; panels: first seed."
    if logged:
        note += (f" {len(logged)} run(s) kept no checkpoint: for them `M` is the mean over the first validation "
                 "batch (batch_size × seq_len tokens of the run) of the depth weights their last diagnostics record logged "
                 "(exact: `M` is linear in the weights), the rank that of this averaged `M`, the spread across tokens "
                 "unknown and no sink flagged; the standard residual's `M` needs no checkpoint.")
    if missing:
        note += f" Not analysed (no checkpoint, nothing logged): {', '.join(missing)}."
    for name, why in undescribed.items():
        note += f" Not analysed: {labels.get(name, name)} ({why})."
    parts = ["## Depth mixing matrices (report §6.2, Fig. 9) and depth-wise attention sinks (report §5.4.2)",
             method_note(n_tokens or first.n_tokens) + note,
             "![depth mixing matrices](mixing.png)",
             rank_table([(labels.get(n, n), [r for r, _ in rs], _expect(rs[0][1], [r for r, _ in rs])[0]) for n, rs in results.items()]),
             "\n\n".join(sink_table(labels.get(n, n), [r for r, _ in rs]) for n, rs in results.items())]
    findings = []
    for n, rs in results.items():
        _, low, high = _expect(rs[0][1], [r for r, _ in rs])
        if all(r.n_tokens == 0 for r, _ in rs):
            low = high = None  # the §6.2 bounds are about each token's M, not the average
        findings += mixing_findings(labels.get(n, n), [r for r, _ in rs], low, high)
    parts.append("Findings (computed):\n\n" + "\n".join(f"- {f}" for f in findings))
    return "\n\n".join(parts)
