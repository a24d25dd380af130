"""attnres: Attention Residuals (Kimi Team, 2026) for PyTorch.

>>> from attnres import AttnResLM, ModelConfig
>>> model = AttnResLM(ModelConfig.preset("tiny", residual="attnres_block"))
"""

import os
import warnings
from typing import TYPE_CHECKING

# This process and its parent as they were before anything slow (importing torch): a torchrun
# worker asks to die with its agent only later, and checks then that the agent is still its
# parent (attnres.distributed.launch.exit_with_launcher).
_started = (os.getpid(), os.getppid())

with warnings.catch_warnings():  # torch's warning without NumPy, which attnres's core does not need
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch  # noqa: F401

from .lazy_exports import lazy_exports

if TYPE_CHECKING:
    from .models import PRESETS, AttnResLM, LMOutput, ModelConfig, ResidualConfig
    from .nn.residual import register_residual, registered_residuals
    from .ops import depth_attention

__version__ = "0.1.0"

# The public names, imported on first use (PEP 562): the model modules import
# torch._dynamo, about as long again as torch itself, which `attnres --version` and a
# command's argument errors need not wait for.
_EXPORTS = {
    "AttnResLM": ".models", "ModelConfig": ".models", "ResidualConfig": ".models", "LMOutput": ".models",
    "PRESETS": ".models", "register_residual": ".nn.residual", "registered_residuals": ".nn.residual",
    "depth_attention": ".ops",
}


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals(), extra=["__version__"])


# Importing attnres changes nothing outside it (no import hooks, no allocator settings) and
# reads no installed distributions (the ``attnres`` command warns about a name clash,
# attnres.name_clash): the transformers classes are registered when ``attnres.hf`` is
# imported (docs/hf.md).

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
