"""Memory traffic of the residual per token per sublayer, counted from the ops it runs.

The residual module (standard, Block or Full AttnRes, two-phase or naive) is driven alone
with random sublayer outputs, under a ``TorchDispatchMode`` that sees every operator the
residual calls (eager, ``through_dispatcher``). For each we add up the per-token tensors it
reads (tensor arguments) and writes (results; for in-place ops the updated tensor counts as
read and written). The depth-attention operators (``attnres::phase1``, ``attnres::merge``)
count as what they are in the fused kernels: one read of each input and one write of each
result. "Per-token" tensors are the ``[..., d]`` activations; the parameters (queries,
gains) and the per-token scalars (logits, softmax statistics) are counted apart, since
they are O(1) or O(L) numbers per token, not multiples of ``d``.

Each op is attributed to the phase the residual's state names while it runs (the public
``ResidualState.phase``):

* Phase 1: a block's (a group's) ``phase1`` of its queries over the completed sources - their
  RMS factors and logits, the softmax and the weighted sums in one pass;
* Phase 2: the rest of ``sublayer_input`` (the merge with the partial sum / the group's own
  outputs, whose logits it computes; Block AttnRes' merge forms the partial sum itself from
  the last output) and the add that closes a block; the standard residual's ``h + f(h)`` is
  its merge;
* Output aggregation (``finish``, including the completion of the last block / group):
  once per token, shown amortised over the L sublayers.

Results are in units of ``d`` elements per token per sublayer (multiply by ``d`` and by
the element size for bytes: 4 in float32, 2 in bfloat16).

    python benchmarks/residual_traffic.py              # the report's shape and bench-infer
    python benchmarks/residual_traffic.py --L 32 --S 4
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from bench_training_overhead import positive_int

from attnres.nn.residual import BlockAttnRes, FullAttnRes, ResidualConfig, StandardResidual
from attnres.ops.depth_attention.library import through_dispatcher

class TrafficCounter(TorchDispatchMode):
    """Counts elements of per-token ``[tokens, d]`` tensors read and written, by the phase of
    ``self.state`` (Phase 1 while ``start`` builds the state: it completes the embedding)."""

    def __init__(self, tokens: int, d: int) -> None:
        super().__init__()
        self.tokens, self.d = tokens, d
        self.state = None
        self.read = defaultdict(int)
        self.written = defaultdict(int)

    def _per_token(self, t) -> bool:
        """Activations: ``n`` per-token vectors for every token, in any layout (stacked,
        permuted or flattened inside an op). ``d`` and ``tokens`` both exceed ``L + 1``, so
        neither the ``[K, d]`` query matrices nor the per-token logits ``[tokens, K]`` match."""
        if not isinstance(t, torch.Tensor) or self.d not in t.shape:
            return False
        return t.numel() >= self.tokens * self.d and t.numel() % (self.tokens * self.d) == 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.overloadpacket in (torch.ops.aten.detach, torch.ops.aten.view, torch.ops.aten._unsafe_view,
                                   torch.ops.aten.unsqueeze, torch.ops.aten.select, torch.ops.aten.slice,
                                   torch.ops.aten.alias, torch.ops.aten.t, torch.ops.aten.expand):
            return out  # views move no data
        phase = "phase1" if self.state is None else self.state.phase
        ins = [t for t in tree_leaves((args, kwargs)) if self._per_token(t)]
        self.read[phase] += sum(t.numel() for t in ins)
        self.written[phase] += sum(t.numel() for t in tree_leaves(out) if self._per_token(t))
        return out


def measure(residual, tokens: int = 200) -> dict:
    """Drive ``residual`` over all its sublayers; return elements per token per sublayer (in
    units of d) read and written, per phase."""
    d, L = residual.dim, residual.n_sublayers
    if min(tokens, d) <= L + 1:
        raise ValueError(f"tokens and d must exceed L + 1 = {L + 1} (to tell activations from queries and logits)")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, d, generator=g)
    outputs = [torch.randn(tokens, d, generator=g) for _ in range(L)]
    counter = TrafficCounter(tokens, d)
    with torch.no_grad(), through_dispatcher():  # (the counter sees the operators, not their insides)
        with counter:
            state = counter.state = residual.start(x)
        for l in range(L):
            with counter:
                residual.sublayer_input(state, l)
                residual.add_output(state, l, outputs[l])
        with counter:
            residual.finish(state)
    scale = tokens * d * L
    phases = sorted(set(counter.read) | set(counter.written))
    return {p: (counter.read[p] / scale, counter.written[p] / scale) for p in phases}


def report_formula(kind: str, L: int, S: int) -> tuple[str, float]:
    """The report's Table 1 entry (report §4.2): symbolic and value, in units of d."""
    N = -(-L // S)
    if kind == "standard":
        return "3d", 3.0
    if kind == "block":
        return "(N/S + 5)d", N / S + 5
    return "(S + N)d", float(S + N)


def table(L: int, S: int, d: int, tokens: int) -> list[str]:
    N = -(-L // S)
    G = S  # Full AttnRes: Appendix-B group size chosen equal to S, as in Table 1
    rows = [
        ("standard", StandardResidual(d, L)),
        ("block", BlockAttnRes(d, L, S)),
        ("full", FullAttnRes(d, L, group_size=G)),
        ("block (naive)", BlockAttnRes(d, L, S, schedule="naive")),
        ("full (naive)", FullAttnRes(d, L, schedule="naive")),
    ]
    lines = [
        f"L={L} sublayers, S={S}, N={N} (Full AttnRes: group size {G}); d={d}, {tokens} tokens; "
        "units of d per token per sublayer",
        "",
        "| residual | phase 1 read / write | phase 2 read / write | aggregation (amortised) | total | report (Table 1) |",
        "|---|---|---|---|---:|---|",
    ]
    for name, module in rows:
        with torch.no_grad():
            for p in module.parameters():
                p.normal_()  # non-uniform depth weights (no effect on traffic, but no degenerate case)
        r = measure(module, tokens)
        cell = {p: f"{r[p][0]:.2f} / {r[p][1]:.2f}" if p in r else "-" for p in ("phase1", "phase2", "aggregation")}
        total = sum(a + b for a, b in r.values())
        kind = name.split()[0]
        sym, val = report_formula(kind, L, S)
        ref = f"{sym} = {val:.2f}d" if "naive" not in name else "-"
        lines.append(f"| {name} | {cell['phase1']} | {cell['phase2']} | {cell['aggregation']} | {total:.2f}d | {ref} |")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--L", type=positive_int, default=None, help="sublayers (default: the report's 128 and bench-infer's 32)")
    p.add_argument("--S", type=positive_int, default=None,
                   help="sublayers per block (default with --L: the models' default, ceil(L / 8): N = 8 blocks)")
    p.add_argument("--d", type=positive_int, default=160)
    p.add_argument("--tokens", type=positive_int, default=200)
    args = p.parse_args()
    if args.S is not None and args.L is None:
        p.error("--S needs --L (without --L the report's L = 128, S = 16 and bench-infer's L = 32, S = 4 are tabled)")
    if args.L is not None and args.S is None:
        args.S = ResidualConfig(kind="attnres_block").resolved_block_size(args.L)
    shapes = [(args.L, args.S)] if args.L else [(128, 16), (32, 4)]
    deepest = max(L for L, _ in shapes)
    if min(args.d, args.tokens) <= deepest + 1:  # (measure() tells activations from queries and logits by size)
        p.error(f"arguments --d and --tokens: both must exceed L + 1 = {deepest + 1}; got --d {args.d} "
                f"--tokens {args.tokens}")
    for L, S in shapes:
        print("\n".join(table(L, S, args.d, args.tokens)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
