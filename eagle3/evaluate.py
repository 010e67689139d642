"""Stage 5: acceptance of the drafter on held-out prompts, offline and in vLLM, plus the parity check.

What this stage measures, and how (see ``docs/DESIGN.md``, "Acceptance"):

* **Offline** (transformers, this module): EAGLE-3 *chain* speculation exactly as vLLM runs it
  (``vllm/v1/spec_decode/llm_base_proposer.py``, ``model_executor/models/llama_eagle3.py``):

  - the target's prefill/verification forwards give the aux hidden states (aux layer id ``k`` =
    the residual stream after decoder layer ``k-1`` = transformers' ``hidden_states[k]``, captured
    with forward hooks), combined by the drafter's ``fc`` (after ``input_norm``/``fc_norm`` when set);
  - the drafter's *first pass* over every newly verified position ``p`` reads the token at ``p+1``
    and the target's state at ``p`` with RoPE position ``p`` (vLLM shifts the input ids left by one);
    its KV cache keeps one entry per verified position;
  - then ``k-1`` more steps, each feeding back the drafted token (a target id, embedded with the
    target's embedding) and the drafter's own pre-norm output (post-norm when ``norm_output``),
    at positions ``p+1, p+2, ...``; draft logits over the draft vocab map to target ids through
    ``d2t`` (target id = i + d2t[i]);
  - the target verifies ``[last token, d_1..d_k]`` in one forward; at temperature 0 a draft is
    accepted while it equals the target's argmax, at temperature > 0 with the speculative-sampling
    rule ``min(1, p(d)/q(d))`` and a rejected position resampled from ``norm(max(0, p - q))``
    (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", Alg. 1;
    Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling"); the bonus/recovered
    token comes from the target; both caches are cut back to the accepted tokens.

  Like vLLM, every round proposes ``k`` drafts and counts all of its accepted drafts, also past
  an end-of-sequence token or ``max_new_tokens`` (the output itself is cut there).
* **vLLM** (``eagle3.evaluate_vllm``, one engine per subprocess): the same prompts through
  ``vllm.LLM.chat`` with ``speculative_config={"method": "eagle3", "model": drafter_dir,
  "num_speculative_tokens": k}``, the n-gram (prompt lookup) baseline and no speculation;
  acceptance from vLLM's ``vllm:spec_decode_*`` counters and per-request per-step metrics.
* **Parity**: at temperature 0 offline τ and vLLM τ must agree within
  ``evaluate.parity_tolerance`` (relative); otherwise :class:`ParityError` with a diagnosis list.

Definitions (one verification round = one target forward after the prefill):

* acceptance length ``tau = 1 + mean(accepted drafts per round)`` over rounds that had drafts
  (vLLM: ``1 + num_accepted_tokens / num_drafts``);
* tokens per target forward = tokens produced by verification rounds / verification rounds,
  counting rounds without drafts (n-gram lookup misses) as producing one token;
* per-position conditional acceptance at position i = P(draft i accepted | drafts 1..i-1 accepted
  and a draft i was proposed); vLLM's own vector is unconditional (accepted at i / drafts).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from eagle3.io import Progress, atomic_write_json, read_json, stage_dir, write_stats
from eagle3.errors import EvaluateError, ParityError

__all__ = [
    "ParityError",
    "EvaluateError",
    "acceptance_metrics",
    "summarize_rounds",
    "context_bucket",
    "speculative_accept",
    "DrafterSettings",
    "drafter_settings_from_config",
    "load_drafter",
    "TargetAuxRunner",
    "Eagle3Drafter",
    "speculative_generate",
    "evaluate_offline",
    "render_prompt",
    "heldout_prompts",
    "run_vllm_job",
    "parity_check",
    "diagnose",
    "vllm_serve_command",
    "run",
]

STAGE = 5
STAGE_NAME = "05_evaluate"


# ---------------------------------------------------------------------------------------------
# Metrics (pure functions)
# ---------------------------------------------------------------------------------------------


def acceptance_metrics(
    accepted: Sequence[int],
    k: int,
    drafted: Sequence[int] | None = None,
    verification_steps: int | None = None,
) -> dict:
    """Acceptance statistics of a list of verification rounds.

    Args:
        accepted: accepted draft tokens per round that had drafts (ints in ``[0, drafted[r]]``).
        k: number of speculative tokens per round (the per-position vectors have length k).
        drafted: draft tokens proposed per round (default: k every round).
        verification_steps: all target verification forwards, including rounds *without* drafts
            (n-gram misses); default ``len(accepted)``. Each such round produced one token.

    Returns:
        dict with ``tau`` (1 + mean accepted, the bonus token counted; NaN without rounds),
        ``rounds``, ``accepted_tokens``, ``draft_tokens``, ``draft_acceptance_rate``
        (accepted / drafted), ``per_position_conditional`` (list of k; position i counts rounds
        with a draft at i whose drafts 1..i-1 were all accepted; None where nothing was counted),
        ``per_position_unconditional`` (accepted at i / rounds, vLLM's vector),
        ``verification_steps`` and ``tokens_per_forward``
        (``(verification_steps + accepted_tokens) / verification_steps``).

    Raises:
        ValueError: lengths differ, or an accepted count is negative or exceeds its drafted count.

    Example (a logged run): k=4, rounds accepting 2, 0, 4 -> tau = 1 + 6/3 = 3.0.
    """
    acc = [int(a) for a in accepted]
    drf = [int(d) for d in drafted] if drafted is not None else [int(k)] * len(acc)
    if len(drf) != len(acc):
        raise ValueError(f"accepted ({len(acc)}) and drafted ({len(drf)}) differ in length")
    for r, (a, d) in enumerate(zip(acc, drf)):
        if a < 0 or a > d or d > k:
            raise ValueError(f"round {r}: accepted={a} drafted={d} k={k} is impossible")
    n = len(acc)
    steps = n if verification_steps is None else int(verification_steps)
    if steps < n:
        raise ValueError(f"verification_steps={steps} < rounds with drafts={n}")
    tot_acc, tot_drf = sum(acc), sum(drf)
    cond: list[float | None] = []
    uncond: list[float | None] = []
    for i in range(1, k + 1):
        den = sum(1 for a, d in zip(acc, drf) if d >= i and a >= i - 1)
        num = sum(1 for a in acc if a >= i)
        cond.append(num / den if den else None)
        uncond.append(num / n if n else None)
    return {
        "tau": 1.0 + tot_acc / n if n else float("nan"),
        "rounds": n,
        "accepted_tokens": tot_acc,
        "draft_tokens": tot_drf,
        "draft_acceptance_rate": tot_acc / tot_drf if tot_drf else float("nan"),
        "per_position_conditional": cond,
        "per_position_unconditional": uncond,
        "verification_steps": steps,
        "tokens_per_forward": (steps + tot_acc) / steps if steps else float("nan"),
    }


_BUCKET_EDGES = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def context_bucket(context_len: int) -> str:
    """Context-length bucket label of a round (tokens before the verification), e.g. '128-255'."""
    lo = 0
    for hi in _BUCKET_EDGES:
        if context_len < hi:
            return f"{lo}-{hi - 1}"
        lo = hi
    return f">={lo}"


def _bucket_start(label: str) -> int:
    return int(label.lstrip(">=").split("-")[0])


def summarize_rounds(records: list[dict], k: int) -> dict:
    """Acceptance metrics overall, by prompt source and by context-length bucket.

    Args:
        records: one dict per prompt: ``source`` (str), ``rounds`` (list of
            ``[context_len, drafted, accepted]``) and optionally ``verification_steps`` (int,
            default: number of rounds).
        k: speculative tokens per round.

    Returns:
        dict: ``overall``, ``by_source`` {source: metrics}, ``by_context`` {bucket: metrics}
        (buckets sorted by length), ``accepted_histogram`` (rounds per accepted count 0..k) and
        ``prompts``. Metrics as in :func:`acceptance_metrics` (by context: rounds only).
    """
    def metrics_of(recs: list[dict]) -> dict:
        acc = [r[2] for rec in recs for r in rec["rounds"] if r[1] > 0]
        drf = [r[1] for rec in recs for r in rec["rounds"] if r[1] > 0]
        steps = sum(rec.get("verification_steps", len(rec["rounds"])) for rec in recs)
        return acceptance_metrics(acc, k, drf, verification_steps=steps)

    by_source: dict[str, list] = {}
    for rec in records:
        by_source.setdefault(rec.get("source", "?"), []).append(rec)
    ctx: dict[str, list] = {}
    for rec in records:
        for r in rec["rounds"]:
            if r[1] > 0:
                ctx.setdefault(context_bucket(r[0]), []).append(r)
    hist = [0] * (k + 1)
    for rec in records:
        for r in rec["rounds"]:
            if r[1] > 0:
                hist[r[2]] += 1
    return {
        "overall": metrics_of(records),
        "by_source": {s: metrics_of(v) for s, v in sorted(by_source.items())},
        "by_context": {
            b: acceptance_metrics([r[2] for r in v], k, [r[1] for r in v])
            for b, v in sorted(ctx.items(), key=lambda kv: _bucket_start(kv[0]))
        },
        "accepted_histogram": hist,
        "prompts": len(records),
    }


def speculative_accept(p_target, q_draft, drafts, generator=None) -> tuple[int, int]:
    """The speculative-sampling acceptance rule for one round (temperature > 0).

    Draft ``i`` is accepted with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection
    the emitted token is sampled from ``norm(max(0, p_i - q_i))``; when all are accepted the bonus
    token is sampled from ``p_k``. The emitted sequence is distributed exactly as sampling the
    target (Leviathan et al. 2023, Alg. 1 and Theorem 3.5; Chen et al. 2023, Alg. 2).

    Args:
        p_target: float tensor ``[n + 1, V]``: target probabilities after each prefix
            (row i = distribution of the token at draft position i; row n = bonus).
        q_draft: float tensor ``[n, V]``: draft probabilities each draft was sampled from, over
            the *target* vocab (zero outside the draft vocab).
        drafts: int64 tensor ``[n]``: the drafted target ids.
        generator: ``torch.Generator`` for reproducibility.

    Returns:
        ``(accepted, next_token)``: number of accepted drafts and the token emitted after them.
    """
    import torch

    n = int(drafts.shape[0])
    for i in range(n):
        d = int(drafts[i])
        p, q = float(p_target[i, d]), float(q_draft[i, d])
        u = float(torch.rand((), generator=generator))
        if q > 0 and u < min(1.0, p / q):
            continue
        resid = torch.clamp(p_target[i] - q_draft[i], min=0)
        total = float(resid.sum())
        if total <= 0:  # p == q up to rounding: resampling from p is exact
            resid = p_target[i]
            total = float(resid.sum())
        tok = int(torch.multinomial(resid / total, 1, generator=generator))
        return i, tok
    tok = int(torch.multinomial(p_target[n] / p_target[n].sum(), 1, generator=generator))
    return n, tok


# ---------------------------------------------------------------------------------------------
# Drafter (speculators' Eagle3DraftModel) and the target's aux hidden states
# ---------------------------------------------------------------------------------------------


@dataclass
class DrafterSettings:
    """How the drafter is wired to the target: what vLLM reads from the drafter's config.json.

    Attributes:
        aux_layer_ids: aux hidden state layer ids, in the order they are concatenated for ``fc``.
        norm_before_residual, norm_before_fc, fc_norm, norm_output: speculators' norm flags.
        source: where these values came from (e.g. "config.json", "03_extract/meta.json").
        vocab_mapping: a ``vocab_mapping.safetensors`` (``d2t``, ``t2d``) to use instead of the
            checkpoint's (the mapping the training data used, ``02_vocab``); None = the checkpoint's.
    """

    aux_layer_ids: list[int]
    norm_before_residual: bool
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    source: str = "config.json"
    vocab_mapping: str | None = None


def _read_config(drafter_dir: str | Path) -> dict:
    p = Path(drafter_dir) / "config.json"
    if not p.is_file():
        raise EvaluateError(f"{p}: not found; a speculators-format drafter dir holds config.json + model.safetensors")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise EvaluateError(f"{p}: invalid JSON at line {exc.lineno}: {exc.msg}") from None


def drafter_settings_from_config(drafter_dir: str | Path, vllm_view: bool = True) -> DrafterSettings:
    """The settings vLLM derives from a speculators config (``transformers_utils/configs/speculators``).

    vLLM concatenates the target's aux states in ascending layer order (it collects them while
    iterating the layers) and defaults ``norm_before_residual`` to True when the key is absent
    (speculators defaults it to False). ``vllm_view=False`` gives the values as written.

    Raises:
        EvaluateError: no config.json, or no ``eagle_aux_hidden_state_layer_ids``.
    """
    cfg = _read_config(drafter_dir)
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        raise EvaluateError(f"{Path(drafter_dir) / 'config.json'}: eagle_aux_hidden_state_layer_ids is missing")
    ids = [int(i) for i in ids]
    return DrafterSettings(
        aux_layer_ids=sorted(set(ids)) if vllm_view else ids,
        norm_before_residual=bool(cfg.get("norm_before_residual", True if vllm_view else False)),
        norm_before_fc=bool(cfg.get("norm_before_fc", False)),
        fc_norm=bool(cfg.get("fc_norm", False)),
        norm_output=bool(cfg.get("norm_output", False)),
        source="config.json (as vLLM reads it)" if vllm_view else "config.json",
    )


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
        settings: optional overrides (:class:`DrafterSettings`).
        device: torch device.

    Returns:
        Eagle3DraftModel in eval mode, in the target's dtype.

    Raises:
        EvaluateError: missing files, unexpected/missing weights, d2t/t2d missing for a reduced
            draft vocab, hidden sizes that differ from the target's.
    """
    import torch
    from safetensors.torch import load_file
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel

    d = Path(drafter_dir)
    _read_config(d)
    wfile = d / "model.safetensors"
    if not wfile.is_file():
        raise EvaluateError(f"{wfile}: not found")
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
    model = Eagle3DraftModel(cfg)
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
    if settings is not None and settings.vocab_mapping and model.use_draft_vocab:
        vm = load_file(str(settings.vocab_mapping))
        if vm["d2t"].shape != sd["d2t"].shape:
            raise EvaluateError(f"{settings.vocab_mapping}: d2t has {vm['d2t'].numel()} entries, the drafter "
                                f"{sd['d2t'].numel()}")
        sd["d2t"], sd["t2d"] = vm["d2t"].long(), vm["t2d"].bool()
    model.load_state_dict(sd, strict=False)
    with torch.no_grad():
        if "embed_tokens.weight" not in sd:
            model.embed_tokens.weight.copy_(target_model.get_input_embeddings().weight)
        if "lm_head.weight" not in sd:
            head = target_model.get_output_embeddings().weight
            model.lm_head.weight.copy_(head[model.t2d.bool()] if model.use_draft_vocab else head)
    dtype = next(target_model.parameters()).dtype
    return model.to(device=device, dtype=dtype).eval()


