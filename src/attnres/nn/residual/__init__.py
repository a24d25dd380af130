"""The residual stream: every variant behind one public protocol, and the registry.

* :mod:`.base` - :class:`ResidualStream` (``start``, ``sublayer_input``, ``add_output``,
  ``finish``, ``history``, ``resume``), :class:`ResidualState`, :class:`DepthHistory`.
* :mod:`.registry` - :func:`register_residual`, :func:`residual_class`,
  :func:`registered_residuals`; :func:`build_residual` builds the module a config names.
* :mod:`.config` - :class:`ResidualConfig` (``ModelConfig.residual``), :class:`AttnResAblation`.
* Variants: :mod:`.standard` (standard, and :class:`SingleStreamResidual` to build on),
  :mod:`.full` and :mod:`.block` (AttnRes, on :mod:`.attnres_base` with its naive and
  two-phase schedules over :mod:`attnres.ops.depth_attention`), :mod:`.baselines`.
"""

# Registration order is the order of registered_residuals(): standard, Full, Block, baselines.
from .standard import SingleStreamResidual, StandardResidual  # noqa: I001
from .full import FullAttnRes
from .block import BlockAttnRes
from .attnres_base import AttnResBase
from .base import PHASES, DepthHistory, HistoryLayout, ResidualState, ResidualStream
from .baselines import MHC, DenseFormer, Highway, HyperConnections, LayerScale, MHCLite, ReZero, sinkhorn_knopp
from .config import BACKENDS, SCHEDULES, AttnResAblation, ResidualConfig
from .query import DepthQuery
from .registry import register_residual, registered_residuals, residual_class, validate_residual_config


def build_residual(config: ResidualConfig | str | dict, dim: int, n_sublayers: int) -> ResidualStream:
    """The module ``config`` names, built by its registered class (with the stream storage
    ``config.autocast_stream`` asks for, which every variant's ``start`` and ``resume`` apply,
    and AttnRes' Phase-1 sums in the autocast dtype where ``config.autocast_phase1_sums``).

    ``config`` as ``ModelConfig.residual`` takes it: a :class:`ResidualConfig`, a registered name
    or a mapping of its fields, e.g. any variant in a model of one's own,
    ``build_residual("highway", dim=256, n_sublayers=8)``. A name or a mapping is checked as a
    model's config is (:func:`validate_residual_config`); a ``ResidualConfig`` is taken as its
    model checked it."""
    if not isinstance(config, ResidualConfig):  # (a name or a mapping: "'str' object has no attribute 'kind'")
        config = ResidualConfig.from_value(config)
        validate_residual_config(config, dim, n_sublayers)
    module = residual_class(config.kind).from_config(config, dim, n_sublayers)
    module.autocast_stream = config.autocast_stream
    if config.autocast_phase1_sums:  # (validate_residual_config: an AttnRes variant's two-phase schedule)
        module.autocast_phase1_sums = True
    return module


__all__ = [
    "ResidualStream",
    "ResidualState",
    "DepthHistory",
    "HistoryLayout",
    "PHASES",
    "SingleStreamResidual",
    "StandardResidual",
    "FullAttnRes",
    "BlockAttnRes",
    "AttnResBase",
    "DepthQuery",
    "AttnResAblation",
    "ResidualConfig",
    "ReZero",
    "LayerScale",
    "Highway",
    "DenseFormer",
    "HyperConnections",
    "MHC",
    "MHCLite",
    "sinkhorn_knopp",
    "register_residual",
    "residual_class",
    "registered_residuals",
    "validate_residual_config",
    "build_residual",
    "SCHEDULES",
    "BACKENDS",
]
