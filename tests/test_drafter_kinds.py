"""Drafter kinds (eagle3.drafters): the registry, the EAGLE-3 kind's entries, and a second kind that
lives in this file only (a linear head on the aux hidden states), taken through Stage 4's training and
export, the export check and Stage 5's offline decoding: adding a kind is one folder plus
``train.drafter``."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from _train_fixtures import make_tiny_run, make_tiny_target, tiny_params

import eagle3.drafters.registry as registry
from eagle3.contracts.drafter import read_config, write_drafter_dir
from eagle3.contracts.vocab_mapping import VocabMapping
from eagle3.drafters import DrafterKind, Proposer, check_drafter, get, names, register
from eagle3.errors import Eagle3Error, ParamsError

TOY = "linear_toy"


# ---------------------------------------------------------------------------------------------
# The registry


def test_unknown_kind_names_the_known_ones():
    assert "eagle3" in names()
    with pytest.raises(Eagle3Error, match=r"unknown drafter kind 'medusa': the known kinds are \['eagle3'"):
        get("medusa")


def test_train_drafter_is_validated_against_the_registry(tmp_path):
    from eagle3.params_file import load_params

    assert load_params(None, {}).train.drafter == "eagle3"
    with pytest.raises(ParamsError, match=r"train\.drafter: .*unknown drafter kind 'medusa'.*\['eagle3'"):
        load_params(None, {"train": {"drafter": "medusa"}})


def test_a_name_is_registered_once(monkeypatch):
    monkeypatch.setattr(registry, "_KINDS", dict(registry._KINDS))

    @register("twice")
    class First(DrafterKind):
        pass

    with pytest.raises(ValueError, match="'twice' is already registered"):
        @register("twice")
        class Second(DrafterKind):
            pass

    assert get("twice").name == "twice" and isinstance(get("twice"), First)


def test_eagle3_speculative_config_is_vllms_eagle3_method(tmp_path):
    from eagle3.evaluate.vllm_worker import _speculative_config

    want = {"method": "eagle3", "model": "/d/drafter", "num_speculative_tokens": 3}
    assert get("eagle3").speculative_config("/d/drafter", 3) == want
    (tmp_path / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3"}))
    assert _speculative_config({"method": "eagle3", "drafter": str(tmp_path), "k": 2}) == \
        {"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 2}
    assert _speculative_config({"method": "none", "k": 2}) is None


# ---------------------------------------------------------------------------------------------
# A second kind, registered here only


class LinearDrafter(torch.nn.Module):
    """Draft logits ``[1, T, draft_vocab]`` = a linear map of the concatenated aux states ``[1, T, n_aux * H]``;
    every TTT step drafts the same token (a linear head has no state to feed back). The verifier's norm
    and head over the draft vocab are the target's (frozen), as in speculators' drafters."""

    def __init__(self, n_aux: int, hidden: int, draft_vocab: int, target_vocab: int, aux_ids: list[int],
                 eps: float, d2t=None, t2d=None) -> None:
        super().__init__()
        self.config = SimpleNamespace(speculators_model_type=TOY, aux_ids=list(aux_ids), hidden_size=hidden,
                                      target_vocab_size=target_vocab)
        self.head = torch.nn.Linear(n_aux * hidden, draft_vocab, bias=False)
        self.verifier_norm = torch.nn.RMSNorm(hidden, eps=eps).requires_grad_(False)
        self.verifier_lm_head = torch.nn.Linear(hidden, draft_vocab, bias=False).requires_grad_(False)
        self.register_buffer("d2t", d2t if d2t is not None else torch.zeros(draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", t2d if t2d is not None else torch.ones(target_vocab, dtype=torch.bool))

    def forward(self, hidden_states, input_ids, document_ids, loss_mask=None, position_ids=None,
                verifier_last_hidden_states=None, ttt_steps: int = 3, ttt_step_loss_decay: float = 1.0,
                loss_config=None, **kwargs):
        logits = self.head(hidden_states)
        with torch.no_grad():
            target = self.verifier_lm_head(self.verifier_norm(verifier_last_hidden_states)).argmax(-1)
        draft = logits.argmax(-1)
        mask = loss_mask.bool()
        T = mask.shape[1]
        loss, metrics, chain = 0.0, {"loss_sum": 0.0, "loss_total": 0.0}, torch.ones_like(mask)
        for s in range(ttt_steps):  # draft s of start p is scored against the verifier at p + s
            valid = mask[:, s:]
            ce = torch.nn.functional.cross_entropy(logits[0, : T - s], target[0, s:], reduction="none")[None]
            step_loss = (ce * valid).sum() / valid.sum().clamp(min=1)
            loss = loss + step_loss * ttt_step_loss_decay ** s
            right = (draft[:, : T - s] == target[:, s:]) & valid
            before = chain[:, : T - s] & valid
            chain = chain[:, : T - s] & right
            metrics.update({f"loss_{s}_sum": step_loss.detach() * valid.sum(), f"loss_{s}_total": valid.sum(),
                            f"full_acc_{s}_sum": chain.sum(), f"full_acc_{s}_total": valid.sum(),
                            f"cond_acc_{s}_sum": chain.sum(), f"cond_acc_{s}_total": before.sum()})
            metrics["loss_sum"] = metrics["loss_sum"] + step_loss.detach() * valid.sum()
            metrics["loss_total"] = metrics["loss_total"] + valid.sum()
        metrics = {k: torch.as_tensor(v, dtype=torch.float64) for k, v in metrics.items()}
        return [draft] * ttt_steps, loss, metrics


class LinearProposer(Proposer):
    """Offline drafting with :class:`LinearDrafter`: the fed-back state is the aux state it drafted from."""

    def __init__(self, model: LinearDrafter) -> None:
        self.m, self.length = model, 0

    def combine(self, aux):
        return aux

    def step(self, input_ids, hidden, positions):
        self.length += int(input_ids.shape[0])
        return self.m.head(hidden.to(self.m.head.weight.dtype)), hidden

    def to_target(self, draft_idx):
        return draft_idx + self.m.d2t[draft_idx]

    def draft_probs_target(self, probs):
        out = torch.zeros(self.m.config.target_vocab_size, dtype=probs.dtype)
        out[torch.arange(probs.shape[0]) + self.m.d2t] = probs
        return out

    def crop(self, length: int) -> None:
        self.length = length


def _target_head(target_dir, t2d):
    """The target's final norm gain and its LM head rows of the draft vocab."""
    from safetensors.torch import load_file

    w = load_file(str(target_dir / "model.safetensors"))
    return w["model.norm.weight"], w["lm_head.weight"][t2d]


