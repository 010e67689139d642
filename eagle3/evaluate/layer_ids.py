"""Are an external drafter's aux layer ids the ones it was trained on? Stage 5's warnings.

First what needs no statistics (:func:`declared_id_warnings`, rule ``aux_layer_ids_mismatch``): the
config's ``eagle_aux_hidden_state_layer_ids`` against the ids this run's stage 3 extracted (its
``meta.json``), or, without them, against the target depth's convention (EAGLE-3's default
``[2, N//2, N-3]`` shifted by one is the other meaning of "layer k"). Then the measurement below, which
decides only with enough positions; when it cannot, it says so (a diagnosis line) rather than nothing.

A drafter from elsewhere (``evaluate.drafter_dir``) comes with nothing but its ``config.json``: when
``eagle_aux_hidden_state_layer_ids`` is wrong but of the right count (``fc`` still fits, vLLM loads
it), every static check passes and acceptance is simply low. Its ``fc`` was fitted to the states of
the layers it was trained on, so its first-draft accuracy on the target's own text (teacher forced,
as :func:`eagle3.evaluate.diagnosis.probe_layer_ids` measures it for this run's own drafter) is
highest with them. :func:`layer_fit` measures it in one target pass per sequence for the config's
ids and the usual alternatives of the same count (:func:`candidate_layer_ids`):

* ``default``: EAGLE-3's ``[2, N//2, N-3]`` (speculators, vLLM), when the config has 3 ids;
* ``config-1`` / ``config+1``: every id shifted by one (the two conventions for "layer k": the
  residual stream after decoder layer ``k-1`` = transformers' ``hidden_states[k]``, which vLLM and
  this project use, or the output of layer ``k``);
* ``stage 3``: the ids of this run's ``03_extract/meta.json``, when there is one.

Rule (``aux_layer_ids_suspect``, :func:`layer_id_warnings`): the best alternative's accuracy
exceeds the config's by at least ``min_gain`` (absolute, default 0.05) and the paired difference is
significant: ``z = (b - c) / sqrt(b + c) >= min_z`` (default 4), where ``b`` counts the positions
only the alternative gets right and ``c`` those only the config's ids get right (McNemar's test on
the same positions). The warning is the stage-5 warning dict ``{"rule", "message", "numbers",
"fix"}`` (``stats.json`` ``warnings``, top of the report).
"""

from __future__ import annotations

import math
from pathlib import Path

from eagle3.errors import EvaluateError
from eagle3.evaluate.drafter import proposer
from eagle3.hooks import CachedCapture, default_aux_layer_ids

__all__ = ["RULE", "DECLARED_RULE", "candidate_layer_ids", "declared_id_warnings", "probe_sequences", "layer_fit",
           "layer_id_warnings", "aux_layer_id_warnings"]

RULE = "aux_layer_ids_suspect"
DECLARED_RULE = "aux_layer_ids_mismatch"
_FIX = ("set eagle_aux_hidden_state_layer_ids in {drafter}/config.json to the ids it was trained on "
        "({ids}) and re-run stage 5; layer id k = the residual stream after decoder layer k-1 "
        "(transformers hidden_states[k], vLLM's convention)")


