"""Stage 4: train the drafter (``train.drafter``'s kind, EAGLE-3 by default) on Stage 3's hidden states.

Entry points: :func:`run` (the stage), ``python -m eagle3.train PARAMS.yaml`` (also under
``torchrun``). The drafter's build, export and check come from its kind (:mod:`eagle3.drafters`);
``stage.py`` is the stage (export, stats), ``loop.py`` the training loop, ``checkpoint.py`` checkpoints
and resume checks, ``metrics.py`` the step's metrics, ``data.py`` batching, ``model.py`` the drafter's
inputs, loss and compile set-up.
"""

from eagle3.train.checkpoint import list_checkpoints
from eagle3.train.loop import TrainingDiverged
from eagle3.train.metrics import tau_hat
from eagle3.train.signals import TrainingInterrupted
from eagle3.train.stage import TrainStats, TrainStopped, run

__all__ = ["run", "TrainStats", "TrainStopped", "TrainingDiverged", "TrainingInterrupted", "list_checkpoints",
           "tau_hat"]
