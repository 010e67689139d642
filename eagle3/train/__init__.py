"""Stage 4: train the EAGLE-3 drafter (speculators' ``Eagle3DraftModel``) on Stage 3's hidden states.

Entry points: :func:`run` (the stage), ``python -m eagle3.train PARAMS.yaml`` (also under
``torchrun``). The exported drafter and its check are :mod:`eagle3.contracts.drafter`; ``stage.py``
is the stage (export, stats), ``loop.py`` the training loop, ``checkpoint.py`` checkpoints and
resume checks, ``metrics.py`` the step's metrics, ``data.py`` batching, ``model.py`` the drafter.
"""

from eagle3.contracts.drafter import check_drafter  # re-exported: the one check, also used by Stage 5
from eagle3.train.checkpoint import list_checkpoints
from eagle3.train.loop import TrainingDiverged, TrainingInterrupted
from eagle3.train.metrics import tau_hat
from eagle3.train.stage import TrainStats, TrainStopped, run

__all__ = ["run", "TrainStats", "TrainStopped", "check_drafter", "TrainingDiverged", "TrainingInterrupted", "list_checkpoints",
           "tau_hat"]
