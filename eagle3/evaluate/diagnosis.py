"""Train/serve mismatches between a drafter, its target and vLLM: one line per problem found.

The checkpoint is checked by :func:`eagle3.drafters.check_drafter` (the one check, shared
with Stage 4); this module adds what only Stage 5 can see: the engine's dtype, rendered prompts and
greedy outputs, the measured effect of wrong layer ids, the mapping the training data used, and the
per-position pattern of acceptance, so that a failed parity check (:class:`eagle3.errors.ParityError`)
names its suspects.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3.contracts import tokenized
from eagle3.contracts.drafter import DrafterSettings, read_config
from eagle3.contracts.vocab_mapping import VocabMapping, load_tensors
from eagle3.drafters import check_drafter
from eagle3.evaluate.layer_ids import layer_fit
from eagle3.rundir import STAGES, VOCAB, RunDir

__all__ = ["probe_layer_ids", "diagnose"]

def probe_layer_ids(target, drafter_model, sequences: list[list[int]], candidates: dict[str, list[int]]) -> dict[str, float]:
    """First-draft accuracy of the drafter on target text with different aux layer ids.

    For each candidate id list, the target's states at those layers feed the drafter's first pass
    over each sequence (teacher forced); returned is the fraction of positions where the drafter's
    argmax (mapped to target ids) equals the target's argmax. A drafter that reads its states scores
    higher with the ids it was trained on; a weak one may barely tell them apart (the warning rule with
    a significance test is :func:`eagle3.evaluate.layer_ids.layer_id_warnings`).

    Args:
        sequences: token id lists (e.g. prompt + generated continuation).
        candidates: name -> aux layer ids.

    Returns:
        dict: name -> accuracy in [0, 1] (NaN when no position was scored).
    """
    # One target pass for all candidates (layer_ids.layer_fit); a candidate whose id count does not
    # match the drafter's fc input cannot be scored and gets NaN.
    width = drafter_model.fc.in_features
    hidden = target.config.hidden_size
    scorable = {name: ids for name, ids in candidates.items() if len(ids) * hidden == width}
    hits = layer_fit(target, drafter_model, sequences, scorable) if scorable else {}
    return {name: (sum(hits[name]) / len(hits[name]) if hits.get(name) else float("nan"))
            for name in candidates}


def _config_ids(drafter_dir: str | Path) -> list:
    """The config's ``eagle_aux_hidden_state_layer_ids`` (``[]`` when absent or unreadable)."""
    try:
        return list(read_config(drafter_dir).get("eagle_aux_hidden_state_layer_ids") or [])
    except Exception:  # noqa: BLE001 - check_drafter reports an unreadable config
        return []


def _layer_probe(target, drafter_model, ids, reference, prompts, offline_records) -> list[str]:
    """The measured first-draft accuracy with the config's vs the trained ids (a hint, never fatal)."""
    by_id = {p["id"]: p for p in prompts or []}
    seqs = [[*by_id[r["id"]]["prompt_ids"], *r["tokens"]] for r in offline_records if r["id"] in by_id][:4]
    try:
        acc = probe_layer_ids(target, drafter_model, seqs,
                              {"config": sorted(set(int(i) for i in ids)), "trained": list(reference.aux_layer_ids)})
        return [f"layer ids: measured first-draft accuracy {acc['trained']:.3f} with the trained ids "
                f"vs {acc['config']:.3f} with the config's"]
    except Exception as exc:  # noqa: BLE001 - the probe is a hint; a failure must not hide the finding before it
        return [f"layer ids: probe failed ({type(exc).__name__}: {exc})"]


def _training_mapping(drafter_dir: str | Path, run_dir: str | Path) -> list[str]:
    """Stage 2's mapping passes :meth:`VocabMapping.problems` (the one check of a mapping) and the
    checkpoint's ``d2t`` equals it (the mapping the training data used)."""
    import torch
    from safetensors import safe_open

    mp, wfile = RunDir(run_dir).vocab_mapping, Path(drafter_dir) / "model.safetensors"
    if not mp.exists() or not wfile.exists():
        return []
    with safe_open(str(wfile), "pt") as f:
        if "d2t" not in f.keys():
            return []
        d2t = f.get_tensor("d2t")
    ref_d2t, ref_t2d, _ = load_tensors(mp)
    ref = VocabMapping(ref_d2t, ref_t2d, int(ref_d2t.numel()), int(ref_t2d.numel()))
    probs = [f"vocab mapping: {mp}: {p}" for p in ref.problems()]
    if ref_d2t.shape != d2t.shape or not torch.equal(ref_d2t.long(), d2t.long()):
        probs.append(f"vocab mapping: d2t differs from {mp} (the mapping the training data used)")
    return probs


