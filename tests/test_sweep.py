"""`eagle3 sweep`: variant names, the refusal of keys stages 1-3 read, stages 1-3 shared by hard links
(recorded in inputs.json), resume, and the comparison table; on notebooks made by the test (each stage
a few lines through StageRun) and, marked slow, a real two-variant sweep of params/ci.yaml."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from eagle3.cli import main
from eagle3.commands.run import run_pipeline
from eagle3.commands.sweep import parse_vary, plan_variants, run_sweep, share_stages, variant_name
from eagle3.errors import ParamsError, RunnerError, StageFailed
from eagle3.io import read_json
from eagle3.rundir import NOTEBOOKS, STAGES
from eagle3.stage import shared_from, write_stats

ROOT = Path(__file__).resolve().parent.parent

# ----------------------------------------------------------------------------- names and refusals


def test_variant_names_are_readable_folder_names_in_vary_order():
    assert variant_name("ci", {"train.lr": "1e-3", "train.num_layers": "2"}) == "ci--lr-1e-3--num_layers-2"
    # two varied keys ending alike keep their whole dotted key; a YAML list becomes a folder name
    assert (variant_name("ci", {"train.k": "1", "evaluate.k": "[1, 2]"}) == "ci--train.k-1--evaluate.k-1_2")
    vs = plan_variants("base", parse_vary(["train.lr=1e-3,2e-3", "train.num_layers=1,2"]))
    assert [v.name for v in vs] == ["base--lr-1e-3--num_layers-1", "base--lr-1e-3--num_layers-2",
                                    "base--lr-2e-3--num_layers-1", "base--lr-2e-3--num_layers-2"]
    assert vs[1].overrides == ["train.lr=1e-3", "train.num_layers=2"]
    # a YAML list is one value: its commas do not split it
    assert parse_vary(["evaluate.vllm_methods=[eagle3, ngram],[eagle3]"]) == {
        "evaluate.vllm_methods": ["[eagle3, ngram]", "[eagle3]"]}
    with pytest.raises(ParamsError, match="--vary train.lr: a value is given twice"):
        plan_variants("base", {"train.lr": ["1e-3", "1e-3"]})
    with pytest.raises(ParamsError, match="give the same run name base--lr-a_b"):
        plan_variants("base", {"train.lr": ["a b", "a/b"]})


@pytest.mark.parametrize("item", ["synthesize.limit=8,16", "extract.token_budget=1024", "target.dtype=float32",
                                  "vocab.draft_vocab_size=1024,2048", "run.seed=1,2"])
def test_a_key_read_by_stages_1_3_is_refused_with_the_way_out(item, capsys):
    key = item.split("=")[0]
    with pytest.raises(ParamsError) as e:
        parse_vary([item])
    msg = str(e.value)
    assert f"--vary {key}: {key.split('.')[0]}.* is read by stages 1-3, which every variant shares" in msg
    assert f"`eagle3 run PARAMS --set {key}=VALUE --run-name NAME`" in msg
    assert "A sweep varies train.* and evaluate.* (read by stages 4-5 only)" in msg
    # the CLI: one clean line, exit 2, nothing run
    assert main(["sweep", str(ROOT / "params" / "ci.yaml"), "--vary", item]) == 2
    assert "stages 1-3" in capsys.readouterr().err


def test_bad_vary_and_stage_selections_are_refused(tmp_params):
    with pytest.raises(ParamsError, match="given twice"):
        parse_vary(["train.lr=1,2"], overrides=["train.lr=3"])
    with pytest.raises(ParamsError, match="given twice"):
        parse_vary(["train.lr=1,2", "train.lr=3"])
    with pytest.raises(ParamsError, match="must look like section.key=VALUE1,VALUE2"):
        parse_vary(["train.lr"])
    with pytest.raises(ParamsError, match="at least one --vary .* or --variant"):
        run_sweep(tmp_params(), [])
    with pytest.raises(ParamsError, match="--stages 3-5: a sweep runs stages 4-5 of its variants"):
        run_sweep(tmp_params(), ["train.lr=1,2"], stages=[3, 4, 5])
    with pytest.raises(ParamsError, match="num_layer"):  # an unknown key: the params' own did-you-mean, before any run
        run_sweep(tmp_params(), ["train.num_layer=1,2"])
    assert not (tmp_params().parent / "outputs").exists()


def test_ctrl_c_in_a_sweep_says_the_same_command_resumes_and_exits_130(tmp_params, monkeypatch, capsys):
    import eagle3.commands.sweep
    from eagle3.errors import RunInterrupted

    def interrupted(*args, **kwargs):
        raise RunInterrupted("stage 4 (04_train) was interrupted (Ctrl-C)", stage=4, run_dir=tmp_params().parent)

    monkeypatch.setattr(eagle3.commands.sweep, "run_pipeline", interrupted)
    assert main(["sweep", str(tmp_params()), "--vary", "train.lr=1e-3,2e-3"]) == 130
    err = capsys.readouterr().err
    assert ("eagle3: stage 4 (04_train) was interrupted (Ctrl-C); the same `eagle3 sweep` command resumes every "
            "run where it stopped (finished ones are skipped)") in err and "Traceback" not in err


# ----------------------------------------------------------------------------- a sweep on fake stages

PARAMS_CELL = 'params_file = None\nrun_dir = None\noverrides = []'

HEAD = """
import dataclasses
from pathlib import Path
from eagle3.rundir import RunDir
from eagle3.stage import StageRun, Stats
rd = RunDir(run_dir)

