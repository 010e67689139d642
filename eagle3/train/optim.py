"""Stage 4's optimizer and lr schedule: AdamW, or Muon on the drafter's weight matrices (``train.optimizer``).

``adamw``: one ``torch.optim.AdamW`` (betas 0.9, 0.95; weight decay on matrices only). ``muon``: speculators'
split (:func:`speculators.train.optimizers.split_named_params_for_muon`: the 2-D matrices other than the
embedding and lm head) to ``torch.optim.Muon`` with speculators' defaults (momentum, weight decay,
Newton-Schulz steps, ``match_rms_adamw`` lr scaling: ``speculators.train.config.schema.OptimizerArgs``),
everything else to the same AdamW. Each optimizer gets its own :class:`WarmupCosine` ``LambdaLR``.

A pair (Muon + AdamW) is driven through :class:`OptimizerSet` / :class:`SchedulerSet`, which expose what the
loop and the checkpoints use of a single optimizer (``step``, ``zero_grad``, ``param_groups``,
``state_dict``, ``load_state_dict``); with AdamW alone the plain torch objects are returned, so an AdamW
checkpoint's ``optimizer.pt`` and ``scheduler.pt`` are those of a single optimizer.
"""

from __future__ import annotations

import math
import warnings

__all__ = ["WarmupCosine", "OptimizerSet", "SchedulerSet", "MUON_EMULATED_BF16", "resolve_optimizer", "muon_emulated_warning",
           "build_optimizer"]


# Muon named on a CPU that emulates bfloat16 (muon_emulated_warning): said on the start line and by build_optimizer,
# for a notebook run without that line.
MUON_EMULATED_BF16 = ("this CPU emulates bfloat16, in which Muon's Newton-Schulz steps run: a training step of the CPU "
                      "default's drafter took 26.4 s with Muon vs 1.47 s with AdamW on 2 AVX2-only cores; adamw or "
                      "auto trains at the CPU's float32 rate")


def resolve_optimizer(name: str, device_type: str, native_bf16: bool | None = None) -> str:
    """``train.optimizer`` as it trains: 'adamw' or 'muon' as given; 'auto' = 'muon' on a GPU and on a CPU
    that multiplies bfloat16 in hardware (``native_bf16``; None: ask :func:`eagle3.target.cpu_has_native_bf16`:
    AMX, AVX512-BF16), 'adamw' elsewhere.

    Why: ``torch.optim.Muon`` runs its Newton-Schulz iterations in bfloat16 (about 62 GFLOP per step on the
    CPU default's drafter: 1.23x an AdamW step with native bf16); a CPU without it emulates bf16 at about
    1/100 of its float32 rate: there a training step took 26.4 s with Muon vs 1.47 s with AdamW on 2 AVX2-only
    cores, 0.055x the tokens/s (benchmarks/RESULTS.md, "CPU default levers").
    """
    if name != "auto":
        return name
    if device_type != "cpu":
        return "muon"
    if native_bf16 is None:
        from eagle3.target import cpu_has_native_bf16

        native_bf16 = cpu_has_native_bf16()
    return "muon" if native_bf16 else "adamw"


def muon_emulated_warning(name: str, device_type: str, native_bf16: bool | None = None) -> str | None:
    """Why ``train.optimizer`` ``name`` is slow on ``device_type`` (:data:`MUON_EMULATED_BF16`): 'muon' named on a
    CPU without AMX or AVX512-BF16 (``native_bf16`` as in :func:`resolve_optimizer`); None elsewhere ('auto'
    never picks Muon there). The start line (:func:`eagle3.machine.optimizer_choice`) and
    :func:`build_optimizer` both say it."""
    if name != "muon" or device_type != "cpu":
        return None
    if native_bf16 is None:
        from eagle3.target import cpu_has_native_bf16

        native_bf16 = cpu_has_native_bf16()
    return None if native_bf16 else MUON_EMULATED_BF16


class WarmupCosine:
    """lr multiplier: linear warmup over ``warmup`` steps, then cosine to ``min_ratio`` at ``total``.

    ``m(s) = (s+1)/warmup`` for ``s < warmup``; then ``min_ratio + (1-min_ratio) * (1+cos(pi p))/2``
    with ``p = (s-warmup)/(total-warmup)`` (nanoGPT's schedule; ``s`` = completed optimizer steps).
    """

    def __init__(self, warmup: int, total: int, min_ratio: float) -> None:
        self.warmup, self.total, self.min_ratio = int(warmup), int(total), float(min_ratio)

    def __call__(self, s: int) -> float:
        if s < self.warmup:
            return (s + 1) / self.warmup
        p = min(1.0, (s - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))


