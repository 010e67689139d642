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


def test_inputs_are_recorded_and_a_change_is_named(tmp_path):
    from eagle3.errors import VocabError
    from eagle3.io import file_sha256
    from eagle3.stage import check_fresh, stale_inputs

    samples = tmp_path / "01_synthesize" / "samples.jsonl"
    samples.parent.mkdir()
    samples.write_text('{"id": "a"}\n{"id": "b"}\n')
    (tmp_path / "02_vocab").mkdir()
    dead = tmp_path / "02_vocab" / ".train.parquet.k3j2.tmp"  # a killed atomic write
    dead.write_bytes(b"half")
    from eagle3.stage import params_read

    with StageRun(_params(tmp_path), tmp_path, 2, total=1) as st:
        rec = json.loads((tmp_path / "02_vocab" / "inputs.json").read_text())
        assert rec == {"stage": 2, "complete": False,
                       "files": {"01_synthesize/samples.jsonl": {"sha256": file_sha256(samples), "bytes": 24}},
                       "params": params_read(2, _params(tmp_path))}
        assert not dead.exists()
        st.finish(_Stats(samples=2, coverage=1.0))
    rec = json.loads((tmp_path / "02_vocab" / "inputs.json").read_text())
    assert rec["complete"] is True and stale_inputs(tmp_path, 2) == []
    check_fresh(tmp_path, 2, None, VocabError)  # unchanged: no error
    samples.write_text('{"id": "a"}\n')  # a sample removed, stage 1 re-run
    (why,) = stale_inputs(tmp_path, 2)
    assert why.startswith("01_synthesize/samples.jsonl: sha256 ")
    assert "(24 bytes) when stage 2 ran" in why and "(12 bytes) now" in why
    with pytest.raises(VocabError, match=r"(?s)stage 2 \(02_vocab\) is complete, but its inputs changed.*--redo 2"):
        check_fresh(tmp_path, 2, None, VocabError)
    samples.unlink()
    assert stale_inputs(tmp_path, 2) == ["01_synthesize/samples.jsonl: removed since stage 2 ran"]


def test_consumed_files_per_stage(tmp_path):
    from eagle3.stage import consumed_files

    def names(stage, params=None):
        return [p.relative_to(tmp_path).as_posix() for p in consumed_files(tmp_path, stage, params)]

    p = _params(tmp_path)
    assert names(1) == [] and names(2) == ["01_synthesize/samples.jsonl"] and names(3) == ["02_vocab/train.parquet"]
    assert names(4, p) == ["02_vocab/train.parquet", "02_vocab/heldout.parquet", "02_vocab/vocab_mapping.safetensors",
                           "02_vocab/mapping.json", "03_extract/meta.json", "03_extract/manifest.jsonl"]
    p.train.online = True  # online training reads no stage-3 file
    assert names(4, p)[-1] == "02_vocab/mapping.json"
    assert names(5, p)[-2:] == ["04_train/drafter/config.json", "04_train/drafter/model.safetensors"]


def test_the_stage_record_answers_complete_and_gives_the_stats(tmp_path):
    """stage_record is the one reader of stats.json: missing, incomplete, torn, not an object or
    unreadable is 'not complete' (never a JSONDecodeError); complete gives the numbers and the typed stats."""
    import os

    from eagle3.stage import completed_stats, stage_record, write_stats

    rec = stage_record(tmp_path, 2)
    assert (rec.stage, rec.complete, rec.stats) == (2, False, {})
    assert not (tmp_path / "02_vocab").exists()  # reading creates nothing
    sd = tmp_path / "02_vocab"
    write_stats(sd, {"samples": 3, "coverage": 0.5}, complete=False)
    rec = stage_record(tmp_path, 2)
    assert rec.complete is False and rec.stats["samples"] == 3 and rec.as_stats(_Stats) is None
    write_stats(sd, {"samples": 3, "coverage": 0.5})
    rec = stage_record(tmp_path, 2)
    assert rec.complete is True and rec.stats["coverage"] == 0.5 and rec.stats["complete"] is True
    assert rec.as_stats(_Stats) == _Stats(samples=3, coverage=0.5) == completed_stats(tmp_path, 2, _Stats)
    for damaged in (b'{"samples": 3, "compl', b"[1, 2]", b"\xff\xfe", b""):
        (sd / "stats.json").write_bytes(damaged)
        assert stage_record(tmp_path, 2) == type(rec)(stage=2, complete=False, stats={}), damaged
        assert completed_stats(tmp_path, 2, _Stats) is None
    write_stats(sd, {"samples": 3, "coverage": 0.5})
    if os.geteuid() != 0:  # root reads a file without read permission
        (sd / "stats.json").chmod(0)
        try:
            assert stage_record(tmp_path, 2).complete is False
        finally:
            (sd / "stats.json").chmod(0o644)


def test_a_params_edit_after_a_stage_ran_makes_that_stage_stale(tmp_path):
    """A run's params.yaml edited by hand after stage 2 finished (vocab.draft_vocab_size): the stage's
    inputs.json holds the params it read, so stale_inputs names the key with both values; params it
    does not read (train.lr), the run's name and tracking change nothing; a record written without
    params (an older run) is checked for its files only."""
    from eagle3.stage import params_read, stale_inputs

    params = _params(tmp_path)
    with StageRun(params, tmp_path, 2, total=1, unit="samples") as st:
        st.progress.update(1)
        st.finish(_Stats(samples=1, coverage=1.0))
    record = json.loads((tmp_path / "02_vocab" / "inputs.json").read_text())
    assert record["params"] == params_read(2, params) and set(record["params"]) == {"run", "target", "vocab"}
    assert "name" not in record["params"]["run"]

    same = _params(tmp_path)
    same.train.lr, same.run.name, same.tracking.mode = 0.5, "renamed", "offline"
    assert stale_inputs(tmp_path, 2, same) == []
    edited = _params(tmp_path)
    edited.vocab.draft_vocab_size = 4096
    assert stale_inputs(tmp_path, 2, edited) == [
        f"params.yaml: vocab.draft_vocab_size {params.vocab.draft_vocab_size!r} when stage 2 ran, 4096 now"]
    assert stale_inputs(tmp_path, 2, edited, quick=True) == stale_inputs(tmp_path, 2, edited)

    # a param the package gained after the stage ran: at its default, no change; set otherwise, a change;
    # a recorded key that is no longer a param: not read, no change
    older = json.loads(json.dumps(record))
    default_limit = older["params"]["vocab"].pop("max_seq_len")
    older["params"]["vocab"]["a_removed_param"] = 7
    (tmp_path / "02_vocab" / "inputs.json").write_text(json.dumps(older))
    assert stale_inputs(tmp_path, 2, _params(tmp_path)) == []
    longer = _params(tmp_path)
    longer.vocab.max_seq_len = default_limit + 1
    assert stale_inputs(tmp_path, 2, longer) == [
        f"params.yaml: vocab.max_seq_len '(absent)' when stage 2 ran, {default_limit + 1} now"]

    del record["params"]
    (tmp_path / "02_vocab" / "inputs.json").write_text(json.dumps(record))
    assert stale_inputs(tmp_path, 2, edited) == []
