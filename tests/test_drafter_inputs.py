"""Drafters that do not fit their target (issue 15 §3, §5): a hidden size that disagrees is named
before transformers validates anything; an external drafter whose aux layer ids are wrong but of the
right count is caught by measuring its first-draft accuracy with the config's and alternative ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _evaluate_fixtures import make_drafter

from eagle3.config import Params
from eagle3.drafters import check_drafter
from eagle3.drafters.eagle3 import check_hidden_size, hidden_size_problems
from eagle3.errors import EvaluateError
from eagle3.evaluate.drafter import load_drafter
from eagle3.evaluate.layer_ids import (
    DECLARED_RULE,
    RULE,
    aux_layer_id_warnings,
    candidate_layer_ids,
    declared_id_warnings,
    layer_id_warnings,
    probe_sequences,
)


def _copy(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if k == "hidden_size":
            cfg["transformer_layer_config"]["hidden_size"] = v
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def random_drafter(embedded_target, target_model, tmp_path_factory):
    model, tok = target_model
    return make_drafter(embedded_target.path, tmp_path_factory.mktemp("rd") / "drafter", model, tok)


# ------------------------------------------------------------------------------------- hidden size


def test_hidden_size_problems_from_the_config_dict():
    cfg = {"transformer_layer_config": {"hidden_size": 512}, "target_hidden_size": 512}
    assert hidden_size_problems(cfg, 576) == ["hidden size 512 ≠ target 576 (transformer_layer_config.hidden_size)",
                                              "hidden size 512 ≠ target 576 (target_hidden_size)"]
    assert hidden_size_problems({"transformer_layer_config": {"hidden_size": 576}}, 576) == []
    assert hidden_size_problems({}, 576) == ["hidden size None ≠ target 576 (transformer_layer_config.hidden_size)"]


def test_drafter_for_another_hidden_size_is_named_before_transformers(random_drafter, embedded_target,
                                                                      target_model, tmp_path):
    """hidden 512 with the target's 9 heads: transformers would say 'not a multiple of the number of
    attention heads'; the project says which sizes disagree, in check_drafter and when loading."""
    model, _ = target_model
    bad = _copy(random_drafter, tmp_path / "d512", hidden_size=512, target_hidden_size=512)
    probs = check_drafter(bad, embedded_target.path)
    assert probs[:2] == ["hidden size 512 ≠ target 576 (transformer_layer_config.hidden_size)",
                         "hidden size 512 ≠ target 576 (target_hidden_size)"]
    msg = (f"{bad / 'config.json'}: hidden size 512 ≠ target 576 (transformer_layer_config.hidden_size); hidden "
           f"size 512 ≠ target 576 (target_hidden_size); this drafter was made for another target (its hidden "
           f"size must equal the target's)")
    with pytest.raises(EvaluateError) as ei:
        load_drafter(bad, model)
    assert str(ei.value) == msg and "attention heads" not in str(ei.value)
    with pytest.raises(EvaluateError, match="hidden size 512 ≠ target 576"):
        check_hidden_size(bad, 576, EvaluateError)
    check_hidden_size(random_drafter, 576, EvaluateError)  # the right size passes


# ------------------------------------------------------------------------------------- aux layer ids


def test_candidate_layer_ids_same_count_in_range_distinct():
    assert candidate_layer_ids([4, 18, 29], 30) == {"config": [4, 18, 29], "default": [2, 15, 27],
                                                    "config-1": [3, 17, 28]}  # config+1 has 30: out of range
    assert candidate_layer_ids([2, 15, 27], 30, {"stage 3": [2, 15, 27]}) == {
        "config": [2, 15, 27], "config-1": [1, 14, 26], "config+1": [3, 16, 28]}  # default = config: once
    assert candidate_layer_ids([3, 9], 12, {"stage 3": [2, 6, 9]}) == {
        "config": [3, 9], "config-1": [2, 8], "config+1": [4, 10]}  # no default / stage 3 of another count


def test_probe_sequences_match_records_to_prompts_by_id():
    prompts = [{"id": "a", "prompt_ids": [1, 2]}, {"id": "b", "prompt_ids": [3]}]
    recs = [{"id": "b", "tokens": [9, 8]}, {"id": "a", "tokens": [7]}, {"id": "c", "tokens": [5]}]
    assert probe_sequences(prompts, recs) == [[3, 9, 8], [1, 2, 7]]


