"""The drafter-kind registry: one :class:`DrafterKind` per kind, looked up by name.

A kind is everything that differs between drafter architectures: how a fresh drafter is built from
the run's params, how it is exported and checked, how offline decoding drafts with it and the
serving engine's ``speculative_config`` for it. The stages ask the registry by the name recorded in
params (``train.drafter``) or in an exported drafter's ``config.json`` (``speculators_model_type``,
speculators' field for the same thing); the training loop, checkpoints and the stage files do not
change with the kind. The shape follows speculators' ``SpeculatorModel.register``: one folder per kind
(``eagle3/drafters/<kind>/``) and one registry entry, the folders discovered and imported on first use
(speculators' ``registry_auto_discovery``), so that a name is known without importing every kind.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from eagle3.errors import Eagle3Error

__all__ = ["DrafterKind", "Proposer", "crop_cache", "register", "get", "names"]

_KINDS: dict[str, DrafterKind] = {}


class Proposer:
    """The offline drafting step of a kind (:mod:`eagle3.evaluate.decoding` schedules it as vLLM does).

    Attributes:
        length: how many positions the proposer's cache holds (verified positions plus the current
            chain's entries).
    """

    length: int = 0

    def combine(self, aux):
        """The target's aux hidden states ``[q, n_aux * H]`` -> the input of :meth:`step` ``[q, D]``."""
        raise NotImplementedError

    def step(self, input_ids, hidden, positions):
        """Draft over ``q`` tokens appended to the cache: ``(logits [q, draft_vocab], feedback [q, D])``."""
        raise NotImplementedError

    def to_target(self, draft_idx):
        """Draft-vocab indices -> target ids (``i + d2t[i]``)."""
        raise NotImplementedError

    def draft_probs_target(self, probs):
        """Draft probabilities ``[draft_vocab]`` scattered onto the target vocab ``[V]``."""
        raise NotImplementedError

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cache entries (the verified positions)."""
        raise NotImplementedError


def crop_cache(cache, length: int) -> None:
    """Cut a transformers ``DynamicCache`` to its first ``length`` positions (a proposer's cache after a
    round, and the target's: :mod:`eagle3.evaluate.decoding`)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


class DrafterKind:
    """What one drafter kind provides; subclass it in ``eagle3/drafters/<kind>/`` and :func:`register` it.

    The model a kind builds is trained by :class:`eagle3.train.loop.Trainer` through speculators'
    forward contract: ``model(hidden_states, input_ids, document_ids, loss_mask, position_ids,
    verifier_last_hidden_states, ttt_steps, ttt_step_loss_decay, loss_config) -> (drafts, loss,
    metrics)`` with the per-TTT-step counts of :func:`eagle3.train.metrics.metric_keys`, and it has
    ``verifier_norm`` / ``verifier_lm_head`` (the target's head over the draft vocab) and a ``config``
    whose ``speculators_model_type`` is the kind's name.

    Attributes:
        name: the registry key, ``train.drafter``'s value and the export's ``speculators_model_type``.
    """

    name: ClassVar[str] = ""

    def build(self, params, inputs, attn_implementation: str):
        """A fresh drafter (float32, CPU) for ``inputs`` (:class:`eagle3.train.model.DrafterInputs`),
        its trainable weights drawn from the current torch seed."""
        raise NotImplementedError

    def supervise_rows(self, model, loss_config: dict) -> dict | None:
        """Restrict the heads and the loss to the supervised rows (``train.supervised_rows``); returns
        the wrapped loss config, or None where the kind has no such path (the default)."""
        return None

    def export(self, model, out_dir: str | Path, verifier_name: str, dtype=None, include_embed_tokens: bool = False,
               info: dict | None = None) -> Path:
        """Write the drafter folder the serving engine loads (atomically); returns ``out_dir``."""
        raise NotImplementedError

    def check(self, cfg: dict, weights: dict, target_dir: Path, target_config) -> list[str]:
        """The kind's problems of an exported drafter against its target, one line each (``cfg``: its
        config.json, ``weights``: its tensors, ``target_config``: the target's text config).
        :func:`eagle3.drafters.check_drafter` adds the training-reference comparison."""
        raise NotImplementedError

    def load(self, drafter_dir: str | Path, target_model, settings=None, device: str = "cpu"):
        """The exported drafter for offline decoding, in the target's dtype, in eval mode."""
        raise NotImplementedError

    def proposer(self, model) -> Proposer:
        """The offline drafting step over a model from :meth:`load` (a fresh, empty cache)."""
        raise NotImplementedError

    def speculative_config(self, drafter_dir: str | Path, k: int) -> dict[str, Any]:
        """vLLM's ``speculative_config`` that serves this drafter with ``k`` draft tokens a round."""
        raise NotImplementedError


def register(name: str) -> Callable[[type[DrafterKind]], type[DrafterKind]]:
    """Class decorator: register a :class:`DrafterKind` subclass under ``name`` (one instance).

    Raises:
        ValueError: ``name`` is already registered to another class.
    """

    def wrap(cls: type[DrafterKind]) -> type[DrafterKind]:
        old = _KINDS.get(name)
        if old is not None and type(old) is not cls:
            raise ValueError(f"drafter kind {name!r} is already registered ({type(old).__qualname__})")
        cls.name = name
        _KINDS[name] = cls()
        return cls

    return wrap


def _folders() -> list[str]:
    """The kind folders of this package (``eagle3/drafters/<kind>/__init__.py``)."""
    return sorted(p.name for p in Path(__file__).parent.iterdir() if (p / "__init__.py").is_file())


def names() -> list[str]:
    """The known kinds, sorted: the kind folders and any kind registered elsewhere."""
    return sorted(set(_KINDS) | set(_folders()))


def get(name: str, error: type[Exception] = Eagle3Error) -> DrafterKind:
    """The kind ``name``, its folder imported (and so registered) on first use.

    Raises:
        error: an unknown kind, with the known kinds listed.
    """
    if name not in _KINDS and name in _folders():
        importlib.import_module(f"{__package__}.{name}")  # the folder's @register runs
    kind = _KINDS.get(name)
    if kind is None:
        raise error(f"unknown drafter kind {name!r}: the known kinds are {names()}")
    return kind
