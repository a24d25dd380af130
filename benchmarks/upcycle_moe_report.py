"""The report of ``benchmarks/upcycle_moe.py``: ``report.md``, ``loss.png`` and ``experts.png``
from its ``results.json`` (``python benchmarks/upcycle_moe.py --report-only --out DIR``). Each
is written beside its place and renamed over it: a run stopped while writing keeps the
committed file whole."""

from __future__ import annotations

from pathlib import Path

from attnres.analysis.experts import ExpertLoad, expert_load_table
from attnres.output_paths import save_figure_atomically, write_text_atomically

MODELS = ("original", "block")


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def _diff(curves: dict, kind: str = "train") -> list[tuple[int, float]]:
    """``block - original`` per step where both logged (train: the language-modelling loss)."""
    a = {row[0]: row[1] for row in curves["original"][kind]}
    b = {row[0]: row[1] for row in curves["block"][kind]}
    return [(s, b[s] - a[s]) for s in sorted(a.keys() & b.keys())]


def _rolling(values: list[float], width: int = 10) -> list[float]:
    return [_mean(values[max(0, i - width + 1): i + 1]) for i in range(len(values))]


def plot_loss(out: Path, r: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, dx, xx) = plt.subplots(3, 1, figsize=(7.5, 8.5), sharex=True, height_ratios=(3, 2, 2))
    for i, (seed, data) in enumerate(r["seeds"].items()):
        c, color = data["curves"], f"C{i}"
        for name, style in zip(MODELS, ("-", "--")):
            steps, loss, aux = zip(*c[name]["train"])
            ax.plot(steps, _rolling(list(loss)), style, color=color, lw=1, label=f"{name}, seed {seed} (train, mean of 10)")
            if aux[0] is not None:
                xx.plot(steps, _rolling(list(aux)), style, color=color, lw=1, label=f"{name}, seed {seed} (mean of 10)")
            if c[name]["eval"]:
                es, el = zip(*c[name]["eval"])
                ax.plot(es, el, "o" + style, color=color, ms=4, label=f"{name}, seed {seed} (held-out)")
        steps, d = zip(*_diff(c))
        dx.plot(steps, d, color=color, lw=0.6, alpha=0.35, label=f"seed {seed}, per step")
        dx.plot(steps, _rolling(list(d)), color=color, lw=1.4, label=f"seed {seed}, mean of 10")
    dx.axhline(0, color="grey", lw=0.8)
    ax.set_ylabel("loss (cross-entropy)")
    dx.set_ylabel("block − original")
    xx.set_ylabel("load-balancing loss")
    xx.set_xlabel("continued-training step")
    ax.set_title(f"Continued training: {r['family']} original vs its Block AttnRes upcycle (S = {r['block_size']})")
    for a in (ax, dx, xx):
        a.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    save_figure_atomically(fig, out / "loss.png", "--out", dpi=120)
    plt.close(fig)


def plot_experts(out: Path, r: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(9, 6.5), sharex=True)
    (qa, aa), (ta, ea) = axes
    for i, (seed, data) in enumerate(r["seeds"].items()):
        rows, color = data["routing"], f"C{i}"
        steps = [x["step"] for x in rows]
        qa.plot(steps, [x["query_norm"] for x in rows], "o-", color=color, label=f"seed {seed}")
        aa.plot(steps, [_mean(y["agreement"] for y in x["layers"]) for x in rows], "o-", color=color, label=f"seed {seed}")
        ta.plot(steps, [_mean(y["tv_between"] for y in x["layers"]) for x in rows], "o-", color=color, lw=2,
                label=f"block vs original, seed {seed}")
        for name, style in zip(MODELS, (":", "--")):
            ta.plot(steps, [_mean(y[f"tv_from_start_{name}"] for y in x["layers"]) for x in rows], "s" + style, ms=3,
                    color=color, label=f"{name} vs its own conversion, seed {seed}")
            ea.plot(steps, [_mean(ExpertLoad(**_load(y[f"load_{name}"])).entropy for y in x["layers"]) for x in rows],
                    "o" + ("-" if name == "original" else "--"), color=color, label=f"{name}, seed {seed}")
    qa.set_ylabel("mean ||pseudo-query||")
    aa.set_ylabel("routing agreement (shared top-k)")
    ta.set_ylabel("expert-load distance (TV)")
    ea.set_ylabel("normalised load entropy")
    for a in (ta, ea):
        a.set_xlabel("continued-training step")
    for a in axes.flat:
        a.legend(fontsize=6)
    fig.suptitle("Routing of the upcycle as its pseudo-queries leave zero (means over the MoE layers)", fontsize=10)
    fig.tight_layout()
    save_figure_atomically(fig, out / "experts.png", "--out", dpi=120)
    plt.close(fig)


