"""Optimisers: AdamW, and Muon with an AdamW part for the parameters Muon does not suit.

Muon (Jordan et al. 2024; at scale: Liu et al. 2025, "Muon is Scalable for LLM Training",
the optimiser the AttnRes report trains with) replaces the update of a weight matrix by the
orthogonalised momentum ``O = NS(M)``, where ``NS`` runs a few Newton-Schulz iterations
that push every singular value of ``M`` towards 1. As in Liu et al., the orthogonal update is
scaled by ``0.2 * sqrt(max(rows, cols))`` so that its RMS matches a typical AdamW update and
both parts share one learning rate, and weight decay is decoupled.

Which parameter goes where (:func:`param_groups`): weight matrices inside the transformer
blocks get Muon (with weight decay) - a mixture of experts' fused expert weights
(``[experts, rows, cols]``) as one matrix per expert, orthogonalised side by side; the token
embedding and the LM head get AdamW with weight decay; every 1-D parameter - RMSNorm gains
and the AttnRes pseudo-queries and key-norm gains - gets AdamW *without* weight decay
(decaying a zero-initialised query towards zero, or a gain towards zero, is not
regularisation).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

# Quintic Newton-Schulz coefficients (a, b, c) of Jordan et al.: X <- a X + b (X X^T) X + c (X X^T)^2 X.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
MUON_RMS_SCALE = 0.2


def newton_schulz(m: Tensor, steps: int = 5, eps: float = 1e-7) -> Tensor:
    """Approximately orthogonalise the matrix ``m`` (``[rows, cols]``, or ``[..., rows, cols]``:
    each matrix on its own): same singular vectors, singular values near 1 (roughly within
    [0.7, 1.2] after 5 steps). Runs in float32."""
    a, b, c = NS_COEFFICIENTS
    x = m.float()
    transpose = x.shape[-2] > x.shape[-1]
    if transpose:  # iterate on the wide orientation: the Gram matrix is the smaller one
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)  # Frobenius norm >= spectral norm, so sigma <= 1
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if transpose else x


def orthogonalise(u: Tensor, steps: int) -> Tensor:
    """:func:`newton_schulz` of a momentum matrix, also when FSDP2 shards it (a DTensor):
    Newton-Schulz needs the whole matrix, so the shards are gathered, every rank runs the
    iteration on the full matrix (the same work everywhere; a round-robin over matrices would
    spread it) and keeps its own shard of the result."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(u, DTensor):
        full = newton_schulz(u.full_tensor(), steps)
        return distribute_tensor(full, u.device_mesh, u.placements, src_data_rank=None)
    return newton_schulz(u, steps)


def param_groups(model: nn.Module, weight_decay: float, muon: bool) -> list[dict]:
    """Split ``model``'s parameters into optimiser groups (see the module docstring).

    Every group carries ``use_muon``; with ``muon=False`` the transformer matrices join
    the decayed AdamW group.
    """
    block_matrices, decayed, undecayed = [], [], []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if p.dim() < 2:
            undecayed.append(p)
        elif name.startswith(("layers.", "model.layers.")):  # native; a transformers family (attnres.hf.families)
            block_matrices.append(p)
        else:
            decayed.append(p)
    groups = [
        dict(params=block_matrices, weight_decay=weight_decay, use_muon=muon),
        dict(params=decayed, weight_decay=weight_decay, use_muon=False),
        dict(params=undecayed, weight_decay=0.0, use_muon=False),
    ]
    return [g for g in groups if g["params"]]


class Muon(torch.optim.Optimizer):
    """Muon for groups with ``use_muon=True``, AdamW for the others, in one optimiser (one
    state dict, one learning rate schedule).

    Muon step for a matrix ``W`` with gradient ``G``: ``M <- mu M + G``; the Nesterov
    direction ``U = G + mu M`` is orthogonalised, ``O = NS(U)``; then
    ``W <- (1 - lr wd) W - lr * 0.2 sqrt(max(rows, cols)) O``.
    """

    def __init__(self, groups: list[dict], lr: float, momentum: float = 0.95, ns_steps: int = 5,
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8) -> None:
        for g in groups:
            if g.get("use_muon") and any(p.dim() < 2 for p in g["params"]):
                raise ValueError("Muon groups may only hold matrices (parameters of 2 or more dimensions, "
                                 "the leading ones stacking matrices)")
        defaults = dict(lr=lr, momentum=momentum, ns_steps=ns_steps, betas=betas, eps=eps, weight_decay=0.0, use_muon=False)
        super().__init__(groups, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
            buf = state["momentum_buffer"]
            grad = p.grad.float()
            buf.mul_(mu).add_(grad)
            update = orthogonalise(grad.add(buf, alpha=mu), group["ns_steps"])
            scale = MUON_RMS_SCALE * math.sqrt(max(p.shape[-2:]))
            p.mul_(1.0 - lr * wd)
            p.add_(update.to(p.dtype), alpha=-lr * scale)

    def _adamw_step(self, group: dict) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "exp_avg" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            state["step"] += 1
            t = state["step"].item()
            grad = p.grad.float()
            state["exp_avg"].lerp_(grad, 1.0 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
            denom = (state["exp_avg_sq"] / (1.0 - beta2 ** t)).sqrt_().add_(eps)
            p.mul_(1.0 - lr * wd)
            p.add_((state["exp_avg"] / (1.0 - beta1 ** t) / denom).to(p.dtype), alpha=-lr)


def build_optimizer(model: nn.Module, config) -> torch.optim.Optimizer:
    """The optimiser named by ``config.optimizer`` (a :class:`~attnres.train.TrainConfig`).
    Every group's ``initial_lr`` is the peak rate that the schedule scales."""
    betas = (config.beta1, config.beta2)
    if config.optimizer == "muon":
        groups = param_groups(model, config.weight_decay, muon=True)
        opt: torch.optim.Optimizer = Muon(groups, lr=config.lr, momentum=config.muon_momentum,
                                          ns_steps=config.muon_ns_steps, betas=betas, eps=config.adam_eps)
    else:
        groups = [{k: v for k, v in g.items() if k != "use_muon"} for g in param_groups(model, config.weight_decay, muon=False)]
        opt = torch.optim.AdamW(groups, lr=config.lr, betas=betas, eps=config.adam_eps)
    for g in opt.param_groups:
        g["initial_lr"] = config.lr
    return opt
