"""Helpers called from the stage notebooks (kept tiny: notebooks hold narrative, not logic)."""

from __future__ import annotations

from pathlib import Path

from eagle3.config import Params
from eagle3.params_file import load_params
from eagle3.rundir import NOTEBOOKS, check_run_location, prepare_run_dir, project_root, resolve_run_dir
from eagle3.stage import RunLock, stage_record

__all__ = ["setup", "show_table", "run_dir_note"]


def setup(params_file: str | None, run_dir: str | None = None, overrides: list[str] | None = None,
          stage: int | None = None) -> tuple[Params, Path]:
    """Load params (papermill passes the run's resolved ``params.yaml``) and open the run directory.

    ``stage``: the notebook's stage (1..5). Unless that stage is complete (the notebook then only
    reads its results), this kernel becomes the run's one writer (:class:`eagle3.stage.RunLock`, held
    while the kernel lives or until it opens another run): a run another process writes is refused,
    one that ``eagle3 run`` executes this notebook for is its own. Params that only another stage reads may differ from the
    run's (a stage-1 notebook opened with the default params on a run whose stage 5 measured other
    sets): :func:`eagle3.rundir.prepare_run_dir` then keeps the run's ``params.yaml``. None: every
    difference is refused.

    A relative ``params_file`` is looked up from the current directory first, then from the
    project root (so the defaults work both in JupyterLab, whose cwd is ``notebooks/``, and headless).

    Returns:
        tuple: ``(Params, run_dir)``.

    Raises:
        ParamsError: see :func:`eagle3.params_file.load_params` and :func:`eagle3.rundir.prepare_run_dir`.
        RunLocked: another process (``eagle3 run``, another notebook's kernel) writes the run.
    """
    pf = Path(params_file) if params_file else None
    if pf is not None and not pf.is_absolute() and not pf.exists():
        alt = project_root() / pf
        if alt.exists():
            pf = alt
    # the stage tables hold whole sentences (warnings, fixes, prompts): pandas' default cuts a cell
    # at 50 characters with "…", and the executed notebook is the report's page
    import pandas as pd

    pd.set_option("display.max_colwidth", None)
    params = load_params(pf, overrides or None)
    rd = Path(run_dir) if run_dir else resolve_run_dir(params)
    check_run_location(rd)  # before the lock file is made there
    _hold_lock(rd, stage)
    rd = prepare_run_dir(params, rd, stages=None if stage is None else [stage])
    _say_which_run(rd, chosen=bool(run_dir))
    return params, rd


# the run lock this kernel holds, by run directory (a notebook kernel writes one run at a time)
_HELD: dict[Path, RunLock] = {}


def _hold_lock(run_dir: Path, stage: int | None) -> None:
    """Take ``run_dir``'s writer lock for this kernel unless the notebook's stage is complete;
    a lock held on another run is let go (the kernel now works on this one)."""
    key = run_dir.resolve()
    for other in [k for k in _HELD if k != key]:
        _HELD.pop(other).release()
    if key in _HELD or (stage is not None and stage_record(key, stage).complete):
        return
    what = f"notebook {NOTEBOOKS[stage]}" if stage is not None else "a notebook"
    _HELD[key] = RunLock(key, f"{what} (Jupyter kernel)").acquire()


def run_dir_note(run_dir: str | Path, chosen: bool) -> str:
    """One Markdown line on which run directory a notebook opened and what it will do there.

    A notebook opened in JupyterLab with the default ``run_dir = None`` lands in
    ``outputs/<run.name>``, which may be a finished run made by ``make run``: the line says so, and
    that its complete stages are read, not redone or rewritten.
    """
    from eagle3.rundir import STAGES

    done = [s for s in STAGES if stage_record(run_dir, s).complete]
    how = ("set in the parameters cell" if chosen else
           "the default `outputs/<run.name>` of the params file; set `run_dir` in the parameters cell to open another run")
    if done:
        state = (f"an existing run, stages {', '.join(map(str, done))} complete: their results are read "
                 "from disk, nothing finished is recomputed or rewritten")
    else:
        state = "no stage complete yet: this notebook runs its stage here"
    return f"**Run directory** `{Path(run_dir).resolve()}` ({how}): {state}."


def _say_which_run(run_dir: Path, chosen: bool) -> None:
    from IPython.display import Markdown, display

    display(Markdown(run_dir_note(run_dir, chosen)))


def show_table(rows, title: str | None = None, sentences: bool = False) -> None:
    """Display a dict (key -> value), a list of dicts or a pandas DataFrame as an HTML table in a notebook.

    ``sentences``: the cells hold sentences (stage 5's warnings), shown left-aligned and without the
    row index; JupyterLab right-aligns table cells, which reads well for numbers only.

    Returns None, so that a call left as a cell's last line does not show the table a second time
    (as the cell's result).
    """
    import pandas as pd
    from IPython.display import Markdown, display

    if isinstance(rows, pd.DataFrame):
        df = rows  # kept as built: its dtypes say how each column prints
    elif isinstance(rows, dict):
        df = pd.DataFrame([{"metric": k, "value": v} for k, v in rows.items()])
    else:
        df = pd.DataFrame(rows)
    if title:
        display(Markdown(f"**{title}**"))
    if sentences:
        left = [("text-align", "left")]
        display(df.style.set_properties(**dict(left)).set_table_styles([{"selector": "th", "props": left}])
                .hide(axis="index"))
    else:
        display(df)
