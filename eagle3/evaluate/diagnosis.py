"""Train/serve mismatches between a drafter, its target and vLLM: one line per problem found.

Each line starts with its category (``layer ids``, ``norm flags``, ``hidden size / vocab``,
``vocab mapping``, ``dtype``, ``chat template``, ``per-position``), so that a failed parity check
(:class:`eagle3.evaluate.errors.ParityError`) names its suspects.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3.evaluate.decoding import TargetAuxRunner
from eagle3.evaluate.drafter import DrafterSettings, Eagle3Drafter, read_drafter_config
from eagle3.rundir import STAGES, VOCAB, RunDir

__all__ = ["probe_layer_ids", "diagnose"]

_NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def probe_layer_ids(target, drafter_model, sequences: list[list[int]], candidates: dict[str, list[int]]) -> dict[str, float]:
    """First-draft accuracy of the drafter on target text with different aux layer ids.

    For each candidate id list, the target's states at those layers feed the drafter's first pass
    over each sequence (teacher forced); returned is the fraction of positions where the drafter's
    argmax (mapped to target ids) equals the target's argmax. The ids the drafter was trained on
    score clearly higher than wrong ones.

    Args:
        sequences: token id lists (e.g. prompt + generated continuation).
        candidates: name -> aux layer ids.

    Returns:
        dict: name -> accuracy in [0, 1] (NaN when no position was scored).
    """
    import torch
    from transformers import DynamicCache

    res = {}
    dev = next(target.parameters()).device
    for name, ids in candidates.items():
        hit = tot = 0
        runner = TargetAuxRunner(target, ids)
        try:
            with torch.no_grad():
                for seq in sequences:
                    if len(seq) < 3:
                        continue
                    logits, aux = runner.forward(torch.tensor([seq], device=dev), DynamicCache())
                    dr = Eagle3Drafter(drafter_model)
                    if dr.m.fc.in_features != aux.shape[-1]:
                        break
                    dl, _ = dr.step(torch.tensor(seq[1:], device=dev), dr.combine(aux[:-1]),
                                    torch.arange(len(seq) - 1, device=dev))
                    pred = dr.to_target(dl.argmax(-1))
                    tgt = logits[1:].argmax(-1)
                    hit += int((pred == tgt).sum())
                    tot += int(tgt.numel())
        finally:
            runner.close()
        res[name] = hit / tot if tot else float("nan")
    return res


@dataclass
class _Checkpoint:
    """What the checks read: the drafter's config and weights, the target's sizes."""

    dir: Path
    target_dir: Path
    cfg: dict
    weights: dict[str, Any]
    n_layers: int
    hidden: int
    vocab: int
    target_dtype: str  # as the target's config.json names it ("" when absent)


def _open(drafter_dir: str | Path, target_dir: str | Path) -> tuple[_Checkpoint, list[str]]:
    """The checkpoint's config and weights (all tensors, on CPU) and the target's sizes."""
    from safetensors import safe_open

    d = Path(drafter_dir)
    cfg = read_drafter_config(d)
    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    tcfg = tcfg.get("text_config", tcfg)
    weights: dict[str, Any] = {}
    probs = []
    wfile = d / "model.safetensors"
    if wfile.exists():
        with safe_open(str(wfile), "pt") as f:
            weights = {kk: f.get_tensor(kk) for kk in f.keys()}
    else:
        probs.append(f"weights: {wfile} is missing")
    ck = _Checkpoint(d, Path(target_dir), cfg, weights, tcfg["num_hidden_layers"], tcfg["hidden_size"],
                     tcfg["vocab_size"], str(tcfg.get("dtype") or tcfg.get("torch_dtype") or ""))
    return ck, probs


def _layer_ids(ck: _Checkpoint, reference: DrafterSettings | None) -> tuple[list[str], list]:
    """Problems with ``eagle_aux_hidden_state_layer_ids``; also returns the ids (``[]`` when absent)."""
    probs = []
    ids = ck.cfg.get("eagle_aux_hidden_state_layer_ids")
    n = ck.n_layers
    if not ids:
        probs.append("layer ids: config.json has no eagle_aux_hidden_state_layer_ids (vLLM then guesses)")
        ids = []
    else:
        bad = [i for i in ids if not 0 <= int(i) <= n]
        if bad:
            probs.append(f"layer ids: {bad} outside [0, {n}] for a target with {n} layers")
        if len(set(ids)) != len(ids):
            probs.append(f"layer ids: duplicates in {ids}")
        if list(ids) != sorted(ids):
            probs.append(f"layer ids: {ids} not ascending; vLLM concatenates aux states in ascending layer "
                         f"order {sorted(set(ids))}, so fc sees them in another order than in training")
    fcw = ck.weights.get("fc.weight")
    if fcw is not None and ids and fcw.shape[1] != len(ids) * ck.hidden:
        probs.append(f"layer ids: fc expects {fcw.shape[1] // ck.hidden} aux states, config lists {len(ids)}")
    if reference is not None and ids and list(reference.aux_layer_ids) != list(ids):
        probs.append(f"layer ids: config.json lists {list(ids)} but the drafter was trained on "
                     f"{list(reference.aux_layer_ids)} ({reference.source})")
    return probs, ids


def _layer_probe(target, drafter_model, ids, reference, prompts, offline_records) -> list[str]:
    """The measured first-draft accuracy with the config's vs the trained ids (a hint, never fatal)."""
    seqs = [[*p["prompt_ids"], *r["tokens"]] for p, r in zip(prompts or [], offline_records)][:4]
    try:
        acc = probe_layer_ids(target, drafter_model, seqs,
                              {"config": sorted(set(int(i) for i in ids)), "trained": list(reference.aux_layer_ids)})
        return [f"layer ids: measured first-draft accuracy {acc['trained']:.3f} with the trained ids "
                f"vs {acc['config']:.3f} with the config's"]
    except Exception as exc:  # the probe is a hint; a failure must not hide the finding before it
        return [f"layer ids: probe failed ({type(exc).__name__}: {exc})"]


