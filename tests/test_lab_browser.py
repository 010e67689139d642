"""Notebook 02 in a real JupyterLab (127.0.0.1, token) driven by Chromium: Run All, then move the
draft-vocab slider and type an exact size; the explorer's numbers change and are the stage's own
(``stats.json`` at the chosen size and at 8K, :class:`eagle3.vocab.mapping.Coverage` elsewhere).

The run directory is small and built through the contracts: stage 1's ``samples.jsonl`` by
:func:`eagle3.contracts.samples.write_samples` (the general-chat prompts, each answered with the next
one's text), stage 2 by the stage itself (its writers), so no pipeline run is needed.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from eagle3.io import read_json
from eagle3.rundir import NOTEBOOKS, VOCAB, RunDir, notebooks_dir, prepare_run_dir

pytestmark = pytest.mark.slow

DRAFT_VOCAB = 64
_EXPLORER = re.compile(r"draft vocab ([\d,]+): train coverage ([\d.]+)%, masked tokens lost ([\d,]+) of ([\d,]+); "
                       r"held-out coverage ([\d.]+)% \(OOV ([\d.]+)%\)")


def _samples() -> list[dict]:
    from importlib.resources import files

    recs = [json.loads(x) for x in files("eagle3.data").joinpath("general_chat.jsonl").read_text().splitlines()]
    out = []
    for i, r in enumerate(recs[:48]):
        answer = recs[(i + 1) % len(recs)]["prompt"]
        out.append({"id": r["id"], "source": r["category"], "split": "heldout" if i % 6 == 0 else "train",
                    "prompt_hash": f"h{i}", "finish_reasons": ["stop"], "prompt_tokens": 0, "completion_tokens": 0,
                    "settings": {}, "messages": [{"role": "user", "content": r["prompt"]},
                                                 {"role": "assistant", "content": answer}]})
    return out


@pytest.fixture(scope="module")
def vocab_run(tmp_path_factory):
    """A run directory with stage 1 (samples) and a complete stage 2 (draft vocab of 64 tokens)."""
    from eagle3.contracts.samples import write_samples
    from eagle3.params_file import load_params
    from eagle3.vocab import run as vocab_run_stage

    tmp = tmp_path_factory.mktemp("lab")
    params = load_params(None, ["tracking.mode=disabled", f"run.output_dir={tmp}", "run.name=lab",
                                f"vocab.draft_vocab_size={DRAFT_VOCAB}", f"vocab.cache_dir={tmp / 'cache'}"])
    rd = prepare_run_dir(params, tmp / "lab")
    write_samples(rd, _samples())
    vocab_run_stage(params, rd)
    return rd


@pytest.fixture(scope="module")
def lab(tmp_path_factory, vocab_run):
    """JupyterLab on a notebook folder holding notebook 02 with its parameters cell pointed at the run
    (as a user edits it); yields ``(base url, token)``; stopped at the end."""
    tmp = tmp_path_factory.mktemp("labserver")
    nbdir = tmp / "notebooks"
    nbdir.mkdir()
    nb = nbformat.read(notebooks_dir() / NOTEBOOKS[2], as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    cell.source = (f'params_file = "{vocab_run / "params.yaml"}"\nrun_dir = "{vocab_run}"\noverrides = []')
    nbformat.write(nb, nbdir / NOTEBOOKS[2])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = secrets.token_hex(16)
    cmd = [str(Path(sys.executable).parent / "jupyter"), "lab", "--no-browser", "--allow-root", "--ip=127.0.0.1",
           f"--port={port}", f"--ServerApp.token={token}", f"--notebook-dir={nbdir}",
           f"--ServerApp.runtime_dir={tmp / 'runtime'}", "--LabApp.news_url=",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    # every cell in the DOM (JupyterLab 4 detaches cells scrolled out of view by default)
    settings = tmp / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp / "config"), JUPYTERLAB_WORKSPACES_DIR=str(tmp / "ws"),
               JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"))
    log = open(tmp / "lab.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        t0 = time.time()
        while f"127.0.0.1:{port}/lab" not in (tmp / "lab.log").read_text():
            assert proc.poll() is None and time.time() - t0 < 180, (tmp / "lab.log").read_text()[-3000:]
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}", token
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()



def _numbers(text: str) -> dict:
    m = _EXPLORER.search(text)
    assert m, text[:500]
    size, cov, lost, total, hcov, oov = m.groups()
    return {"size": int(size.replace(",", "")), "coverage": float(cov) / 100, "lost": int(lost.replace(",", "")),
            "total": int(total.replace(",", "")), "heldout_coverage": float(hcov) / 100, "oov": float(oov) / 100}


def _start_kernel(page, base: str, token: str, timeout_s: float = 180) -> None:
    """Wait until the notebook's kernel runs (the server lists its session, kernel idle). When the
    kernel specs load after the notebook opened (a busy machine), JupyterLab asks which kernel to
    start, with the notebook's own preselected: accept it, as a user would."""
    import urllib.request

    t0 = time.time()
    while time.time() - t0 < timeout_s:
        dialog = page.query_selector(".jp-Dialog")
        if dialog is not None and "Select Kernel" in dialog.inner_text():
            assert "eagle3 (.venv)" in dialog.query_selector("select").evaluate("s => s.options[s.selectedIndex].text")
            dialog.query_selector(".jp-Dialog-button.jp-mod-accept").click()
        with urllib.request.urlopen(f"{base}/api/sessions?token={token}", timeout=10) as r:
            sessions = json.loads(r.read())
        if any(x["kernel"]["name"] == "eagle3" and x["kernel"]["execution_state"] == "idle" for x in sessions):
            return
        time.sleep(1)
    raise AssertionError("the kernel eagle3 (.venv) did not start")