def test_declared_ids_against_stage3_and_the_convention():
    """What needs no statistics: the config's ids against the run's stage-3 ids (both lists named),
    else against EAGLE-3's default shifted by one (the other meaning of 'layer k')."""
    (w,) = declared_id_warnings([3, 16, 28], 30, [2, 15, 27], "03_extract/meta.json")
    assert w["rule"] == DECLARED_RULE and w["numbers"] == {"config_ids": [3, 16, 28], "stage3_ids": [2, 15, 27]}
    assert "config lists aux layer ids [3, 16, 28], but this run's stage 3 extracted [2, 15, 27]" in w["message"]
    assert "eagle_aux_hidden_state_layer_ids in {drafter}/config.json" in w["fix"] and "[2, 15, 27]" in w["fix"]
    assert declared_id_warnings([2, 15, 27], 30, [2, 15, 27]) == []
    # no stage 3: the default shifted by +1 or -1 is named; any other list is left to the measurement
    (w,) = declared_id_warnings([3, 16, 28], 30, None)
    assert w["numbers"] == {"config_ids": [3, 16, 28], "default_ids": [2, 15, 27], "shift": 1, "num_layers": 30}
    assert declared_id_warnings([1, 14, 26], 30, None)[0]["numbers"]["shift"] == -1
    assert declared_id_warnings([4, 18, 29], 30, None) == []
    assert declared_id_warnings([2, 15, 27], 30, None) == []
    assert declared_id_warnings([3, 16, 28], None, None) == []  # layer count unknown (vLLM only)
    assert declared_id_warnings([], 30, [2, 15, 27]) == []  # missing ids: check_drafter's problem


def test_external_drafter_ids_checked_against_stage3_without_measuring(tmp_path):
    """A drafter trained on [2, 15, 27] whose config says [3, 16, 28]: named from stage 3's meta.json
    alone, with no offline record (few or no prompts decoded)."""
    from eagle3.contracts.hidden_states import write_meta
    from eagle3.rundir import EXTRACT, RunDir

    d = tmp_path / "external"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": [3, 16, 28]}))
    write_meta(RunDir(tmp_path / "run").stage(EXTRACT, create=True), {"aux_layer_ids": [2, 15, 27]})
    params = Params.model_validate({"evaluate": {"drafter_dir": str(d)}})
    (w,) = aux_layer_id_warnings(params, tmp_path / "run", d, None, None, [], None)
    assert w["rule"] == DECLARED_RULE and w["numbers"] == {"config_ids": [3, 16, 28], "stage3_ids": [2, 15, 27]}
    assert f"{RunDir(tmp_path / 'run').extract_meta.relative_to(tmp_path / 'run')}" in w["message"]
    assert f"eagle_aux_hidden_state_layer_ids in {d}/config.json" in w["fix"]
    # this run's own drafter: diagnose compares it with stage 3 (reference_problems), not this check
    assert aux_layer_id_warnings(Params.model_validate({}), tmp_path / "run", d, None, None, [], None) == []


def test_a_measurement_too_small_to_decide_says_so(monkeypatch):
    """9 positions where only the ids one below (the default) are right: z = 3 < 4, no warning, but a
    diagnosis line that the check could not decide (not silence, which reads as 'nothing found')."""
    import eagle3.evaluate.layer_ids as li

    def fit(target, dm, seqs, cands):
        return {name: [ids == [2, 15, 27]] * 9 + [True] * 11 for name, ids in cands.items()}

    monkeypatch.setattr(li, "layer_fit", fit)
    notes: list[str] = []
    warns, acc = layer_id_warnings(None, None, [3, 16, 28], [[1, 2, 3]], 30, notes=notes)
    assert warns == [] and acc["default"] == 1.0 and acc["config"] == 0.55
    assert notes == ["layer ids: the measured check could not decide: 20 positions, 9 where [2, 15, 27] (default, "
                     "first-draft accuracy 1.000) and the config's [3, 16, 28] (0.550) disagree, z = 3.0; the rule "
                     "needs z >= 4 and a gain >= 0.05 (decode more prompts: evaluate.offline_prompts)"]
    # enough positions: the warning, no note
    monkeypatch.setattr(li, "layer_fit", lambda t, d, s, cands: {n: [n == "default"] * 16 + [True] * 4 for n in cands})
    notes.clear()
    warns, _ = layer_id_warnings(None, None, [3, 16, 28], [[1, 2, 3]], 30, notes=notes)
    assert [w["rule"] for w in warns] == [RULE] and notes == []
    # the config's ids clearly best: decided, no note
    monkeypatch.setattr(li, "layer_fit", lambda t, d, s, cands: {n: [n == "config"] * 20 for n in cands})
    warns, _ = layer_id_warnings(None, None, [3, 16, 28], [[1, 2, 3]], 30, notes=notes)
    assert warns == [] and notes == []
    monkeypatch.setattr(li, "layer_fit", lambda t, d, s, cands: {n: [] for n in cands})
    assert layer_id_warnings(None, None, [3, 16, 28], [[1, 2]], 30, notes=notes) == ([], {})
    assert notes == ["layer ids: the measured check scored no position (1 sequences): not decided"]