def declared_id_warnings(config_ids: list[int], num_layers: int | None, stage3_ids: list[int] | None,
                         stage3_where: str = "stage 3's meta.json") -> list[dict]:
    """The aux layer id checks that need no measurement (rule ``aux_layer_ids_mismatch``).

    * With ``stage3_ids`` (this run extracted those layers): the config listing other ids is named with
      both lists; a drafter trained on this run's states reads those layers, and vLLM feeds it the config's.
    * Without them, with ``num_layers`` ``N``: a config of 3 ids equal to the default ``[2, N//2, N-3]``
      shifted by one each (the other convention for "layer k": the output of layer ``k``) is named.

    Args:
        config_ids: the drafter config's ``eagle_aux_hidden_state_layer_ids``.
        num_layers: the target's decoder layers (None: unknown, the convention is not checked).
        stage3_ids: this run's stage-3 ``aux_layer_ids`` (None or empty: no stage 3).
        stage3_where: where they are recorded (said in the message).

    Returns:
        list[dict]: empty or one stage-5 warning ``{"rule", "message", "numbers", "fix"}`` (``fix`` holds
        ``{drafter}`` for the caller to fill in).
    """
    cfg = [int(i) for i in config_ids]
    if not cfg:
        return []  # a missing list is check_drafter's problem
    if stage3_ids:
        ref = [int(i) for i in stage3_ids]
        if ref == cfg:
            return []
        why = (f"the drafter's config lists aux layer ids {cfg}, but this run's stage 3 extracted {ref} "
               f"({stage3_where}): if the drafter was trained on these states, vLLM feeds it other layers "
               f"than it learned")
        numbers = {"config_ids": cfg, "stage3_ids": ref}
    else:
        default = default_aux_layer_ids(num_layers) if num_layers and len(cfg) == 3 else None
        shift = next((d for d in (-1, 1) if default and cfg == [i + d for i in default]), None)
        if shift is None:
            return []
        ref = default
        why = (f"the drafter's config lists aux layer ids {cfg}: EAGLE-3's default {ref} for a {num_layers}-layer "
               f"target, each id shifted by {shift:+d} (the other convention for 'layer k'): it was probably "
               f"trained on {ref}")
        numbers = {"config_ids": cfg, "default_ids": ref, "shift": shift, "num_layers": int(num_layers)}
    return [{"rule": DECLARED_RULE, "message": why, "numbers": numbers, "fix": _FIX.replace("{ids}", f"e.g. {ref}")}]


def candidate_layer_ids(config_ids: list[int], num_layers: int, extra: dict[str, list[int]] | None = None
                        ) -> dict[str, list[int]]:
    """``{"config": config_ids, <name>: ids, ...}``: the alternatives of the module docstring that have
    as many ids as the config, all within ``[1, N-1]`` and distinct, each id list once (first name kept).

    Args:
        config_ids: the drafter config's ``eagle_aux_hidden_state_layer_ids`` (order kept).
        num_layers: the target's decoder layers ``N``.
        extra: more named candidates (e.g. ``{"stage 3": [...]}``).
    """
    n, N = len(config_ids), int(num_layers)
    cands: dict[str, list[int]] = {"config": [int(i) for i in config_ids]}
    if n == 3:
        cands["default"] = default_aux_layer_ids(N)
    cands["config-1"] = [int(i) - 1 for i in config_ids]
    cands["config+1"] = [int(i) + 1 for i in config_ids]
    for name, ids in (extra or {}).items():
        cands[name] = [int(i) for i in ids]
    out: dict[str, list[int]] = {}
    seen: set[tuple[int, ...]] = set()
    for name, ids in cands.items():
        key = tuple(sorted(ids))
        ok = len(ids) == n and len(set(ids)) == n and all(1 <= i < N for i in ids)
        if name == "config" or (ok and key not in seen):
            out[name] = ids
            seen.add(key)
    return out


def probe_sequences(prompts: list[dict], records: list[dict], n: int = 16) -> list[list[int]]:
    """Up to ``n`` token sequences of the target's own text: each offline record's prompt ids
    (``prompts`` matched by ``id``) followed by the tokens the target generated (``records[i]["tokens"]``)."""
    ids = {p["id"]: p["prompt_ids"] for p in prompts}
    seqs = [[*ids[r["id"]], *r["tokens"]] for r in records if r.get("id") in ids and r.get("tokens")]
    return seqs[:n]


