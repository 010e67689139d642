"""The stage pages of the report: throughput plots not flattened by a rate over a near-zero
interval, widgets rendered as static HTML (progress bars in their final state, the vocab explorer as
a table), tables shown once, and the notebooks saying which run directory they opened."""

from __future__ import annotations

import json
import re

import nbformat
import numpy as np
import pytest

from eagle3.io import window_rates


def test_window_rates_never_divide_by_a_near_zero_interval():
    # 100 tokens/s, a point every 2 s, plus one 5 ms after a heartbeat (a batch finished) and a last
    # point 1 ms after the one before it
    pts = [(2.0 * i, 200.0 * i) for i in range(11)]
    pts.insert(6, (10.005, 1000.5))
    pts.append((20.001, 2000.1))
    rates = window_rates(pts, 1.0)
    assert all(b - a >= 1.0 for a, b, _ in rates)
    assert [r for _, _, r in rates] == pytest.approx([100.0] * len(rates))
    assert rates[0][0] == 0.0 and rates[-1][1] == 20.001  # the whole span is covered
    # points with the same time are never split; a series shorter than the window is one window
    assert window_rates([(0.0, 0.0), (1.0, 10.0), (1.0, 30.0), (1.2, 32.0)], 5.0) == [(0.0, 1.2, pytest.approx(32 / 1.2))]
    assert window_rates([(0.0, 0.0)], 1.0) == [] and window_rates([(1.0, 5.0), (1.0, 9.0)], 1.0) == []


def _timeline(run_dir, points):
    from eagle3.rundir import EXTRACT, RunDir

    sd = RunDir(run_dir).stage(EXTRACT, create=True)
    (sd / "timeline.jsonl").write_text("".join(json.dumps(p) + "\n" for p in points))


def test_extract_throughput_plot_is_not_flattened_by_an_outlier(tmp_path):
    from eagle3.extract.report import fig_throughput, throughput_windows

    # 300 tokens/s with a heartbeat every 2 s; a batch ends 4 ms after a heartbeat (the old plot drew
    # 1200 tokens / 0.004 s = 300,000 tokens/s there); then a resumed run (elapsed_s restarts)
    t0, pts, tok = 1.7e9, [], 0
    for i in range(20):
        pts.append({"t": t0 + 2 * i, "elapsed_s": 2.0 * i, "tokens": 600 * i, "tokens_per_s": 300.0})
    pts.insert(11, {"t": t0 + 20.004, "elapsed_s": 20.004, "tokens": 6001, "tokens_per_s": 300.0})
    tok = 600 * 19
    for j in range(1, 6):
        pts.append({"t": t0 + 100 + 2 * j, "elapsed_s": 2.0 * j, "tokens": tok + 300 * j, "tokens_per_s": 150.0})
    _timeline(tmp_path, pts)
    wins = throughput_windows(pts)
    rates = np.array([r for _, _, r in wins])
    assert rates.max() < 310 and rates[:-4].min() > 290 and rates[-4:] == pytest.approx(150.0)
    assert not any(a < t0 + 100 < b for a, b, _ in wins)  # no window spans the gap between two runs
    ax = fig_throughput(tmp_path).axes[1]
    lo, hi = ax.get_ylim()
    assert lo == 0 and 300 < hi < 400  # the plot's scale is the real rate


def test_synthesize_throughput_last_write_does_not_make_an_outlier(tmp_path):
    from eagle3.synthesize.report import _throughput_figure
    from eagle3.synthesize.summary import overall_rate, throughput_series

    # a batched backend: 8 samples of 48 tokens every 32 s (12 tokens/s), then one straggler written
    # 1 ms after the last batch (the old series had a 48 / 0.001 s = 48,000 tokens/s point)
    ev = [{"t": 100.0, "session_start": True}]
    for b in range(5):
        ev += [{"t": 132.0 + 32 * b, "id": f"{b}-{i}", "completion_tokens": 48} for i in range(8)]
    ev.append({"t": 260.001, "id": "late", "completion_tokens": 48})
    series = throughput_series(ev)
    # the straggler joins the last batch's window: 9 x 48 tokens over 32 s
    assert [r for _, r in series] == pytest.approx([12.0] * 4 + [9 * 48 / 32.001])
    assert series[-1][0] == (228.0, 260.001)
    assert overall_rate(ev) == round((41 * 48) / 160.001, 2)  # the totals are unchanged
    ax = _throughput_figure(ev).axes[1]
    assert ax.get_ylim()[1] < 20