def _norm_flags(ck: _Checkpoint, reference: DrafterSettings | None) -> list[str]:
    """Norm flags written, equal to the training values, consistent with the weights present."""
    probs, cfg, w = [], ck.cfg, ck.weights
    for flag in _NORM_FLAGS:
        if flag not in cfg:
            extra = " (vLLM then assumes True, speculators False)" if flag == "norm_before_residual" else ""
            probs.append(f"norm flags: {flag} is not written in config.json{extra}")
        elif reference is not None and bool(cfg[flag]) != bool(getattr(reference, flag)):
            probs.append(f"norm flags: config.json has {flag}={cfg[flag]} but the drafter was trained with "
                         f"{getattr(reference, flag)} ({reference.source})")
    if not w:
        return probs
    has_in = "input_norm.weight" in w
    if bool(cfg.get("norm_before_fc")) != has_in:
        probs.append(f"norm flags: norm_before_fc={cfg.get('norm_before_fc')} but input_norm.weight is "
                     f"{'present' if has_in else 'absent'} in the weights")
    has_fcn = any(kk.startswith("fc_norm.") for kk in w)
    if bool(cfg.get("fc_norm")) != has_fcn:
        probs.append(f"norm flags: fc_norm={cfg.get('fc_norm')} but fc_norm.* weights are "
                     f"{'present' if has_fcn else 'absent'}")
    if "layers.0.hidden_norm.weight" not in w:
        probs.append("norm flags: layers.0.hidden_norm.weight missing (vLLM would leave it at 1.0)")
    return probs


def _sizes(ck: _Checkpoint) -> list[str]:
    """Drafter vs target hidden size and vocab; ``lm_head`` rows vs ``draft_vocab_size``."""
    probs, cfg = [], ck.cfg
    tl = cfg.get("transformer_layer_config", {})
    if tl.get("vocab_size") not in (None, ck.vocab):
        probs.append(f"hidden size / vocab: transformer_layer_config.vocab_size {tl.get('vocab_size')} != target {ck.vocab}")
    if tl.get("hidden_size") not in (None, ck.hidden) or cfg.get("target_hidden_size") not in (None, ck.hidden):
        probs.append(f"hidden size / vocab: drafter hidden {tl.get('hidden_size')} / target_hidden_size "
                     f"{cfg.get('target_hidden_size')} vs target {ck.hidden}")
    lm, dvs = ck.weights.get("lm_head.weight"), cfg.get("draft_vocab_size")
    if lm is not None and dvs is not None and lm.shape[0] != dvs:
        probs.append(f"vocab mapping: lm_head has {lm.shape[0]} rows, draft_vocab_size is {dvs}")
    return probs


