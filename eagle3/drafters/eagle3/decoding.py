"""The EAGLE-3 drafter for offline decoding: speculators' ``Eagle3DraftModel`` with a KV cache, as vLLM runs it.

vLLM's proposer (``vllm/v1/spec_decode/llm_base_proposer.py``, ``model_executor/models/llama_eagle3.py``):
the drafter's *first pass* over every newly verified position ``p`` reads the token at ``p+1`` and
the target's (``fc``-combined) aux state at ``p`` with RoPE position ``p``; its KV cache keeps one
entry per verified position; the chain steps then feed back the drafted token and the drafter's own
pre-norm output (post-norm when ``norm_output``). Draft logits over the draft vocab map to target
ids through ``d2t`` (target id = i + d2t[i]).
"""

from __future__ import annotations

from pathlib import Path

from eagle3.contracts.drafter import DrafterSettings, read_config
from eagle3.contracts.vocab_mapping import load_tensors
from eagle3.drafters.eagle3.check import check_hidden_size
from eagle3.drafters.registry import Proposer, crop_cache
from eagle3.errors import EvaluateError

__all__ = ["load_drafter", "Eagle3Drafter"]


def _speculators_config(d: Path, target_model, settings: DrafterSettings | None):
    """``Eagle3SpeculatorConfig`` of ``d`` with ``settings`` applied, eager attention, sizes checked."""
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    check_hidden_size(d, target_model.config.hidden_size, EvaluateError)  # before transformers validates heads
    cfg = Eagle3SpeculatorConfig.from_pretrained(str(d))
    if settings is not None:
        cfg.eagle_aux_hidden_state_layer_ids = list(settings.aux_layer_ids)
        cfg.norm_before_residual = settings.norm_before_residual
        cfg.norm_before_fc = settings.norm_before_fc
        cfg.fc_norm = settings.fc_norm
        cfg.norm_output = settings.norm_output
    tl = cfg.transformer_layer_config
    tl._attn_implementation = "eager"
    th = target_model.config.hidden_size
    if tl.hidden_size != th or (cfg.target_hidden_size or th) != th:
        raise EvaluateError(
            f"{d / 'config.json'}: drafter hidden size {tl.hidden_size} / target_hidden_size "
            f"{cfg.target_hidden_size} do not match the target's hidden_size {th}")
    return cfg


def _checked_state_dict(model, wfile: Path) -> dict:
    """The weights of ``wfile``, checked against ``model``'s own names and shapes.

    Absent ``embed_tokens``/``lm_head``/verifier weights are allowed (filled from the target);
    ``d2t``/``t2d`` are dropped for a full-size draft vocab.
    """
    from safetensors.torch import load_file

    sd = load_file(str(wfile))
    allowed_missing = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    if not model.use_draft_vocab:
        allowed_missing |= {"d2t", "t2d"}
        sd.pop("d2t", None), sd.pop("t2d", None)
    own = dict(model.state_dict())
    unexpected = sorted(set(sd) - set(own))
    missing = sorted(set(own) - set(sd) - allowed_missing)
    if unexpected or missing:
        raise EvaluateError(f"{wfile}: weights do not match the config: missing {missing}, unexpected {unexpected}")
    for name, t in sd.items():
        if tuple(t.shape) != tuple(own[name].shape):
            raise EvaluateError(f"{wfile}: {name} has shape {tuple(t.shape)}, the config implies {tuple(own[name].shape)}")
    return sd