@dataclasses.dataclass
class S(Stats):
    lr: float = 0.0
    best_val_tau_hat: float = 0.0
    train_time_s: float = 0.0
"""

# stages 1-3: the files the later stages' input records name, and one in a subfolder (hidden states)
EARLY = """
with StageRun(params, run_dir, {s}, total=1, unit="items") as st:
    files = {{1: [rd.samples], 2: [rd.tokenized("train"), rd.tokenized("heldout")],
             3: [rd.extract_meta, rd.manifest, rd.stage(3) / "rows_000" / "000000.safetensors"]}}[{s}]
    for f in files:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(f"{{f.name}} of stage {s}")
    st.progress.update(1)
    st.finish(S())
"""

TRAIN = """
with StageRun(params, run_dir, 4, total=1, unit="steps") as st:
    lr = params.train.lr
    if (Path(run_dir).parent / f"fail-{lr}").exists():
        raise RuntimeError("planned failure")
    (rd.stage(4) / "runs.txt").open("a").write("x")
    st.progress.update(1)
    st.finish(S(lr=lr, best_val_tau_hat=1 + 100 * lr, train_time_s=10000 * lr))
"""

EVALUATE = """
from eagle3.evaluate.stats import EvaluateStats, SetStats, Settings
lr = params.train.lr
grid = {"vllm/eagle3": {"tau": 2 + 100 * lr, "tokens_per_forward": 1.5 + 100 * lr},
        "vllm/ngram": {"tau": 1.2, "tokens_per_forward": 1.1}}
with StageRun(params, run_dir, 5, total=1, unit="measurements") as st:
    st.progress.update(1)
    st.finish(EvaluateStats(settings=Settings(k=3, temperature=0.0),
                            sets={"heldout": SetStats(domain="in-distribution", methods=grid)}))
