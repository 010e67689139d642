"""Hostile input across the stages: records, files and folders a user can hand the tool that once
gave a traceback or a silent wrong result. Each test keeps the right behaviour: a clear error that
names the file/line/field, or a bad record counted and skipped."""

from __future__ import annotations

import json

import pytest

from eagle3.config import PromptSource
from eagle3.prompts import LoadReport, PromptError, load_source


def _load(path, report=None):
    return load_source(PromptSource(kind="file", path=str(path)), report)


def test_prompt_records_with_text_no_tokenizer_can_take_are_bad_records_not_tracebacks(tmp_path):
    """Content parts whose text is a number or null, a lone surrogate escape (json.loads accepts
    "\\ud800"; UTF-8 cannot hold it), an integer over Python's 4300-digit limit and a line nested
    deeper than the recursion limit: each is one counted bad record with its line, the rest load."""
    f = tmp_path / "hostile.jsonl"
    f.write_text("\n".join([
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
        '{"prompt": "bad \\ud800 here"}',
        '{"prompt": 1' + "0" * 5000 + "}",
        "[" * 100_000 + "]" * 100_000,
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "fine"}, {"type": "text", "text": null}]}]}',
        '{"prompt": "good"}',
    ]) + "\n")
    rep = LoadReport()
    assert [p.turns[0][0]["content"] for p in _load(f, rep)] == ["fine", "good"]
    assert rep.bad == {"missing_field": 1, "invalid_unicode": 1, "malformed_json": 2}
    got = {e["where"]: e["message"] for e in rep.examples}
    assert got[f"{f}:1"] == "messages[0].content: a content part's text is int, not text"
    assert got[f"{f}:2"] == "prompt: character 4 is a lone surrogate '\\ud800', not valid Unicode"
    assert got[f"{f}:3"].startswith("unreadable JSON: Exceeds the limit (4300 digits)")
    assert got[f"{f}:4"] == "unreadable JSON: nested too deeply"
    assert rep.to_dict()["records"] == 6


def test_a_json_document_json_cannot_read_is_a_prompt_error(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(PromptError, match=r"deep.json: unreadable JSON: nested too deeply"):
        _load(deep)
    big = tmp_path / "big.json"
    big.write_text(json.dumps([{"prompt": "a"}])[:-1] + ', {"n": 1' + "0" * 5000 + "}]")
    with pytest.raises(PromptError, match=r"big.json: unreadable JSON: Exceeds the limit"):
        _load(big)


def test_a_vocab_mapping_cache_that_cannot_be_written_does_not_stop_stage_2(tmp_path, caplog):
    """$EAGLE3_CACHE pointing at a file (or a read-only cache): the mapping is built and returned,
    the unwritable cache named in a warning."""
    import numpy as np
    import torch

    from eagle3.vocab.mapping import cached_vocab_mapping

    f = tmp_path / "cache-is-a-file"
    f.write_text("x")
    counts = np.arange(100, dtype=np.int64)
    m, hit = cached_vocab_mapping(counts, 10, "corpus", "tok", f / "vocab_mappings")
    assert not hit and m.draft_vocab_size == 10 and sorted((m.d2t + torch.arange(10)).tolist()) == list(range(90, 100))
    assert "not written" in caplog.text and str(f / "vocab_mappings") in caplog.text


def test_sample_store_finalize_on_a_full_disk_names_samples_jsonl_and_keeps_it(tmp_path, monkeypatch):
    """The final in-order rewrite of samples.jsonl meets a full disk: the OSError names the file
    (a write names none) and the appended lines stay as they were."""
    import errno
    import os

    from eagle3.contracts.samples import SampleStore

    p = tmp_path / "samples.jsonl"
    store = SampleStore(p)
    for sid in ("b", "a"):
        store.append({"id": sid, "source": "s", "split": "train", "messages": [{"role": "user", "content": sid}]})
    before = p.read_bytes()
    real_fsync = os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".tmp"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError) as e:
        store.finalize(["a", "b"])
    assert (e.value.errno, e.value.filename) == (errno.ENOSPC, str(p))
    assert p.read_bytes() == before and [q.name for q in tmp_path.iterdir() if q.suffix == ".tmp"] == []


