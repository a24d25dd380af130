"""attnres: Attention Residuals (Kimi Team, 2026) for PyTorch.

>>> from attnres import AttnResLM, ModelConfig
>>> model = AttnResLM(ModelConfig.preset("tiny", residual="attnres_block"))
"""

import importlib
import importlib.util
import sys

from .models import PRESETS, AttnResLM, LMOutput, ModelConfig, ResidualConfig
from .nn.residual import register_residual, registered_residuals
from .ops import depth_attention

__version__ = "0.1.0"


class _RegisterWithTransformers:
    """Import hook: registers the Hugging Face classes (``attnres.hf``) right after
    ``transformers`` is first imported, so ``import attnres`` stays fast and works without
    transformers, and ``AutoModelForCausalLM.from_pretrained`` on an exported directory
    needs nothing beyond ``import attnres``."""

    def find_spec(self, name, path=None, target=None):
        if name != "transformers":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_register(module):
            exec_module(module)
            if f"{__name__}.hf" not in sys.modules:  # else attnres.hf is importing: it registers itself
                importlib.import_module(f"{__name__}.hf")

        spec.loader.exec_module = exec_and_register
        return spec


def _register_hf() -> None:
    """Register with transformers now if it is imported, else when it is (see above)."""
    if "transformers" in sys.modules:
        importlib.import_module(f"{__name__}.hf")  # registers on import
    elif importlib.util.find_spec("transformers") is not None:
        sys.meta_path.insert(0, _RegisterWithTransformers())


_register_hf()


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