class TargetAuxRunner:
    """The target with forward hooks that capture aux hidden states (vLLM's convention).

    Aux id ``k`` (1 <= k <= N) is the output of decoder layer ``k-1`` (the residual stream,
    transformers' ``hidden_states[k]`` for k < N; for k = N the pre-final-norm state); id 0 is the
    embedding output. States are concatenated in the order of ``aux_layer_ids``.

    Args:
        model: transformers Llama-family causal LM (``model.model.layers``).
        aux_layer_ids: ids to capture.

    Raises:
        EvaluateError: an id outside ``[0, num_hidden_layers]``.
    """

    def __init__(self, model, aux_layer_ids: Sequence[int]):
        self.model = model
        self.ids = [int(i) for i in aux_layer_ids]
        layers = model.model.layers
        n = len(layers)
        bad = [i for i in self.ids if i < 0 or i > n]
        if bad:
            raise EvaluateError(f"aux layer ids {bad} are outside [0, {n}] for a target with {n} layers")
        self._store: dict[int, Any] = {}
        self._handles = []
        for i in sorted(set(self.ids)):
            mod = model.model.embed_tokens if i == 0 else layers[i - 1]
            self._handles.append(mod.register_forward_hook(self._hook(i)))

    def _hook(self, i: int):
        def fn(_mod, _inp, out):
            self._store[i] = out[0] if isinstance(out, tuple) else out
        return fn

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def forward(self, input_ids, cache):
        """One target forward over new tokens with a KV cache.

        Args:
            input_ids: int64 ``[1, q]`` new tokens (positions continue the cache).
            cache: transformers ``DynamicCache`` (updated in place).

        Returns:
            ``(logits, aux)``: float ``[q, V]`` and ``[q, n_aux * H]`` (target dtype).
        """
        import torch

        self._store.clear()
        out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True)
        aux = torch.cat([self._store[i][0] for i in self.ids], dim=-1)
        return out.logits[0], aux


