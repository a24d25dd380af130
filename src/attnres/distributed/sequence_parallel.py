"""Sequence-sharded prefill (report §4.2): P ranks each hold T/P positions of the prompt.

Block representations cost ``N T d`` values per sequence in a one-process prefill. Here rank
``r`` of ``P`` runs the model on positions ``[r T/P, (r+1) T/P)`` only, so every depth source
it holds (the embedding, the completed blocks or sublayer outputs, the partial block) is
``[B, T/P, d]``: ``N (T/P) d`` per rank.

What stays local and what needs a collective:

* Depth attention - Phase 1 over the completed blocks and the Phase-2 merge with the partial
  block - mixes over depth for each token on its own, so it runs on the shard unchanged, with
  the model's own two-phase code.
* Self-attention mixes over positions: the queries of shard ``r`` need the keys and values of
  every earlier position. Each attention layer all-gathers its new K/V over the group and
  attends causally over shards ``0 .. r``. Gathering K/V rather than the normed input spares
  every rank the key/value projections of the other shards, and is no larger
  (``2 n_kv_heads head_dim <= d`` values per token once grouped-query attention shares each
  K/V head among two or more query heads).

This rides on the model's KV-cache hook (:class:`~attnres.nn.transformer.KVStore`): a cache
whose "past" is the ``r T/P`` positions before the shard makes RoPE use the true positions
and aligns the causal mask to the shard, so the model code is shared with one-process
prefill. The weights are replicated on every rank (this shards activations, not weights).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..models import AttnResLM, require_attnres_lm
from ..nn.kv_cache import KVCache


class _ShardKVExchange:
    """A :class:`~attnres.nn.transformer.KVStore` for one shard: ``update`` all-gathers the
    shard's keys/values ``[B, H_kv, T/P, D]`` from every rank and returns those of shards
    ``0 .. rank``, ``[B, H_kv, (rank + 1) T/P, D]``; with ``cache``, the whole prompt's
    keys/values are stored there too (for decoding after the prefill)."""

    def __init__(self, rank: int, world: int, shard_len: int, group, cache: KVCache | None) -> None:
        self.rank, self.world, self.shard_len, self.group, self.cache = rank, world, shard_len, group, cache

    @property
    def seq_len(self) -> int:
        """The positions before this shard: the model's ``past`` (RoPE offset, mask alignment)."""
        return self.rank * self.shard_len

    def _gather(self, x: Tensor) -> list[Tensor]:
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return parts

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        ks, vs = self._gather(k), self._gather(v)
        if self.cache is not None:
            self.cache.update(layer, torch.cat(ks, dim=2), torch.cat(vs, dim=2))
        return torch.cat(ks[: self.rank + 1], dim=2), torch.cat(vs[: self.rank + 1], dim=2)


def residual_sources(residual, state) -> list[Tensor]:
    """The depth sources a residual state holds after a forward (each ``[B, T, d]``), from
    its public history: the embedding and every completed block (Block AttnRes) or sublayer
    output (Full AttnRes), or the running sum (standard residual)."""
    completed, running = residual.history(state)
    return list(completed) + ([running] if running is not None else [])


def tensors_nbytes(tensors: list[Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a tensor held twice counts once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


@dataclass
class ShardedPrefill:
    """What :func:`sharded_prefill` returns on each rank.

    logits: ``[B, T/P, vocab]``, the positions ``start .. start + T/P`` of the prompt.
    kv_cache: with ``build_cache=True``, the whole prompt's keys/values (identical on every
        rank, so any rank can go on decoding); else ``None``.
    n_sources: depth sources the residual held (``N + 1`` for Block AttnRes with ``N``
        blocks: the embedding plus every block; ``L + 1`` for Full AttnRes; 1 for standard).
    source_bytes: bytes of those sources on this rank, measured from the tensors held:
        ``n_sources * B * (T/P) * d * element size``.
    """

    logits: Tensor
    start: int
    kv_cache: KVCache | None
    n_sources: int
    source_bytes: int


def _check_sources_described(model: AttnResLM) -> None:
    """``ValueError`` before any collective where the residual does not describe the depth
    sources it holds (the measure :func:`sharded_prefill` returns): its history was asked for
    only after every rank had run the whole prefill, and the error spoke of pipeline stages."""
    try:
        model.residual.history_layout(0)
    except ValueError:
        raise ValueError(f"sharded_prefill: residual {model.config.residual.kind!r} does not describe the depth sources "
                         "it holds (history_layout), which the prefill measures on each shard; use a residual that "
                         "does (standard, attnres_block, attnres_full)") from None


@torch.no_grad()
def sharded_prefill(model: AttnResLM, input_ids: Tensor, group=None, build_cache: bool = False) -> ShardedPrefill:
    """Prefill the prompt ``input_ids [B, T]`` (the same on every rank of ``group``, default
    the whole world) with the sequence split into ``P = group size`` equal shards; rank ``r``
    computes positions ``[r T/P, (r+1) T/P)``. Every rank of the group must call this.
    ``T`` must be divisible by ``P``, and the residual must describe its depth sources
    (``history_layout``: standard, Block and Full AttnRes do; hyper-connections, mHC and
    DenseFormer do not). See the module docstring."""
    require_attnres_lm(model, "sharded_prefill")
    model.check_input_ids(input_ids)
    _check_sources_described(model)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:  # (torch's answer for a rank outside the group: it sliced an empty shard, then torch.cat failed)
        raise ValueError(f"sharded_prefill: this process (global rank {dist.get_rank()}) is not in the group it was "
                         "given; call it on the group's ranks only")
    t = input_ids.shape[1]
    if t % world:
        raise ValueError(f"sequence length {t} must be divisible by the number of ranks {world} for sharded prefill")
    shard = t // world
    start = rank * shard
    cache = KVCache(model.config.n_layers, capacity=t) if build_cache else None
    exchange = _ShardKVExchange(rank, world, shard, group, cache)
    h, state = model.decode(input_ids[:, start:start + shard], kv_cache=exchange)
    sources = residual_sources(model.residual, state)
    logits = model.lm_head(model.norm(h))
    return ShardedPrefill(logits=logits, start=start, kv_cache=cache, n_sources=len(sources),
                          source_bytes=tensors_nbytes(sources))


def gather_sequence(x: Tensor, group=None) -> Tensor:
    """Concatenate every rank's ``x [B, T/P, ...]`` along dim 1 in rank order: ``[B, T, ...]``."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)