def _vocab_mapping(ck: _Checkpoint, run_dir: str | Path | None) -> list[str]:
    """``d2t``/``t2d``: present for a reduced draft vocab, lengths, range, order, consistency, equal
    to the mapping the training data used (stage 2's ``vocab_mapping.safetensors``)."""
    import torch

    dvs, vocab = ck.cfg.get("draft_vocab_size"), ck.vocab
    d2t, t2d = ck.weights.get("d2t"), ck.weights.get("t2d")
    if dvs is None or dvs == vocab:
        if d2t is not None and d2t.numel() and bool((d2t != 0).any()):
            return ["vocab mapping: full-size draft vocab but a non-identity d2t in the weights"]
        return []
    if d2t is None or t2d is None:
        return [f"vocab mapping: draft_vocab_size {dvs} < {vocab} but d2t/t2d are missing from the weights"]
    probs = []
    if d2t.numel() != dvs:
        probs.append(f"vocab mapping: d2t has {d2t.numel()} entries, draft_vocab_size is {dvs}")
    tids = torch.arange(d2t.numel()) + d2t.long()
    if tids.numel() and (int(tids.min()) < 0 or int(tids.max()) >= vocab):
        probs.append(f"vocab mapping: d2t maps outside the target vocab [0, {vocab})")
    elif tids.numel() > 1 and not bool((tids[1:] > tids[:-1]).all()):
        probs.append("vocab mapping: d2t target ids are not strictly ascending")
    elif t2d.numel() != vocab or int(t2d.sum()) != d2t.numel() or not bool(t2d.bool()[tids].all()):
        probs.append("vocab mapping: t2d is inconsistent with d2t")
    mp = RunDir(run_dir).vocab_mapping if run_dir is not None else None
    if mp is not None and mp.exists():
        from safetensors.torch import load_file

        ref = load_file(str(mp))
        if ref["d2t"].shape != d2t.shape or not torch.equal(ref["d2t"].long(), d2t.long()):
            probs.append(f"vocab mapping: d2t differs from {mp} (the mapping the training data used)")
    return probs


def _dtype(ck: _Checkpoint, vllm: dict | None) -> list[str]:
    """``embed_tokens`` bit-identical to the target's; checkpoint vs target vs vLLM dtype."""
    import torch
    from safetensors import safe_open

    probs = []
    floats = [t for t in ck.weights.values() if t.is_floating_point()]
    ck_dtype = str(floats[0].dtype).replace("torch.", "") if floats else None
    t_dtype = ck.target_dtype
    emb = ck.weights.get("embed_tokens.weight")
    tfile = ck.target_dir / "model.safetensors"
    if emb is not None:
        with safe_open(str(tfile), "pt") if tfile.exists() else nullcontext() as f:
            key = next((kk for kk in f.keys() if kk.endswith("embed_tokens.weight")), None) if f is not None else None
            if key is not None:
                te = f.get_tensor(key)
                if te.shape != emb.shape or not torch.equal(te.to(emb.dtype), emb):
                    probs.append("dtype: embed_tokens in the drafter is not bit-identical to the target's "
                                 "(vLLM then keeps a separate copy; training used the target's)")
    if vllm is not None:
        vd = vllm.get("dtype")
        if vd and t_dtype and vd != t_dtype:
            probs.append(f"dtype: vLLM ran the target in {vd}, the checkpoint is {t_dtype} (offline used {t_dtype})")
        if ck_dtype and vd and ck_dtype != vd:
            probs.append(f"dtype: drafter weights are {ck_dtype}, vLLM ran it in {vd}")
    return probs


def _vllm_outputs(vllm: dict, prompts: list[dict], offline_records: list[dict] | None) -> list[str]:
    """vLLM's rendered prompt ids equal the offline ones; its greedy output equals transformers'."""
    probs = []
    ours = {p["id"]: p["prompt_ids"] for p in prompts}
    diff = []
    for r in vllm["per_prompt"]:
        a, b = ours.get(r["id"]), r.get("prompt_ids")
        if a is not None and b and list(a) != list(b):
            i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            diff.append(f"{r['id']}@{i}")
    if diff:
        probs.append(f"chat template: vLLM rendered {len(diff)}/{len(vllm['per_prompt'])} prompts differently "
                     f"from the offline render (first differing token: {', '.join(diff[:3])})")
    if offline_records and vllm.get("temperature", 1) <= 0:
        off = {r["id"]: r["tokens"] for r in offline_records}
        mism = [r["id"] for r in vllm["per_prompt"] if r["id"] in off and list(off[r["id"]]) != list(r["tokens"])]
        if mism:
            probs.append(f"dtype: vLLM's greedy output differs from transformers' for {len(mism)}/"
                         f"{len(vllm['per_prompt'])} prompts (numerics of the target itself, e.g. dtype or kernels)")
    return probs


