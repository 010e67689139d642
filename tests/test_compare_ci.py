"""`eagle3 compare` and the single-file report on real runs: the CI run and a second CI-sized run that
differs in one train setting (`train.lr`), both through stage 5, opened in headless Chromium as a file
sent alone (no request may leave it), every image loaded, the differing key and both runs' τ per set
on the page. A third run, the variant without its stage 5, is shown with what it has.

The runs are the session's CI run and its `eagle3 sweep params/ci.yaml --vary train.lr=0.002` variant
(conftest: the variant trains on the CI run's stages 1-3, shared by hard links).
``EAGLE3_COMPARE_RUNS=FOLDER`` reuses finished runs ``FOLDER/ci`` and ``FOLDER/ci--lr-0.002`` instead."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from conftest import run_eagle3

from eagle3.evaluate.methods import VLLM_EAGLE3
from eagle3.evaluate.stats import read_stats
from eagle3.rundir import STAGES

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow
VARIANT = "ci--lr-0.002"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, request) -> tuple[Path, Path, Path]:
    """(the CI run, its variant with train.lr=0.002, the variant without stage 5), all in one folder:
    the session's CI sweep (conftest), or the runs ``ci`` and ``ci--lr-0.002`` of the folder
    ``EAGLE3_COMPARE_RUNS`` names (hard-linked copies)."""
    given = os.environ.get("EAGLE3_COMPARE_RUNS")
    if given:
        out = tmp_path_factory.mktemp("compare-runs")
        for name in ("ci", VARIANT):
            shutil.copytree(Path(given) / name, out / name, copy_function=os.link, symlinks=True)
    else:
        base, _, _ = request.getfixturevalue("ci_sweep")
        out = tmp_path_factory.mktemp("compare-runs")
        for name in ("ci", VARIANT):  # hard-linked copies: the session's runs stay as they are
            shutil.copytree(base.parent / name, out / name, copy_function=os.link, symlinks=True)
    partial = out / "no-eval"
    shutil.copytree(out / VARIANT, partial, copy_function=os.link, symlinks=True)
    shutil.rmtree(partial / STAGES[5])
    return out / "ci", out / VARIANT, partial


def _taus(run: Path) -> dict[str, str]:
    st = read_stats(run)
    assert st is not None and st.sets, run
    return {s: f"{e.get(VLLM_EAGLE3, 'tau'):.3f}" for s, e in st.sets.items()}


def _row(view, first_cells: list[str]) -> list[str] | None:
    """The cells of the first table row of the page that starts with ``first_cells``."""
    rows = view.page.evaluate("() => Array.from(document.querySelectorAll('tr')).map("
                              "r => Array.from(r.children).map(c => c.innerText.trim()))")
    return next((r for r in rows if r[:len(first_cells)] == first_cells), None)


def test_the_comparison_page_opens_alone_with_the_differing_key_and_every_runs_tau(runs, tmp_path):
    from _browser import launch, page_problems, require_chromium, view_alone

    ci, variant, partial = runs
    page = tmp_path / "page.html"
    r = run_eagle3("compare", str(ci), str(variant), str(partial), "--out", str(page), timeout=900)
    assert f"eagle3 compare: page {page} (" in r.stdout and (tmp_path / "page.ipynb").is_file()
    assert "over TCP" not in r.stdout + r.stderr  # the kernel talks over Unix sockets, as in `eagle3 run`
    with launch(require_chromium()) as browser:
        view, outside = view_alone(browser, page)
        assert outside == [] and view.js_errors == []
        assert len(view.imgs) >= 2 and all(i["ok"] for i in view.imgs), view.imgs  # curves, sets
        assert page_problems(view) == []
        # a page of results: the code stays in the executed notebook beside it
        assert "compare.read_runs(run_dirs)" not in view.text and "In\N{NO-BREAK SPACE}[" not in view.text
        assert "compare.read_runs(run_dirs)" in (tmp_path / "page.ipynb").read_text()
        assert _row(view, ["train.lr"]) == ["train.lr", "0.001", "0.002", "0.002"]
        assert _row(view, ["no-eval"])[2] == "1-4 (5 not finished)"
        assert "no-eval has no evaluation (stage 5 not finished): its columns are empty" in view.text
        a, b = _taus(ci), _taus(variant)
        assert a.keys() == b.keys()
        for s in a:  # the set's drafter row: τ of each run, then the run without stage 5
            assert _row(view, [s, "drafter"])[2:5] == [a[s], b[s], "—"], s
        assert "No data-scaling curve: the runs differ in train.lr" in view.text


def test_the_single_file_report_opens_alone_with_every_figure_and_the_result(runs):
    from _browser import launch, require_chromium, view_alone

    ci = runs[0]
    r = run_eagle3("report", str(ci), timeout=900)
    single = ci / "report" / "ci.html"
    assert f"eagle3: single-file report {single} (" in r.stdout
    pngs = [p for s in STAGES.values() for p in (ci / s).glob("*.png")]
    lone = ci.parent / "sent-alone" / "ci.html"  # nothing beside it: figures/ and the pages stay behind
    lone.parent.mkdir()
    shutil.copy(single, lone)
    with launch(require_chromium()) as browser:
        view, outside = view_alone(browser, lone)
        assert outside == [] and view.js_errors == []
        assert len(view.imgs) == len(pngs) and all(i["ok"] for i in view.imgs), view.imgs
        rows = view.page.evaluate("() => Array.from(document.querySelectorAll('#headline tr')).map("
                                  "r => Array.from(r.children).map(c => c.innerText.trim()))")
        for s, tau in _taus(ci).items():  # the result table: set (its label over 3 rows), method, tpf, τ, ...
            row = next(r for r in rows if r[0].split("\n")[0] == s)
            assert row[1:2] == ["EAGLE-3 drafter"] and row[3] == tau, (s, row)
        assert "The tables of stage 4's executed notebook" in view.text
