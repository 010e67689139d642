"""Params: loading, validation errors that name file/key/allowed values, overrides, run dirs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from eagle3.config import Params, ParamsError, dump_params, load_params, params_fingerprint, parse_overrides
from eagle3.rundir import prepare_run_dir

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["smollm2-135m", "ci", "llama-3.1-8b", "kimi-k2.5"])
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


# What params/smollm2-135m.yaml (the embedded default, `make run`) deliberately sets differently
# from Params(): the run's name and a CPU/bfloat16 pin. Everything else of the default run is
# Params' defaults, so the defaults live in one place (eagle3/config.py).
DEFAULT_YAML_OVERRIDES = {
    "run.name": "smollm2-135m",
    "target.dtype": "bfloat16",
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