def test_a_vllm_only_stage5_checks_an_external_drafters_aux_ids_against_the_convention(tmp_path):
    """No loaded target (evaluate.backends: [vllm]) and no stage 3: the layer count comes from the
    target's config.json, so EAGLE-3's default shifted by one is still named (SmolLM2-135M: 30 layers)."""
    from eagle3.config import Params
    from eagle3.evaluate.layer_ids import DECLARED_RULE, aux_layer_id_warnings

    d = tmp_path / "external"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": [3, 16, 28]}))
    params = Params.model_validate({"evaluate": {"drafter_dir": str(d), "backends": ["vllm"]}})
    (w,) = aux_layer_id_warnings(params, tmp_path / "run", d, None, None, [], None)
    assert w["rule"] == DECLARED_RULE
    assert w["numbers"] == {"config_ids": [3, 16, 28], "default_ids": [2, 15, 27], "shift": 1, "num_layers": 30}


@pytest.mark.parametrize("where", ["output_dir", "below", "run"])
def test_a_run_directory_blocked_by_a_file_is_refused_by_name(tmp_path, where):
    """run.output_dir a file (or a path below one), or a file already named like the run: `eagle3 run`
    refused with NotADirectoryError's traceback; now one line naming the path in the way."""
    from eagle3.errors import ParamsError
    from eagle3.rundir import check_run_location

    f = tmp_path / "afile"
    f.write_text("x")
    run_dir = {"output_dir": f / "ci", "below": f / "sub" / "ci", "run": f}[where]
    with pytest.raises(ParamsError, match=rf"run directory {run_dir} cannot be made: {f} is a regular file, not a folder"):
        check_run_location(run_dir)
    check_run_location(tmp_path / "new" / "ci")  # a folder still to be made is fine


def test_a_run_directory_on_a_file_system_without_folders_is_refused_by_name(tmp_path):
    """run.output_dir=/proc/self: mkdir fails with ENOENT on the pseudo file system (a traceback);
    now one line naming the folder and the way out, nothing written."""
    from eagle3.errors import ParamsError
    from eagle3.params_file import load_params
    from eagle3.rundir import prepare_run_dir

    params = load_params(None, {"run": {"name": "ci", "output_dir": "/proc/self"}})
    with pytest.raises(ParamsError, match=r"run directory /proc/\d+/ci cannot be made \(No such file or directory: "
                                         r"/proc/\d+/ci\)\. Set run.output_dir"):
        prepare_run_dir(params)


@pytest.mark.parametrize("override,message", [
    ("synthesize.sources=[]", "synthesize.sources: List should have at least 1 item"),
    ("target.model=''", "target.model: Value error, target.model is empty"),
    ("target.model='  '", "target.model: Value error, target.model is empty"),
    ("evaluate.backends=[]", "evaluate.backends: List should have at least 1 item"),
])
def test_params_that_leave_a_stage_nothing_to_work_on_are_refused_by_key(override, message):
    """No prompt source: stage 1 'completed' with 0 samples; an empty target.model failed inside
    stage 1 as "target.model:  is a directory without config.json" (the working directory); no
    evaluate.backends: stage 5 'finished' (exit 0) measuring nothing."""
    from pathlib import Path

    from eagle3.errors import ParamsError
    from eagle3.params_file import load_params

    ci = Path(__file__).resolve().parent.parent / "params" / "ci.yaml"
    with pytest.raises(ParamsError, match=message):
        load_params(ci, [override])


