"""eagle3.stage.StageRun: progress.json, stats.json and the failure status, written once."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

import pytest

from eagle3.config import Params
from eagle3.stage import StageRun, Stats


@dataclass
class _Stats(Stats):
    HEADLINE: ClassVar[tuple[str, ...]] = ("samples", "coverage")
    samples: int
    coverage: float
    cache_key: str = ""


def _params(tmp_path):
    p = Params()
    p.tracking.mode = "disabled"
    p.run.output_dir = str(tmp_path)
    return p


def test_stage_run_writes_progress_and_stats(tmp_path):
    with StageRun(_params(tmp_path), tmp_path, 2, total=3, unit="samples") as st:
        st.progress.update(3, tokens=30)
        out = st.finish(_Stats(samples=3, coverage=0.5, cache_key="k"))
    sd = tmp_path / "02_vocab"
    stats = json.loads((sd / "stats.json").read_text())
    assert {k: stats[k] for k in ("samples", "coverage", "cache_key", "complete")} == {
        "samples": 3, "coverage": 0.5, "cache_key": "k", "complete": True}
    assert out == stats
    prog = json.loads((sd / "progress.json").read_text())
    assert (prog["status"], prog["done"], prog["total"], prog["tokens"]) == ("done", 3, 3, 30)
    assert _Stats.from_dict(stats).headline() == {"samples": 3, "coverage": 0.5}


def test_stage_run_failure_status(tmp_path):
    with pytest.raises(KeyError):
        with StageRun(_params(tmp_path), tmp_path, 4, total=10, unit="steps") as st:
            st.progress.update(2)
            raise KeyError("boom")
    prog = json.loads((tmp_path / "04_train" / "progress.json").read_text())
    assert (prog["status"], prog["done"], prog["extra"]["error"]) == ("failed", 2, "KeyError: 'boom'")
    assert not (tmp_path / "04_train" / "stats.json").exists()


def test_stage_run_incomplete_stats(tmp_path):
    with StageRun(_params(tmp_path), tmp_path, 1, total=2) as st:
        st.finish({"failed": 2}, complete=False)
    assert json.loads((tmp_path / "01_synthesize" / "stats.json").read_text())["complete"] is False
    assert json.loads((tmp_path / "01_synthesize" / "progress.json").read_text())["status"] == "failed"
