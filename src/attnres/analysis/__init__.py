"""Analysis helpers: training diagnostics of the report's Fig. 5 and Fig. 8, and residuals as
depth mixing matrices with their depth-wise attention sinks (report §6.2, Fig. 9, §5.4.2)."""

from .diagnostics import block_grad_norms, depth_entropy, forward_diagnostics
from .mixing import (
    RANK_RTOL,
    DepthMixing,
    MixingForward,
    SourceStats,
    depth_mixing_matrix,
    mixing_forward,
    semiseparable_rank,
    source_stats,
)

__all__ = [
    "block_grad_norms",
    "depth_entropy",
    "forward_diagnostics",
    "depth_mixing_matrix",
    "mixing_forward",
    "semiseparable_rank",
    "source_stats",
    "DepthMixing",
    "MixingForward",
    "SourceStats",
    "RANK_RTOL",
]
