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
from typing import Any

from .standard import SingleStreamResidual, StandardResidual  # noqa: I001
from .full import FullAttnRes
from .block import BlockAttnRes
from .attnres_base import AttnResBase
from .base import PHASES, DepthHistory, HistoryLayout, ResidualState, ResidualStream
from .baselines import MHC, DenseFormer, Highway, HyperConnections, LayerScale, MHCLite, ReZero, sinkhorn_knopp
from .config import BACKENDS, SCHEDULES, AttnResAblation, ResidualConfig
from .query import DepthQuery
from .registry import register_residual, registered_residuals, residual_class, validate_residual_config


def build_residual(config: ResidualConfig | str | dict, dim: int, n_sublayers: int, **fields: Any) -> ResidualStream:
    """The module ``config`` names, built by its registered class (with the stream storage
    ``config.autocast_stream`` asks for, which every variant's ``start`` and ``resume`` apply,
    and AttnRes' Phase-1 sums in the autocast dtype where ``config.autocast_phase1_sums``).

    ``config`` as ``ModelConfig.residual`` takes it: a :class:`ResidualConfig`, a registered name
    or a mapping of its fields, e.g. any variant in a model of one's own,
    ``build_residual("highway", dim=256, n_sublayers=8)``. A name or a mapping is checked as a
    model's config is (:func:`validate_residual_config`); a ``ResidualConfig`` is taken as its
    model checked it. ``fields``: more fields of a name or a mapping,
    ``build_residual("attnres_block", 256, 8, block_size=2)`` (it was a ``TypeError``, "unexpected
    keyword argument 'block_size'")."""
    if fields:
        config = _with_fields(config, fields)
    if not isinstance(config, ResidualConfig):  # (a name or a mapping: "'str' object has no attribute 'kind'")
        config = ResidualConfig.from_value(config)
        validate_residual_config(config, dim, n_sublayers)
    module = residual_class(config.kind).from_config(config, dim, n_sublayers)
    module.autocast_stream = config.autocast_stream
    if config.autocast_phase1_sums:  # (validate_residual_config: an AttnRes variant's two-phase schedule)
        module.autocast_phase1_sums = True
    return module



def _with_fields(config: ResidualConfig | str | dict, fields: dict[str, Any]) -> dict:
    """``config`` (a name or a mapping) as a mapping with ``fields`` added; a ``ResidualConfig``
    is complete as it is and refused, naming the way to change it."""
    if isinstance(config, ResidualConfig):
        raise ValueError(f"build_residual: a ResidualConfig takes no more fields ({sorted(fields)}): change it with "
                         "dataclasses.replace(config, ...), or pass its kind's name with them")
    if isinstance(config, str):
        return {"kind": config, **fields}
    return {**config, **fields} if isinstance(config, dict) else config  # (anything else: refused as it is)


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
