"""`eagle3 compare`: the tables and rules of the comparison page on runs built in memory, the refusals
of the command, and the single-file report of `eagle3 report` (fast; the real runs: test_compare_ci.py)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from eagle3.cli import main
from eagle3.compare import (
    RunView,
    data_table,
    params_table,
    plot_scaling,
    run_labels,
    scaling,
    set_coverage,
    set_table,
    warnings_table,
)
from eagle3.evaluate.methods import VLLM_EAGLE3, VLLM_NGRAM, VLLM_NONE
from eagle3.evaluate.stats import EvaluateStats
from eagle3.params_file import load_params


def _stats(sets: dict[str, float], warnings: list[dict] = ()) -> EvaluateStats:
    """A stage-5 grid: per set the drafter's τ (= its tokens per forward), n-gram's and no speculation's."""
    return EvaluateStats.from_dict({
        "settings": {"k": 3, "temperature": 0.0},
        "sets": {s: {"domain": "in-distribution" if s == "heldout" else "out-of-domain", "prompts": 6,
                     "methods": {VLLM_EAGLE3: {"tau": t, "tokens_per_forward": t, "tokens_per_s": 10 * t,
                                               "speedup": 10 * t / 9.0},
                                 VLLM_NGRAM: {"tau": 2.5, "tokens_per_forward": 1.2, "tokens_per_s": 11.0},
                                 VLLM_NONE: {"tokens_per_forward": 1.0, "tokens_per_s": 9.0}}}
                 for s, t in sets.items()},
        "warnings": list(warnings)})


def _view(tmp_params, label: str, yaml: str = "", *, conversations: int | None = 18, sets=None, steps=18,
          warnings=()) -> RunView:
    params = load_params(tmp_params(yaml, f"{label}.yaml"))
    done = {1: conversations is not None, 2: True, 3: True, 4: steps is not None, 5: sets is not None}
    data = {"conversations": conversations, "completion_tokens": 48 * conversations, "sources": {"human-eval": conversations},
            "categories": {"human-eval": conversations}, "heldout": 6} if conversations else {}
    return RunView(label=label, run_dir=Path(label), params=params, complete=done, data=data,
                   train={"total_steps": steps, "tokens_seen": 400 * steps} if steps else {},
                   stats=_stats(sets, warnings) if sets is not None else None)


def test_only_the_params_that_differ_are_shown_with_each_runs_value(tmp_params):
    a = _view(tmp_params, "a", "train:\n  lr: 0.001\n")
    b = _view(tmp_params, "b", "train:\n  lr: 0.002\n")
    c = _view(tmp_params, "c", "train:\n  lr: 0.001\n  ttt_steps: 4\n")
    df = params_table([a, b, c])
    assert list(df.index) == ["train.lr", "train.ttt_steps"] and list(df.columns) == ["a", "b", "c"]
    assert df.loc["train.lr"].tolist() == ["0.001", "0.002", "0.001"]
    assert df.loc["train.ttt_steps"].tolist() == ["2", "2", "4"]
    assert params_table([a, _view(tmp_params, "a2", "train:\n  lr: 0.001\n")]).empty  # names are not compared


def test_the_data_each_run_trained_on_side_by_side(tmp_params):
    df = data_table([_view(tmp_params, "small", conversations=18), _view(tmp_params, "none", conversations=None,
                                                                         steps=None)])
    assert df.loc["training conversations"].tolist() == ["18", "—"]
    assert df.loc["completion tokens (training conversations)", "small"] == "864"
    assert df.loc["sources (conversations)", "small"] == "human-eval 18"
    assert df.loc["held-out conversations", "small"] == "6" and df.loc["training steps", "none"] == "—"


def test_a_set_measured_by_only_some_runs_is_named_not_dropped(tmp_params):
    a = _view(tmp_params, "a", sets={"general-chat": 1.04, "heldout": 1.338})
    b = _view(tmp_params, "b", sets={"heldout": 1.5})
    c = _view(tmp_params, "c", sets=None, steps=None)
    assert set_coverage([a, b, c]) == [
        "c has no evaluation (stage 5 not finished): its columns are empty",
        "set general-chat is measured by a only, not by b"]
    df = set_table([a, b, c])
    assert df.loc[("general-chat", "drafter"), ("τ", "a")] == "1.040"
    assert df.loc[("general-chat", "drafter"), ("τ", "b")] == "—"
    assert df.loc[("heldout", "drafter"), ("τ", "b")] == "1.500"
    assert df.loc[("heldout", "n-gram"), ("tokens per forward", "a")] == "1.200"
    assert df.loc[("heldout", "no speculation"), ("τ", "a")] == "—"  # no drafts: no τ
    assert df.loc[("heldout", "drafter"), ("speed-up", "b")] == f"{15.0 / 9.0:.2f}"
    assert df.loc[("heldout", "drafter"), ("tokens/s", "c")] == "—"


