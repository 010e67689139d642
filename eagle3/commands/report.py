"""``eagle3 report RUN``: the executed notebooks rendered to static HTML pages that open offline,
the stage figures beside them, and the index page (its content: :mod:`eagle3.report`); and the same
index as one self-contained file, ``report/<run name>.html`` (every figure inside it, each stage
page's tables included, nothing requested outside it), to attach to a message or a ticket."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

from eagle3.errors import RunnerError
from eagle3.io import atomic_write_text, format_bytes
from eagle3.rundir import NOTEBOOKS, STAGES, RunDir

__all__ = ["NotebookUnreadable", "render_report", "render_after_run", "print_result", "static_widgets", "offline_html",
           "notebook_html", "notebook_tables", "single_file", "single_file_line"]


_REMOTE_SCRIPT = re.compile(r"<script[^>]*\bsrc=[\"']https?://[^>]*>\s*</script>", re.I)


def offline_html(body: str) -> str:
    """Remove ``<script src="https://...">`` tags (require.js, MathJax from a CDN) from nbconvert
    output, so that the report renders with no network and no failed requests."""
    return _REMOTE_SCRIPT.sub("", body)


_WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def _final_bar_html(model_id: str, state: dict) -> str | None:
    """The last state of a tqdm notebook bar (HBox of HTML, FloatProgress, HTML) as static HTML."""
    box = state.get(model_id, {})
    kids = [state.get(str(c).removeprefix("IPY_MODEL_"), {}) for c in box.get("state", {}).get("children", [])]
    if box.get("model_name") != "HBoxModel" or [k.get("model_name") for k in kids] != [
            "HTMLModel", "FloatProgressModel", "HTMLModel"]:
        return None
    pre, bar, post = (k.get("state", {}) for k in kids)
    value, top = bar.get("value") or 0, bar.get("max") or 0
    return (f"<div class='eagle3-progress'><code>{pre.get('value', '')}</code> "
            f"<progress value='{value}' max='{top}'></progress> <code>{post.get('value', '')}</code></div>")


def static_widgets(nb) -> int:
    """Replace each widget output of an executed notebook by static HTML, in place; returns how many.

    The report renders without a widget manager, where nbconvert would fall back to the widget's
    ``text/plain`` repr (a tqdm bar's *first* state, "0%"; ``VBox(children=...)``). A progress bar
    becomes its last state (from the notebook's saved widget state); an output that carries its own
    ``text/html`` (the vocab explorer's static block) keeps that; any other widget says where it runs.
    """
    state = (nb.metadata.get("widgets") or {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
    n = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data") or {}
            if _WIDGET_VIEW not in data:
                continue
            html_text = data.get("text/html") or _final_bar_html(data[_WIDGET_VIEW].get("model_id", ""), state) or (
                "<p><em>(interactive widget: open this notebook in JupyterLab)</em></p>")
            out["data"] = {"text/html": html_text}
            n += 1
    return n


class NotebookUnreadable(ValueError):
    """An executed notebook nbformat cannot read (a kernel or a disk that died while it was saved)."""


def notebook_html(nb_path: str | Path, title: str, code: bool = True) -> str:
    """An executed notebook as one HTML page that opens offline: widgets as static HTML
    (:func:`static_widgets`), no script from a CDN (:func:`offline_html`), every figure inside the page
    (nbconvert writes image outputs as ``data:`` URIs), ``title`` as its title. ``code=False`` leaves the
    code cells' sources and In/Out prompts out (markdown and outputs stay): a page of results to send,
    whose code stays in the executed notebook.

    Raises:
        NotebookUnreadable: ``nb_path`` is not a notebook nbformat can read (cut short, not JSON).
    """
    import nbformat
    from nbconvert import HTMLExporter

    try:
        nb = nbformat.read(Path(nb_path), as_version=4)
    except Exception as exc:  # noqa: BLE001 - nbformat raises NotJSONError, ValidationError, ...
        raise NotebookUnreadable(f"{type(exc).__name__}: {str(exc)[:120]}") from None
    # Widget state (tqdm bars, the vocab slider) would make nbconvert load the widget manager
    # from a CDN; the report must render offline, so widgets become static HTML first.
    static_widgets(nb)
    nb.metadata.pop("widgets", None)
    nb.metadata["title"] = title
    exporter = HTMLExporter(exclude_input=not code, exclude_input_prompt=not code, exclude_output_prompt=not code)
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": title}})
    return offline_html(body)


def render_report(run_dir: str | Path) -> Path:
    """Render the executed notebooks to HTML plus ``report/index.html`` (key numbers, figures, links).

    Returns:
        Path: ``<run_dir>/report/index.html``.

    Raises:
        RunnerError: the run directory has no executed notebooks; one of them is not a readable notebook
            (cut short: a kernel or a disk that died while it was saved).
    """
    from eagle3.report import SingleFile, index_html

    run_dir = Path(run_dir)
    nb_dir = RunDir(run_dir).executed_dir
    executed = sorted(nb_dir.glob("*.ipynb")) if nb_dir.exists() else []
    if not executed:
        raise RunnerError(f"{run_dir}: no executed notebooks in {nb_dir}; run `eagle3 run` first")
    rep = RunDir(run_dir).report_dir
    (rep / "figures").mkdir(parents=True, exist_ok=True)
    pages = []
    for nb_path in executed:
        stage = next((n for n, f in NOTEBOOKS.items() if f == nb_path.name), None)
        # Each page gets its stage's title (nbconvert's default is "Notebook" for every page).
        title = f"Stage {stage}: {STAGES[stage][3:]} ({run_dir.name})" if stage else f"{nb_path.stem} ({run_dir.name})"
        try:
            html = notebook_html(nb_path, title)
        except NotebookUnreadable as exc:
            raise RunnerError(f"{nb_path}: not a readable notebook ({exc}); run its stage again (`eagle3 run PARAMS "
                              f"--stages {stage or 'N'} --redo {stage or 'N'}`) or delete it") from None
        out = rep / (nb_path.stem + ".html")
        out.write_text(html, encoding="utf-8")
        pages.append(out.name)
    figures: dict[str, list[str]] = {}
    for name in STAGES.values():
        for png in sorted((run_dir / name).glob("*.png")):
            dst = rep / "figures" / f"{name}__{png.name}"
            shutil.copy2(png, dst)
            figures.setdefault(name, []).append(f"figures/{dst.name}")
    index = rep / "index.html"
    index.write_text(index_html(run_dir, pages, figures), encoding="utf-8")
    tables = {STAGES[n]: notebook_tables(nb_dir / f) for n, f in NOTEBOOKS.items() if (nb_dir / f).is_file()}
    atomic_write_text(single_file(run_dir), index_html(run_dir, pages, figures, SingleFile(rep, tables)))
    return index


def single_file(run_dir: str | Path) -> Path:
    """The single-file report of a run: ``report/<run name>.html`` (``report/<run name>-report.html``
    where the name is one of the report's own pages, ``index`` or a stage notebook's)."""
    rd = Path(run_dir)
    taken = {"index", *(Path(f).stem for f in NOTEBOOKS.values())}
    return RunDir(rd).report_dir / (f"{rd.name}-report.html" if rd.name in taken else f"{rd.name}.html")


def single_file_line(run_dir: str | Path) -> str:
    """What ``eagle3 report`` and ``eagle3 run`` say of the single-file report: its path and size."""
    f = single_file(run_dir)
    return f"eagle3: single-file report {f} ({format_bytes(f.stat().st_size)}, every figure inside it: attach it as it is)"


def notebook_tables(nb_path: str | Path) -> list[str]:
    """The HTML tables an executed notebook shows (its ``text/html`` outputs that hold a ``<table>``:
    DataFrames, :func:`eagle3.notebook.show_table`), in cell order; the single-file report carries them."""
    import nbformat

    nb = nbformat.read(Path(nb_path), as_version=4)
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            text = (o.get("data") or {}).get("text/html")
            text = "".join(text) if isinstance(text, list) else text
            if text and "<table" in text and "<script" not in text:
                out.append(text)
    return out


def render_after_run(run_dir: str | Path) -> Path | None:
    """The report at the end of ``eagle3 run``: :func:`render_report`, its index printed; or, when it
    cannot be rendered (e.g. nbconvert installed without its ``lab`` template, a full disk), one
    warning line on stderr with the reason and the command that renders it again.

    The stages finished and their results stand, so a failed report is not a failed run: ``eagle3
    run`` exits 0 after the warning. ``eagle3 report RUN`` renders the report alone and keeps the
    full error (a bug's traceback included). Ctrl-C is not caught.

    Returns:
        Path | None: ``<run_dir>/report/index.html``, or None when it could not be rendered.
    """
    try:
        index = render_report(run_dir)
    except Exception as exc:  # noqa: BLE001 - the stages' results stand whatever broke the rendering
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
        print(f"eagle3: warning: the report could not be rendered ({reason}); the stages' results stand in "
              f"{run_dir}; render it again with `eagle3 report {run_dir}`", file=sys.stderr, flush=True)
        return None
    print(f"eagle3: report {index}", flush=True)
    if single_file(run_dir).is_file():
        print(single_file_line(run_dir), flush=True)
    return index


def print_result(run_dir: str | Path) -> None:
    """The last lines of ``eagle3 run`` on stdout (the terminal, and a log the output is sent to): the
    result table, the parity line and the mismatch warnings (:func:`eagle3.report.summary_text`), then
    the command that serves the drafter on this machine; nothing when stage 5 has not finished."""
    from eagle3.report import summary_text
    from eagle3.stage import stage_record

    text = summary_text(run_dir)
    if not text:
        return
    cmd = stage_record(run_dir, 5).stats.get("vllm_serve_command")
    print("\n" + text + (f"\nServe it on this machine (as printed): {cmd}" if cmd else ""), flush=True)
