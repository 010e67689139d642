"""The check of an exported EAGLE-3 drafter against its target (Stage 4 after export, Stage 5 before
measuring; :func:`eagle3.drafters.check_drafter` dispatches here by the recorded kind).

Catches: missing/duplicate/out-of-range/unordered ``eagle_aux_hidden_state_layer_ids`` (valid:
1 <= k < N, ascending, and as many as ``fc`` expects); a hidden size that disagrees with the
target; a draft vocab whose ``d2t`` has the wrong length or maps outside the target vocab, or a
``t2d`` inconsistent with ``d2t``; ``embed_tokens`` that differ from the target's (bit for bit,
dtype included); NaN/Inf weights; never-trained weights (every RMSNorm gain still exactly 1.0,
its initial value); norm flags absent from ``config.json`` (vLLM would fill in its own defaults)
or disagreeing with the weights present; rope settings that differ from the target's.
"""

from __future__ import annotations

from pathlib import Path

from eagle3.contracts.drafter import NORM_FLAGS, read_config
from eagle3.contracts.vocab_mapping import VocabMapping
from eagle3.errors import Eagle3Error

__all__ = ["check", "hidden_size_problems", "check_hidden_size", "shape_problems", "layer_id_problems",
           "vocab_problems", "weight_problems"]


def check(cfg: dict, w: dict, target_dir: Path, tcfg) -> list[str]:
    """Every problem of an EAGLE-3 export: config keys and shapes, layer ids, vocab, weights.

    Args:
        cfg: its ``config.json``. w: its ``model.safetensors`` tensors.
        target_dir: the target model directory (its embeddings are compared).
        tcfg: the target's (text) transformers config.

    Returns:
        list[str]: one line per problem.
    """
    return [*shape_problems(cfg, w, tcfg),
            *layer_id_problems(cfg, w, int(tcfg.hidden_size), int(tcfg.num_hidden_layers)),
            *vocab_problems(cfg, w, int(tcfg.vocab_size)),
            *weight_problems(cfg, w, target_dir)]


def _load_target_embed(target_dir: Path):
    from speculators.utils.loading import load_model_layers

    w = load_model_layers(["embed_tokens.weight"], str(target_dir))
    return w.get("embed_tokens.weight")


def shape_problems(cfg: dict, w: dict, tcfg) -> list[str]:
    """Config keys, hidden size, rope settings against the target."""
    H, V = int(tcfg.hidden_size), int(tcfg.vocab_size)
    out: list[str] = []
    if cfg.get("speculators_model_type") != "eagle3":
        out.append(f"speculators_model_type is {cfg.get('speculators_model_type')!r}, expected 'eagle3'")
    missing_flags = [k for k in NORM_FLAGS if k not in cfg]
    if missing_flags:
        out.append(f"norm flags absent from config.json: {missing_flags} (vLLM would apply its own defaults)")
    tl = cfg.get("transformer_layer_config") or {}
    out += hidden_size_problems(cfg, H)
    if tl.get("vocab_size") not in (None, V):
        out.append(f"transformer_layer_config.vocab_size={tl.get('vocab_size')} but the target has {V} tokens")
    for k in ("rope_parameters", "rope_theta", "rope_scaling"):
        t_val = getattr(tcfg, k, None)
        if k in tl and t_val is not None and tl[k] != t_val:
            out.append(f"transformer_layer_config.{k}={tl[k]} differs from the target's {t_val}")
    return out


def hidden_size_problems(cfg: dict, target_hidden_size: int) -> list[str]:
    """The drafter config's hidden sizes against the target's, from the ``config.json`` dict alone
    (no transformers config is built: one with a wrong hidden size fails there first with a message
    about attention heads). ``transformer_layer_config.hidden_size`` must equal the target's (the
    draft layer runs in the target's hidden space: ``fc`` maps ``n_aux * H -> H``, the embeddings
    are the target's), and so must ``target_hidden_size`` when given.

    Returns:
        list[str]: e.g. ``["hidden size 512 ≠ target 576 (transformer_layer_config.hidden_size)"]``.
    """
    H = int(target_hidden_size)
    tl = cfg.get("transformer_layer_config") or {}
    out = []
    for key, val in (("transformer_layer_config.hidden_size", tl.get("hidden_size")),
                     ("target_hidden_size", cfg.get("target_hidden_size"))):
        if (val is not None or key.startswith("transformer")) and val != H:
            out.append(f"hidden size {val} ≠ target {H} ({key})")
    return out


def check_hidden_size(drafter_dir: str | Path, target_hidden_size: int, error: type[Exception] = Eagle3Error) -> None:
    """Refuse a drafter whose ``config.json`` hidden sizes disagree with the target's, before any
    model or transformers config is built from it (:func:`hidden_size_problems`).

    Raises:
        error: no/invalid config.json (:func:`read_config`), or a hidden size that disagrees, e.g.
            ``<dir>/config.json: hidden size 512 ≠ target 576 (transformer_layer_config.hidden_size);
            this drafter was made for another target``.
    """
    probs = hidden_size_problems(read_config(drafter_dir, error), target_hidden_size)
    if probs:
        raise error(f"{Path(drafter_dir) / 'config.json'}: {'; '.join(probs)}; this drafter was made for another "
                    f"target (its hidden size must equal the target's)")


