"""Pure functions: depth attention, its operations and the report's Table-4 ablations of it
(:mod:`.depth_attention`)."""

from .depth_attention import OPERATIONS, Operations, check_sources, compute_dtype, depth_attention, operations

__all__ = ["depth_attention", "check_sources", "compute_dtype", "Operations", "operations", "OPERATIONS"]
