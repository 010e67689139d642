"""eagle3.rundir: the one place that knows the paths of a run."""

from __future__ import annotations

import re

import pytest

from eagle3 import rundir
from eagle3.rundir import RunDir


def test_rundir_paths(tmp_path):
    rd = RunDir(tmp_path)
    rel = {
        "samples": rd.samples, "train": rd.tokenized("train"), "heldout": rd.tokenized("heldout"),
        "vm": rd.vocab_mapping, "mj": rd.mapping_json, "meta": rd.extract_meta, "man": rd.manifest,
        "pf": rd.preflight, "drafter": rd.drafter_dir, "ckpt": rd.checkpoints_dir, "metrics": rd.train_metrics,
        "res": rd.evaluate_results, "params": rd.params_file, "report": rd.report_dir,
        "executed": rd.executed_dir,
        "p2": rd.progress(2), "s5": rd.stats(5),
    }
    assert {k: v.relative_to(tmp_path).as_posix() for k, v in rel.items()} == {
        "samples": "01_synthesize/samples.jsonl", "train": "02_vocab/train.parquet",
        "heldout": "02_vocab/heldout.parquet", "vm": "02_vocab/vocab_mapping.safetensors",
        "mj": "02_vocab/mapping.json", "meta": "03_extract/meta.json", "man": "03_extract/manifest.jsonl",
        "pf": "03_extract/preflight.json", "drafter": "04_train/drafter", "ckpt": "04_train/checkpoints",
        "metrics": "04_train/metrics.jsonl", "res": "05_evaluate/results.json", "params": "params.yaml",
        "report": "report", "executed": "notebooks", "p2": "02_vocab/progress.json", "s5": "05_evaluate/stats.json",
    }
    assert list(tmp_path.iterdir()) == []  # path arithmetic only
    assert rd.stage(3, create=True).is_dir()
    with pytest.raises(ValueError, match="split"):
        rd.tokenized("val")


def test_stage_complete_and_notebooks(tmp_path):
    from eagle3.stage import stage_record, write_stats

    rd = RunDir(tmp_path)
    assert not stage_record(tmp_path, 1).complete
    write_stats(rd.stage(1, create=True), {"x": 1}, complete=False)
    assert not stage_record(tmp_path, 1).complete
    write_stats(rd.stage(1), {"x": 1})
    assert stage_record(tmp_path, 1).complete
    assert sorted(rundir.STAGES) == sorted(rundir.NOTEBOOKS) == [1, 2, 3, 4, 5]
    for n in rundir.NOTEBOOKS:
        assert rundir.notebook_path(n).is_file()


def test_an_empty_params_yaml_of_a_run_is_an_error_not_the_defaults(tmp_params, capsys):
    """A 0-byte params.yaml in a run folder (a cut write) was read as the default params."""
    from eagle3.cli import main
    from eagle3.errors import ParamsError
    from eagle3.params_file import load_params

    params = load_params(tmp_params())
    rd = rundir.prepare_run_dir(params)
    (rd / "params.yaml").write_bytes(b"")
    msg = f"the run's params.yaml ({rd / 'params.yaml'}) is empty, so what the run was made with is unknown"
    with pytest.raises(ParamsError, match=re.escape(msg)):
        rundir.prepare_run_dir(params)
    with pytest.raises(ParamsError, match=re.escape(msg)):
        rundir.read_run_params(rd)
    assert main(["verify", str(rd)]) == 2 and msg in capsys.readouterr().err
    assert (rd / "params.yaml").read_bytes() == b""
    (rd / "params.yaml").write_text("train:\n  lr: [1\n")
    with pytest.raises(ParamsError, match="the run's params.yaml cannot be used .*YAML syntax error in"):
        rundir.read_run_params(rd)