def test_notebook_02_slider_in_jupyterlab(lab, vocab_run, tmp_path):
    from _browser import launch, require_chromium

    from eagle3.vocab import CoverageExplorer

    base, token = lab
    stats = read_json(RunDir(vocab_run).stats(VOCAB))
    stats_bytes = RunDir(vocab_run).stats(VOCAB).read_bytes()
    ex = CoverageExplorer.from_run(vocab_run)
    with launch(require_chromium()) as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        try:
            page.goto(f"{base}/lab/tree/{NOTEBOOKS[2]}?token={token}", wait_until="domcontentloaded", timeout=120_000)
            page.wait_for_selector(".jp-NotebookPanel .jp-Cell", timeout=120_000)
            _start_kernel(page, base, token)
            page.click("li.lm-MenuBar-item:has-text('Run')")
            page.click("li.lm-Menu-item[data-command='runmenu:run-all']")
            html_out = page.wait_for_selector(".widget-html-content:has-text('draft vocab')", timeout=300_000)
            # the live widget, not the static fallback block
            handle = page.wait_for_selector(".widget-slider .noUi-handle", timeout=60_000)
            first = _numbers(html_out.inner_text())
            # at the chosen size the explorer says what the stage wrote
            assert first["size"] == stats["draft_vocab_size"] == DRAFT_VOCAB
            assert first["coverage"] == pytest.approx(stats["coverage"], abs=5e-7)
            assert first["oov"] == pytest.approx(stats["heldout_oov_rate"], abs=5e-7)
            assert first["total"] == stats["masked_tokens"]

            # drag the slider handle to 55% of the (log2) track: about 2^(0.55 * log2 49152) ~ 380 tokens
            handle.scroll_into_view_if_needed()
            track = page.query_selector(".widget-slider .noUi-target").bounding_box()
            box = handle.bounding_box()
            y = box["y"] + box["height"] / 2
            page.mouse.move(box["x"] + box["width"] / 2, y)
            page.mouse.down()
            page.mouse.move(track["x"] + 0.55 * track["width"], y, steps=10)
            page.mouse.up()
            page.wait_for_function("(s) => !document.querySelector('.widget-html-content').innerText.includes(s)",
                                   arg=f"draft vocab {DRAFT_VOCAB}:", timeout=60_000)
            moved = _numbers(page.query_selector(".widget-html-content").inner_text())
            assert moved["size"] > DRAFT_VOCAB and moved != first
            want = ex.summary(moved["size"])
            assert moved["coverage"] == pytest.approx(want["coverage"], abs=5e-7) and moved["coverage"] > first["coverage"]
            assert moved["lost"] == want["masked_tokens_lost"] < first["lost"]
            assert moved["oov"] == pytest.approx(want["heldout_oov_rate"], abs=5e-7)
            exact = page.query_selector(".widget-text input")
            assert int(exact.input_value()) == moved["size"]

            # an exact size: 8192, one of the sizes stats.json records
            exact.fill("8192")
            exact.press("Enter")
            page.wait_for_function("() => document.querySelector('.widget-html-content').innerText.includes('draft vocab 8,192:')",
                                   timeout=60_000)
            at8k = _numbers(page.query_selector(".widget-html-content").inner_text())
            assert at8k["coverage"] == pytest.approx(stats["coverage_at_8k"], abs=5e-7)
            assert at8k["oov"] == pytest.approx(ex.summary(8192)["heldout_oov_rate"], abs=5e-7)
            errs = page.query_selector_all(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.error']")
            assert errs == [] and errors == []
        except BaseException:
            page.screenshot(path=str(tmp_path / "failed.png"))  # what the browser showed, for the log
            print(f"screenshot: {tmp_path / 'failed.png'}")
            raise
    # opening the finished stage in JupyterLab rewrote nothing
    assert RunDir(vocab_run).stats(VOCAB).read_bytes() == stats_bytes