def _widget_nb():
    """An executed notebook with a tqdm bar (first repr "0%", final state in the widget state), an
    output that carries its own text/html, and an unknown widget."""
    wv = "application/vnd.jupyter.widget-view+json"
    state = {
        "bar": {"model_name": "HBoxModel", "state": {"children": ["IPY_MODEL_pre", "IPY_MODEL_prog", "IPY_MODEL_post"]}},
        "pre": {"model_name": "HTMLModel", "state": {"value": "02_vocab:\u2007100%"}},
        "prog": {"model_name": "FloatProgressModel", "state": {"value": 24.0, "max": 24.0}},
        "post": {"model_name": "HTMLModel", "state": {"value": "\u200724/24\u2007[00:01&lt;00:00]"}},
        "box": {"model_name": "VBoxModel", "state": {"children": []}},
    }
    out = lambda data: nbformat.v4.new_output("display_data", data=data)  # noqa: E731
    cell = nbformat.v4.new_code_cell("x", outputs=[
        out({wv: {"model_id": "bar", "version_major": 2}, "text/plain": "02_vocab:   0%|   | 0/24"}),
        out({wv: {"model_id": "box", "version_major": 2}, "text/plain": "VBox(children=(...))",
             "text/html": "<p>static explorer</p>"}),
        out({wv: {"model_id": "gone", "version_major": 2}, "text/plain": "IntSlider(value=3)"}),
        out({"text/plain": "plain"}),
    ])
    nb = nbformat.v4.new_notebook(cells=[cell])
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": state}}
    return nb


def test_widgets_become_static_html_in_the_report():
    from nbconvert import HTMLExporter

    from eagle3.commands.report import static_widgets

    nb = _widget_nb()
    assert static_widgets(nb) == 3
    outs = nb.cells[0].outputs
    assert list(outs[0].data) == ["text/html"] and "02_vocab:\u2007100%" in outs[0].data["text/html"]
    assert "<progress value='24.0' max='24.0'>" in outs[0].data["text/html"]
    assert outs[1].data == {"text/html": "<p>static explorer</p>"}
    assert "open this notebook in JupyterLab" in outs[2].data["text/html"]
    assert outs[3].data == {"text/plain": "plain"}
    nb.metadata.pop("widgets")
    body, _ = HTMLExporter().from_notebook_node(nb)
    assert "0%|" not in body and "VBox(" not in body and "IntSlider(" not in body and "static explorer" in body


def test_a_page_without_code_keeps_markdown_and_outputs(tmp_path):
    """``notebook_html(code=False)`` (the comparison page): no code cell source and no In/Out prompt on the
    page, the markdown and every output kept; the default page shows the code."""
    import nbformat

    from eagle3.commands.report import notebook_html

    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("answer = compare_the_runs(41)\nanswer", execution_count=3)
    cell.outputs = [nbformat.v4.new_output("execute_result", {"text/plain": "42 tokens per forward"}, execution_count=3)]
    nb.cells = [nbformat.v4.new_markdown_cell("# What differs"), cell]
    path = tmp_path / "executed.ipynb"
    nbformat.write(nb, path)
    with_code, without = notebook_html(path, "t"), notebook_html(path, "t", code=False)
    for page in (with_code, without):
        assert "What differs" in page and "42 tokens per forward" in page
    prompts = (">In\N{NO-BREAK SPACE}[3]:<", ">Out[3]:<")
    assert "compare_the_runs" in with_code and all(p in with_code for p in prompts)
    assert "compare_the_runs" not in without and not any(p in without for p in prompts)


def test_vocab_explorer_carries_a_static_block_for_the_report():
    from eagle3.vocab.report import CoverageExplorer

    counts = np.zeros(64, dtype=np.int64)
    counts[:10] = np.arange(10, 0, -1)
    ex = CoverageExplorer(counts, counts, chosen_size=5)
    bundle = ex.widget()._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle  # JupyterLab renders the live widget
    static = bundle["text/html"]
    assert "Static view at the chosen draft vocab size 5" in static and ex.render_html(5) in static
    assert "nothing lost at this size" in ex.render_html(64)


def test_show_table_displays_once(monkeypatch):
    import IPython.display

    from eagle3.notebook import show_table

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda *a, **k: shown.append(a))
    assert show_table({"a": 1}, "T") is None  # nothing for the cell to show a second time
    assert len(shown) == 2  # the title and the table
    table = __import__("pandas").DataFrame({"metric": ["rounds"], "value": [939]}, dtype=object)
    show_table(table)
    assert shown[-1][0] is table  # a DataFrame is shown as built (its dtypes say how counts print)
    # stage 5's warnings are sentences: left-aligned, headers too, without the row index
    warn = __import__("pandas").DataFrame([{"rule": "drafter_below_ngram", "warning": "on general-chat the drafter "
                                            "gives 1.042 tokens per target forward", "fix": "more data"}])
    show_table(warn, sentences=True)
    page = shown[-1][0].to_html()
    assert re.search(r"#T_\w+ th \{\s*text-align: left;", page)  # the headers
    assert re.search(r"_row0_col2 \{\s*text-align: left;", page)  # every cell, the last column's included
    assert "gives 1.042 tokens per target forward</td>" in page and "row_heading" not in page


