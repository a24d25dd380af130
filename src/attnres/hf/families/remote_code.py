"""What makes a saved AttnRes directory load where ``attnres.hf`` was not imported (a plain
``lm_eval --model hf`` command line, a notebook, a Hub download): transformers' own
``trust_remote_code`` way. ``config.json`` gets an ``auto_map`` naming the classes of a small
module file written beside it, :data:`MODULE_FILE`, which imports them from the installed
``attnres`` package - no copy of the model code. transformers checks that file's imports
before it runs it, so without attnres installed it says the file "requires the following
packages that were not found in your environment: attnres".

A residual of the user's own is registered by their module: ``config.json`` names it, and the
module file imports it before its classes read the config (:mod:`.residual_module`).

Loading after ``import attnres.hf`` is unchanged: transformers prefers the registered classes
to an ``auto_map`` (no prompt, no warning, ``trust_remote_code`` or not).
"""

from __future__ import annotations

import os
from pathlib import Path

from ...nn.residual.imports import MAIN
from ...output_paths import HF_MODULE_FILE
from ...user_warning import warn_user
from .residual_module import residual_module

__all__ = ["MODULE_FILE", "KeepsItsSourceHome", "SavesAutoMap"]

#: The module file of a saved directory that ``config.json``'s ``auto_map`` names.
MODULE_FILE = HF_MODULE_FILE

_DOCSTRING = '''"""The classes of this AttnRes model, for transformers' trust_remote_code loading
(config.json's auto_map): imported from the installed attnres package with its hf extra
(pip install -e ".[hf]" in a clone of attnres); no model code is here. After `import attnres.hf`
the model loads without trust_remote_code."""
'''


class KeepsItsSourceHome:
    """Refuses transformers' ``register_for_auto_class``, which loading with
    ``trust_remote_code`` calls on the class it got from :data:`MODULE_FILE`: the class would
    then save by copying its own source file (attnres's, with its relative imports) into the
    directory, and name it in ``auto_map``."""

    @classmethod
    def register_for_auto_class(cls, auto_class=None) -> None:
        """Nothing: a saved directory names its classes through :data:`MODULE_FILE`."""


class SavesAutoMap(KeepsItsSourceHome):
    """A config whose ``save_pretrained`` writes :data:`MODULE_FILE` and names its classes in
    ``config.json``'s ``auto_map``. ``auto_classes`` gives the module the classes are
    imported from and the class of each Auto factory; ``residual_kind`` the residual, and
    ``RESIDUAL_MODULE_KEY`` the key of ``config.json`` that names the module registering it
    where it is the user's own (:mod:`.residual_module`)."""

    RESIDUAL_MODULE_KEY: str

    @classmethod
    def auto_classes(cls) -> tuple[str, dict[str, str]]:
        raise NotImplementedError

    def residual_kind(self) -> str:
        raise NotImplementedError

    def to_diff_dict(self) -> dict:
        """What ``config.json`` holds, with the module that registers a residual of the user's
        own (nothing more for a built-in one)."""
        saved = super().to_diff_dict()
        module = residual_module(self.residual_kind())
        if module is not None:
            saved[self.RESIDUAL_MODULE_KEY] = module
        return saved

    def _module_file(self, module: str, names: str) -> str:
        """:data:`MODULE_FILE`'s text: the classes' import, after that of the module that
        registers a residual of the user's own (a call, not an ``import`` statement, so that
        transformers' check of the file's imports does not take it for a package to install)."""
        registers = residual_module(self.residual_kind())
        first = "" if registers is None else (
            "from attnres.nn.residual.imports import import_residual_module\n\n"
            f"import_residual_module({registers!r}, {self.residual_kind()!r}, {self.RESIDUAL_MODULE_KEY!r})\n")
        return f"{_DOCSTRING}\n{first}from {module} import {names}  # noqa: F401\n"

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs):
        module, classes = self.auto_classes()
        self.auto_map = {auto: f"{Path(MODULE_FILE).stem}.{name}" for auto, name in classes.items()}
        if residual_module(self.residual_kind()) == MAIN:
            warn_user(f"residual {self.residual_kind()!r} is registered by this script (its __main__), which no other "
                      f"process can import: {save_directory} loads only in a process that registers it again; "
                      "move the class into a module, import it, and save again")
        if not os.path.isfile(save_directory):  # (a file there: transformers' own refusal follows)
            os.makedirs(save_directory, exist_ok=True)
            names = ", ".join(sorted(set(classes.values())))
            (Path(save_directory) / MODULE_FILE).write_text(self._module_file(module, names))
        return super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)

    def _get_files_timestamps(self, working_dir) -> dict[str, float]:
        """transformers' record of a folder's files before ``save_pretrained(DIR,
        push_to_hub=True)`` writes, whose newer files it uploads - less :data:`MODULE_FILE`,
        which :meth:`save_pretrained` writes before that record is taken: the Hub repository
        got a ``config.json`` whose ``auto_map`` named a file it lacked."""
        stamps = super()._get_files_timestamps(working_dir)
        stamps.pop(MODULE_FILE, None)
        return stamps
