"""Stage 4: train the EAGLE-3 drafter (speculators' ``Eagle3DraftModel``) on Stage 3's hidden states.

Entry points: :func:`run` (the stage), ``python -m eagle3.train PARAMS.yaml`` (also under
``torchrun``). The exported drafter and its check are :mod:`eagle3.contracts.drafter`; see
``loop.py`` for the loop, ``data.py`` for batching, ``model.py`` for building the drafter.
"""

from eagle3.contracts.drafter import check_drafter  # re-exported: the one check, also used by Stage 5
from eagle3.train.loop import TrainingDiverged, TrainingInterrupted, list_checkpoints, run, tau_hat

__all__ = ["run", "check_drafter", "TrainingDiverged", "TrainingInterrupted", "list_checkpoints", "tau_hat"]
