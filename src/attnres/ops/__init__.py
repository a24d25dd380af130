"""Pure functions: the reference depth attention and the two-phase building blocks."""

from .depth_attention import check_sources, depth_attention
from .two_phase import (
    PartialAttention,
    attend_with_stats,
    compute_dtype,
    decoding,
    finalize,
    full_precision,
    merge_partial_sum,
    merge_partials,
    merge_with_one_source,
    merge_with_sources,
    merge_with_sources_lse,
    rms_inverse,
    rms_logits,
    source_logits,
    weighted_sum,
    weighted_sums,
)
from .recompute import depth_merge_reference, lean_depth_merge, lean_phase1, lean_rms_logits, phase1_reference, tap_source

__all__ = [
    "depth_attention",
    "check_sources",
    "PartialAttention",
    "attend_with_stats",
    "merge_partials",
    "finalize",
    "compute_dtype",
    "full_precision",
    "rms_inverse",
    "source_logits",
    "weighted_sum",
    "weighted_sums",
    "merge_with_sources",
    "merge_with_sources_lse",
    "merge_with_one_source",
    "rms_logits",
    "merge_partial_sum",
    "decoding",
    "lean_rms_logits",
    "lean_depth_merge",
    "lean_phase1",
    "phase1_reference",
    "tap_source",
    "depth_merge_reference",
]