def test_each_runs_warnings_and_a_run_without_any(tmp_params):
    w = {"rule": "drafter_below_ngram", "message": "on heldout the drafter gives 1.3", "fix": "more data"}
    df = warnings_table([_view(tmp_params, "a", sets={"heldout": 1.3}, warnings=[w]),
                         _view(tmp_params, "b", sets={"heldout": 1.6}), _view(tmp_params, "c", steps=None)])
    assert df.values.tolist() == [["a", "drafter_below_ngram", "on heldout the drafter gives 1.3"],
                                  ["b", "", "no mismatch warning"], ["c", "—", "no evaluation"]]


def test_the_scaling_curve_only_for_runs_that_differ_in_how_much_data(tmp_params):
    small = _view(tmp_params, "n20", "synthesize:\n  limit: 20\n", conversations=15, sets={"heldout": 1.2, "general-chat": 1.0})
    big = _view(tmp_params, "n40", "synthesize:\n  limit: 40\n", conversations=30, steps=36,
                sets={"heldout": 1.4, "general-chat": 1.1})
    sc = scaling([big, small])
    assert sc.applies and sc.held.startswith("epochs held (train.epochs = ")
    assert [(p[0], p[1], p[2]) for p in sc.points] == [("n20", 15, {"heldout": 1.2, "general-chat": 1.0}),
                                                        ("n40", 30, {"heldout": 1.4, "general-chat": 1.1})]
    assert plot_scaling(sc) is not None
    big.train["total_steps"] = 18  # the same steps on more data
    assert scaling([small, big]).held == "steps held (18 training steps each)"
    held = [_view(tmp_params, f"n{n}", f"synthesize:\n  limit: {n}\ntrain:\n  max_steps: 50\n", conversations=c, sets={"heldout": 1.2})
            for n, c in ((20, 15), (40, 30))]
    assert scaling(held).held.startswith("steps held (train.max_steps = 50")
    lr = _view(tmp_params, "lr", "synthesize:\n  limit: 40\ntrain:\n  lr: 0.01\n", conversations=30, sets={"heldout": 1.4})
    no = scaling([small, lr])
    assert not no.applies and "train.lr" in no.reason and plot_scaling(no) is None
    assert "not evaluated yet" in scaling([small, _view(tmp_params, "n40b", "synthesize:\n  limit: 40\n",
                                                         conversations=30)]).reason


def test_run_labels_are_folder_names_and_a_run_given_twice_is_refused(tmp_path):
    from eagle3.errors import RunnerError

    assert run_labels([tmp_path / "x" / "ci", tmp_path / "ci--lr-0.002"]) == ["ci", "ci--lr-0.002"]
    assert run_labels([tmp_path / "x" / "ci", tmp_path / "y" / "ci"]) == ["x/ci", "y/ci"]
    with pytest.raises(RunnerError, match="given twice"):
        run_labels([tmp_path / "ci", tmp_path / "x" / ".." / "ci"])


def test_compare_refuses_a_folder_that_is_not_a_run_and_a_page_not_html(tmp_path, capsys):
    assert main(["compare", str(tmp_path)]) == 2
    assert f"{tmp_path} is not a run directory (no params.yaml)" in capsys.readouterr().err
    run = tmp_path / "ci"
    run.mkdir()
    (run / "params.yaml").write_text("run:\n  name: ci\ntracking:\n  mode: disabled\n")
    assert main(["compare", str(run), "--out", str(tmp_path / "page.md")]) == 2
    assert "the page is an HTML file" in capsys.readouterr().err


def test_the_default_page_is_named_after_the_runs_beside_the_first(tmp_path):
    from eagle3.commands.compare import default_page

    assert default_page([tmp_path / "ci", tmp_path / "ci--lr-0.002"]) == tmp_path / "ci--vs--ci--lr-0.002.html"
    many = [tmp_path / f"run-with-a-long-name-{i}" for i in range(8)]
    assert default_page(many) == tmp_path / "run-with-a-long-name-0--vs--7-runs.html"