def _stage2_run(tmp_path):
    """A run folder whose stages 1 and 2 are complete (no stage ran after them): params.yaml, one
    sample a split, both tokenized splits and a draft vocab mapping of 4 of 16 tokens."""
    import numpy as np

    from eagle3.config import Params
    from eagle3.contracts import tokenized
    from eagle3.contracts.samples import write_samples
    from eagle3.contracts.vocab_mapping import VocabMapping, write_mapping
    from eagle3.params_file import dump_params
    from eagle3.rundir import SYNTHESIZE, VOCAB, RunDir
    from eagle3.stage import write_stats

    rd = RunDir(tmp_path / "run")
    rd.root.mkdir()
    rd.params_file.write_text(dump_params(Params.model_validate({"run": {"name": "run"}})))
    write_samples(rd.root, [{"id": s, "source": "s", "split": s, "messages": [{"role": "user", "content": "hi"},
                                                                             {"role": "assistant", "content": "yo"}]}
                            for s in ("train", "heldout")])
    for s in ("train", "heldout"):
        tokenized.write_split(rd.root, s, [[tokenized.TokenizedRow(s, "s", np.arange(5), np.ones(5, np.int8), 5)]])
    write_mapping(rd.root, VocabMapping.build(np.arange(16), 4, "key"), coverage=1.0, corpus_hash="c",
                  tokenizer_hash="t", cache_hit=False)
    write_stats(rd.stage(SYNTHESIZE, create=True), {})
    write_stats(rd.stage(VOCAB, create=True), {})
    return rd


def test_verify_reads_the_outputs_of_the_last_finished_stage(tmp_path):
    """A truncated train.parquet, a removed heldout.parquet, a bad samples line and a mapping.json cut
    short in a run whose later stages never ran: no later stage recorded them as inputs, and
    `eagle3 verify` said "no problem found"."""
    from eagle3.commands.verify import verify_run

    rd = _stage2_run(tmp_path)
    assert verify_run(rd.root) == []
    train = rd.tokenized("train")
    train.write_bytes(train.read_bytes()[:100])
    rd.tokenized("heldout").unlink()
    with open(rd.samples, "a") as f:
        f.write('{"id": 5}\n')
    rd.mapping_json.write_text('{"draft_vocab_size": 4,\n')
    problems = verify_run(rd.root)
    assert problems == [
        f"{train}: missing, unreadable or its row lengths disagree; redo stage 2 (`--stages 2 --redo 2`)",
        f"{rd.tokenized('heldout')}: missing, unreadable or its row lengths disagree; redo stage 2 (`--stages 2 --redo 2`)",
        f"stage 2's draft vocab mapping: {rd.mapping_json}:2:1: not valid JSON (Expecting property name enclosed in "
        f"double quotes): the file is damaged (cut short or edited); restore it or redo the stage that wrote it",
    ]
    # stage 2 not complete: stage 1's samples are read as it will read them
    (rd.stage(2) / "stats.json").unlink()
    assert verify_run(rd.root)[0] == f"stage 1's samples: {rd.samples}:3: field 'id' must be a non-empty string (got 5)"


def test_a_damaged_tokenized_split_is_named_and_redone_not_reused(tmp_path):
    """pyarrow's "Parquet magic bytes not found in footer" named no file, and `--redo 2` (the fix) reused
    the damaged split: it counted as complete while both files existed."""
    from eagle3.contracts import tokenized

    rd = _stage2_run(tmp_path)
    assert tokenized.split_complete(rd.root, "train")
    train = rd.tokenized("train")
    train.write_bytes(train.read_bytes()[:100])
    assert not tokenized.split_complete(rd.root, "train")
    for read in (tokenized.read_rows, lambda r, s: list(tokenized.iter_batches(r, s))):
        with pytest.raises(tokenized.TokenizedError, match=rf"^{train}: not a readable Parquet file \(ArrowInvalid: "):
            read(rd.root, "train")


def test_a_damaged_json_file_of_a_run_names_itself():
    """read_json, the reader of every stage's JSON files, raised a bare JSONDecodeError (a traceback)."""
    import tempfile
    from pathlib import Path

    from eagle3.errors import DamagedFile
    from eagle3.io import read_json

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "meta.json"
        p.write_text('{"a": 1,')
        with pytest.raises(DamagedFile, match=rf"^{p}:1:9: not valid JSON \(Expecting property name"):
            read_json(p)
        p.write_bytes(b'{"a": "\xff"}')
        with pytest.raises(ValueError, match=rf"^{p}: not valid JSON \('utf-8' codec can't decode"):
            read_json(p)
        # stage 3's meta.json through its contract (`eagle3 verify` gave a JSONDecodeError traceback)
        from eagle3.contracts.hidden_states import read_meta

        p.write_text('{"aux\n')
        with pytest.raises(DamagedFile, match=rf"^{p}:1:6: not valid JSON \(Invalid control character\): the file is damaged"):
            read_meta(d)