class LinearKind(DrafterKind):
    """The toy kind: build, export, check, load, proposer, speculative_config."""

    def build(self, params, inputs, attn_implementation):
        cfg = inputs.target_config
        m = LinearDrafter(inputs.n_aux, inputs.hidden_size, inputs.draft_vocab_size, inputs.target_vocab_size,
                          inputs.aux_layer_ids, cfg.rms_norm_eps, inputs.d2t, inputs.t2d)
        norm, head = _target_head(inputs.target_path, m.t2d)
        m.verifier_norm.weight.data.copy_(norm)
        m.verifier_lm_head.weight.data.copy_(head)
        return m

    def export(self, model, out_dir, verifier_name, dtype=None, include_embed_tokens=False, info=None):
        c = model.config
        config = {"speculators_model_type": TOY, "eagle_aux_hidden_state_layer_ids": c.aux_ids,
                  "draft_vocab_size": model.head.out_features, "hidden_size": c.hidden_size,
                  "target_vocab_size": c.target_vocab_size, "rms_norm_eps": model.verifier_norm.eps,
                  "speculators_config": {"verifier": {"name_or_path": verifier_name},
                                         "proposal_methods": [{"speculative_tokens": 1}]}}
        tensors = {"head.weight": model.head.weight.detach().cpu().contiguous(), "d2t": model.d2t.cpu(),
                   "t2d": model.t2d.cpu()}
        return write_drafter_dir(out_dir, tensors, config, info)

    def check(self, cfg, weights, target_dir, target_config):
        H, N, V = target_config.hidden_size, target_config.num_hidden_layers, target_config.vocab_size
        ids, draft = cfg["eagle_aux_hidden_state_layer_ids"], cfg["draft_vocab_size"]
        out = [f"aux layer {k} out of range [1, {N - 1}]" for k in ids if not 1 <= k < N]
        if tuple(weights["head.weight"].shape) != (draft, len(ids) * H):
            out.append(f"head.weight {tuple(weights['head.weight'].shape)} ≠ ({draft}, {len(ids) * H})")
        mapping = VocabMapping(weights["d2t"], weights["t2d"], int(draft), V)
        return out + [f"vocab mapping: {p}" for p in mapping.problems()]

    def load(self, drafter_dir, target_model, settings=None, device="cpu"):
        from safetensors.torch import load_file

        cfg, w = read_config(drafter_dir), load_file(str(drafter_dir / "model.safetensors"))
        ids = cfg["eagle_aux_hidden_state_layer_ids"]
        m = LinearDrafter(len(ids), cfg["hidden_size"], cfg["draft_vocab_size"], cfg["target_vocab_size"], ids,
                          cfg["rms_norm_eps"], w["d2t"], w["t2d"])
        m.head.weight.data.copy_(w["head.weight"])
        return m.to(device=device, dtype=next(target_model.parameters()).dtype).eval()

    def proposer(self, model):
        return LinearProposer(model)

    def speculative_config(self, drafter_dir, k):
        return {"method": TOY, "model": str(drafter_dir), "num_speculative_tokens": int(k)}


