"""Training: ``TrainConfig``, optimisers (AdamW, Muon), schedules, checkpoints, the loop.

>>> from attnres.train import load_config, train
>>> result = train(load_config("run.yaml", ["steps=200", "model.d_model=128"]))
"""

from ..checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from .config import DataConfig, TrainConfig, load_config
from .lock import RunLock, RunLocked
from .loop import Trainer, TrainingDiverged, TrainingOutOfMemory, TrainResult, train
from .optim import Muon, build_optimizer, newton_schulz
from .schedule import lr_factor

__all__ = [
    "TrainConfig",
    "DataConfig",
    "load_config",
    "train",
    "Trainer",
    "TrainResult",
    "TrainingDiverged",
    "TrainingOutOfMemory",
    "RunLock",
    "RunLocked",
    "CheckpointError",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "Muon",
    "build_optimizer",
    "newton_schulz",
    "lr_factor",
]