def test_resuming_from_a_damaged_checkpoint_names_the_folder_and_the_way_on(tmp_path):
    """A checkpoint whose model.safetensors was cut short (a copy, a disk fault) stopped stage 4 with
    safetensors' "Error while deserializing header: invalid header length", naming no file."""
    import torch

    from eagle3.errors import TrainError
    from eagle3.train.checkpoint import load_checkpoint

    step = tmp_path / "checkpoints" / "step_000018"
    step.mkdir(parents=True)
    (step / "model.safetensors").write_bytes(b"\x00" * 100)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with pytest.raises(TrainError, match=rf"^cannot resume from {step}: it does not load \(SafetensorError: .*\)\. "
                                         rf"Delete that folder .* or delete {step.parent} to start stage 4 over$"):
        load_checkpoint(step, model, opt, sched, "cpu")


def test_eagle3_cache_pointing_at_a_file_is_named_with_its_source(tmp_path, monkeypatch):
    """$EAGLE3_CACHE (or target.cache_dir) naming a file: the embedded target's conversion failed inside
    the stage with "NotADirectoryError: [Errno 20] Not a directory: '.../models'"."""
    from eagle3.config import TargetParams
    from eagle3.errors import TargetError
    from eagle3.target import resolve_target

    f = tmp_path / "afile"
    f.write_text("x")
    monkeypatch.setenv("EAGLE3_CACHE", str(f))
    with pytest.raises(TargetError, match=rf"^\$EAGLE3_CACHE = {f} is not a folder"):
        resolve_target(TargetParams())
    with pytest.raises(TargetError, match=rf"^target.cache_dir = {f} is not a folder"):
        resolve_target(TargetParams(cache_dir=str(f)))


def test_a_damaged_executed_notebook_is_named_by_eagle3_report(tmp_path):
    """An executed notebook cut short (a kernel or disk that died while papermill saved it): `eagle3
    report` ended in nbformat's NotJSONError traceback."""
    from eagle3.commands.report import render_report
    from eagle3.errors import RunnerError
    from eagle3.rundir import NOTEBOOKS, RunDir

    rd = RunDir(tmp_path / "run")
    rd.executed_dir.mkdir(parents=True)
    nb = rd.executed_dir / NOTEBOOKS[2]
    nb.write_text('{"cells": [\n')
    with pytest.raises(RunnerError, match=rf"^{nb}: not a readable notebook \(NotJSONError: .*\); run its stage again "
                                          r"\(`eagle3 run PARAMS --stages 2 --redo 2`\) or delete it$"):
        render_report(rd.root)


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "abc"])
def test_status_watch_takes_only_a_finite_number_of_seconds(value, capsys):
    """`eagle3 status RUN --watch -1` (or nan) ended in time.sleep's ValueError traceback."""
    from eagle3.cli import main

    with pytest.raises(SystemExit) as e:
        main(["status", "/nonexistent", "--watch", value])
    assert e.value.code == 2
    assert f"argument --watch: {value!r} is not a number of seconds >= 0" in capsys.readouterr().err


def test_the_training_curves_read_past_a_torn_last_metrics_line(tmp_path):
    """A training killed while appending to metrics.jsonl leaves a torn last line: notebook 04's
    curves (load_metrics) raised JSONDecodeError; now the line is left out, a damaged middle line is named."""
    from eagle3.rundir import RunDir
    from eagle3.train.report import load_metrics

    f = RunDir(tmp_path).train_metrics
    f.parent.mkdir(parents=True)
    f.write_text('{"kind": "train", "step": 1, "loss": 2.5}\n{"kind": "val", "step": 1, "val_tau_hat": 1.4}\n{"kind": "tr')
    df = load_metrics(tmp_path)
    assert list(df["step"]) == [1, 1] and df["loss"].iloc[0] == 2.5
    f.write_text('{"kind": "train", "step": 1}\n{"kind": "tr\n{"kind": "train", "step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        load_metrics(tmp_path)