def _dtype(drafter_dir: str | Path, target_dir: str | Path, vllm: dict, offline_dtype: str | None = None) -> list[str]:
    """The dtype vLLM ran in vs the one the offline side used (``offline_dtype``: the target's, the
    drafter cast to it, :func:`eagle3.evaluate.drafter.load_drafter`). Equal: nothing to report (a
    run's ``target.dtype`` may differ from the checkpoint's on purpose, e.g. bfloat16 on CPU). Unknown
    (None): the checkpoint's dtypes are the reference, stated as such."""
    from safetensors import safe_open

    probs = []
    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    tcfg = tcfg.get("text_config", tcfg)
    t_dtype = str(tcfg.get("dtype") or tcfg.get("torch_dtype") or "")
    ck_dtype = None
    wfile = Path(drafter_dir) / "model.safetensors"
    if wfile.exists():
        with safe_open(str(wfile), "pt") as f:
            for name in f.keys():
                t = f.get_slice(name)
                if t.get_dtype() in ("F32", "F16", "BF16", "F64"):
                    ck_dtype = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}[t.get_dtype()]
                    break
    vd = vllm.get("dtype")
    if offline_dtype is not None:
        if vd and vd != offline_dtype:
            probs.append(f"dtype: vLLM ran the target and drafter in {vd}, offline (transformers) in {offline_dtype} "
                         f"(the checkpoints: target {t_dtype or '?'}, drafter {ck_dtype or '?'})")
        return probs
    if vd and t_dtype and vd != t_dtype:
        probs.append(f"dtype: vLLM ran the target in {vd}, the checkpoint is {t_dtype}")
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
        compared = [r for r in vllm["per_prompt"] if r["id"] in off]  # the prompts decoded offline, not all of vLLM's
        mism = [r["id"] for r in compared if list(off[r["id"]]) != list(r["tokens"])]
        if mism:
            probs.append(f"dtype: vLLM's greedy output differs from transformers' for {len(mism)}/{len(compared)} "
                         f"prompts decoded by both (numerics of the target itself, e.g. dtype or kernels; each engine "
                         f"is measured on its own text, so this alone needs no action: it explains a parity gap)")
    return probs


def _training_render(prompts: list[dict], run_dir: str | Path) -> list[str]:
    """The offline render is a prefix of the same conversation as tokenized for training (stage 2)."""
    hp = tokenized.split_path(run_dir, "heldout")
    if not hp.exists():
        return []
    tab = tokenized.read_table(run_dir, "heldout", ["id", "input_ids"]).to_pydict()
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
             offline_records: list[dict] | None = None, drafter_problems: list[str] | None = None,
             offline_dtype: str | None = None) -> list[str]:
    """Look for train/serve mismatches between a drafter, its target and vLLM; one line per problem.

    Checked:

    * the checkpoint itself, with :func:`eagle3.drafters.check_drafter` (the one check, also
      Stage 4's): layer ids, norm flags, hidden sizes, rope, the d2t/t2d mapping, embeddings, and, with
      ``reference``, the layer ids and norm flags the drafter was trained with (pass the result as
      ``drafter_problems`` when it is already known);
    * ``layer ids`` measured: with ``target``, ``drafter_model`` and ``offline_records``, the
      first-draft accuracy with the config's vs the trained ids when they differ;
    * ``vocab mapping``: ``d2t`` equal to stage 2's ``vocab_mapping.safetensors`` (with ``run_dir``);
    * ``dtype``: the dtype vLLM ran in vs ``offline_dtype`` (what the offline side used: the target's
      loaded dtype, the drafter cast to it; without it, vs the checkpoints' dtypes); vLLM's greedy
      output equal to transformers' (numerics of the target itself);
    * ``chat template``: vLLM's rendered prompt ids equal the offline ones; the offline render is a
      prefix of the same conversation tokenized for training (stage 2's ``heldout.parquet``);
    * ``per-position``: where vLLM's conditional acceptance falls below offline's.

    Returns:
        list[str]: problems found (empty when nothing is wrong).
    """
    probs = list(check_drafter(drafter_dir, target_dir, reference=reference)
                 if drafter_problems is None else drafter_problems)
    ids = _config_ids(drafter_dir)
    if (reference is not None and ids and list(reference.aux_layer_ids) != list(ids)
            and target is not None and drafter_model is not None and offline_records):
        probs += _layer_probe(target, drafter_model, ids, reference, prompts, offline_records)
    if run_dir is not None:
        probs += _training_mapping(drafter_dir, run_dir)
    if vllm is not None:
        probs += _dtype(drafter_dir, target_dir, vllm, offline_dtype)
    if prompts and vllm is not None and vllm.get("per_prompt"):
        probs += _vllm_outputs(vllm, prompts, offline_records)
    if prompts and run_dir is not None:
        probs += _training_render(prompts, run_dir)
    if offline and vllm is not None and offline.get("per_position_conditional") and vllm.get("per_position_conditional"):
        probs += _per_position(offline, vllm)
    return probs