def _load(d: dict) -> dict:
    return {k: d[k] for k in ("layer", "fraction", "tokens", "top_k")}


def loss_table(r: dict) -> list[str]:
    lines = ["| seed | first-step loss original / block | mean block − original (all steps) | largest block − original "
             "(mean of 10 steps) | final held-out loss original / block | final aux loss original / block |",
             "|---|---|---:|---:|---|---|"]
    for seed, data in r["seeds"].items():
        c = data["curves"]
        d = [v for _, v in _diff(c)]
        first = [c[n]["train"][0][1] for n in MODELS]
        ev = [c[n]["eval"][-1][1] for n in MODELS]
        aux = [c[n]["train"][-1][2] for n in MODELS]
        lines.append(f"| {seed} | {first[0]:.5f} / {first[1]:.5f} | {_mean(d):+.4f} | {max(_rolling(d)):+.4f} | "
                     f"{ev[0]:.4f} / {ev[1]:.4f} | {aux[0]:.4f} / {aux[1]:.4f} |")
    return lines


def routing_table(r: dict) -> list[str]:
    lines = ["| seed | step | query norm | layer | agreement | TV block vs original | TV from conversion: original / "
             "block | entropy original / block | max load original / block |", "|---|---:|---:|---:|---:|---:|---|---|---|"]
    for seed, data in r["seeds"].items():
        for row in (data["routing"][0], data["routing"][-1]):
            for y in row["layers"]:
                o, b = (ExpertLoad(**_load(y[f"load_{n}"])) for n in MODELS)
                lines.append(f"| {seed} | {row['step']} | {row['query_norm']:.3f} | {y['layer']} | {y['agreement']:.3f} | "
                             f"{y['tv_between']:.3f} | {y['tv_from_start_original']:.3f} / {y['tv_from_start_block']:.3f} | "
                             f"{o.entropy:.4f} / {b.entropy:.4f} | {o.max_load:.3f} / {b.max_load:.3f} |")
    return lines


def write_report(out: Path, r: dict) -> None:
    plot_loss(out, r)
    plot_experts(out, r)
    seed0 = next(iter(r["seeds"].values()))["routing"][-1]
    final = [(f"{n} (step {seed0['step']})", [ExpertLoad(**_load(y[f"load_{n}"])) for y in seed0["layers"]]) for n in MODELS]
    m, e = r["model"], r["experts"]
    lines = [
        f"# Continued training of an upcycled mixture of experts ({r['family']})", "",
        f"Command: `{r['command']}`  ", f"torch {r['torch']}, one thread; {r.get('cpu_seconds', '?')} CPU seconds in all.", "",
        f"Model: `{r['family']}` from `transformers`, d = {m['d_model']}, {m['n_layers']} decoder layers (all MoE), "
        f"{e['num_experts']} experts of width {e['moe_intermediate_size']}, top-{e['num_experts_per_tok']}, normalised "
        f"top-k weights, load-balancing loss coefficient {e['router_aux_loss_coef']}. Pretrained from scratch as a standard "
        f"MoE for {len(r['pretrain']['train'])} steps (final held-out loss {r['pretrain']['eval'][-1][1]:.4f}), written as a "
        f"plain `{r['family']}` directory (the original) and upcycled to Block AttnRes with S = {r['block_size']}. Both "
        "then continue with identical data, optimiser, schedule and seed (`config.json`). Routing measured at every "
        f"checkpoint on {r['analysis_tokens']} validation tokens.", "",
        "![loss](loss.png)", "", "## Loss", "", *loss_table(r), "",
        "![experts](experts.png)", "", "## Routing at conversion and at the end", "",
        "Agreement: the share of each token's top-k experts the two models have in common. TV: total variation "
        "distance between expert-load vectors (0: the same load, 1: disjoint). How far the upcycle's depth weights "
        "moved: the largest departure of a mean depth-attention weight from uniform (first validation batch) at the "
        "end, " + ", ".join(f"seed {seed}: {d['curves']['block']['depth_departure'][-1][1]:.3f}"
                            for seed, d in r["seeds"].items()) + ".", "", *routing_table(r), "",
        "## Expert load at the end (first seed)", "", expert_load_table(final), "",
        "`analysis/report.md`: `attnres analyze` of the first seed's final upcycle (A) against the original (B): "
        "depth mixing matrices, and per MoE layer the expert load beside the depth weights into its MLP.", ""]
    write_text_atomically(out / "report.md", "\n".join(lines) + "\n")