class Eagle3Drafter:
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
        _crop(self.cache, length)
        self.length = length


def _crop(cache, length: int) -> None:
    """Cut a transformers ``DynamicCache`` to its first ``length`` positions."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def _stop_ids(tokenizer, model) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        e = getattr(src, "eos_token_id", None)
        if e is None:
            continue
        ids.update(e if isinstance(e, (list, tuple)) else [e])
    return {int(i) for i in ids}


def speculative_generate(target, drafter_model, prompt_ids: Sequence[int], k: int, max_new_tokens: int,
                         aux_layer_ids: Sequence[int], temperature: float = 0.0, stop_ids: Iterable[int] = (),
                         generator=None) -> dict:
    """Generate with EAGLE-3 chain speculation (k drafts per round), exactly as vLLM schedules it.

    Args:
        target: transformers causal LM (the verifier), eval mode.
        drafter_model: ``Eagle3DraftModel`` from :func:`load_drafter` (same device/dtype).
        prompt_ids: the rendered prompt's token ids.
        k: draft tokens per round (>= 1).
        max_new_tokens: output length cap.
        aux_layer_ids: target layers whose states feed the drafter, in concatenation order.
        temperature: 0 = greedy (exact-match rule); > 0 = speculative sampling.
        stop_ids: end-of-sequence ids (the output stops after the first one).
        generator: ``torch.Generator`` for temperature > 0.

    Returns:
        dict: ``tokens`` (generated ids, cut at the first stop id / max_new_tokens), ``rounds``
        (``[context_len, drafted, accepted]`` per verification round; context_len = tokens before
        the round's verification), ``verification_steps``, ``target_forwards`` (incl. prefill),
        ``finish_reason`` ('stop' | 'length').
    """
    import torch
    from transformers import DynamicCache

    if k < 1:
        raise ValueError("k must be >= 1")
    stops = set(int(s) for s in stop_ids)
    dev = next(target.parameters()).device
    runner = TargetAuxRunner(target, aux_layer_ids)
    dr = Eagle3Drafter(drafter_model)
    tcache = DynamicCache()
    greedy = temperature <= 0

    def pick(logits_row):
        if greedy:
            return int(torch.argmax(logits_row))
        p = torch.softmax(logits_row.float().cpu() / temperature, dim=-1)
        return int(torch.multinomial(p, 1, generator=generator))

    try:
        with torch.no_grad():
            tokens = list(int(t) for t in prompt_ids)
            n0 = len(tokens)
            logits, aux = runner.forward(torch.tensor([tokens], device=dev), tcache)
            tokens.append(pick(logits[-1]))
            pending_aux = aux  # target states of positions dr.length .. len(tokens)-2
            rounds: list[list[int]] = []
            forwards = 1

            def done() -> bool:
                gen = tokens[n0:]
                return len(gen) >= max_new_tokens or any(t in stops for t in gen)

            while not done():
                L = len(tokens)  # tokens[L-1] is the last (unverified-by-drafter) token
                start = dr.length
                # First pass: position p reads token p+1 and the target's state at p.
                hid = dr.combine(pending_aux)
                ids = torch.tensor(tokens[start + 1:L], device=dev)
                pos = torch.arange(start, L - 1, device=dev)
                dlogits, fb = dr.step(ids, hid, pos)
                drafts: list[int] = []
                qs = []
                lg, h = dlogits[-1], fb[-1:]
                for j in range(k):
                    if greedy:
                        di = torch.argmax(lg)[None]
                    else:
                        qd = torch.softmax(lg.float().cpu() / temperature, dim=-1)
                        di = torch.multinomial(qd, 1, generator=generator)
                        qs.append(dr.draft_probs_target(qd))
                    tid = dr.to_target(di.to(dev))
                    drafts.append(int(tid))
                    if j + 1 < k:
                        lgs, h = dr.step(tid.to(dev), h, torch.tensor([L - 1 + j], device=dev))
                        lg = lgs[-1]
                # Verify [last token, d1..dk] in one target forward.
                vlogits, vaux = runner.forward(torch.tensor([[tokens[-1]] + drafts], device=dev), tcache)
                forwards += 1
                if greedy:
                    tgt = torch.argmax(vlogits, dim=-1).tolist()
                    a = 0
                    while a < k and drafts[a] == tgt[a]:
                        a += 1
                    nxt = int(tgt[a])
                else:
                    p = torch.softmax(vlogits.float().cpu() / temperature, dim=-1)
                    a, nxt = speculative_accept(p, torch.stack(qs), torch.tensor(drafts), generator)
                rounds.append([L, k, a])
                tokens.extend(drafts[:a] + [nxt])
                _crop(tcache, L + a)  # keep positions ..L-1 (last token) + a accepted drafts
                dr.crop(L - 1)  # drop this round's chain entries
                pending_aux = vaux[: a + 1]
            gen = tokens[n0:]
            cut = len(gen)
            for i, t in enumerate(gen):
                if t in stops:
                    cut = i + 1
                    break
            cut = min(cut, max_new_tokens)
            finish = "stop" if any(t in stops for t in gen[:cut]) else "length"
            return {"tokens": gen[:cut], "rounds": rounds, "verification_steps": len(rounds),
                    "target_forwards": forwards, "finish_reason": finish}
    finally:
        runner.close()


# ---------------------------------------------------------------------------------------------
# Held-out prompts
# ---------------------------------------------------------------------------------------------


def _prompt_prefix(messages: list[dict]) -> list[dict]:
    """The turns before the first assistant turn (system/user), as ``{"role", "content"}``."""
    out = []
    for m in messages:
        if m.get("role") == "assistant":
            break
        out.append({"role": m["role"], "content": m.get("content", "")})
    return out


def _prefix_hash(prefix: list[dict]) -> str:
    blob = json.dumps([[m["role"], m["content"]] for m in prefix], ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def chat_template_kwargs(params) -> dict | None:
    """Chat-template kwargs the target is served with (``enable_thinking`` from ``synthesize``)."""
    et = params.synthesize.enable_thinking
    return None if et is None else {"enable_thinking": bool(et)}


def render_prompt(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a prompt exactly as vLLM's chat endpoint renders it.

    The chat template is applied as text with the generation prompt
    (``apply_chat_template(..., add_generation_prompt=True, tokenize=False)``), then tokenized
    with ``add_special_tokens=False`` (the template already holds any BOS), as vLLM does.

    Returns:
        list[int]: the prompt's token ids.
    """
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                         **(template_kwargs or {}))
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _read_samples(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "01_synthesize" / "samples.jsonl"
    if not path.is_file():
        raise EvaluateError(f"{path}: not found; run stage 1 (synthesize) first")
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise EvaluateError(f"{path}:{n}: invalid JSON ({exc.msg})") from None
    return out


def _train_ids(run_dir: Path) -> set[str]:
    p = Path(run_dir) / "02_vocab" / "train.parquet"
    if not p.is_file():
        return set()
    import pyarrow.parquet as pq

    return set(pq.read_table(p, columns=["id"]).column("id").to_pylist())


def _other_prompt_set(source) -> list[dict]:
    """Records ``{"id", "source", "messages", "prompt_hash"}`` of ``evaluate.prompts`` (Stage 1's loader;
    the first system/user turn group of each prompt)."""
    from eagle3.prompts import load_source

    return [{"id": p.id, "source": p.source, "messages": p.first_messages(), "prompt_hash": p.prompt_hash}
            for p in load_source(source, dedup=True)]


def heldout_prompts(params, run_dir: str | Path, tokenizer) -> tuple[list[dict], dict]:
    """The evaluation prompts: held-out samples of Stage 1 (or ``evaluate.prompts``), never trained on.

    A candidate is dropped when its prompt hash (Stage 1's ``prompt_hash`` or the hash of its
    system/user turns) belongs to a ``split == "train"`` sample, or its id is in
    ``02_vocab/train.parquet``. Prompts longer than ``target.max_model_len - max_new_tokens - k - 1``
    tokens are skipped (they could not finish in vLLM).

    Returns:
        ``(prompts, info)``: prompts ``{"id", "source", "prompt_hash", "messages", "prompt_ids"}``
        (at most ``evaluate.num_prompts``) and counts (``candidates``, ``excluded_training``,
        ``skipped_too_long``, ``by_source``).

    Raises:
        EvaluateError: no samples file, or no held-out prompt left.
    """
    ev = params.evaluate
    run_dir = Path(run_dir)
    samples = _read_samples(run_dir) if (run_dir / "01_synthesize" / "samples.jsonl").exists() or ev.prompts is None else []
    train_hashes: set[str] = set()
    for s in samples:
        if s.get("split") == "train":
            train_hashes.add(_prefix_hash(_prompt_prefix(s.get("messages", []))))
            if s.get("prompt_hash"):
                train_hashes.add(str(s["prompt_hash"]))
    train_ids = _train_ids(run_dir)
    if ev.prompts is not None:
        cands = _other_prompt_set(ev.prompts)
    else:
        cands = [s for s in samples if s.get("split") == "heldout"]
    tk = chat_template_kwargs(params)
    limit = params.target.max_model_len - ev.max_new_tokens - ev.num_speculative_tokens - 1
    out, excluded, too_long = [], 0, 0
    for s in cands:
        prefix = _prompt_prefix(s.get("messages", []))
        if not prefix:
            continue
        h = _prefix_hash(prefix)
        if h in train_hashes or (s.get("prompt_hash") and str(s["prompt_hash"]) in train_hashes) or s.get("id") in train_ids:
            excluded += 1
            continue
        ids = render_prompt(tokenizer, prefix, tk)
        if len(ids) > limit:
            too_long += 1
            continue
        out.append({"id": str(s["id"]), "source": str(s.get("source", "?")), "prompt_hash": s.get("prompt_hash") or h,
                    "messages": prefix, "prompt_ids": ids})
        if ev.num_prompts is not None and len(out) >= ev.num_prompts:
            break
    if not out:
        raise EvaluateError(
            f"no held-out prompt to evaluate in {run_dir} ({len(cands)} candidates, {excluded} seen in "
            f"training, {too_long} longer than {limit} tokens); raise synthesize.heldout_fraction or set evaluate.prompts")
    by_source: dict[str, int] = {}
    for p in out:
        by_source[p["source"]] = by_source.get(p["source"], 0) + 1
    return out, {"candidates": len(cands), "excluded_training": excluded, "skipped_too_long": too_long,
                 "count": len(out), "by_source": by_source}


# ---------------------------------------------------------------------------------------------
# Offline evaluation (resumable per prompt)
# ---------------------------------------------------------------------------------------------


def _key(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _file_sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def evaluate_offline(target, tokenizer, drafter_model, prompts: list[dict], k: int, max_new_tokens: int,
                     aux_layer_ids: Sequence[int], temperature: float = 0.0, seed: int = 0,
                     out_file: str | Path | None = None, key: str = "", progress: Progress | None = None) -> list[dict]:
    """Run :func:`speculative_generate` over prompts; one record per prompt.

    With ``out_file`` (JSONL) the records are appended as they finish and prompts already there
    (same ``key``) are skipped on a re-run; a torn last line is dropped.

    Returns:
        list[dict]: ``{"id", "source", "prompt_len", "tokens", "rounds", "verification_steps",
        "target_forwards", "finish_reason", "time_s"}`` in prompt order.
    """
    import torch

    done: dict[str, dict] = {}
    if out_file is not None:
        out_file = Path(out_file)
        if out_file.exists():
            lines = out_file.read_text(encoding="utf-8").splitlines()
            good = []
            for line in lines:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    break  # torn tail
                if rec.get("key") != key:
                    good = []
                    break
                good.append(line)
                done[rec["id"]] = rec
            if len(good) != len(lines):
                out_file.write_text("".join(g + "\n" for g in good), encoding="utf-8")
                if not good:
                    done = {}
    stops = _stop_ids(tokenizer, target)
    records = []
    for i, p in enumerate(prompts):
        if p["id"] in done:
            records.append(done[p["id"]])
            continue
        gen = torch.Generator().manual_seed(seed + i)
        t0 = time.time()
        r = speculative_generate(target, drafter_model, p["prompt_ids"], k, max_new_tokens, aux_layer_ids,
                                 temperature=temperature, stop_ids=stops, generator=gen)
        rec = {"key": key, "id": p["id"], "source": p["source"], "prompt_len": len(p["prompt_ids"]),
               **r, "time_s": round(time.time() - t0, 3)}
        if out_file is not None:
            with open(out_file, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
                f.flush()
                os.fsync(f.fileno())
        records.append(rec)
        if progress is not None:
            progress.update(1, tokens=len(r["tokens"]))
    return records


def _backend_summary(records: list[dict], k: int, temperature: float, backend: str, method: str) -> dict:
    s = summarize_rounds(records, k)
    gen_tokens = sum(len(r["tokens"]) for r in records)
    secs = sum(r.get("time_s", 0.0) for r in records)
    return {
        "backend": backend, "method": method, "k": k, "temperature": temperature,
        "acceptance_rule": "exact match with the target argmax" if temperature <= 0 else
        "speculative sampling min(1, p/q), resample from norm(max(0, p - q)) (Leviathan et al. 2023)",
        **s["overall"],
        "by_source": s["by_source"], "by_context": s["by_context"],
        "accepted_histogram": s["accepted_histogram"], "prompts": s["prompts"],
        "output_tokens": gen_tokens, "tokens_per_s": gen_tokens / secs if secs else None,
    }


# ---------------------------------------------------------------------------------------------
# vLLM (one engine per subprocess)
# ---------------------------------------------------------------------------------------------


def run_vllm_job(job: dict, out_path: str | Path, log_path: str | Path | None = None,
                 timeout_s: float = 1800.0) -> dict:
    """Run ``python -m eagle3.evaluate_vllm`` on ``job`` in a subprocess and return its result.

    The job file is written beside ``out_path``; the child's output goes to ``log_path``. The
    child runs in its own process group, killed on timeout.

    Raises:
        EvaluateError: the child failed or timed out (the message holds the log tail).
    """
    import signal

    from eagle3.vllm_utils import cpu_env

    out_path = Path(out_path)
    job_path = out_path.with_suffix(".job.json")
    atomic_write_json(job_path, job)
    log_path = Path(log_path) if log_path else out_path.with_suffix(".log")
    env = cpu_env()
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "eagle3.evaluate_vllm", str(job_path), str(out_path)],
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    if rc != 0 or not out_path.exists():
        tail = "\n".join(Path(log_path).read_text(errors="replace").splitlines()[-30:])
        why = f"timed out after {timeout_s:.0f} s" if rc is None else f"exited with code {rc}"
        raise EvaluateError(f"vLLM job {job['method']} {why} (log: {log_path}):\n{tail}")
    return json.loads(out_path.read_text())


def vllm_records(result: dict, prompts: list[dict]) -> list[dict]:
    """Per-prompt round records from a vLLM result (per-step accepted/drafted lists).

    Context lengths are reconstructed as prompt + 1 + tokens produced by earlier rounds, exact
    when every engine step drafted (EAGLE-3); for n-gram lookup, steps without drafts are not
    reported by vLLM, so its context lengths are lower bounds.
    """
    src = {p["id"]: p["source"] for p in prompts}
    out = []
    for r in result["per_prompt"]:
        acc, drf = r.get("per_step_accepted") or [], r.get("per_step_drafted") or []
        ctx = len(r["prompt_ids"]) + 1
        rounds = []
        for a, d in zip(acc, drf):
            rounds.append([ctx, int(d), int(a)])
            ctx += 1 + int(a)
        out.append({"id": r["id"], "source": src.get(r["id"], "?"), "prompt_len": len(r["prompt_ids"]),
                    "tokens": r["tokens"], "rounds": rounds, "verification_steps": len(rounds),
                    "finish_reason": r.get("finish_reason")})
    return out


def _vllm_summary(result: dict, prompts: list[dict], k: int) -> dict:
    """Acceptance from vLLM's counters (headline) plus per-source/context splits from per-request data."""
    c = result["counters"]
    method = result["method"]
    n_prompts = len(result["per_prompt"])
    steps = c["engine_steps"] - n_prompts  # one prefill step per prompt (unchunked, max_num_seqs=1)
    summary: dict = {"backend": "vllm", "method": method, "k": result["k"], "temperature": result["temperature"],
                     "acceptance_rule": "vLLM rejection sampler (greedy: exact match with the target argmax)"
                     if result["temperature"] <= 0 else "vLLM rejection sampler",
                     "dtype": result.get("dtype"), "vllm_version": result.get("vllm_version"),
                     "tokens_per_s": result.get("tokens_per_s"), "output_tokens": result.get("output_tokens"),
                     "generate_s": result.get("generate_s"), "startup_s": result.get("startup_s"),
                     "counters": c, "prompts": n_prompts}
    if method == "none":
        summary.update({"tau": None, "rounds": 0, "verification_steps": steps,
                        "tokens_per_forward": (c["vllm:generation_tokens"] - n_prompts) / steps if steps > 0 else None})
        return summary
    drafts = c["vllm:spec_decode_num_drafts"]
    acc = c["vllm:spec_decode_num_accepted_tokens"]
    dtoks = c["vllm:spec_decode_num_draft_tokens"]
    per_pos = c["per_pos"]
    cond, prev = [], drafts
    for x in per_pos:
        cond.append(x / prev if prev else None)
        prev = x
    summary.update({
        "tau": 1 + acc / drafts if drafts else float("nan"),
        "rounds": drafts, "accepted_tokens": acc, "draft_tokens": dtoks,
        "draft_acceptance_rate": acc / dtoks if dtoks else float("nan"),
        "per_position_unconditional": [x / drafts if drafts else None for x in per_pos],
        "per_position_conditional": cond,
        "verification_steps": steps,
        "tokens_per_forward": (steps + acc) / steps if steps > 0 else None,
    })
    recs = vllm_records(result, prompts)
    s = summarize_rounds(recs, k)
    summary["per_request_check"] = {"drafts": s["overall"]["rounds"], "accepted": s["overall"]["accepted_tokens"]}
    if method == "eagle3":
        summary["per_position_conditional"] = s["overall"]["per_position_conditional"]
        summary["by_context"] = s["by_context"]
    summary["by_source"] = {src: {kk: v for kk, v in m.items() if kk not in ("verification_steps", "tokens_per_forward")}
                            for src, m in s["by_source"].items()}
    summary["accepted_histogram"] = s["accepted_histogram"]
    return summary


def vllm_serve_command(target_name: str, drafter_dir: str | Path, k: int, extra: str = "") -> str:
    """The ``vllm serve`` command line that serves the target with this drafter (EAGLE-3, k tokens)."""
    spec = json.dumps({"method": "eagle3", "model": str(drafter_dir), "num_speculative_tokens": int(k)})
    cmd = f"vllm serve {shlex.quote(str(target_name))} --speculative-config {shlex.quote(spec)}"
    return cmd + (f" {extra}" if extra else "")


# ---------------------------------------------------------------------------------------------
# Parity check and diagnosis
# ---------------------------------------------------------------------------------------------


def parity_check(tau_offline: float, tau_vllm: float, tolerance: float) -> tuple[bool, float]:
    """``(ok, gap)`` with ``gap = |tau_offline - tau_vllm| / tau_offline`` and ``ok = gap <= tolerance``."""
    if tau_offline is None or tau_vllm is None or not math.isfinite(tau_offline) or not math.isfinite(tau_vllm):
        return False, float("nan")
    gap = abs(tau_offline - tau_vllm) / tau_offline
    return gap <= tolerance, gap


def probe_layer_ids(target, drafter_model, sequences: list[list[int]], candidates: dict[str, list[int]]) -> dict[str, float]:
    """First-draft accuracy of the drafter on target text with different aux layer ids.

    For each candidate id list, the target's states at those layers feed the drafter's first pass
    over each sequence (teacher forced); returned is the fraction of positions where the drafter's
    argmax (mapped to target ids) equals the target's argmax. The ids the drafter was trained on
    score clearly higher than wrong ones.

    Args:
        sequences: token id lists (e.g. prompt + generated continuation).
        candidates: name -> aux layer ids.
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


def diagnose(drafter_dir: str | Path, target_dir: str | Path, reference: DrafterSettings | None = None,
             run_dir: str | Path | None = None, target=None, drafter_model=None,
             offline: dict | None = None, vllm: dict | None = None, prompts: list[dict] | None = None,
             offline_records: list[dict] | None = None) -> list[str]:
    """Look for train/serve mismatches between a drafter, its target and vLLM; one line per problem.

    Checked (each line starts with its category):

    * ``layer ids``: present, in ``[0, N]``, distinct, ascending (vLLM concatenates the aux states
      in ascending layer order), as many as ``fc`` expects, equal to the ids the drafter was
      trained on (``reference``, e.g. ``03_extract/meta.json``); with ``target`` and
      ``drafter_model`` also measured: first-draft accuracy with the config's vs the trained ids.
    * ``norm flags``: written in config.json (vLLM defaults ``norm_before_residual`` to True,
      speculators to False), equal to the training values, consistent with the weights present
      (``input_norm`` for ``norm_before_fc``, ``fc_norm.*`` for ``fc_norm``).
    * ``vocab mapping``: ``d2t``/``t2d`` present for a reduced draft vocab, lengths, range, order,
      t2d consistent with d2t, ``lm_head`` rows = ``draft_vocab_size``, equal to
      ``02_vocab/vocab_mapping.safetensors``.
    * ``chat template``: vLLM's rendered prompt ids equal the offline ones; the offline render is a
      prefix of the same conversation tokenized for training (``02_vocab/heldout.parquet``).
    * ``dtype``: checkpoint vs target vs vLLM dtype; ``embed_tokens`` bit-identical to the target's;
      vLLM's greedy output equal to transformers' (numerics of the target itself).
    * ``hidden size / vocab``: drafter vs target config.
    * ``per-position``: where vLLM's conditional acceptance falls below offline's.

    Returns:
        list[str]: problems found (empty when nothing is wrong).
    """
    import torch
    from safetensors import safe_open

    probs: list[str] = []
    d = Path(drafter_dir)
    cfg = _read_config(d)
    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    tcfg = tcfg.get("text_config", tcfg)
    n_layers, hidden, vocab = tcfg["num_hidden_layers"], tcfg["hidden_size"], tcfg["vocab_size"]
    weights: dict[str, Any] = {}
    wfile = d / "model.safetensors"
    if wfile.exists():
        with safe_open(str(wfile), "pt") as f:
            weights = {kk: f.get_tensor(kk) for kk in f.keys()}
    else:
        probs.append(f"weights: {wfile} is missing")

    # layer ids
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        probs.append("layer ids: config.json has no eagle_aux_hidden_state_layer_ids (vLLM then guesses)")
        ids = []
    else:
        bad = [i for i in ids if not 0 <= int(i) <= n_layers]
        if bad:
            probs.append(f"layer ids: {bad} outside [0, {n_layers}] for a target with {n_layers} layers")
        if len(set(ids)) != len(ids):
            probs.append(f"layer ids: duplicates in {ids}")
        if list(ids) != sorted(ids):
            probs.append(f"layer ids: {ids} not ascending; vLLM concatenates aux states in ascending layer "
                         f"order {sorted(set(ids))}, so fc sees them in another order than in training")
    fcw = weights.get("fc.weight")
    if fcw is not None and ids and fcw.shape[1] != len(ids) * hidden:
        probs.append(f"layer ids: fc expects {fcw.shape[1] // hidden} aux states, config lists {len(ids)}")
    if reference is not None and ids and list(reference.aux_layer_ids) != list(ids):
        probs.append(f"layer ids: config.json lists {list(ids)} but the drafter was trained on "
                     f"{list(reference.aux_layer_ids)} ({reference.source})")
        if target is not None and drafter_model is not None and offline_records:
            seqs = [[*p["prompt_ids"], *r["tokens"]] for p, r in zip(prompts or [], offline_records)][:4]
            try:
                acc = probe_layer_ids(target, drafter_model, seqs,
                                      {"config": sorted(set(int(i) for i in ids)), "trained": list(reference.aux_layer_ids)})
                probs.append(f"layer ids: measured first-draft accuracy {acc['trained']:.3f} with the trained ids "
                             f"vs {acc['config']:.3f} with the config's")
            except Exception as exc:  # the probe is a hint; a failure must not hide the finding above
                probs.append(f"layer ids: probe failed ({type(exc).__name__}: {exc})")

    # norm flags
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        if flag not in cfg:
            extra = " (vLLM then assumes True, speculators False)" if flag == "norm_before_residual" else ""
            probs.append(f"norm flags: {flag} is not written in config.json{extra}")
        elif reference is not None and bool(cfg[flag]) != bool(getattr(reference, flag)):
            probs.append(f"norm flags: config.json has {flag}={cfg[flag]} but the drafter was trained with "
                         f"{getattr(reference, flag)} ({reference.source})")
    if weights:
        has_in = "input_norm.weight" in weights
        if bool(cfg.get("norm_before_fc")) != has_in:
            probs.append(f"norm flags: norm_before_fc={cfg.get('norm_before_fc')} but input_norm.weight is "
                         f"{'present' if has_in else 'absent'} in the weights")
        has_fcn = any(kk.startswith("fc_norm.") for kk in weights)
        if bool(cfg.get("fc_norm")) != has_fcn:
            probs.append(f"norm flags: fc_norm={cfg.get('fc_norm')} but fc_norm.* weights are "
                         f"{'present' if has_fcn else 'absent'}")
        if "layers.0.hidden_norm.weight" not in weights:
            probs.append("norm flags: layers.0.hidden_norm.weight missing (vLLM would leave it at 1.0)")

    # vocab mapping
    dvs = cfg.get("draft_vocab_size")
    tl = cfg.get("transformer_layer_config", {})
    if tl.get("vocab_size") not in (None, vocab):
        probs.append(f"hidden size / vocab: transformer_layer_config.vocab_size {tl.get('vocab_size')} != target {vocab}")
    if tl.get("hidden_size") not in (None, hidden) or cfg.get("target_hidden_size") not in (None, hidden):
        probs.append(f"hidden size / vocab: drafter hidden {tl.get('hidden_size')} / target_hidden_size "
                     f"{cfg.get('target_hidden_size')} vs target {hidden}")
    lm = weights.get("lm_head.weight")
    if lm is not None and dvs is not None and lm.shape[0] != dvs:
        probs.append(f"vocab mapping: lm_head has {lm.shape[0]} rows, draft_vocab_size is {dvs}")
    d2t, t2d = weights.get("d2t"), weights.get("t2d")
    if dvs is not None and dvs != vocab:
        if d2t is None or t2d is None:
            probs.append(f"vocab mapping: draft_vocab_size {dvs} < {vocab} but d2t/t2d are missing from the weights")
        else:
            if d2t.numel() != dvs:
                probs.append(f"vocab mapping: d2t has {d2t.numel()} entries, draft_vocab_size is {dvs}")
            tids = torch.arange(d2t.numel()) + d2t.long()
            if tids.numel() and (int(tids.min()) < 0 or int(tids.max()) >= vocab):
                probs.append(f"vocab mapping: d2t maps outside the target vocab [0, {vocab})")
            elif tids.numel() > 1 and not bool((tids[1:] > tids[:-1]).all()):
                probs.append("vocab mapping: d2t target ids are not strictly ascending")
            elif t2d.numel() != vocab or int(t2d.sum()) != d2t.numel() or not bool(t2d.bool()[tids].all()):
                probs.append("vocab mapping: t2d is inconsistent with d2t")
            if run_dir is not None:
                mp = Path(run_dir) / "02_vocab" / "vocab_mapping.safetensors"
                if mp.exists():
                    from safetensors.torch import load_file

                    ref = load_file(str(mp))
                    if ref["d2t"].shape != d2t.shape or not torch.equal(ref["d2t"].long(), d2t.long()):
                        probs.append(f"vocab mapping: d2t differs from {mp} (the mapping the training data used)")
    elif d2t is not None and d2t.numel() and bool((d2t != 0).any()):
        probs.append("vocab mapping: full-size draft vocab but a non-identity d2t in the weights")

    # dtype / embeddings
    floats = [t for kk, t in weights.items() if t.is_floating_point()]
    ck_dtype = str(floats[0].dtype).replace("torch.", "") if floats else None
    t_dtype = str(tcfg.get("dtype") or tcfg.get("torch_dtype") or "")
    emb = weights.get("embed_tokens.weight")
    if emb is not None:
        with safe_open(str(Path(target_dir) / "model.safetensors"), "pt") if (Path(target_dir) / "model.safetensors").exists() else _null() as f:
            if f is not None:
                key = next((kk for kk in f.keys() if kk.endswith("embed_tokens.weight")), None)
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

    # chat template and greedy outputs
    if prompts and vllm is not None and vllm.get("per_prompt"):
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
    if prompts and run_dir is not None:
        hp = Path(run_dir) / "02_vocab" / "heldout.parquet"
        if hp.exists():
            import pyarrow.parquet as pq

            tab = pq.read_table(hp, columns=["id", "input_ids"]).to_pydict()
            train_render = dict(zip(tab["id"], tab["input_ids"]))
            bad = [p["id"] for p in prompts if p["id"] in train_render
                   and list(train_render[p["id"]][: len(p["prompt_ids"])]) != list(p["prompt_ids"])]
            if bad:
                probs.append(f"chat template: {len(bad)} prompts render differently from 02_vocab/heldout.parquet "
                             f"(the training tokenization), e.g. {bad[0]}")

    # per-position pattern
    if offline and vllm is not None and offline.get("per_position_conditional") and vllm.get("per_position_conditional"):
        o, v = offline["per_position_conditional"], vllm["per_position_conditional"]
        if o[0] is not None and v[0] is not None and o[0] - v[0] > 0.1:
            probs.append(f"per-position: vLLM accepts position 1 at {v[0]:.2f} vs {o[0]:.2f} offline: the first "
                         "draft already differs (aux states, fc, norms or the vocab mapping)")
        elif len(o) > 1 and o[1] is not None and v[1] is not None and o[1] - v[1] > 0.15:
            probs.append(f"per-position: position 1 agrees but position 2 is {v[1]:.2f} in vLLM vs {o[1]:.2f} "
                         "offline: the fed-back hidden state differs (norm_output, chain positions)")
    return probs


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------------


def find_drafter(params, run_dir: str | Path) -> Path:
    """``evaluate.drafter_dir`` when set, else the drafter Stage 4 exported (``04_train/stats.json``).

    Raises:
        EvaluateError: no drafter (Stage 4 not complete) or the directory lacks config.json.
    """
    if params.evaluate.drafter_dir:
        d = Path(params.evaluate.drafter_dir).expanduser()
    else:
        st = read_json(Path(run_dir) / "04_train" / "stats.json", {}) or {}
        d = Path(st.get("drafter_dir") or Path(run_dir) / "04_train" / "drafter")
        if not d.is_absolute():
            d = Path(run_dir) / d if (Path(run_dir) / d).exists() else Path(run_dir) / "04_train" / d
    if not (d / "config.json").is_file():
        raise EvaluateError(f"no drafter at {d} (config.json missing): run stage 4 (train) first, "
                            f"or set evaluate.drafter_dir to a speculators-format directory")
    return d.resolve()


def training_reference(params, run_dir: str | Path, drafter_dir: str | Path) -> DrafterSettings:
    """What the drafter learned with: aux ids from ``03_extract/meta.json``, norm flags from
    ``params.train`` and the draft vocab mapping from ``02_vocab/vocab_mapping.safetensors`` when the
    drafter is this run's Stage 4 export; otherwise the config and weights as written.

    The offline evaluator uses these values, vLLM uses the exported config: a difference is a
    train/serve mismatch that the parity check catches.
    """
    cfg = drafter_settings_from_config(drafter_dir, vllm_view=False)
    run_dir = Path(run_dir)
    meta = read_json(run_dir / "03_extract" / "meta.json", None)
    own = Path(drafter_dir).resolve().is_relative_to((run_dir / "04_train").resolve()) and not params.evaluate.drafter_dir
    srcs = []
    ids = cfg.aux_layer_ids
    if own and meta and meta.get("aux_layer_ids"):
        ids = [int(i) for i in meta["aux_layer_ids"]]
        srcs.append("aux ids: 03_extract/meta.json")
    if own:
        t = params.train
        flags = dict(norm_before_residual=t.norm_before_residual, norm_before_fc=t.norm_before_fc,
                     fc_norm=t.fc_norm, norm_output=t.norm_output)
        srcs.append("norm flags: params.train")
    else:
        flags = dict(norm_before_residual=cfg.norm_before_residual, norm_before_fc=cfg.norm_before_fc,
                     fc_norm=cfg.fc_norm, norm_output=cfg.norm_output)
    vm = run_dir / "02_vocab" / "vocab_mapping.safetensors"
    mapping = None
    if own and vm.is_file():
        mapping = str(vm)
        srcs.append("vocab mapping: 02_vocab/vocab_mapping.safetensors")
    return DrafterSettings(aux_layer_ids=ids, **flags, source="; ".join(srcs) or "config.json", vocab_mapping=mapping)


def _stage4_check(drafter_dir: Path, target_dir: Path) -> list[str] | None:
    """Stage 4's ``check_drafter`` problems (None when that module is unavailable)."""
    try:
        from eagle3.train import check_drafter
    except ImportError:
        return None
    try:
        return list(check_drafter(drafter_dir, target_dir))
    except Exception as exc:  # a crash of the checker is itself worth reporting, not fatal here
        return [f"check_drafter raised {type(exc).__name__}: {exc}"]


def run(params, run_dir: str | Path) -> dict:
    """Stage 5: offline and vLLM acceptance on held-out prompts, n-gram and no-speculation baselines,
    parity check; writes ``05_evaluate/results.json`` and ``stats.json``.

    Resumable: offline records are appended per prompt (``offline_records.jsonl``) and each vLLM
    measurement is kept (``vllm_<method>.json``) with a key of its inputs; a re-run reuses them.

    Returns:
        dict: the stats (``tau_offline``, ``tau_vllm``, ``tokens_per_forward_vllm``, ``tau_ngram``,
        ``tokens_per_forward_ngram``, ``parity_ok``, ``vllm_serve_command``, ...).

    Raises:
        EvaluateError: missing inputs or a failed vLLM job.
        ParityError: at temperature 0, offline and vLLM τ differ by more than
            ``evaluate.parity_tolerance`` (relative); results.json holds the diagnosis.
    """
    from eagle3.target import load_target, load_tokenizer, resolve_target, torch_dtype
    from eagle3.tracking import Tracker

    run_dir = Path(run_dir)
    sd = stage_dir(run_dir, STAGE)
    ev = params.evaluate
    k, temp = ev.num_speculative_tokens, ev.temperature
    resolved = resolve_target(params.target)
    drafter_dir = find_drafter(params, run_dir)
    if "offline" in ev.backends:
        model, tok, _ = load_target(params.target)
    else:  # vLLM only (e.g. a target too large for one device): the tokenizer is enough
        model, tok = None, load_tokenizer(resolved, params.target.trust_remote_code)
    prompts, pinfo = heldout_prompts(params, run_dir, tok)
    atomic_write_json(sd / "prompts.json", {"info": pinfo, "prompts": [
        {kk: p[kk] for kk in ("id", "source", "prompt_hash")} | {"prompt_tokens": len(p["prompt_ids"])} for p in prompts]})
    ref = training_reference(params, run_dir, drafter_dir)
    served = drafter_settings_from_config(drafter_dir, vllm_view=True)
    drafter_key = _key([_file_sha(drafter_dir / "model.safetensors"), _read_config(drafter_dir)])
    prompts_key = _key([[p["id"], p["prompt_ids"]] for p in prompts])
    t_dtype = str(model.dtype if model is not None else torch_dtype(params.target.dtype, resolved.path)).replace("torch.", "")
    units = (len(prompts) if "offline" in ev.backends else 0) + (len(ev.vllm_methods) if "vllm" in ev.backends else 0)
    backends: dict[str, dict] = {}
    offline_recs: list[dict] | None = None
    vllm_results: dict[str, dict] = {}
    dm = None
    with Progress(sd, units, unit="steps", desc=STAGE_NAME) as prog:
        if "offline" in ev.backends:
            dm = load_drafter(drafter_dir, model, ref, device=str(model.device))
            key = _key([drafter_key, prompts_key, asdict(ref), k, temp, ev.max_new_tokens, params.run.seed, t_dtype])
            offline_recs = evaluate_offline(model, tok, dm, prompts, k, ev.max_new_tokens, ref.aux_layer_ids,
                                            temperature=temp, seed=params.run.seed,
                                            out_file=sd / "offline_records.jsonl", key=key, progress=prog)
            backends["offline/eagle3"] = _backend_summary(offline_recs, k, temp, "transformers", "eagle3") | {
                "dtype": t_dtype, "device": str(model.device), "aux_layer_ids": ref.aux_layer_ids,
                "settings_source": ref.source}
        if "vllm" in ev.backends:
            logs = sd / "logs"
            logs.mkdir(exist_ok=True)
            for method in ev.vllm_methods:
                job = {"target": str(resolved.path), "dtype": params.target.dtype if params.target.dtype != "auto" else "auto",
                       "max_model_len": params.target.max_model_len, "seed": params.run.seed, "method": method,
                       "tensor_parallel_size": params.target.tensor_parallel_size,
                       "trust_remote_code": params.target.trust_remote_code,
                       "drafter": str(drafter_dir) if method == "eagle3" else None, "k": k,
                       "prompt_lookup_min": ev.ngram.prompt_lookup_min, "prompt_lookup_max": ev.ngram.prompt_lookup_max,
                       "temperature": temp, "max_new_tokens": ev.max_new_tokens,
                       "chat_template_kwargs": chat_template_kwargs(params),
                       "prompts": [{"id": p["id"], "messages": p["messages"], "prompt_ids": p["prompt_ids"]} for p in prompts]}
                jkey = _key([job, drafter_key if method == "eagle3" else None])
                out = sd / f"vllm_{method}.json"
                res = read_json(out, None)
                if not res or res.get("job_key") != jkey:
                    res = run_vllm_job(job, out, logs / f"vllm_{method}.log", timeout_s=ev.vllm_timeout_s)
                    res["job_key"] = jkey
                    atomic_write_json(out, res)
                vllm_results[method] = res
                backends[f"vllm/{method}"] = _vllm_summary(res, prompts, k)
                prog.update(1, tokens=res.get("output_tokens", 0))

        off, vl = backends.get("offline/eagle3"), backends.get("vllm/eagle3")
        parity: dict = {"checked": False, "tolerance": ev.parity_tolerance}
        if off is not None and vl is not None and temp <= 0:
            ok, gap = parity_check(off["tau"], vl["tau"], ev.parity_tolerance)
            parity = {"checked": True, "ok": ok, "relative_gap": gap, "tolerance": ev.parity_tolerance,
                      "tau_offline": off["tau"], "tau_vllm": vl["tau"]}
        elif temp > 0:
            parity["reason"] = "parity is checked at temperature 0 only"
        diagnosis = diagnose(drafter_dir, resolved.path, reference=ref, run_dir=run_dir, target=model,
                             drafter_model=dm, offline=off, vllm=(vllm_results.get("eagle3") and
                             {**vllm_results["eagle3"], **(vl or {})}), prompts=prompts, offline_records=offline_recs)
        drafter_check = _stage4_check(drafter_dir, resolved.path)
        if parity.get("checked") and not parity.get("ok") and drafter_check:
            diagnosis += [f"drafter check: {p}" for p in drafter_check]
        none = backends.get("vllm/none")
        cmd = vllm_serve_command(resolved.name, drafter_dir, k)
        results = {
            "settings": {"temperature": temp, "k": k, "max_new_tokens": ev.max_new_tokens,
                         "acceptance_rule": (off or vl or {}).get("acceptance_rule"),
                         "drafter_dir": str(drafter_dir), "target": str(resolved.path), "verifier_name": resolved.name,
                         "trained_settings": asdict(ref), "served_settings": asdict(served),
                         "ngram": ev.ngram.model_dump(), "vllm_engine": "LLM.chat, max_num_seqs=1"},
            "prompts": pinfo,
            "backends": backends,
            "parity": parity,
            "diagnosis": diagnosis,
            "drafter_check": drafter_check,
            "vllm_serve_command": cmd,
        }
        atomic_write_json(sd / "results.json", results)
        ng = backends.get("vllm/ngram")

        def g(b, key):
            return None if b is None else b.get(key)

        stats = {
            "num_prompts": len(prompts), "k": k, "temperature": temp,
            "tau_offline": g(off, "tau"), "tokens_per_forward_offline": g(off, "tokens_per_forward"),
            "tau_vllm": g(vl, "tau"), "tokens_per_forward_vllm": g(vl, "tokens_per_forward"),
            "tau_ngram": g(ng, "tau"), "tokens_per_forward_ngram": g(ng, "tokens_per_forward"),
            "tokens_per_s_vllm_eagle3": g(vl, "tokens_per_s"), "tokens_per_s_vllm_ngram": g(ng, "tokens_per_s"),
            "tokens_per_s_vllm_none": g(none, "tokens_per_s"),
            "speedup_vllm_eagle3": (g(vl, "tokens_per_s") / g(none, "tokens_per_s"))
            if g(vl, "tokens_per_s") and g(none, "tokens_per_s") else None,
            "draft_acceptance_rate_offline": g(off, "draft_acceptance_rate"),
            "draft_acceptance_rate_vllm": g(vl, "draft_acceptance_rate"),
            "parity_ok": parity.get("ok") if parity["checked"] else None,
            "parity_gap": parity.get("relative_gap"), "parity_tolerance": ev.parity_tolerance,
            "diagnosis": diagnosis,
            "vllm_serve_command": cmd,
        }
        tracker = Tracker(params, run_dir, STAGE_NAME)
        try:
            for name, fig in figures(results).items():
                tracker.figure(name, fig)
                import matplotlib.pyplot as plt

                plt.close(fig)
            tracker.log({kk: v for kk, v in stats.items() if isinstance(v, (int, float)) and v is not None})
            tracker.summary(stats)
        finally:
            tracker.finish()
        if parity["checked"] and not parity["ok"]:
            write_stats(sd, stats, complete=False)
            prog.extra["parity"] = "failed"
            raise ParityError(
                f"parity check failed: offline tau {off['tau']:.3f} vs vLLM tau {vl['tau']:.3f} "
                f"(relative gap {parity['relative_gap']:.3f} > tolerance {ev.parity_tolerance}); see {sd / 'results.json'}",
                diagnosis)
        return write_stats(sd, stats)


# ---------------------------------------------------------------------------------------------
# Tables and figures (used by notebook 05)
# ---------------------------------------------------------------------------------------------

_LABELS = {"offline/eagle3": "EAGLE-3 offline (transformers)", "vllm/eagle3": "EAGLE-3 in vLLM",
           "vllm/ngram": "n-gram lookup in vLLM", "vllm/none": "no speculation (vLLM)"}


def comparison_table(results: dict):
    """Drafter vs n-gram vs no speculation (and offline): τ, tokens/forward, tokens/s (pandas DataFrame)."""
    import pandas as pd

    rows = []
    for name, b in results["backends"].items():
        rows.append({"method": _LABELS.get(name, name), "backend": b["backend"], "k": b.get("k"),
                     "tau": b.get("tau"), "tokens_per_forward": b.get("tokens_per_forward"),
                     "draft_acceptance_rate": b.get("draft_acceptance_rate"), "rounds": b.get("rounds"),
                     "tokens_per_s": b.get("tokens_per_s") if b["backend"] == "vllm" else None})
    return pd.DataFrame(rows)


def parity_table(results: dict):
    """Offline vs vLLM side by side: τ, acceptance rate and per-position conditional rates."""
    import pandas as pd

    off, vl = results["backends"].get("offline/eagle3"), results["backends"].get("vllm/eagle3")
    rows = []
    for key in ("tau", "tokens_per_forward", "draft_acceptance_rate", "rounds", "accepted_tokens"):
        rows.append({"metric": key, "offline": (off or {}).get(key), "vllm": (vl or {}).get(key)})
    k = results["settings"]["k"]
    for i in range(k):
        rows.append({"metric": f"P(accept pos {i + 1} | 1..{i} accepted)",
                     "offline": ((off or {}).get("per_position_conditional") or [None] * k)[i],
                     "vllm": ((vl or {}).get("per_position_conditional") or [None] * k)[i]})
    return pd.DataFrame(rows)


def figures(results: dict) -> dict:
    """Matplotlib figures: ``per_position`` (conditional acceptance bars), ``tau_histogram``
    (accepted+1 per round), ``tau_vs_context`` (τ by context-length bucket), ``speed``."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import numpy as np

    bk = results["backends"]
    k = results["settings"]["k"]
    figs = {}
    spec = [n for n in ("offline/eagle3", "vllm/eagle3", "vllm/ngram") if n in bk]
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    w = 0.8 / max(len(spec), 1)
    for j, n in enumerate(spec):
        vals = [v if v is not None else 0 for v in (bk[n].get("per_position_conditional") or [0] * k)]
        ax.bar(np.arange(1, k + 1) + (j - (len(spec) - 1) / 2) * w, vals, w, label=_LABELS[n])
    ax.set_xlabel("draft position i")
    ax.set_ylabel("P(accepted | 1..i-1 accepted)")
    ax.set_ylim(0, 1)
    ax.set_xticks(range(1, k + 1))
    ax.legend(fontsize=8)
    ax.set_title(f"Per-position acceptance (k={k}, T={results['settings']['temperature']})")
    figs["per_position"] = fig

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for j, n in enumerate(spec):
        h = np.array(bk[n].get("accepted_histogram") or [0] * (k + 1), dtype=float)
        if h.sum():
            ax.bar(np.arange(1, k + 2) + (j - (len(spec) - 1) / 2) * w, h / h.sum(), w, label=_LABELS[n])
    ax.set_xlabel("tokens per round (accepted drafts + 1)")
    ax.set_ylabel("fraction of rounds")
    ax.legend(fontsize=8)
    ax.set_title("Acceptance length per round")
    figs["tau_histogram"] = fig

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for n in ("offline/eagle3", "vllm/eagle3"):
        bc = (bk.get(n) or {}).get("by_context") or {}
        if bc:
            ax.plot(list(bc), [m["tau"] for m in bc.values()], marker="o", label=_LABELS[n])
    ax.set_xlabel("context length (tokens before the round)")
    ax.set_ylabel("tau")
    ax.legend(fontsize=8)
    ax.set_title("Acceptance length vs context length")
    figs["tau_vs_context"] = fig

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    names = [n for n in ("vllm/eagle3", "vllm/ngram", "vllm/none") if n in bk]
    if names:
        ax.bar([_LABELS[n].replace(" in vLLM", "").replace(" (vLLM)", "") for n in names],
               [bk[n].get("tokens_per_s") or 0 for n in names])
    ax.set_ylabel("output tokens/s (vLLM, one request at a time)")
    ax.set_title("Decoding speed")
    figs["speed"] = fig
    return figs