def layer_fit(target, drafter_model, sequences: list[list[int]], candidates: dict[str, list[int]]) -> dict[str, list[bool]]:
    """Per-position first-draft hits of the drafter with each candidate's aux states.

    One target forward per sequence captures the union of the candidates' layers
    (:class:`eagle3.hooks.CachedCapture`); then, for each candidate, the drafter's first pass over the
    sequence (token ``p+1`` with the ``fc``-combined states at ``p``, as vLLM's proposer runs it) is
    compared with the target's argmax at ``p+1``, mapped through ``d2t``.

    Args:
        target: the transformers target (eval mode).
        drafter_model: a speculators ``Eagle3DraftModel`` whose ``fc`` takes as many aux states as each
            candidate has.
        sequences: token id lists (sequences shorter than 3 tokens are skipped).
        candidates: name -> aux layer ids (any of ``1..N``).

    Returns:
        dict: name -> hits, one bool per scored position, the same positions for every candidate.
    """
    import torch
    from transformers import DynamicCache

    union = sorted({int(i) for ids in candidates.values() for i in ids})
    slot = {i: k for k, i in enumerate(union)}
    hits: dict[str, list[bool]] = {name: [] for name in candidates}
    dev = next(target.parameters()).device
    runner = CachedCapture(target, union, error=EvaluateError)
    try:
        with torch.no_grad():
            for seq in sequences:
                if len(seq) < 3:
                    continue
                logits, aux = runner.forward(torch.tensor([seq], device=dev), DynamicCache())
                per_layer = aux.view(aux.shape[0], len(union), -1)  # [seq, layers, H]
                tgt = logits[1:].argmax(-1)
                for name, ids in candidates.items():
                    dr = proposer(drafter_model)
                    states = per_layer[:-1, [slot[int(i)] for i in ids]].flatten(1)  # config order
                    dl, _ = dr.step(torch.tensor(seq[1:], device=dev), dr.combine(states),
                                    torch.arange(len(seq) - 1, device=dev))
                    hits[name] += (dr.to_target(dl.argmax(-1)) == tgt).tolist()
    finally:
        runner.close()
    return hits


def _undecided(n: int, best: str, cands: dict[str, list[int]], acc: dict[str, float], discordant: int, z: float,
               min_gain: float, min_z: float) -> str | None:
    """The diagnosis line of a measurement that could not decide, else None: the positions where the
    best alternative and the config's ids disagree cannot reach ``z >= min_z`` (fewer than ``min_z**2``),
    or the alternative scores higher without reaching it."""
    if discordant >= min_z ** 2 and (acc[best] <= acc["config"] or z >= min_z):
        return None
    return (f"layer ids: the measured check could not decide: {n} positions, {discordant} where {cands[best]} "
            f"({best}, first-draft accuracy {acc[best]:.3f}) and the config's {cands['config']} "
            f"({acc['config']:.3f}) disagree, z = {z:.1f}; the rule needs z >= {min_z:g} and a gain >= "
            f"{min_gain:g} (decode more prompts: evaluate.offline_prompts)")


def layer_id_warnings(target, drafter_model, config_ids: list[int], sequences: list[list[int]], num_layers: int,
                      extra: dict[str, list[int]] | None = None, min_gain: float = 0.05, min_z: float = 4.0,
                      notes: list[str] | None = None) -> tuple[list[dict], dict[str, float]]:
    """Measure the first-draft accuracy with the config's and the alternative ids; warn (module rule).

    Args:
        target: the transformers target (eval mode).
        drafter_model: the drafter as loaded for offline decoding.
        config_ids: the ids the drafter's config lists.
        sequences: token id lists of the target's own text (:func:`probe_sequences`).
        num_layers: the target's decoder layers ``N``.
        extra, min_gain, min_z: see :func:`candidate_layer_ids` and the module rule.
        notes: when given, a line is appended to it when the measurement could not decide (too few
            positions where the candidates disagree, or none scored): stage 5's diagnosis.

    Returns:
        tuple: ``(warnings, accuracy)``; ``accuracy`` maps each candidate name to its first-draft
        accuracy in [0, 1] ({} when nothing was measured); ``warnings`` is empty or one dict.
    """
    notes = [] if notes is None else notes
    cands = candidate_layer_ids(config_ids, num_layers, extra)
    if len(cands) < 2 or not all(1 <= int(i) <= num_layers for i in cands["config"]):
        return [], {}  # nothing to compare with, or ids check_drafter already reports
    hits = layer_fit(target, drafter_model, sequences, cands)
    n = len(hits["config"])
    if n == 0:
        notes.append(f"layer ids: the measured check scored no position ({len(sequences)} sequences): not decided")
        return [], {}
    acc = {k: sum(v) / n for k, v in hits.items()}
    base = hits["config"]
    best = max((k for k in cands if k != "config"), key=lambda k: (acc[k], k == "default"))
    b = sum(a and not c for a, c in zip(hits[best], base))
    c = sum(c and not a for a, c in zip(hits[best], base))
    zb = (b - c) / math.sqrt(b + c) if b + c else 0.0
    if not (acc[best] >= acc["config"] + min_gain and zb >= min_z):
        line = _undecided(n, best, cands, acc, b + c, zb, min_gain, min_z)
        notes += [line] if line else []
        return [], acc
    numbers = {"config_ids": list(cands["config"]), "config_accuracy": round(acc["config"], 4), "best": best,
               "best_ids": list(cands[best]), "best_accuracy": round(acc[best], 4), "z": round(zb, 2),
               "positions": n, "accuracy": {k: round(v, 4) for k, v in acc.items()},
               "candidates": {k: list(v) for k, v in cands.items()}, "min_gain": min_gain, "min_z": min_z}
    return [{
        "rule": RULE,
        "message": (f"the drafter's aux layer ids look wrong: its config lists {cands['config']}, but with "
                    f"{cands[best]} ({best}) its first-draft accuracy on the target's own text is "
                    f"{acc[best]:.3f} vs {acc['config']:.3f} with the config's ids ({n} positions, z = {zb:.1f}): "
                    f"it was probably trained on other layers, and vLLM feeds it the config's"),
        "numbers": numbers,
        "fix": _FIX.replace("{ids}", f"try {cands[best]}"),
    }], acc