def load_drafter(drafter_dir: str | Path, target_model, settings: DrafterSettings | None = None,
                 device: str = "cpu"):
    """Load a speculators-format EAGLE-3 drafter for offline decoding.

    The model is speculators' ``Eagle3DraftModel`` built from ``config.json`` (eager attention),
    weights from ``model.safetensors``. ``embed_tokens`` absent -> the target's input embedding
    (what vLLM shares); ``lm_head`` absent -> the target's LM head rows of the draft vocab.
    ``settings`` overrides the aux layer ids and norm flags (e.g. the training-time values).

    Args:
        drafter_dir: directory with config.json + model.safetensors.
        target_model: the loaded target (transformers causal LM); its dtype is used.
        settings: optional overrides (:class:`eagle3.contracts.drafter.DrafterSettings`).
        device: torch device.

    Returns:
        Eagle3DraftModel in eval mode, in the target's dtype.

    Raises:
        EvaluateError: missing files, unexpected/missing weights, d2t/t2d missing for a reduced
            draft vocab, hidden sizes that differ from the target's.
    """
    import torch
    from speculators.models.eagle3.core import Eagle3DraftModel

    d = Path(drafter_dir)
    read_config(d, EvaluateError)
    wfile = d / "model.safetensors"
    if not wfile.is_file():
        raise EvaluateError(f"{wfile}: not found")
    model = Eagle3DraftModel(_speculators_config(d, target_model, settings))
    sd = _checked_state_dict(model, wfile)
    if settings is not None and settings.vocab_mapping and model.use_draft_vocab:
        d2t, t2d, _ = load_tensors(settings.vocab_mapping)  # stage 2's file, read by its contract
        if d2t.shape != sd["d2t"].shape:
            raise EvaluateError(f"{settings.vocab_mapping}: d2t has {d2t.numel()} entries, the drafter "
                                f"{sd['d2t'].numel()}")
        sd["d2t"], sd["t2d"] = d2t.long(), t2d.bool()
    model.load_state_dict(sd, strict=False)
    with torch.no_grad():  # the weights vLLM shares with the target when the checkpoint omits them
        if "embed_tokens.weight" not in sd:
            model.embed_tokens.weight.copy_(target_model.get_input_embeddings().weight)
        if "lm_head.weight" not in sd:
            head = target_model.get_output_embeddings().weight
            model.lm_head.weight.copy_(head[model.t2d.bool()] if model.use_draft_vocab else head)
    dtype = next(target_model.parameters()).dtype
    return model.to(device=device, dtype=dtype).eval()


class Eagle3Drafter(Proposer):
    """Inference wrapper around a speculators ``Eagle3DraftModel`` with a KV cache (vLLM's proposer).

    Holds the drafter's KV cache: one entry per verified position (the first pass) plus the
    entries of the current chain, which :meth:`crop` removes before the next round.
    """

    def __init__(self, model):
        from transformers import DynamicCache

        self.m = model
        self.cache = DynamicCache()
        self.length = 0
        self.d2t = model.d2t if model.use_draft_vocab else None
        self.norm_output = bool(model.config.norm_output)

    def combine(self, aux):
        """``fc`` over the concatenated aux states ``[q, n_aux*H] -> [q, H]`` (with input/fc norms)."""
        import torch

        h = aux
        if self.m.input_norm is not None:
            h = self.m.input_norm(h)
        if self.m.fc_norm is not None:
            chunks = h.chunk(len(self.m.fc_norm), dim=-1)
            h = torch.cat([nrm(c) for nrm, c in zip(self.m.fc_norm, chunks)], dim=-1)
        return self.m.fc(h)

    def step(self, input_ids, hidden, positions):
        """Run the draft layer(s) over ``q`` tokens appended to the cache.

        Args:
            input_ids: int64 ``[q]`` target token ids.
            hidden: ``[q, H]`` combined target states (first pass) or fed-back drafter states.
            positions: int64 ``[q]`` RoPE positions.

        Returns:
            ``(logits, feedback)``: draft-vocab logits ``[q, draft_vocab]`` and the state fed to
            the next step ``[q, H]`` (pre-norm output; post-norm when ``norm_output``).
        """
        import torch

        m = self.m
        q = int(input_ids.shape[0])
        past = self.length
        emb = m.embed_tokens(input_ids[None])
        h = torch.cat([emb, hidden[None].to(emb.dtype)], dim=-1)
        pos = positions[None]
        pe = m.rotary_emb(h, pos)
        kv = past + q
        mask = torch.full((q, kv), float("-inf"), dtype=emb.dtype, device=emb.device)
        mask = torch.triu(mask, diagonal=past + 1)[None, None]
        for layer in m.layers:
            h = layer(h, attention_mask=mask, position_ids=pos, past_key_values=self.cache,
                      position_embeddings=pe)
        self.length = kv
        normed = m.norm(h)
        logits = m.lm_head(normed)[0]
        return logits, (normed if self.norm_output else h)[0]

    def to_target(self, draft_idx):
        """Draft-vocab indices -> target ids (``i + d2t[i]``; identity for a full vocab)."""
        return draft_idx + self.d2t[draft_idx] if self.d2t is not None else draft_idx

    def draft_probs_target(self, probs):
        """Draft probabilities ``[V_draft]`` scattered onto the target vocab ``[V]``."""
        import torch

        if self.d2t is None:
            return probs
        out = torch.zeros(self.m.verifier_vocab_size, dtype=probs.dtype, device=probs.device)
        out[torch.arange(probs.shape[0], device=probs.device) + self.d2t.to(probs.device)] = probs
        return out

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cache entries (the verified positions)."""
        crop_cache(self.cache, length)
        self.length = length