TRAINED_IDS = [3, 5, 6]  # of the tiny target's 8 layers; its default [2, 4, 5] is one below each


@pytest.fixture(scope="module")
def tiny_drafter(tmp_path_factory):
    """(target, drafter) for the tiny random Llama target (8 layers, hidden 64, vocab 512): a one-layer
    drafter fitted for 200 steps (speculators' forward and KL loss) on the target's states of layers
    [3, 5, 6] over random token sequences, so that its fc reads those layers."""
    import torch
    from _train_fixtures import make_tiny_target, random_token_samples, target_hidden_states
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.losses.utils import resolve_loss_config
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import AutoConfig, AutoModelForCausalLM

    path = make_tiny_target(tmp_path_factory.mktemp("tiny") / "target")
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    torch.manual_seed(0)
    vc = AutoConfig.from_pretrained(path)
    vc.num_hidden_layers, vc._attn_implementation = 1, "eager"
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=vc, draft_vocab_size=vc.vocab_size, norm_before_residual=True,
        eagle_aux_hidden_state_layer_ids=TRAINED_IDS, target_hidden_size=vc.hidden_size,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            verifier=VerifierConfig.from_pretrained(str(path))))
    m = Eagle3DraftModel(cfg)
    m.load_verifier_weights()
    data = []
    for s in random_token_samples(32, seed=1, min_len=40, max_len=60):
        hs = target_hidden_states(target, s["token_ids"], TRAINED_IDS)  # [seq, 4, 64]
        ids, n = torch.as_tensor(s["token_ids"]), len(s["token_ids"])
        data.append(dict(hidden_states=hs[:-1, :3].flatten(1)[None], input_ids=ids[1:][None],
                         verifier_last_hidden_states=hs[1:, 3][None], loss_mask=torch.ones(1, n - 1, dtype=torch.bool),
                         position_ids=torch.arange(1, n)[None], document_ids=torch.zeros(1, n - 1, dtype=torch.long)))
    loss_config = resolve_loss_config("kl_div", "eager")
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=3e-3)
    m.train()
    for step in range(200):
        _, loss, _ = m(**data[step % len(data)], ttt_steps=1, loss_config=loss_config)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return target, m.eval()


@pytest.fixture(scope="module")
def tiny_text():
    """16 held-out sequences as (prompts, offline records): 10 prompt tokens, the rest 'generated'."""
    from _train_fixtures import random_token_samples

    seqs = [list(map(int, s["token_ids"])) for s in random_token_samples(16, seed=99, min_len=50, max_len=60)]
    prompts = [{"id": f"p{i}", "prompt_ids": s[:10]} for i, s in enumerate(seqs)]
    records = [{"id": f"p{i}", "tokens": s[10:]} for i, s in enumerate(seqs)]
    return prompts, records


@pytest.mark.slow  # fits a tiny drafter (200 steps): ~40 s on 2 free cores
def test_wrong_aux_ids_of_the_right_count_are_found_by_measurement(tiny_drafter, tiny_text, tmp_path):
    """Fitted on layers [3, 5, 6]; a config claiming [2, 4, 5] (the default: fc fits, ids in range and
    ascending, every static check passes) is caught: the ids one above score clearly better."""
    target, dm = tiny_drafter
    prompts, records = tiny_text
    seqs = probe_sequences(prompts, records)
    assert len(seqs) == 16
    warns, acc = layer_id_warnings(target, dm, [2, 4, 5], seqs, 8)
    assert set(acc) == {"config", "config-1", "config+1"}  # default [2, 4, 5] = config: once
    assert acc["config+1"] >= acc["config"] + 0.05, acc
    assert len(warns) == 1 and warns[0]["rule"] == RULE
    n = warns[0]["numbers"]
    assert (n["config_ids"], n["best"], n["best_ids"]) == ([2, 4, 5], "config+1", TRAINED_IDS)
    assert n["positions"] == sum(len(s) - 1 for s in seqs) and n["z"] >= 4
    assert (n["best_accuracy"], n["config_accuracy"]) == (round(acc["config+1"], 4), round(acc["config"], 4))
    assert "its config lists [2, 4, 5], but with [3, 5, 6] (config+1)" in warns[0]["message"]
    # the trained ids: no warning, and the same accuracy as the alternative above (same states)
    warns, acc_ok = layer_id_warnings(target, dm, TRAINED_IDS, seqs, 8)
    assert warns == [] and acc_ok["config"] == acc["config+1"] and acc_ok["config"] > max(
        v for k, v in acc_ok.items() if k != "config")


