"""Helpers called from the stage notebooks (kept tiny: notebooks hold narrative, not logic)."""

from __future__ import annotations

from pathlib import Path

from eagle3.config import Params, load_params
from eagle3.rundir import prepare_run_dir, project_root, resolve_run_dir

__all__ = ["setup", "show_table"]


def setup(params_file: str | None, run_dir: str | None = None, overrides: list[str] | None = None) -> tuple[Params, Path]:
    """Load params (papermill passes the run's resolved ``params.yaml``) and open the run directory.

    A relative ``params_file`` is looked up from the current directory first, then from the
    project root (so the defaults work both in JupyterLab, whose cwd is ``notebooks/``, and headless).

    Returns:
        tuple: ``(Params, run_dir)``.

    Raises:
        ParamsError: see :func:`eagle3.config.load_params` and :func:`eagle3.rundir.prepare_run_dir`.
    """
    pf = Path(params_file) if params_file else None
    if pf is not None and not pf.is_absolute() and not pf.exists():
        alt = project_root() / pf
        if alt.exists():
            pf = alt
    params = load_params(pf, overrides or None)
    rd = Path(run_dir) if run_dir else resolve_run_dir(params)
    return params, prepare_run_dir(params, rd)


def show_table(rows: dict | list, title: str | None = None):
    """Display a dict (key -> value) or a list of dicts as an HTML table in a notebook."""
    import pandas as pd
    from IPython.display import Markdown, display

    df = pd.DataFrame([{"metric": k, "value": v} for k, v in rows.items()]) if isinstance(rows, dict) else pd.DataFrame(rows)
    if title:
        display(Markdown(f"**{title}**"))
    display(df)
    return df