"""


def _nb(path: Path, body: str) -> None:
    p = new_code_cell(PARAMS_CELL)
    p.metadata["tags"] = ["parameters"]
    setup = new_code_cell("from eagle3.notebook import setup\nparams, run_dir = setup(params_file, run_dir, overrides)")
    kernel = {"name": "eagle3", "display_name": "eagle3", "language": "python"}
    nbformat.write(new_notebook(cells=[p, setup, new_code_cell(HEAD + body)], metadata={"kernelspec": kernel}), path)


@pytest.fixture
def nbdir(tmp_path):
    d = tmp_path / "nbs"
    d.mkdir()
    for s in (1, 2, 3):
        _nb(d / NOTEBOOKS[s], EARLY.format(s=s))
    _nb(d / NOTEBOOKS[4], TRAIN)
    _nb(d / NOTEBOOKS[5], EVALUATE)
    return d


def _files(stage_dir: Path) -> list[Path]:
    return sorted(p.relative_to(stage_dir) for p in stage_dir.rglob("*") if p.is_file())


def test_a_sweep_shares_stages_1_3_by_hard_links_resumes_and_compares(tmp_params, nbdir, capsys):
    """The base runs stages 1-5; each variant's stages 1-3 are the base's files (the same inodes), its
    inputs.json the base's record plus shared_from; its stages 4-5 run on its own params. A variant
    whose stage 4 failed resumes on the same command while finished runs are skipped; the comparison
    lists every run with its numbers."""
    pf = tmp_params("train:\n  lr: 0.003\n")
    out = pf.parent / "outputs"
    out.mkdir()
    (out / "fail-0.005").touch()
    with pytest.raises(StageFailed, match="planned failure"):
        run_sweep(pf, ["train.lr=0.003,0.004,0.005"], notebooks=nbdir)
    base, v4, v5 = out / "t", out / "t--lr-0.004", out / "t--lr-0.005"
    assert read_json(v4 / STAGES[5] / "stats.json")["complete"] and not (out / "t--lr-0.003").exists()
    for s in (1, 2, 3):
        files = _files(base / STAGES[s])
        assert Path("inputs.json") in files and len(files) >= 4, files
        for f in files:
            if f.name != "inputs.json":
                assert os.path.samefile(base / STAGES[s] / f, v5 / STAGES[s] / f), f
        assert (base / STAGES[s] / "stats.json").stat().st_nlink == 3
        rec, own = read_json(v4 / STAGES[s] / "inputs.json"), read_json(base / STAGES[s] / "inputs.json")
        assert rec == {**own, "shared_from": str(base / STAGES[s])} and "shared_from" not in own
        assert shared_from(v4, s) == base / STAGES[s] and shared_from(base, s) is None
    # stage 4 of a variant recorded its own (linked) inputs: the base's bytes
    assert (read_json(v4 / STAGES[4] / "inputs.json")["files"]["03_extract/manifest.jsonl"]
            == read_json(base / STAGES[4] / "inputs.json")["files"]["03_extract/manifest.jsonl"])
    assert "lr: 0.004" in (v4 / "params.yaml").read_text() and "name: t--lr-0.004" in (v4 / "params.yaml").read_text()

    (out / "fail-0.005").unlink()
    capsys.readouterr()
    md = run_sweep(pf, ["train.lr=0.003,0.004,0.005"], notebooks=nbdir)
    printed = capsys.readouterr().out
    assert printed.count("already complete, skipped") == 5 + 2 + 0  # the base, variant 0.004; 0.005's stage 4 ran
    assert [(d / STAGES[4] / "runs.txt").read_text() for d in (base, v4, v5)] == ["x", "x", "x"]
    assert md == out / "t--sweep.md"
    text = md.read_text()
    assert text in printed
    assert "| run | lr | val τ̂ | train time | heldout: drafter τ (n-gram tokens/forward) |" in text
    assert "| `t` | 0.003 | 1.300 | 30 s | 2.300 (1.100) |" in text
    assert "| `t--lr-0.004` | 0.004 | 1.400 | 40 s | 2.400 (1.100) |" in text
    assert "| `t--lr-0.005` | 0.005 | 1.500 | 50 s | 2.500 (1.100) |" in text
    assert "- t--lr-0.003: the base's own params, its row is the base run's" in text
    assert "`t--sweep.html` beside this file" in text  # the page the sweep writes next, not a command to make it

    # redoing a shared stage in a variant would write into the base's files: refused, nothing changed
    before = (base / STAGES[3] / "stats.json").read_bytes()
    with pytest.raises(RunnerError, match=r"stage 3 of .*t--lr-0.004 is .*shared by hard links"):
        run_pipeline(v4 / "params.yaml", stages=[3], redo=[3], notebooks=nbdir)
    assert (base / STAGES[3] / "stats.json").read_bytes() == before


def test_named_variants_change_settings_together_and_are_checked():
    from eagle3.commands.sweep import parse_variants

    v = parse_variants("b", ["ttt7:train.ttt_steps=7,train.ttt_step_loss_decay=0.9", "l:train.loss={kl_div: 1, jsd: 1}"])
    assert [(x.name, x.values) for x in v] == [
        ("b--ttt7", {"train.ttt_steps": "7", "train.ttt_step_loss_decay": "0.9"}),
        ("b--l", {"train.loss": "{kl_div: 1, jsd: 1}"})]
    for bad, msg in [("no-colon", "must look like NAME:"), ("a b:train.lr=1", "must look like NAME:"),
                     ("x:train.lr", "must be section.key=VALUE"), ("x:vocab.draft_vocab_size=32768", "read by stages 1-3"),
                     ("x:train.epochs=2", "also given by --set")]:
        with pytest.raises(ParamsError, match=msg):
            parse_variants("b", [bad], ["train.epochs=3"])
    with pytest.raises(ParamsError, match="NAME of its own"):
        parse_variants("b", ["x:train.lr=1", "x:train.lr=2"])


def test_a_parallel_sweep_runs_processes_names_a_failure_by_its_log_and_resumes(tmp_params, nbdir, capsys):
    """--parallel 2 with a named --variant: after the base's stages 1-3, the base's stage 4 and the variants' run in processes
    of their own, each printing into <run folder>/sweep.log; a failed one is named with its log's last
    line while the others finish; the same call resumes it; the comparison equals a sequential sweep's."""
    pf = tmp_params("train:\n  lr: 0.003\n")
    out = pf.parent / "outputs"
    out.mkdir()
    (out / "fail-0.005").touch()
    with pytest.raises(RunnerError, match=r"1 of 3 sweep run\(s\) failed; the others finished: t--big: "
                                          r"eagle3 sweep: StageFailed: .*planned failure.*sweep.log"):
        run_sweep(pf, ["train.lr=0.003,0.004"], stages=[4], notebooks=nbdir, parallel=2, variants=["big:train.lr=0.005"])
    base, v4, v5 = out / "t", out / "t--lr-0.004", out / "t--big"
    printed = capsys.readouterr().out
    assert "eagle3 sweep: t started (1 running" in printed and "t--lr-0.004 started (2 running" in printed
    assert "t--big exited 1 after" in printed
    assert read_json(base / STAGES[4] / "stats.json")["complete"] and read_json(v4 / STAGES[4] / "stats.json")["complete"]
    assert "stage 4 (04_train) finished" in (v4 / "sweep.log").read_text()
    assert os.path.samefile(base / STAGES[3] / "manifest.jsonl", v5 / STAGES[3] / "manifest.jsonl")
    # the runs that finished are compared all the same
    assert "| `t--lr-0.004` | 0.004 | 1.400 | 40 s |" in (out / "t--sweep.md").read_text()
    assert "| `t--big` | 0.005 | — | — |" in (out / "t--sweep.md").read_text()
    (out / "fail-0.005").unlink()
    md = run_sweep(pf, ["train.lr=0.003,0.004"], stages=[4], notebooks=nbdir, parallel=2, variants=["big:train.lr=0.005"])
    assert [(d / STAGES[4] / "runs.txt").read_text() for d in (base, v4, v5)] == ["x", "x", "x"]
    assert "| `t--big` | 0.005 | 1.500 | 50 s |" in md.read_text()
    with pytest.raises(ParamsError, match="--parallel 0"):
        run_sweep(pf, ["train.lr=0.003,0.004"], parallel=0)