def layer_id_problems(cfg: dict, w: dict, H: int, N: int) -> list[str]:
    """``eagle_aux_hidden_state_layer_ids``: present, in range, distinct, ascending, as many as ``fc`` takes."""
    out: list[str] = []
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        out.append("eagle_aux_hidden_state_layer_ids missing from config.json (vLLM would guess its defaults)")
    else:
        bad = [k for k in ids if not isinstance(k, int) or not (1 <= k < N)]
        if bad:
            out.append(f"eagle_aux_hidden_state_layer_ids {ids}: {bad} out of range [1, {N - 1}] for a {N}-layer target")
        if len(set(ids)) != len(ids):
            out.append(f"eagle_aux_hidden_state_layer_ids {ids} has duplicates")
        elif list(ids) != sorted(ids):
            out.append(f"eagle_aux_hidden_state_layer_ids {ids} not ascending: vLLM concatenates the aux states in "
                       f"ascending layer order, so fc would see them in another order than in training")
    fc = w.get("fc.weight")
    if fc is None:
        out.append("fc.weight missing from model.safetensors")
    else:
        if ids and fc.shape[1] != len(ids) * H:
            out.append(f"fc.weight takes {fc.shape[1]} inputs but {len(ids)} aux layers x hidden {H} = {len(ids) * H}")
        if fc.shape[0] != H:
            out.append(f"hidden size {fc.shape[0]} ≠ target {H} (fc.weight outputs)")
    return out


def vocab_problems(cfg: dict, w: dict, V: int) -> list[str]:
    """``draft_vocab_size``, ``lm_head`` rows and the d2t/t2d mapping."""
    out: list[str] = []
    draft = cfg.get("draft_vocab_size")
    lm = w.get("lm_head.weight")
    if lm is None:
        out.append("lm_head.weight missing from model.safetensors")
    elif draft is not None and lm.shape[0] != draft:
        out.append(f"lm_head.weight has {lm.shape[0]} rows but draft_vocab_size={draft}")
    if draft is None:
        out.append("draft_vocab_size missing from config.json")
    elif draft != V or "d2t" in w:
        # the one mapping check (contracts.vocab_mapping), on the tensors the drafter ships
        mapping = VocabMapping(w.get("d2t"), w.get("t2d"), int(draft), V)
        out += [f"vocab mapping: {p}" for p in mapping.problems()]
    return out


def weight_problems(cfg: dict, w: dict, target_dir: Path) -> list[str]:
    """Embeddings bit-identical to the target's, finite values, trained norms, norm flags vs weights."""
    import torch

    out: list[str] = []
    if "embed_tokens.weight" in w:
        emb, temb = w["embed_tokens.weight"], _load_target_embed(target_dir)
        if temb is None:
            out.append(f"embed_tokens present but the target {target_dir} has no embed_tokens to compare with")
        elif emb.shape != temb.shape or emb.dtype != temb.dtype or not torch.equal(emb, temb):
            same_shape = emb.shape == temb.shape
            why = (f"dtype {emb.dtype} vs {temb.dtype}" if same_shape and emb.dtype != temb.dtype else
                   f"shape {list(emb.shape)} vs {list(temb.shape)}" if not same_shape else
                   f"{int((emb != temb).any(dim=-1).sum())} rows differ")
            out.append(f"embed_tokens differ from the target's ({why}); export them bit-identical or omit them")
    nonfinite = [k for k, v in w.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if nonfinite:
        out.append(f"NaN/Inf in {nonfinite}")
    norms = {k: v for k, v in w.items() if k.endswith("norm.weight") or k.endswith("layernorm.weight")}
    if norms and all(bool((v == 1).all()) for v in norms.values()):
        out.append(f"weights look never trained: every RMSNorm gain ({len(norms)} tensors) is still exactly 1.0, "
                   f"its initial value")
    if "layers.0.hidden_norm.weight" not in w:
        out.append("norm flags: layers.0.hidden_norm.weight missing (vLLM would leave it at 1.0)")
    if "norm_before_fc" in cfg and bool(cfg["norm_before_fc"]) != ("input_norm.weight" in w):
        out.append(f"norm flags: norm_before_fc={cfg['norm_before_fc']} but input_norm.weight is "
                   f"{'present' if 'input_norm.weight' in w else 'absent'} in the weights")
    has_fcn = any(k.startswith("fc_norm.") for k in w)
    if "fc_norm" in cfg and bool(cfg["fc_norm"]) != has_fcn:
        out.append(f"norm flags: fc_norm={cfg['fc_norm']} but fc_norm.* weights are {'present' if has_fcn else 'absent'}")
    return out
