"""A fresh EAGLE-3 drafter for training: speculators' ``Eagle3DraftModel`` from the run's params, the
target's config and Stage 2's vocab mapping.

The drafter is what vLLM's ``speculators_model_type: eagle3`` loader reads
(``vllm/transformers_utils/configs/speculators/algos.py`` -> ``Eagle3LlamaForCausalLM``): a
Llama-style decoder layer whose first layer takes ``cat(embed, hidden)``, an ``fc`` that fuses the
aux hidden states ``[n_aux * H] -> [H]``, the target's embeddings (frozen) and an ``lm_head`` over the
draft vocab, mapped back to target ids by ``d2t`` (target id = i + d2t[i], DESIGN.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from eagle3.errors import TrainError

if TYPE_CHECKING:
    from eagle3.config import Params
    from eagle3.train.model import DrafterInputs

__all__ = ["build_drafter"]


def build_drafter(params: Params, inputs: DrafterInputs, attn_implementation: str = "sdpa"):
    """A fresh ``Eagle3DraftModel`` for the target: draft layers initialised from the current torch
    seed, embeddings / lm_head / verifier head loaded from the target (frozen).

    The decoder-layer config is speculators' ``create_transformer_layer_config`` (head geometry,
    rope settings, rms eps from the target), with every draft layer on full attention.

    Args:
        params: ``train`` gives num_layers, norm flags and TTT steps.
        inputs: from :func:`resolve_inputs`.
        attn_implementation: 'sdpa' / 'eager' (CPU) or 'simple_flex_attention' (GPU).

    Returns:
        speculators.models.eagle3.Eagle3DraftModel (float32, on CPU).

    Raises:
        TrainError: speculators refuses the configuration (message included).
    """
    from loguru import logger as _loguru
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    train_params = params.train
    # speculators logs every verifier file it opens (and warns about tied lm_heads); quiet here
    _loguru.disable("speculators")
    try:
        layer_cfg = create_transformer_layer_config(
            verifier_name_or_path=str(inputs.target_path), num_layers=train_params.num_layers, draft_arch="llama",
            hidden_act=None, sliding_window=0, full_attention_indices=list(range(train_params.num_layers)),
            trust_remote_code=params.target.trust_remote_code,
        )
        layer_cfg.sliding_window = None
        layer_cfg.use_sliding_window = False
        model = Eagle3DraftModel.from_training_args(
            layer_cfg, t2d=inputs.t2d, d2t=inputs.d2t, verifier_name_or_path=str(inputs.target_path),
            draft_vocab_size=inputs.draft_vocab_size, norm_before_residual=train_params.norm_before_residual,
            norm_before_fc=train_params.norm_before_fc, fc_norm=train_params.fc_norm, norm_output=train_params.norm_output,
            ttt_steps=train_params.ttt_steps, target_layer_ids=list(inputs.aux_layer_ids), draft_attn_impl=attn_implementation,
            trust_remote_code=params.target.trust_remote_code,
        )
    except (ValueError, TypeError) as exc:
        raise TrainError(f"speculators refused the drafter configuration: {exc}") from None
    finally:
        _loguru.enable("speculators")
    model.config.target_hidden_size = inputs.hidden_size
    return model