def test_a_variant_refuses_base_stages_finished_again_and_never_copies(tmp_path, monkeypatch):
    """share_stages on folders made here: a base stage finished again since (a new stats.json) is
    refused for the variant that shared the old one, with the folder to remove; a file system without
    hard links stops the sweep, nothing copied."""
    base, var = tmp_path / "b", tmp_path / "b--lr-1"
    for s in (1, 2, 3):
        d = base / STAGES[s]
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "data.bin").write_bytes(b"abc")
        write_stats(d, {"n": s})
    var.mkdir()
    share_stages(base, var)
    assert os.path.samefile(base / STAGES[3] / "sub" / "data.bin", var / STAGES[3] / "sub" / "data.bin")
    assert read_json(var / STAGES[1] / "inputs.json") == {"stage": 1, "complete": True, "files": {},
                                                          "shared_from": str(base / STAGES[1])}
    share_stages(base, var)  # again: the same files, nothing to do
    write_stats(base / STAGES[2], {"n": 22})  # the base's stage 2 finished again
    with pytest.raises(RunnerError, match=rf"holds an earlier state of the base's stage .*Remove {var} "):
        share_stages(base, var)

    def no_link(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    other = tmp_path / "b--lr-2"
    other.mkdir()
    monkeypatch.setattr(os, "link", no_link)
    with pytest.raises(RunnerError, match="Invalid cross-device link.*never copies them"):
        share_stages(base, other)
    assert not (other / STAGES[1]).exists() and not list(other.rglob("*.bin"))


def test_a_comparison_page_that_cannot_be_made_is_one_line_with_the_command(tmp_path, monkeypatch, capsys):
    """The sweep's page needs a kernel and nbconvert; where it cannot be made (here nbconvert missing, as on
    a bare GPU machine) the sweep says why in one line and gives the command that makes it, no traceback:
    its table and runs stand."""
    import eagle3.commands.compare as compare
    from eagle3.commands.sweep import _comparison_page

    def no_nbconvert(*args, **kwargs):
        raise ModuleNotFoundError("No module named 'nbconvert'")

    monkeypatch.setattr(compare, "compare_runs", no_nbconvert)
    runs = [tmp_path / "r", tmp_path / "r--e12"]
    assert _comparison_page(runs[0], runs, "eagle3", None) is None
    printed = capsys.readouterr().out
    assert printed == (f"eagle3 sweep: the comparison page was not made (ModuleNotFoundError: No module named "
                       f"'nbconvert'); the table above and the runs stand; make it with `eagle3 compare {runs[0]} "
                       f"{runs[1]} --out {tmp_path / 'r--sweep.html'}`\n")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(compare, "compare_runs", interrupted)
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C is not a page that failed
        _comparison_page(runs[0], runs, "eagle3", None)


# ----------------------------------------------------------------------------- a real sweep


@pytest.mark.slow
def test_a_real_sweep_of_the_ci_params(ci_sweep):
    """`eagle3 sweep params/ci.yaml --vary train.lr=0.002` beside the finished CI run (conftest): the
    base's stages skipped, the variant trained on the base's linked hidden states and evaluated in
    vLLM; the table holds both drafters' numbers."""
    base, variant, printed = ci_sweep
    assert printed.count("already complete, skipped") >= 5  # the base: every stage
    rows = [ln for ln in (base.parent / "ci--sweep.md").read_text().splitlines() if ln.startswith("| `")]
    assert [ln.split("|")[1].strip() for ln in rows] == ["`ci`", "`ci--lr-0.002`"]
    assert [ln.split("|")[2].strip() for ln in rows] == ["0.001", "0.002"]
    for ln in rows:
        cells = [c.strip() for c in ln.split("|")[1:-1]]
        tau, ngram = re.fullmatch(r"([\d.]+) \(([\d.]+)\)", cells[4]).groups()  # first set: drafter τ (n-gram)
        assert all(1.0 <= float(c) <= 4.0 for c in (cells[2], tau, ngram)), ln  # and val τ̂
    assert os.path.samefile(base / STAGES[3] / "manifest.jsonl", variant / STAGES[3] / "manifest.jsonl")
    assert shared_from(variant, 3) == base / STAGES[3]
    assert read_json(variant / STAGES[4] / "stats.json")["complete"]
    assert read_json(variant / STAGES[5] / "stats.json")["complete"]
    page = base.parent / "ci--sweep.html"  # the same runs on one page (eagle3 compare)
    assert f"eagle3 compare: page {page}" in printed and "ci--lr-0.002" in page.read_text()
