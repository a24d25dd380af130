"""Pure functions: depth attention and its operations (:mod:`.depth_attention`), and the
report's Table-4 ablations of it (:mod:`.ablations`)."""

from .depth_attention import OPERATIONS, Operations, check_sources, compute_dtype, depth_attention, operations

__all__ = ["depth_attention", "check_sources", "compute_dtype", "Operations", "operations", "OPERATIONS"]