def test_notebook_setup_lets_table_cells_show_whole_sentences(tmp_path):
    """A warning's fix or a prompt is a sentence: the executed notebook (a report page) must not cut it
    at pandas' default 50 characters with '…'."""
    import pandas as pd

    from eagle3.notebook import setup
    from eagle3.rundir import project_root
    from eagle3.vocab import report_table

    pd.reset_option("display.max_colwidth")
    try:
        setup(str(project_root() / "params" / "ci.yaml"), str(tmp_path / "run"))
        fix = "train on more conversations, or add a kind: self source so the target writes general-chat prompts"
        assert fix in pd.DataFrame([{"fix": fix}])._repr_html_()  # what the notebook page shows
    finally:
        pd.reset_option("display.max_colwidth")  # setup's option is for a notebook kernel, not this test process
    # stage 2's counters: a split without one of them keeps integer columns (no 1234.0)
    counts = report_table({"tokenize_reports": {"train": {"samples": 1234, "rows": 1234},
                                                "val": {"samples": 56}}})
    assert counts.loc["samples"].tolist() == [1234, 56] and ".0" not in counts.to_string()


def test_the_setup_cell_says_which_run_directory_it_opened(tmp_path):
    from eagle3.notebook import run_dir_note
    from eagle3.rundir import STAGES
    from eagle3.stage import write_stats

    rd = tmp_path / "smollm2-135m"
    note = run_dir_note(rd, chosen=False)
    assert str(rd) in note and "default" in note and "no stage complete" in note
    for s in (1, 2):
        write_stats(rd / STAGES[s], {"x": 1})
    note = run_dir_note(rd, chosen=True)
    assert "existing run, stages 1, 2 complete" in note and "not recomputed" not in note
    assert "nothing finished is recomputed or rewritten" in note and "set in the parameters cell" in note


def test_committed_notebooks_have_no_raw_latex_and_default_to_no_run():
    from eagle3.rundir import NOTEBOOKS, notebooks_dir

    for s, name in NOTEBOOKS.items():
        nb = nbformat.read(notebooks_dir() / name, as_version=4)
        params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
        assert "run_dir = None" in params.source, name  # the run dir comes from the params, and setup says which
        if s <= 4:
            for c in nb.cells:
                if c.cell_type == "markdown":  # the report has no MathJax (offline): no $...$, no \\commands
                    assert "$" not in c.source and "\\hat" not in c.source and "\\sum" not in c.source, (name, c.source)


def test_engine_output_goes_to_its_log_file_not_the_page(tmp_path, capfd, monkeypatch):
    import os
    import subprocess
    import sys

    from eagle3.vllm_utils import engine_logs_to

    log = tmp_path / "01_synthesize" / "vllm_engine.log"
    monkeypatch.delenv("VLLM_LOGGING_CONFIG_PATH", raising=False)
    print("before", flush=True)
    with engine_logs_to(log) as path:
        # what LLM(...) does when it builds its engine: configure vLLM's logging from the environment
        from vllm.config.logging import LoggingConfig
        from vllm.logger import configure_logging_if_needed, init_logger

        configure_logging_if_needed(LoggingConfig())
        init_logger("vllm.engine").warning("engine says hello")
        os.write(2, b"(EngineCore_DP0 pid=1) INFO from the engine process\n")
        subprocess.run([sys.executable, "-c", "import sys; print('child stdout'); print('child stderr', file=sys.stderr)"],
                       check=True)
    print("after", flush=True)
    os.write(2, b"fd 2 is back\n")
    text = path.read_text()
    for line in ("engine says hello", "INFO from the engine process", "child stdout", "child stderr"):
        assert line in text
    out, err = capfd.readouterr()
    assert "before" in out and "after" in out and "fd 2 is back" in err
    assert "engine says hello" not in out + err and "child stdout" not in out + err
    init_logger("vllm.engine").warning("at shutdown")  # the engine's logger keeps its file
    assert "at shutdown" in path.read_text() and "at shutdown" not in "".join(capfd.readouterr())
    assert "VLLM_LOGGING_CONFIG_PATH" not in os.environ


IMPORT_TIME = """
import io, logging, sys
from eagle3.vllm_utils import engine_logs_to
buf = io.StringIO()
sys.stderr = buf
with engine_logs_to(sys.argv[1]):
    # vLLM's logger is not configured before an engine is made: its import-time warnings (the Triton
    # one on CPU) used to go to sys.stderr through the last-resort handler
    logging.getLogger("vllm.triton_utils.importing").warning("import-time probe")
    from vllm import LLM  # noqa: F401
logging.getLogger("vllm.x").warning("after the block")
sys.stderr = sys.__stderr__
print(repr(buf.getvalue()))
"""


def test_what_vllm_warns_at_import_goes_to_the_engine_log(tmp_path):
    """Session-14 trial: "Triton is installed, but doesn't include CPU backend. Disabling Triton."
    on stage 1's page and in the terminal, from `from vllm import LLM` inside engine_logs_to."""
    import ast
    import subprocess
    import sys

    log = tmp_path / "vllm_engine.log"
    r = subprocess.run([sys.executable, "-c", IMPORT_TIME, str(log)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    stderr_inside_and_after = ast.literal_eval(r.stdout.strip().splitlines()[-1])
    text = log.read_text()
    assert "WARNING" in text and "import-time probe" in text  # with the log's format
    assert "import-time probe" not in stderr_inside_and_after and "Triton" not in stderr_inside_and_after
    assert "after the block" in stderr_inside_and_after and "after the block" not in text  # the logger as it was
