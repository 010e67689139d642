"""One run as the comparison page sees it: what each stage's contract says, read once.

Every file is read through its stage's own reader: ``params.yaml`` (:func:`eagle3.rundir.read_run_params`),
each ``stats.json`` (:func:`eagle3.stage.stage_record`), stage 1's samples
(:func:`eagle3.contracts.samples.read_samples`, summed by :func:`eagle3.evaluate.prompts.training_data`),
stage 4's ``metrics.jsonl`` (:func:`eagle3.train.report.load_metrics`), stage 5's ``stats.json`` grid
(:func:`eagle3.evaluate.stats.read_stats`) and ``results.json`` (:func:`eagle3.evaluate.report.read_results`).
A stage that has not finished leaves its part empty (the page shows what the run has).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.errors import RunnerError
from eagle3.rundir import EVALUATE, PARAMS_FILE, STAGES, SYNTHESIZE, TRAIN, read_run_params
from eagle3.stage import stage_record

__all__ = ["RunView", "read_run", "read_runs", "run_labels"]


@dataclass
class RunView:
    """What one run holds, per stage contract.

    Attributes:
        label: the run's name on the page (its folder name; ``parent/name`` where two runs share one).
        run_dir: the run directory.
        params: the run's params (:class:`eagle3.config.Params`).
        complete: ``{stage: finished}`` for stages 1-5.
        data: the training data (stage 1): ``conversations``, ``completion_tokens``, ``sources`` and
            ``categories`` ({name: conversations}) of the train split, ``heldout`` (held-out
            conversations); ``{}`` before stage 1 finished.
        train: stage 4's ``stats.json`` keys (``total_steps``, ``tokens_seen``, ``best_val_tau_hat``...),
            ``{}`` before it finished.
        curves: stage 4's validation records (pandas DataFrame: ``step``, ``tokens`` (training tokens
            seen by then), ``val_tau_hat``, ``val_tau_sim``, ``val_loss``), None without any.
        losses: stage 4's training records (DataFrame: ``step``, ``tokens``, ``loss``), None without any.
        stats: stage 5's :class:`eagle3.evaluate.stats.EvaluateStats`, None before stage 5 finished.
        results: stage 5's ``results.json`` (per category, per position), None before stage 5 finished.
        problems: what could not be read, in words (shown on the page).
    """

    label: str
    run_dir: Path
    params: Any
    complete: dict[int, bool]
    data: dict = field(default_factory=dict)
    train: dict = field(default_factory=dict)
    curves: Any = None
    losses: Any = None
    stats: Any = None
    results: dict | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def stages_done(self) -> str:
        """The finished stages in words: ``1-5``, ``1-4 (5 not finished)``, ``1, 2, 4 (3, 5 not finished)``,
        ``none``."""
        done = [s for s, ok in self.complete.items() if ok]
        missing = [s for s, ok in self.complete.items() if not ok]

        def text(stages: list[int]) -> str:
            run = len(stages) > 2 and stages == list(range(stages[0], stages[-1] + 1))
            return f"{stages[0]}-{stages[-1]}" if run else ", ".join(map(str, stages))

        return (text(done) if done else "none") + (f" ({text(missing)} not finished)" if missing and done else "")


def _training_data(run_dir: Path) -> dict:
    """Stage 1's train split summed (:func:`eagle3.evaluate.prompts.training_data`) and the held-out size."""
    from eagle3.contracts.samples import read_samples
    from eagle3.evaluate.prompts import training_data

    data = training_data(read_samples(run_dir))
    data.pop("hashes", None)
    data.pop("known", None)
    data["heldout"] = stage_record(run_dir, SYNTHESIZE).stats.get("samples_heldout")
    return data


def _curves(run_dir: Path):
    """(validation records, training records) of stage 4's ``metrics.jsonl``, each step once (its last
    record: a resumed training logs a step again), with the training tokens seen by each step."""
    from eagle3.train.report import load_metrics

    df = load_metrics(run_dir)
    if df.empty or "kind" not in df:
        return None, None
    tr = df[df["kind"] == "train"].drop_duplicates("step", keep="last").sort_values("step")
    tokens = tr.set_index("step")["tokens_seen"] if "tokens_seen" in tr else None
    losses = tr.assign(tokens=tr["step"].map(tokens) if tokens is not None else None)[["step", "tokens", "loss"]]
    val = df[df["kind"] == "val"].drop_duplicates("step", keep="last").sort_values("step")
    cols = [c for c in ("val_tau_hat", "val_tau_sim", "val_loss") if c in val]
    val = val.assign(tokens=val["step"].map(tokens) if tokens is not None else None)[["step", "tokens", *cols]]
    return (val if not val.empty else None), (losses if not losses.empty else None)


def _evaluation(run_dir: Path, view: RunView) -> None:
    """Stage 5's grid and results into ``view`` (a stats.json of an earlier layout is a problem named)."""
    from eagle3.evaluate.report import read_results
    from eagle3.evaluate.stats import read_stats

    try:
        view.stats = read_stats(run_dir)
        view.results = read_results(run_dir)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        view.stats, view.results = None, None
        view.problems.append(f"stage 5: {exc}")


def read_run(run_dir: str | Path, label: str | None = None) -> RunView:
    """Read one run for the comparison (module docstring).

    Raises:
        RunnerError: ``run_dir`` is not a run directory (no ``params.yaml``).
        ParamsError: its ``params.yaml`` cannot be used (:func:`eagle3.rundir.read_run_params`).
    """
    rd = Path(run_dir)
    if not (rd / PARAMS_FILE).is_file():
        raise RunnerError(f"{rd} is not a run directory (no {PARAMS_FILE}): give the run folders, "
                          f"<run.output_dir>/<run.name>, e.g. outputs/ci")
    view = RunView(label=label or rd.name, run_dir=rd, params=read_run_params(rd),
                   complete={s: stage_record(rd, s).complete for s in STAGES})
    if view.complete[SYNTHESIZE]:
        try:
            view.data = _training_data(rd)
        except (OSError, ValueError) as exc:  # SamplesError is a ValueError
            view.problems.append(f"stage 1: {exc}")
    if view.complete[TRAIN]:
        view.train = stage_record(rd, TRAIN).stats
    view.curves, view.losses = _curves(rd)
    if view.complete[EVALUATE]:
        _evaluation(rd, view)
    return view


def run_labels(run_dirs: list[Path]) -> list[str]:
    """Each run's name on the page: its folder name, ``parent/name`` where two runs share a folder name.

    Raises:
        RunnerError: a run given twice.
    """
    resolved = [Path(d).resolve() for d in run_dirs]
    dup = sorted({str(d) for d in resolved if resolved.count(d) > 1})
    if dup:
        raise RunnerError(f"eagle3 compare: {dup[0]} is given twice; name each run once")
    names = [d.name for d in resolved]
    return [d.name if names.count(d.name) == 1 else f"{d.parent.name}/{d.name}" for d in resolved]


def read_runs(run_dirs: list[str | Path]) -> list[RunView]:
    """:func:`read_run` of each run, labelled by :func:`run_labels`.

    Raises:
        RunnerError: fewer than one run, a run given twice, a folder that is not a run.
    """
    dirs = [Path(d) for d in run_dirs]
    if not dirs:
        raise RunnerError("eagle3 compare needs at least one run directory (two to compare)")
    return [read_run(d, label) for d, label in zip(dirs, run_labels(dirs))]
