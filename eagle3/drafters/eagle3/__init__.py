"""The EAGLE-3 drafter kind (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large
Language Models via Training-Time Test"): speculators' ``Eagle3DraftModel``, exported in the format
vLLM's ``speculators_model_type: eagle3`` loader reads.

* :mod:`.build`: a fresh drafter from the run's params, the target's config and the vocab mapping;
* :mod:`.supervised_rows`: heads and loss on the supervised rows only (``train.supervised_rows``);
* :mod:`.export` and :mod:`.check`: the export and its check against the target;
* :mod:`.decoding`: the drafter with a KV cache, drafting as vLLM's proposer does (Stage 5 offline).
"""

from __future__ import annotations

from pathlib import Path

from eagle3.drafters.eagle3.build import build_drafter
from eagle3.drafters.eagle3.check import check, check_hidden_size, hidden_size_problems
from eagle3.drafters.eagle3.decoding import Eagle3Drafter, load_drafter
from eagle3.drafters.eagle3.export import export_drafter
from eagle3.drafters.eagle3.supervised_rows import SupervisedRows
from eagle3.drafters.registry import DrafterKind, register

__all__ = ["Eagle3", "build_drafter", "export_drafter", "check", "check_hidden_size", "hidden_size_problems",
           "load_drafter", "Eagle3Drafter", "SupervisedRows"]


@register("eagle3")
class Eagle3(DrafterKind):
    """EAGLE-3: a Llama-style draft layer over ``fc``-fused aux hidden states, trained with TTT."""

    def build(self, params, inputs, attn_implementation: str):
        return build_drafter(params, inputs, attn_implementation)

    def supervise_rows(self, model, loss_config: dict) -> dict:
        return SupervisedRows(model).wrap_loss(loss_config)

    def export(self, model, out_dir, verifier_name, dtype=None, include_embed_tokens=False, info=None) -> Path:
        return export_drafter(model, out_dir, verifier_name, dtype=dtype, include_embed_tokens=include_embed_tokens,
                              info=info)

    def check(self, cfg: dict, weights: dict, target_dir: Path, target_config) -> list[str]:
        return check(cfg, weights, target_dir, target_config)

    def load(self, drafter_dir, target_model, settings=None, device: str = "cpu"):
        return load_drafter(drafter_dir, target_model, settings, device=device)

    def proposer(self, model) -> Eagle3Drafter:
        return Eagle3Drafter(model)

    def speculative_config(self, drafter_dir, k: int) -> dict:
        """vLLM's EAGLE-3 proposer over the speculators-format folder."""
        return {"method": "eagle3", "model": str(drafter_dir), "num_speculative_tokens": int(k)}
