"""Pure functions: depth attention, its operations and the report's Table-4 ablations of it
(:mod:`.depth_attention`).

>>> import torch
>>> from attnres.ops import depth_attention
>>> sources = [torch.randn(2, 5, 8) for _ in range(3)]  # n = 3 sources [..., d]
>>> h, weights = depth_attention(torch.zeros(8), sources, return_weights=True)
>>> h.shape, weights.shape  # h [..., d]; weights [n, ...], uniform for the zero query
(torch.Size([2, 5, 8]), torch.Size([3, 2, 5]))
"""

from .depth_attention import OPERATIONS, Operations, check_sources, compute_dtype, depth_attention, operations

__all__ = ["depth_attention", "check_sources", "compute_dtype", "Operations", "operations", "OPERATIONS"]
