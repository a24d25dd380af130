"""Every training-config field with its default and allowed values: the text of
``attnres train --help``."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..models.config import PRESETS, ModelConfig
from ..distributed.parallel import PARALLEL_RULES, ParallelConfig
from .config import DATA_RULES, DEFAULT_MODEL_PRESET, TRAIN_RULES, DataConfig, TrainConfig, flatten


#: What each field does, in one line: ``attnres train --help`` prints it under the field's
#: default and allowed values (the classes' docstrings say more).
MEANINGS: dict[str, str] = {
    "seed": "the seed of the initial weights and of the data order",
    "steps": "optimiser steps of the run; the learning-rate schedule spans them",
    "stop_after": "end this invocation after this many steps in all (with a checkpoint), schedule unchanged",
    "seq_len": "tokens per training sequence",
    "batch_size": "sequences per micro-batch (the global batch, over all data-parallel ranks); a step takes grad_accum",
    "grad_accum": "micro-batches per step: batch_size x grad_accum sequences a step",
    "optimizer": "adamw, or muon (orthogonalised momentum for the blocks' matrices, AdamW for the rest)",
    "lr": "the peak learning rate",
    "weight_decay": "decoupled weight decay of the 2-D weights (not of norms, biases or pseudo-queries)",
    "beta1": "AdamW's first-moment decay",
    "beta2": "AdamW's second-moment decay",
    "adam_eps": "AdamW's epsilon",
    "muon_momentum": "Muon's momentum",
    "muon_ns_steps": "Muon's Newton-Schulz iterations",
    "schedule": "cosine (to min_lr_ratio x lr), wsd (warmup, stable, linear decay) or constant",
    "warmup_steps": "linear warmup steps from 0 to lr",
    "min_lr_ratio": "the learning rate at the end of the schedule, as a share of lr",
    "decay_fraction": "wsd: the share of the steps the final decay takes",
    "grad_clip": "clip the global gradient norm to this (0: no clipping)",
    "dtype": "float32, or bfloat16 autocast (mixed precision)",
    "compile": "torch.compile the model",
    "device": "auto (CUDA when available), cpu, cuda, or cuda:N (one GPU of several, one process)",
    "cpu_allocator": "CPU runs of the command: retain freed memory for the next step, or leave malloc as is",
    "eval_every": "steps between validation losses",
    "eval_batches": "validation batches per evaluation",
    "log_every": "steps between train records (loss, lr, gradient norm, tokens/s)",
    "diagnostics_every": "steps between the Fig. 5 / Fig. 8 diagnostics (magnitudes, depth weights)",
    "checkpoint_every": "steps between checkpoints (and one at the end)",
    "keep_checkpoints": "the newest checkpoints kept; older ones are deleted",
    "out_dir": "the run's directory: config, metrics, checkpoints",
    "dist_timeout_s": "seconds a collective waits for a rank that died or stalled (not the waits for rank 0's "
                      "set-up or checkpoint)",
    "setup_timeout_s": "seconds the other ranks wait for rank 0's set-up (BPE, tokenising, verifying the checkpoint) "
                       "and for it to publish a checkpoint (hashing every shard)",
    "activation_checkpoint": "recompute activations in the backward: none, block (every sublayer), selective",
    "resume": "continue the newest valid checkpoint in out_dir, bit-exactly",
    "resume_from": "continue this checkpoint (into out_dir)",
    "init_from": "a new run from this checkpoint's weights: fresh optimiser, schedule and data position",
    "allow_data_change": "let a resumed run continue on data whose fingerprint differs from the checkpoint's",
    "allow_residual_change": "let init_from load a checkpoint's weights into another residual (Full vs Block AttnRes, "
                             "another block size)",
    "progress": "show progress on stderr: a bar on a terminal, a line per evaluation in a log",
    "tensorboard": "also write TensorBoard events under out_dir/tensorboard",
    "wandb_project": "also log to this Weights & Biases project (extra wandb)",
    "data.paths": "the training text: files, directories or glob patterns (.txt, .jsonl)",
    "data.text_field": "the field of a .jsonl line that holds its text",
    "data.tokenizer": "bpe (trained on the data), byte, or a tokenizer.json of your own",
    "data.vocab_size": "the BPE's vocabulary (the model's vocab_size follows the tokenizer)",
    "data.val_fraction": "the share of the text held out for validation",
    "data.bpe_sample": "train the BPE on about this many characters of the training split (evenly spaced pieces)",
    "data.cache_dir": "where the tokenizer and token caches go",
    "parallel.dp": "data-parallel ranks (FSDP2)",
    "parallel.tp": "tensor-parallel ranks",
    "parallel.pp": "pipeline stages",
    "parallel.pp_schedule": "the pipeline schedule",
    "parallel.pp_virtual": "virtual stages (model chunks) per pipeline stage",
    "parallel.pp_cache": "cross-stage caching of the block history (report §4.1)",
    "parallel.pp_microbatches": "micro-batches per step in the pipeline",
    "model": "the model: a preset, or model.<field> settings",
    "model.preset": "the preset the model.<field> settings start from",
    "model.from_hf": "a saved transformers model's directory to take the model from",
    "model.vocab_size": "embedding rows (set from the tokenizer when the run starts; a value given is replaced, with a warning)",
    "model.d_model": "the width d",
    "model.n_layers": "transformer blocks (2 sublayers each: L = 2 x n_layers)",
    "model.n_heads": "attention heads",
    "model.n_kv_heads": "key/value heads (grouped-query attention)",
    "model.mlp_hidden": "the SwiGLU MLP's hidden width",
    "model.max_seq_len": "the longest sequence (the RoPE tables)",
    "model.rope_theta": "RoPE's base",
    "model.norm_eps": "every RMSNorm's epsilon",
    "model.tie_embeddings": "the LM head shares the embedding's weights",
    "model.init_std": "the standard deviation of the weights' normal init",
    "model.residual.kind": "the residual: standard, attnres_full, attnres_block, a baseline or your own",
    "model.residual.block_size": "Block AttnRes' S, in sublayers (report §3.2)",
    "model.residual.schedule": "two_phase (report §4.2, fast) or naive (per sublayer): the same function",
    "model.residual.backend": "the depth-attention operators' implementation (auto: by device)",
    "model.residual.eps": "epsilon of the RMSNorm on the depth-attention keys",
    "model.residual.recompute_phase1": "recompute Phase 1's sums in the backward instead of keeping them (memory)",
    "model.residual.autocast_stream": "under autocast, store the residual stream in bfloat16 (a rounding choice)",
    "model.residual.autocast_norm_output": "under autocast, the sublayers' RMSNorms return bfloat16",
    "model.residual.autocast_phase1_sums": "under autocast, store Phase 1's weighted sums in bfloat16",
    "model.residual.full_group_size": "Full AttnRes' two-phase scheduling group (report Appendix B)",
    "model.residual.ablation.input_dependent_query": "Table 4: a query computed from the input",
    "model.residual.ablation.input_independent_mixing": "Table 4: one learned weight per source, no query or keys",
    "model.residual.ablation.sigmoid_weights": "Table 4: sigmoid weights instead of the softmax",
    "model.residual.ablation.key_norm": "RMSNorm on the keys (false: Table 4's raw keys)",
    "model.residual.ablation.heads": "Table 4: multihead depth attention",
    "model.residual.ablation.window": "Table 4: Full AttnRes over the embedding and the last W outputs",
    "model.residual.hc_streams": "Hyper-Connections' and mHC's residual streams m",
    "model.residual.sinkhorn_iters": "mHC's Sinkhorn-Knopp iterations",
    "model.residual.options": "settings of a residual registered from your own code",
    "model.hf_architecture": "build the decoder from a transformers family's modules",
    "model.hf_config": "that family's config fields beyond the ones above",
}


class _Probe:
    """A value no field accepts: validating it makes ModelConfig name what the field allows."""

    def __repr__(self) -> str:
        return "<probe>"


def _with(data: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """A copy of nested ``data`` with the dotted key set to ``value``."""
    head, _, rest = dotted.partition(".")
    copy = dict(data)
    copy[head] = _with(copy[head], rest, value) if rest else value
    return copy


def model_field_allowed(base: ModelConfig, dotted: str) -> str:
    """What ModelConfig allows for ``dotted``, as its own validation error words it (the
    model validates itself; this asks it rather than repeating its rules)."""
    leaf = dotted.rsplit(".", 1)[-1]
    try:
        ModelConfig.from_dict(_with(base.to_dict(), dotted, _Probe()))
    except ValueError as e:
        msg = str(e)
        for marker in (f".{dotted} must be ", f".{leaf} must be "):
            if marker in msg:
                return msg.split(marker, 1)[1].rsplit("; got", 1)[0]
    except Exception:  # noqa: BLE001 - a check that cannot handle the probe: fall through
        pass
    return "see attnres.ModelConfig"


def _fmt(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, str) else str(value)


def config_reference() -> str:
    """Every ``key=value`` the training config takes: default and allowed values."""
    defaults = TrainConfig(progress=False)  # the built-in defaults (progress is a display choice)
    rows = []
    for f in dataclasses.fields(TrainConfig):
        if f.name in ("model", "data", "parallel"):
            continue
        value = f.default if f.default is not dataclasses.MISSING else getattr(defaults, f.name)
        rows.append((f.name, _fmt(value), TRAIN_RULES[f.name].describe() if f.name in TRAIN_RULES else ""))
    data_defaults = DataConfig()
    for f in dataclasses.fields(DataConfig):
        rows.append((f"data.{f.name}", _fmt(getattr(data_defaults, f.name)), DATA_RULES[f.name].describe()))
    parallel_defaults = ParallelConfig()
    for name, rule in PARALLEL_RULES.items():
        rows.append((f"parallel.{name}", _fmt(getattr(parallel_defaults, name)), rule.describe()))
    model = defaults.model
    rows.append(("model", repr(DEFAULT_MODEL_PRESET), "a preset name (" + ", ".join(sorted(PRESETS)) + ") or model.<field>=..."))
    rows.append(("model.preset", repr(DEFAULT_MODEL_PRESET), "the preset the model.<field> settings change"))
    rows.append(("model.from_hf", "null", "a saved transformers directory (e.g. of `attnres upcycle`) whose model this "
                 "is, instead of a preset; with init_from=DIR, its weights too"))
    for key, value in flatten(model.to_dict()).items():
        rows.append((f"model.{key}", _fmt(value), model_field_allowed(model, key)))
    width = max(len(k) + len(v) for k, v, _ in rows) + 5
    lines = []
    for k, v, allowed in rows:
        lines.append(f"  {k} = {v}".ljust(width) + f"  {allowed}")
        if k in MEANINGS:
            lines.append(f"      {MEANINGS[k]}")
    return ("every field, as key=value (default, then allowed values), and what it does. The model: model.<field> settings, in a "
            f"YAML `model:` mapping or as overrides alike, start from preset {DEFAULT_MODEL_PRESET!r} unless "
            "model.preset names another; the model defaults below are that preset's:\n" + "\n".join(lines))