class OptimizerSet:
    """Several optimizers stepped together (Muon on matrices, AdamW on the rest).

    ``param_groups`` lists the last optimizer's groups first (the AdamW groups: ``param_groups[0]["lr"]``
    is the lr the loop logs, ``train.lr`` times the schedule). ``state_dict()`` is a list with one
    optimizer state per optimizer, in order.
    """

    def __init__(self, optimizers: list) -> None:
        self.optimizers = list(optimizers)

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in reversed(self.optimizers) for g in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> list[dict]:
        return [opt.state_dict() for opt in self.optimizers]

    def load_state_dict(self, states: list[dict]) -> None:
        """Raises ValueError: ``states`` is not one state per optimizer (a checkpoint of another optimizer)."""
        if not isinstance(states, list) or len(states) != len(self.optimizers):
            raise ValueError(f"the checkpoint holds the state of another optimizer ({type(states).__name__}), not of "
                             f"{len(self.optimizers)} optimizers (train.optimizer changed since it was written)")
        for opt, st in zip(self.optimizers, states):
            opt.load_state_dict(st)


class SchedulerSet:
    """One lr scheduler per optimizer of an :class:`OptimizerSet`, stepped together."""

    def __init__(self, schedulers: list) -> None:
        self.schedulers = list(schedulers)

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    def state_dict(self) -> list[dict]:
        return [s.state_dict() for s in self.schedulers]

    def load_state_dict(self, states: list[dict]) -> None:
        for s, st in zip(self.schedulers, states):
            s.load_state_dict(st)


def _adamw(named: list, train_params, fused: bool | None):
    """AdamW over ``named`` (``[(name, param)]``): weight decay on matrices, none on vectors."""
    import torch

    decay = [p for _, p in named if p.dim() >= 2]
    no_decay = [p for _, p in named if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": train_params.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=train_params.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def build_optimizer(model, train_params, total_steps: int, device_type: str):
    """The optimizer and lr scheduler of ``train.optimizer`` for the drafter's trainable parameters.

    Args:
        model: the drafter (``torch.nn.Module``); parameters without ``requires_grad`` are left out.
        train_params: :class:`eagle3.config.TrainParams` (``optimizer``, resolved by :func:`resolve_optimizer`; ``lr``, ``muon_lr``,
            ``weight_decay``, ``warmup_steps``, ``min_lr_ratio``).
        total_steps: optimizer steps of the whole run (the cosine's end).
        device_type: ``"cuda"`` uses the fused AdamW kernel.

    Returns:
        ``(optimizer, scheduler)``: ``torch.optim.AdamW`` and ``LambdaLR`` for ``adamw``;
        :class:`OptimizerSet` ``[Muon, AdamW]`` and :class:`SchedulerSet` for ``muon``.
    """
    import torch

    fused = device_type == "cuda" or None
    schedule = WarmupCosine(train_params.warmup_steps, total_steps, train_params.min_lr_ratio)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if resolve_optimizer(train_params.optimizer, device_type) == "adamw":
        opt = _adamw(named, train_params, fused)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    if slow := muon_emulated_warning(train_params.optimizer, device_type):
        warnings.warn(f"train.optimizer: muon: {slow}", stacklevel=2)
    from speculators.train.config.schema import OptimizerArgs
    from speculators.train.optimizers import split_named_params_for_muon

    spec = OptimizerArgs()  # speculators' Muon defaults
    matrices, rest = split_named_params_for_muon(model)
    optimizers = [torch.optim.Muon([p for _, p in matrices], lr=train_params.muon_lr or train_params.lr,
                                   weight_decay=spec.muon_weight_decay, momentum=spec.muon_momentum,
                                   ns_steps=spec.muon_ns_steps, adjust_lr_fn=spec.muon_adjust_lr_fn)]
    if rest:
        optimizers.append(_adamw(rest, train_params, fused))
    return OptimizerSet(optimizers), SchedulerSet([torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in optimizers])
