"""Drafter kinds: one folder per kind (``eagle3/drafters/<kind>/``) and one registry entry.

The stages ask :func:`get` (which imports a kind's folder on first use) by the kind recorded in params (``train.drafter``) or in an exported
drafter's ``config.json`` (:func:`eagle3.contracts.drafter.kind_name`); :func:`check_drafter` is the
one check of an export, Stage 4 after exporting and Stage 5 before measuring. Registering a kind:

    from eagle3.drafters import DrafterKind, register

    @register("my_kind")
    class MyKind(DrafterKind):
        ...  # build, export, check, load, proposer, speculative_config
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3.contracts.drafter import DrafterCheckError, DrafterSettings, reference_problems
from eagle3.drafters.registry import DrafterKind, Proposer, crop_cache, get, names, register

__all__ = ["DrafterKind", "Proposer", "crop_cache", "register", "get", "names", "check_drafter"]


def check_drafter(drafter_dir: str | Path, target_dir: str | Path, raise_on_error: bool = False,
                  reference: DrafterSettings | None = None) -> list[str]:
    """Check an exported drafter against its target; returns the problems found (empty = fine).

    The kind recorded in ``config.json`` (``speculators_model_type``) checks its own format
    (:meth:`DrafterKind.check`, e.g. :func:`eagle3.drafters.eagle3.check`); with ``reference``, the
    layer ids and norm flags are compared with those the drafter was trained with
    (:func:`eagle3.contracts.drafter.reference_problems`).

    Args:
        drafter_dir: folder with ``config.json`` and ``model.safetensors``.
        target_dir: the target model directory (config.json and weights).
        raise_on_error: raise :class:`DrafterCheckError` instead of returning a non-empty list.
        reference: the settings the drafter was trained with (:func:`eagle3.contracts.drafter.settings_from_params`).

    Returns:
        list[str]: one line per problem.

    Raises:
        DrafterCheckError: with ``raise_on_error``, when a problem was found.
    """
    from safetensors.torch import load_file
    from transformers import AutoConfig

    drafter_dir, target_dir = Path(drafter_dir), Path(target_dir)
    cfg_file, w_file = drafter_dir / "config.json", drafter_dir / "model.safetensors"
    if not cfg_file.exists() or not w_file.exists():
        problems = [f"{drafter_dir}: config.json and model.safetensors are required"]
    else:
        cfg = json.loads(cfg_file.read_text())
        kind = cfg.get("speculators_model_type")
        if kind not in names():
            problems = [f"speculators_model_type is {kind!r}, not a known drafter kind ({names()})"]
        else:
            w = load_file(str(w_file))
            tcfg = AutoConfig.from_pretrained(target_dir)
            tcfg = getattr(tcfg, "text_config", None) or tcfg  # the decoder's config of a multimodal target
            problems = [*get(kind).check(cfg, w, target_dir, tcfg),
                        *(reference_problems(cfg, reference) if reference is not None else [])]
    if raise_on_error and problems:
        raise DrafterCheckError(drafter_dir, problems)
    return problems
