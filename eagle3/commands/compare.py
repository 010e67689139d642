"""``eagle3 compare RUN [RUN ...]``: several runs side by side on one self-contained HTML page.

Executes ``notebooks/06_compare_runs.ipynb`` with papermill (``run_dirs`` = the runs), as ``eagle3 run``
executes the stage notebooks, then renders it as one page with every figure inside it and no code cell
(:func:`eagle3.commands.report.notebook_html`): a file to attach to a message or a ticket. The
executed notebook, code included, is kept beside the page (``<page>.ipynb``). What the page shows:
:mod:`eagle3.compare`.
"""

from __future__ import annotations

from pathlib import Path

from eagle3.errors import RunnerError
from eagle3.io import atomic_write_text, format_bytes
from eagle3.rundir import notebooks_dir

__all__ = ["COMPARE_NOTEBOOK", "default_page", "compare_runs"]

COMPARE_NOTEBOOK = "06_compare_runs.ipynb"
_MAX_NAME = 120  # characters of a default page name made of the run names


def default_page(run_dirs: list[str | Path]) -> Path:
    """Where the page goes by default: beside the first run, named after the runs
    (``<output_dir>/ci--vs--ci--lr-0.002.html``; ``<first>--vs--<n>-runs.html`` when that is long)."""
    dirs = [Path(d).resolve() for d in run_dirs]
    name = "--vs--".join(d.name for d in dirs)
    if len(name) > _MAX_NAME:
        name = f"{dirs[0].name}--vs--{len(dirs) - 1}-runs"
    return dirs[0].parent / f"{name}.html"


def _execute(nb_in: Path, nb_out: Path, run_dirs: list[Path], kernel: str) -> None:
    """Run the comparison notebook with papermill into ``nb_out``.

    Raises:
        RunnerError: a cell raised (its In [n], the error, the executed notebook to open).
    """
    import sys

    import papermill as pm

    from eagle3.commands.run import InterruptForwarder

    try:
        # the kernel as `eagle3 run` starts it: Unix sockets (over TCP ipykernel warns at its start), Ctrl-C
        # passed on to the running cell
        with InterruptForwarder() as fwd:
            pm.execute_notebook(str(nb_in), str(nb_out), parameters={"run_dirs": [str(d) for d in run_dirs]},
                                kernel_name=kernel, kernel_manager_class=fwd.manager_class(), cwd=str(nb_in.parent),
                                log_output=False, progress_bar=False, stdout_file=sys.stdout, stderr_file=sys.stderr)
    except pm.PapermillExecutionError as exc:
        raise RunnerError(f"the comparison notebook {nb_in.name} failed at In [{exc.exec_count}]: {exc.ename}: "
                          f"{exc.evalue}\nExecuted notebook: {nb_out}") from None


def compare_runs(run_dirs: list[str | Path], out: str | Path | None = None, kernel: str | None = None,
                 notebooks: str | Path | None = None) -> Path:
    """``eagle3 compare`` (module docstring): execute the comparison notebook on ``run_dirs`` and write
    its page to ``out`` (default :func:`default_page`); prints the page and its size; returns the page.

    Raises:
        RunnerError: no run, a run given twice, a folder that is not a run, ``out`` not ending in
            ``.html``, the notebook missing, the kernel not registered, a failed cell.
        ParamsError: a run's ``params.yaml`` cannot be used.
    """
    from eagle3.commands.report import notebook_html
    from eagle3.commands.run import KERNEL, require_kernel
    from eagle3.compare import read_runs

    dirs = [Path(d).resolve() for d in run_dirs]
    runs = read_runs(dirs)  # refuses a folder that is not a run before a kernel starts
    page = Path(out) if out else default_page(dirs)
    if page.suffix != ".html":
        raise RunnerError(f"eagle3 compare --out {page}: the page is an HTML file; name it <something>.html")
    nb_in = Path(notebooks or notebooks_dir()) / COMPARE_NOTEBOOK
    if not nb_in.is_file():
        raise RunnerError(f"the comparison notebook {nb_in} does not exist: restore it "
                          f"(`git checkout -- notebooks/{COMPARE_NOTEBOOK}`)")
    require_kernel(kernel or KERNEL)
    page.parent.mkdir(parents=True, exist_ok=True)
    nb_out = page.with_suffix(".ipynb")
    print(f"eagle3 compare: {', '.join(r.label for r in runs)} ({COMPARE_NOTEBOOK})", flush=True)
    _execute(nb_in, nb_out, dirs, kernel or KERNEL)
    # a page of results to attach: the notebook's code stays in nb_out beside it
    atomic_write_text(page, notebook_html(nb_out, "Comparison: " + " vs ".join(r.label for r in runs), code=False))
    print(f"eagle3 compare: page {page} ({format_bytes(page.stat().st_size)}, one file: every figure inside it)",
          flush=True)
    return page
