"""The drafter for offline decoding, from its kind (:mod:`eagle3.drafters`): loaded by the kind
recorded in its ``config.json``, drafting through the kind's proposer."""

from __future__ import annotations

from pathlib import Path

from eagle3.contracts.drafter import DrafterSettings, kind_name
from eagle3.drafters import Proposer, get
from eagle3.errors import EvaluateError

__all__ = ["load_drafter", "proposer"]


def load_drafter(drafter_dir: str | Path, target_model, settings: DrafterSettings | None = None,
                 device: str = "cpu"):
    """Load an exported drafter for offline decoding, by the kind its ``config.json`` records
    (e.g. :func:`eagle3.drafters.eagle3.load_drafter`).

    Args:
        drafter_dir: directory with config.json + model.safetensors.
        target_model: the loaded target (transformers causal LM); its dtype is used.
        settings: optional overrides of the aux layer ids, norm flags and vocab mapping
            (:class:`eagle3.contracts.drafter.DrafterSettings`, e.g. the training-time values).
        device: torch device.

    Returns:
        The kind's model in eval mode, in the target's dtype.

    Raises:
        EvaluateError: no config.json, an unknown kind, or the kind's own load errors.
    """
    kind = get(kind_name(drafter_dir, EvaluateError), EvaluateError)
    return kind.load(drafter_dir, target_model, settings, device=device)


def proposer(drafter_model) -> Proposer:
    """A fresh offline drafting step (empty cache) for a model from :func:`load_drafter`, by its kind
    (``drafter_model.config.speculators_model_type``)."""
    return get(drafter_model.config.speculators_model_type, EvaluateError).proposer(drafter_model)