@torch.no_grad()
def _greedy(target, ids: list[int], n: int) -> list[int]:
    """The target's argmax continuation, one full forward per token (no cache, no generation config)."""
    ids = list(ids)
    for _ in range(n):
        ids.append(int(target(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-n:]


@pytest.fixture
def toy_kind(monkeypatch):
    """The toy kind registered for one test (the registry as it was afterwards)."""
    monkeypatch.setattr(registry, "_KINDS", dict(registry._KINDS))
    register(TOY)(LinearKind)
    return get(TOY)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("tiny") / "target")


def test_a_second_kind_trains_exports_checks_and_decodes_offline(toy_kind, tiny_target, tmp_path):
    from transformers import AutoModelForCausalLM

    from eagle3.evaluate.decoding import evaluate_offline
    from eagle3.evaluate.drafter import load_drafter
    from eagle3.evaluate.vllm_worker import _speculative_config
    from eagle3.rundir import RunDir
    from eagle3.train import run

    # Stage 4 with train.drafter = the toy kind: the loop, checkpoints and export machinery are the stage's
    rd = tmp_path / "run"
    samples = make_tiny_run(rd, tiny_target, n=16)
    stats = run(tiny_params(tiny_target, drafter=TOY, epochs=2), rd)
    drafter = RunDir(rd).drafter_dir
    cfg = json.loads((drafter / "config.json").read_text())
    assert cfg["speculators_model_type"] == TOY and cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert stats.total_steps > 0 and stats.best_val_tau_hat is not None and stats.best_val_tau_hat >= 1.0
    assert stats.draft_vocab_size == 128 and stats.aux_layer_ids == [2, 4, 5]
    metrics = [json.loads(line) for line in RunDir(rd).train_metrics.read_text().splitlines()]
    assert [r["step"] for r in metrics if r["kind"] == "train"] == list(range(1, stats.total_steps + 1))
    assert all(r["loss"] > 0 for r in metrics if r["kind"] == "train")

    # the one check dispatches by the recorded kind (the stage ran it with raise_on_error)
    assert check_drafter(drafter, tiny_target) == []
    bad = tmp_path / "bad"
    w = {"head.weight": torch.zeros(128, 64), "d2t": torch.zeros(128, dtype=torch.long),
         "t2d": torch.zeros(512, dtype=torch.bool)}
    write_drafter_dir(bad, w, cfg | {"eagle_aux_hidden_state_layer_ids": [2, 9]})
    probs = check_drafter(bad, tiny_target)
    assert "aux layer 9 out of range [1, 7]" in probs and "head.weight (128, 64) ≠ (128, 128)" in probs
    assert any(p.startswith("vocab mapping: ") for p in probs)

    # Stage 5 offline: loaded and drafted by the kind; at T=0 the output is the target's greedy output
    target = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    dm = load_drafter(drafter, target)
    assert isinstance(dm, LinearDrafter)
    prompts = [{"id": s["id"], "source": "test", "prompt_ids": [int(t) for t in s["token_ids"][:12]]}
               for s in samples[:3]]
    recs = evaluate_offline(target, None, dm, prompts, k=2, max_new_tokens=10, aux_layer_ids=[2, 4, 5], stop_ids=[])
    for p, r in zip(prompts, recs):
        assert r["tokens"] == _greedy(target, p["prompt_ids"], 10) and r["finish_reason"] == "length"
        assert all(drafted == 2 and 0 <= accepted <= 2 for _, drafted, accepted in r["rounds"])
        assert sum(a + 1 for _, _, a in r["rounds"]) + 1 >= 10  # every round emits its accepted drafts + 1

    # vLLM's speculative_config comes from the kind recorded in the export
    assert _speculative_config({"method": "eagle3", "drafter": str(drafter), "k": 3}) == \
        {"method": TOY, "model": str(drafter), "num_speculative_tokens": 3}