@pytest.mark.slow  # fits a tiny drafter (200 steps): ~40 s on 2 free cores
def test_stage5_call_only_for_an_external_drafter(tiny_drafter, tiny_text, tmp_path):
    target, dm = tiny_drafter
    prompts, records = tiny_text
    d = tmp_path / "external"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}))
    params = Params.model_validate({"evaluate": {"drafter_dir": str(d)}})
    out = aux_layer_id_warnings(params, tmp_path / "run", d, target, dm, prompts, records)
    assert [w["numbers"]["best_ids"] for w in out] == [TRAINED_IDS]
    assert f"eagle_aux_hidden_state_layer_ids in {d}/config.json" in out[0]["fix"]
    # this run's own drafter (diagnose compares it with stage 3's ids) and no offline run: nothing
    assert aux_layer_id_warnings(Params.model_validate({}), tmp_path / "run", d, target, dm, prompts, records) == []
    assert aux_layer_id_warnings(params, tmp_path / "run", d, None, None, prompts, None) == []


@pytest.mark.slow  # stage 5 offline on two prompts with the embedded target
def test_stage5_puts_the_layer_id_warning_into_stats_and_results(random_drafter, tmp_params, tmp_path, monkeypatch):
    """The wiring: stage 5 hands an external drafter's config ids, the offline records' text and the
    target's layer count to the check, and its warning lands in stats.json and results.json."""
    import eagle3.evaluate.layer_ids as li
    from eagle3.contracts.samples import write_samples
    from eagle3.evaluate import run
    from eagle3.io import read_json
    from eagle3.params_file import load_params
    from eagle3.rundir import EVALUATE, RunDir, prepare_run_dir, resolve_run_dir

    seen = {}

    def spy(target, dm, ids, seqs, n_layers, extra=None, notes=None, **kw):
        seen.update(ids=list(ids), sequences=len(seqs), layers=n_layers, extra=extra)
        notes.append("planted note")  # an undecided measurement: a diagnosis line
        return [{"rule": li.RULE, "message": "planted", "numbers": {"best_ids": [2, 15, 27]}, "fix": "see {drafter}"}], {}

    monkeypatch.setattr(li, "layer_id_warnings", spy)
    ext = _copy(random_drafter, tmp_path / "external", eagle_aux_hidden_state_layer_ids=[4, 18, 29])
    params = load_params(tmp_params(
        "target:\n  model: embedded:smollm2-135m\n  dtype: float32\n  device: cpu\n  max_model_len: 1024\n"
        f"evaluate:\n  drafter_dir: {ext}\n  backends: [offline]\n  max_new_tokens: 6\n  num_prompts: 1\n"
        "  offline_prompts: 1\n"))
    run_dir = prepare_run_dir(params, resolve_run_dir(params))
    write_samples(run_dir, [{"id": f"{split}-0", "source": "mine", "split": split, "prompt_hash": f"h-{split}",
                             "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "x"}],
                             "finish_reasons": ["stop"], "prompt_tokens": 1, "completion_tokens": 1, "settings": {}}
                            for split, q in (("heldout", "Write a function that adds two numbers."),
                                             ("train", "Write a function that reverses a list."))])
    stats = run(params, run_dir)
    assert seen == {"ids": [4, 18, 29], "sequences": 2, "layers": 30, "extra": None}  # 1 held-out + 1 general-chat
    planted = {"rule": li.RULE, "message": "planted", "numbers": {"best_ids": [2, 15, 27]}, "fix": f"see {ext}"}
    assert planted in stats.warnings
    assert planted in read_json(RunDir(run_dir).stats(EVALUATE))["warnings"]
    assert planted in read_json(RunDir(run_dir).evaluate_results)["warnings"]
    assert "planted note" in read_json(RunDir(run_dir).evaluate_results)["diagnosis"]
    assert "planted note" in stats.diagnosis