def _training_render(prompts: list[dict], run_dir: str | Path) -> list[str]:
    """The offline render is a prefix of the same conversation as tokenized for training (stage 2)."""
    hp = RunDir(run_dir).tokenized("heldout")
    if not hp.exists():
        return []
    import pyarrow.parquet as pq

    tab = pq.read_table(hp, columns=["id", "input_ids"]).to_pydict()
    train_render = dict(zip(tab["id"], tab["input_ids"]))
    bad = [p["id"] for p in prompts if p["id"] in train_render
           and list(train_render[p["id"]][: len(p["prompt_ids"])]) != list(p["prompt_ids"])]
    if bad:
        return [f"chat template: {len(bad)} prompts render differently from {STAGES[VOCAB]}/{hp.name} "
                f"(the training tokenization), e.g. {bad[0]}"]
    return []


def _per_position(offline: dict, vllm: dict) -> list[str]:
    """Where vLLM's conditional acceptance falls below offline's: position 1 or the chain."""
    o, v = offline["per_position_conditional"], vllm["per_position_conditional"]
    if o[0] is not None and v[0] is not None and o[0] - v[0] > 0.1:
        return [f"per-position: vLLM accepts position 1 at {v[0]:.2f} vs {o[0]:.2f} offline: the first "
                "draft already differs (aux states, fc, norms or the vocab mapping)"]
    if len(o) > 1 and o[1] is not None and v[1] is not None and o[1] - v[1] > 0.15:
        return [f"per-position: position 1 agrees but position 2 is {v[1]:.2f} in vLLM vs {o[1]:.2f} "
                "offline: the fed-back hidden state differs (norm_output, chain positions)"]
    return []


def diagnose(drafter_dir: str | Path, target_dir: str | Path, reference: DrafterSettings | None = None,
             run_dir: str | Path | None = None, target=None, drafter_model=None,
             offline: dict | None = None, vllm: dict | None = None, prompts: list[dict] | None = None,
             offline_records: list[dict] | None = None) -> list[str]:
    """Look for train/serve mismatches between a drafter, its target and vLLM; one line per problem.

    Checked (each line starts with its category):

    * ``layer ids``: present, in ``[0, N]``, distinct, ascending (vLLM concatenates the aux states
      in ascending layer order), as many as ``fc`` expects, equal to the ids the drafter was
      trained on (``reference``, e.g. stage 3's ``meta.json``); with ``target`` and
      ``drafter_model`` also measured: first-draft accuracy with the config's vs the trained ids.
    * ``norm flags``: written in config.json (vLLM defaults ``norm_before_residual`` to True,
      speculators to False), equal to the training values, consistent with the weights present
      (``input_norm`` for ``norm_before_fc``, ``fc_norm.*`` for ``fc_norm``).
    * ``hidden size / vocab``: drafter vs target config.
    * ``vocab mapping``: ``d2t``/``t2d`` present for a reduced draft vocab, lengths, range, order,
      t2d consistent with d2t, ``lm_head`` rows = ``draft_vocab_size``, equal to stage 2's
      ``vocab_mapping.safetensors``.
    * ``dtype``: checkpoint vs target vs vLLM dtype; ``embed_tokens`` bit-identical to the target's;
      vLLM's greedy output equal to transformers' (numerics of the target itself).
    * ``chat template``: vLLM's rendered prompt ids equal the offline ones; the offline render is a
      prefix of the same conversation tokenized for training (stage 2's ``heldout.parquet``).
    * ``per-position``: where vLLM's conditional acceptance falls below offline's.

    Returns:
        list[str]: problems found (empty when nothing is wrong).

    Raises:
        EvaluateError: the drafter has no readable config.json.
    """
    ck, probs = _open(drafter_dir, target_dir)
    id_probs, ids = _layer_ids(ck, reference)
    probs += id_probs
    if (reference is not None and ids and list(reference.aux_layer_ids) != list(ids)
            and target is not None and drafter_model is not None and offline_records):
        probs += _layer_probe(target, drafter_model, ids, reference, prompts, offline_records)
    probs += _norm_flags(ck, reference)
    probs += _sizes(ck)
    probs += _vocab_mapping(ck, run_dir)
    probs += _dtype(ck, vllm)
    if prompts and vllm is not None and vllm.get("per_prompt"):
        probs += _vllm_outputs(vllm, prompts, offline_records)
    if prompts and run_dir is not None:
        probs += _training_render(prompts, run_dir)
    if offline and vllm is not None and offline.get("per_position_conditional") and vllm.get("per_position_conditional"):
        probs += _per_position(offline, vllm)
    return probs
