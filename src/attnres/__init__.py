"""attnres: Attention Residuals (Kimi Team, 2026) for PyTorch.

>>> from attnres import AttnResLM, ModelConfig
>>> model = AttnResLM(ModelConfig.preset("tiny", residual="attnres_block"))
"""

import warnings

with warnings.catch_warnings():  # torch's warning without NumPy, which attnres's core does not need
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch  # noqa: F401

from .models import PRESETS, AttnResLM, LMOutput, ModelConfig, ResidualConfig
from .nn.residual import register_residual, registered_residuals
from .ops import depth_attention

__version__ = "0.1.0"

# Importing attnres changes nothing outside it (no import hooks, no allocator settings): the
# transformers classes are registered when ``attnres.hf`` is imported (docs/hf.md).


def _check_name_clash() -> None:
    from .name_clash import warn_about_clashes

    warn_about_clashes()


_check_name_clash()

__all__ = [
    "AttnResLM",
    "ModelConfig",
    "ResidualConfig",
    "LMOutput",
    "PRESETS",
    "register_residual",
    "registered_residuals",
    "depth_attention",
    "__version__",
]
