"""The EAGLE-3 export: speculators' ``Eagle3DraftModel`` as the folder vLLM's ``speculators_model_type:
eagle3`` loader reads (``vllm/transformers_utils/configs/speculators/algos.py`` -> ``Eagle3LlamaForCausalLM``).

* ``config.json``: speculators' ``Eagle3SpeculatorConfig`` with ``eagle_aux_hidden_state_layer_ids``,
  the four norm flags (:data:`eagle3.contracts.drafter.NORM_FLAGS`, always written: vLLM and
  speculators disagree on the default of ``norm_before_residual``), ``draft_vocab_size``,
  ``target_hidden_size``, the Llama-style ``transformer_layer_config`` (rope settings from the target)
  and the verifier's portable name;
* ``model.safetensors``: the draft layer, ``fc`` (``[H, n_aux * H]``), ``norm``, ``lm_head`` over the
  draft vocab, ``d2t``/``t2d`` when the draft vocab is smaller, ``embed_tokens.weight`` only when
  exported bit-identical to the target's.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from eagle3.contracts.drafter import NORM_FLAGS, write_drafter_dir

__all__ = ["export_config", "export_tensors", "export_drafter"]


def export_config(model, verifier_name: str, dtype) -> dict:
    """``config.json`` of ``model``: its speculators config with the verifier's portable name, the
    export dtype and every norm flag written out (transformers' bookkeeping keys dropped)."""
    cfg = copy.deepcopy(model.config)
    cfg.speculators_config.verifier.name_or_path = verifier_name
    d = json.loads(cfg.to_json_string(use_diff=False))
    for k in ("auto_map", "_name_or_path", "_attn_implementation_autoset"):
        d.pop(k, None)
    tl = d.get("transformer_layer_config", {})
    tl.pop("_attn_implementation_autoset", None)
    d["dtype"] = str(dtype).replace("torch.", "")
    for k in NORM_FLAGS:
        d[k] = bool(getattr(model.config, k))
    return d


def export_tensors(model, dtype, include_embed_tokens: bool) -> dict:
    """The tensors vLLM loads: no verifier-only tensors, no rotary buffers, floats cast to ``dtype``
    except the RMSNorm gains (:func:`export_drafter`)."""
    tensors = {}
    for k, v in model.state_dict().items():
        if k.startswith(("verifier_lm_head", "verifier_norm")) or ".rotary_emb." in k or k.startswith("rotary_emb"):
            continue
        if k == "embed_tokens.weight" and not include_embed_tokens:
            continue
        if v.is_floating_point() and dtype is not None and not k.endswith("norm.weight"):
            v = v.to(dtype)  # RMSNorm gains stay float32: a short run's updates (~lr) survive, see export_drafter
        tensors[k] = v.detach().cpu().contiguous().clone()
    return tensors


def export_drafter(model, out_dir: str | Path, verifier_name: str, dtype=None, include_embed_tokens: bool = False,
                   info: dict | None = None) -> Path:
    """Write an EAGLE-3 drafter in the speculators format (``config.json`` + ``model.safetensors``), atomically
    (:func:`eagle3.contracts.drafter.write_drafter_dir`).

    Tensors written: the trained draft weights and the frozen ``lm_head`` cast to ``dtype`` (except
    the RMSNorm gains, kept in float32: they start at exactly 1.0 and move by about ``lr`` per step,
    which bfloat16's 2^-7 spacing near 1.0 would round away in a short run; vLLM and speculators cast
    on load), ``d2t`` (int64) and ``t2d`` (bool) when the draft vocab is smaller than the target's, and
    ``embed_tokens.weight`` only when ``include_embed_tokens`` (then it must equal the target's bit
    for bit: pass the target's dtype). Without it vLLM shares the target's embeddings. The
    verifier-only tensors (``verifier_lm_head``, ``verifier_norm``) are never written.

    Args:
        model: an ``Eagle3DraftModel`` (plain, not DDP-wrapped).
        out_dir: the drafter folder (replaced as a whole).
        verifier_name: written as ``speculators_config.verifier.name_or_path``.
        dtype: torch dtype of the floating tensors (default: as in the model).
        include_embed_tokens: write ``embed_tokens.weight`` too.
        info: extra provenance written to ``training_info.json`` beside the weights.

    Returns:
        Path: ``out_dir``.
    """
    tensors = export_tensors(model, dtype, include_embed_tokens)
    cfg = export_config(model, verifier_name, dtype or next(model.parameters()).dtype)
    return write_drafter_dir(out_dir, tensors, cfg, info)
