"""Stage 4: train the EAGLE-3 drafter (speculators' ``Eagle3DraftModel``) on Stage 3's hidden states.

Entry points: :func:`run` (the stage), :func:`check_drafter` (an exported drafter against its
target), ``python -m eagle3.train PARAMS.yaml`` (also under ``torchrun``). See ``loop.py`` for the
loop, ``data.py`` for batching, ``model.py`` for building/exporting/checking the drafter.
"""

from __future__ import annotations

from eagle3.train.model import (
    NORM_FLAGS,
    DrafterCheckError,
    TrainError,
    check_drafter,
    export_drafter,
    mapping_problems,
)

__all__ = [
    "run",
    "main",
    "check_drafter",
    "export_drafter",
    "mapping_problems",
    "TrainError",
    "TrainingDiverged",
    "TrainingInterrupted",
    "DrafterCheckError",
    "NORM_FLAGS",
    "tau_hat",
]


def __getattr__(name: str):
    # The loop pulls in speculators' training stack (seconds to import): load it on first use.
    if name in ("run", "main", "TrainingDiverged", "TrainingInterrupted", "tau_hat", "summarize", "list_checkpoints"):
        from eagle3.train import loop

        return getattr(loop, name)
    raise AttributeError(f"module 'eagle3.train' has no attribute {name!r}")