def _num_layers(params, target) -> int | None:
    """The target's decoder layers: of the loaded model, else of its ``config.json`` (vLLM only loads
    no target here); None when that cannot be read (the convention is then not checked)."""
    from eagle3.hooks import text_config

    if target is not None:
        return int(text_config(target.config).num_hidden_layers)
    try:
        from transformers import AutoConfig

        from eagle3.target import resolve_target

        cfg = AutoConfig.from_pretrained(resolve_target(params.target).path,
                                         trust_remote_code=params.target.trust_remote_code)
        return int(text_config(cfg).num_hidden_layers)
    except Exception:  # noqa: BLE001 - a hint only; stage 5 loads the same target for vLLM and says what fails
        return None


def aux_layer_id_warnings(params, run_dir: str | Path, drafter_dir: str | Path, target, drafter_model,
                          prompts: list[dict], records: list[dict] | None,
                          notes: list[str] | None = None) -> list[dict]:
    """Stage 5's check of an external drafter's (``evaluate.drafter_dir``) aux layer ids, else ``[]``.

    First :func:`declared_id_warnings` (the config against this run's stage-3 ids, read through the
    hidden-states contract, or against the convention), always; then :func:`layer_id_warnings` once
    the offline measurement ran (``target``, ``drafter_model`` and its ``records`` given), whose
    undecided result is appended to ``notes`` (stage 5's diagnosis).

    A drafter exported by this run's Stage 4 is not checked here: its trained ids are known (stage 3's
    ``meta.json``) and :func:`eagle3.evaluate.diagnosis.diagnose` compares them with its config.
    Without a loaded target (vLLM only) the layer count comes from the target's ``config.json``.
    """
    if not params.evaluate.drafter_dir:
        return []
    from eagle3.contracts.drafter import read_config
    from eagle3.contracts.hidden_states import read_meta  # torch at import: only where needed
    from eagle3.rundir import EXTRACT, RunDir

    rd = RunDir(run_dir)
    ids = list(read_config(drafter_dir, EvaluateError).get("eagle_aux_hidden_state_layer_ids") or [])
    meta = read_meta(rd.stage(EXTRACT)) or {}
    stage3 = meta.get("aux_layer_ids") or None
    num_layers = _num_layers(params, target)
    warnings = declared_id_warnings(ids, num_layers, stage3, str(rd.extract_meta.relative_to(rd.root)))
    if target is not None and drafter_model is not None and records:
        extra = {"stage 3": stage3} if stage3 else None
        warnings += layer_id_warnings(target, drafter_model, ids, probe_sequences(prompts, records), num_layers,
                                      extra, notes=notes)[0]
    for w in warnings:
        w["fix"] = w["fix"].replace("{drafter}", str(drafter_dir))
    return warnings