def test_the_committed_compare_notebook_has_no_outputs_and_a_parameters_cell():
    nb = nbformat.read(Path(__file__).resolve().parent.parent / "notebooks" / "06_compare_runs.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code)
    params = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1 and "run_dirs = []" in params[0].source


# ----------------------------------------------------------------------------- the single-file report


def _executed_notebook(path: Path) -> None:
    """An executed stage-4 notebook with one table output and one text output."""
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("show_table(stats)")
    cell.outputs = [nbformat.v4.new_output("display_data", data={
        "text/html": "<table class='dataframe'><tr><th>best_step</th><td>18</td></tr></table>", "text/plain": "x"}),
        nbformat.v4.new_output("stream", text="trained\n")]
    nb.cells = [nbformat.v4.new_markdown_cell("# Stage 4"), cell]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


def test_the_single_file_report_holds_its_figures_and_the_stage_tables(tmp_path, capsys):
    import base64

    from eagle3.rundir import NOTEBOOKS

    run = tmp_path / "lr-study"
    _executed_notebook(run / "notebooks" / NOTEBOOKS[4])
    png = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==")
    (run / "04_train").mkdir(parents=True)
    (run / "04_train" / "training_curves.png").write_bytes(png)
    (run / "05_evaluate" / "logs").mkdir(parents=True)
    (run / "05_evaluate" / "logs" / "vllm_eagle3.log").write_text("engine\n")
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    single = run / "report" / "lr-study.html"
    assert f"eagle3: single-file report {single} (" in out and "KiB" in out
    text = single.read_text()
    assert f"data:image/png;base64,{base64.b64encode(png).decode()}" in text
    assert "src='figures/" not in text and "href=" not in text  # nothing beside it is linked
    assert "<th>best_step</th><td>18</td>" in text and "The tables of stage 4's executed notebook (1;" in text
    assert "Engine logs (in the run folder, 05_evaluate/logs/): vllm_eagle3.log" in text
    index = (run / "report" / "index.html").read_text()
    assert "src='figures/04_train__training_curves.png'" in index and "data:image" not in index


def test_a_run_named_like_a_report_page_gets_its_own_file_name(tmp_path):
    from eagle3.commands.report import single_file

    assert single_file(tmp_path / "index") == tmp_path / "index" / "report" / "index-report.html"
    assert single_file(tmp_path / "ci") == tmp_path / "ci" / "report" / "ci.html"


def test_a_list_item_one_run_lacks_is_shown_absent(tmp_params):
    a = _view(tmp_params, "a")
    b = _view(tmp_params, "b", "evaluate:\n  sources:\n    - {kind: file, path: my.jsonl, label: mine}\n")
    df = params_table([a, b])
    assert list(df.index) == ["evaluate.sources.0"]
    assert df.loc["evaluate.sources.0", "a"] == "(absent)" and '"label": "mine"' in df.loc["evaluate.sources.0", "b"]


def test_categories_and_draft_positions_per_set_in_the_set_tables_order(tmp_params):
    from eagle3.compare import category_table, position_table

    def results(pos: list[float]) -> dict:
        def entry(cats: dict[str, int]) -> dict:
            return {"info": {"by_category": cats},
                    "methods": {VLLM_EAGLE3: {"per_position_conditional": pos}, VLLM_NGRAM: {"per_position_conditional": [0.6]}},
                    "by_category": {c: {VLLM_EAGLE3: {"tokens_per_forward": 1.25}, VLLM_NGRAM: {"tokens_per_forward": 1.1}}
                                    for c in cats}}
        return {"sets": {"heldout": entry({"human-eval": 6}), "general-chat": entry({"math": 1, "coding": 2})}}

    a = _view(tmp_params, "a", sets={"general-chat": 1.04, "heldout": 1.3})
    b = _view(tmp_params, "b", sets={"general-chat": 1.1, "heldout": 1.4})
    a.results, b.results = results([0.5, 0.25, 0.0]), results([0.4, 0.2])
    cats = category_table([a, b])
    assert list(cats.index) == [("general-chat", "math"), ("general-chat", "coding"), ("heldout", "human-eval")]
    assert cats.loc[("general-chat", "math"), ("drafter tokens per forward", "a")] == "1.250 (1 prompt)"
    assert cats.loc[("heldout", "human-eval"), ("n-gram tokens per forward", "b")] == "1.100"
    pos = position_table([a, b])
    assert pos.loc[("heldout", "drafter"), ("position 2", "b")] == "0.200"
    assert pos.loc[("heldout", "drafter"), ("position 3", "b")] == "—"  # b drafted 2 tokens
    assert pos.loc[("general-chat", "n-gram"), ("position 1", "a")] == "0.600"
