"""The comparison page's figures (``matplotlib.figure.Figure``, no pyplot state) and the data-scaling
curve's rule: when the runs differ only in how many conversations they trained on."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from eagle3.compare.runs import RunView
from eagle3.compare.tables import eval_sets
from eagle3.evaluate.methods import VLLM_EAGLE3, VLLM_NGRAM

__all__ = ["DATA_SIZE_KEY", "Scaling", "scaling", "plot_curves", "plot_sets", "plot_scaling"]

# params that set how many conversations stage 1 keeps: the only keys data-scaling runs differ in
DATA_SIZE_KEY = re.compile(r"^synthesize\.(limit|sources\.\d+\.(limit|self_prompt\.count))$")


@dataclass
class Scaling:
    """Whether the runs form a data-scaling curve, and its points.

    Attributes:
        applies: the runs differ only in :data:`DATA_SIZE_KEY` params and trained on different
            numbers of conversations, every one evaluated.
        reason: why not, in words (empty when it applies).
        held: what the runs held equal while the data grew: ``steps held (...)`` or ``epochs held (...)``.
        points: ``(run label, training conversations, {set: the drafter's vLLM τ}, steps)``, by conversations.
    """

    applies: bool
    reason: str = ""
    held: str = ""
    points: list[tuple[str, int, dict[str, float | None], int | None]] = field(default_factory=list)


def _held(runs: list[RunView]) -> str:
    """``steps held`` when the runs trained the same number of steps (``train.max_steps``, or stage 4's
    ``total_steps`` alike), else ``epochs held`` (each run ``train.epochs`` over its own data)."""
    t = runs[0].params.train
    steps = {r.train.get("total_steps") for r in runs}
    if t.max_steps is not None:
        return f"steps held (train.max_steps = {t.max_steps}: more data is seen fewer times)"
    if len(steps) == 1 and None not in steps:
        return f"steps held ({steps.pop()} training steps each)"
    return f"epochs held (train.epochs = {t.epochs}: the steps grow with the data)"


def scaling(runs: list[RunView]) -> Scaling:
    """The data-scaling curve of ``runs``: τ per evaluation set against training conversations, when
    they differ only in how many conversations they trained on (:class:`Scaling`)."""
    from eagle3.params_file import differing_values

    if len(runs) < 2:
        return Scaling(False, "one run")
    keys = list(differing_values([r.params for r in runs]))
    other = [k for k in keys if not DATA_SIZE_KEY.match(k)]
    if not keys or other:
        return Scaling(False, f"the runs differ in {', '.join(other or ['nothing'])}, not only in the data size "
                              f"(synthesize.limit, a source's limit or self_prompt.count)")
    if any(not r.data or not r.stats for r in runs):
        missing = [r.label for r in runs if not r.data or not r.stats]
        return Scaling(False, f"{', '.join(missing)} not evaluated yet (stages 1 and 5 finished are needed)")
    convs = [r.data["conversations"] for r in runs]
    if len(set(convs)) < 2:
        return Scaling(False, "the runs trained on the same number of conversations")
    points = sorted(((r.label, r.data["conversations"],
                      {s: (r.stats.sets[s].get(VLLM_EAGLE3, "tau") if s in r.stats.sets else None)
                       for s in eval_sets(runs)}, r.train.get("total_steps")) for r in runs), key=lambda p: p[1])
    return Scaling(True, held=_held(runs), points=points)


def _colors(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return [cmap(i % 10) for i in range(n)]


def plot_curves(runs: list[RunView]):
    """Stage 4's curves overlaid, a color per run: validation τ̂, validation τ_sim (greedy verification
    rounds walked over the validation answers) and the loss (training: thin line; validation:
    markers), each against the optimizer step (left) and the training tokens seen (right).
    None when no run has training records."""
    from matplotlib.figure import Figure

    if not any(r.curves is not None or r.losses is not None for r in runs):
        return None
    fig = Figure(figsize=(10, 9))
    axes = fig.subplots(3, 2, squeeze=False)
    panels = (("val_tau_hat", "validation τ̂"), ("val_tau_sim", "validation τ_sim"), ("val_loss", "loss"))
    for (col, title), row in zip(panels, axes):
        for x, ax in zip(("step", "tokens"), row):
            for r, color in zip(runs, _colors(len(runs))):
                if col == "val_loss" and r.losses is not None and r.losses[x].notna().any():
                    ax.plot(r.losses[x], r.losses["loss"], color=color, lw=0.8, alpha=0.6)
                v = r.curves
                if v is not None and col in v and v[col].notna().any() and v[x].notna().any():
                    ax.plot(v[x], v[col], "o-" if col != "val_loss" else "o--", color=color, label=r.label)
            ax.set_xlabel("optimizer step" if x == "step" else "training tokens seen")
            ax.set_ylabel(title)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    axes[2][0].set_title("loss: training (line), validation (markers)", fontsize=9)
    fig.suptitle("Training curves")
    fig.tight_layout()
    return fig


def plot_sets(runs: list[RunView]):
    """Tokens per target forward of the drafter per evaluation set, a bar per run, n-gram lookup's as a
    black tick on each bar. None when no run has an evaluation."""
    import numpy as np
    from matplotlib.figure import Figure

    sets = eval_sets(runs)
    if not sets:
        return None
    fig = Figure(figsize=(max(6.5, 1.6 * len(sets) * max(1, len(runs) / 2)), 3.8))
    ax = fig.add_subplot()
    w = 0.8 / len(runs)
    for j, (r, color) in enumerate(zip(runs, _colors(len(runs)))):
        x = np.arange(len(sets)) + (j - (len(runs) - 1) / 2) * w
        st = r.stats.sets if r.stats else {}
        ax.bar(x, [(st[s].get(VLLM_EAGLE3, "tokens_per_forward") or 0) if s in st else 0 for s in sets], w,
               color=color, label=r.label)
        ng = [st[s].get(VLLM_NGRAM, "tokens_per_forward") if s in st else None for s in sets]
        ax.scatter([xi for xi, v in zip(x, ng) if v], [v for v in ng if v], marker="_", s=300, color="black",
                   label="n-gram lookup" if j == 0 else None)
    ax.set_xticks(range(len(sets)))
    ax.set_xticklabels(sets, fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("tokens per target forward (vLLM)")
    ax.set_ylim(0, max([b.get_height() for b in ax.patches] + [1.0]) * 1.35)
    ax.legend(fontsize=8, ncol=min(len(runs) + 1, 4), loc="upper center")
    ax.set_title("The drafter per evaluation set (n-gram lookup: black tick)")
    return fig


def plot_scaling(sc: Scaling):
    """The data-scaling curve: the drafter's vLLM τ per evaluation set against the training
    conversations (log scale), a line per set; None when ``sc`` does not apply."""
    from matplotlib.figure import Figure

    if not sc.applies:
        return None
    fig = Figure(figsize=(6.5, 4))
    ax = fig.add_subplot()
    sets = list(dict.fromkeys(s for p in sc.points for s in p[2]))
    for s in sets:
        pts = [(p[1], p[2][s]) for p in sc.points if p[2].get(s) is not None]
        ax.plot([c for c, _ in pts], [t for _, t in pts], "o-", label=s)
    ax.set_xscale("log")
    ax.set_xlabel("training conversations")
    ax.set_ylabel("τ of the drafter (vLLM)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"Data scaling: {sc.held}", fontsize=9)
    return fig
