"""Stage 4 metrics: speculators' per-TTT-step counts, the step's named metrics packed for ONE
all-reduce, and the ratios logged to ``metrics.jsonl``.

speculators' ``Eagle3DraftModel.forward`` returns, per TTT step ``k``, summed counts
``loss_k_sum/total``, ``full_acc_k_sum/total``, ``cond_acc_k_sum/total`` (plus the overall
``loss_sum/total``). A step sums them over its micro-batches (on the device), packs them with the
token count and the divergence / signal flags into one float64 vector (:meth:`StepMetrics.pack`),
all-reduces it once across ranks and copies it to the host once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["tau_hat", "metric_keys", "summarize", "StepMetrics", "draft_positions", "chain_lengths", "simulate_rounds"]


def tau_hat(cond_acc: list[float]) -> float:
    """Simulated acceptance length from per-TTT-step conditional accuracies.

    ``tau_hat = 1 + sum_k prod_{i<=k} cond_acc_i``: the bonus token plus the expected number of
    leading draft tokens accepted, when draft token k is accepted with probability ``cond_acc_k``
    given that 0..k-1 were (greedy acceptance; EAGLE-3 paper, Sec. 4). E.g. [0.8, 0.5, 0.25] -> 2.3.
    """
    total, prod = 1.0, 1.0
    for a in cond_acc:
        prod *= a
        total += prod
    return total


def draft_positions(loss_mask, document_ids):
    """The packed positions a serving engine drafts from: supervised, and followed by a supervised
    position of the same document.

    With speculators' ``shift_batch`` alignment, position ``t`` holds answer token ``x[t+1]`` as input and
    the verifier's prediction of ``x[t+2]``; ``loss_mask[t]`` says ``x[t+1]`` is an answer token. A round
    drafting ``x[t+2]`` happens only when ``x[t+2]`` is an answer token too (``loss_mask[t+1]``): after the
    answer's last token (e.g. the end of turn) the engine stops, although speculators also scores the
    verifier's prediction of the template token that follows it.

    Args:
        loss_mask: ``[1, T]`` or ``[T]`` bool/int.
        document_ids: the same shape, int64 (-1 = padding).

    Returns:
        ``[T]`` bool tensor on the input's device.
    """
    mask = loss_mask.reshape(-1).bool()
    doc = document_ids.reshape(-1)
    out = mask.clone()
    out[-1:] = False
    out[:-1] &= mask[1:] & (doc[1:] == doc[:-1])
    return out


def chain_lengths(draft_tokens: list, target_ids, positions, document_ids):
    """Per draft start, how many of the TTT chain's drafts are right before the first wrong one.

    The chain of start ``p`` is what greedy verification checks in one round that starts at ``p``:
    draft ``s`` (TTT step ``s``) is scored against the verifier's argmax at ``p + s`` (speculators'
    ``align_for_step``), while ``p + s`` is one of ``positions`` of the same document. With
    ``positions = loss_mask``, ``sum_p [chain[p] > s]`` is speculators' ``full_acc_s`` count.

    Args:
        draft_tokens: ``ttt_steps`` tensors ``[1, T]`` int64, the drafter's argmax per TTT step (draft
            vocab ids), as speculators' ``Eagle3DraftModel.forward`` returns them.
        target_ids: ``[1, T]`` int64, the argmax of the verifier's logits over the draft vocab.
        positions: ``[T]`` bool, where a draft may be scored (:func:`draft_positions`).
        document_ids: ``[1, T]`` int64, the packed document of each position (-1 = padding).

    Returns:
        ``[T]`` int8 on the input's device: 0..ttt_steps; 0 outside ``positions``.
    """
    import torch

    pos = positions.reshape(-1).bool()
    doc = document_ids.reshape(-1)
    tgt = target_ids.reshape(-1)
    T = pos.numel()
    run = pos.clone()
    out = torch.zeros(T, dtype=torch.int8, device=pos.device)
    for s, d in enumerate(draft_tokens):
        ok = torch.zeros_like(pos)
        if s < T:
            ok[: T - s] = (d.reshape(-1)[: T - s] == tgt[s:]) & pos[s:] & (doc[s:] == doc[: T - s])
        run &= ok
        out += run.to(torch.int8)
    return out


def simulate_rounds(chain, positions, document_ids, k: int) -> tuple[int, int]:
    """Greedy verification rounds over teacher-forced text: ``(tokens, rounds)``; tokens / rounds is the
    acceptance length tau that chain speculation with ``k`` drafts measures on this text.

    Per answer (a run of ``positions`` in one document: :func:`draft_positions`, whose first position
    drafts the answer's second token, the first coming from the prefill), the first round starts at the
    run's first position; a round at ``p`` emits ``min(chain[p], k) + 1`` tokens (the accepted drafts
    plus the verifier's bonus token, vLLM's counting), and the next starts that many positions later,
    while inside the run. Unlike ``tau_hat`` (per-position accuracies averaged over *every* position),
    rounds start where decoding starts them, more often right after a rejection, i.e. at harder
    positions: on real text this is lower than ``tau_hat``. On the target's own greedy text it is the
    tau the engine measures (first-draft acceptance at the rounds' starts equalled vLLM's over 9,169
    rounds: benchmarks/RESULTS.md).

    Args:
        chain: ``[T]`` ints, :func:`chain_lengths` (numpy or a CPU tensor).
        positions: ``[T]`` bool, the same positions as ``chain`` was computed with.
        document_ids: ``[T]`` ints, the same positions' documents.
        k: drafts per round (>= 1; chains are cut at ``k``).

    Returns:
        tuple: ``(tokens, rounds)`` summed over the answers (``(0, 0)`` without any round).
    """
    import numpy as np

    chain = np.asarray(chain, dtype=np.int64).reshape(-1)
    pos = np.asarray(positions).reshape(-1).astype(bool)
    doc = np.asarray(document_ids).reshape(-1)
    T = len(pos)
    tokens = rounds = 0
    for q0 in np.flatnonzero(pos).tolist():
        if q0 > 0 and pos[q0 - 1] and doc[q0 - 1] == doc[q0]:
            continue  # not the first position of its run
        end = q0  # the run's end: a jump past it must not land in a later answer or micro-batch
        while end < T and pos[end] and doc[end] == doc[q0]:
            end += 1
        p = q0
        while p < end:
            n = min(int(chain[p]), k) + 1
            tokens += n
            rounds += 1
            p += n
    return tokens, rounds


def metric_keys(ttt_steps: int) -> list[str]:
    """speculators' count names, in the order they are packed: ``loss_sum, loss_total`` then per step
    ``loss_k_*``, ``full_acc_k_*``, ``cond_acc_k_*`` (``_sum`` then ``_total``)."""
    keys = ["loss_sum", "loss_total"]
    for k in range(ttt_steps):
        keys += [f"loss_{k}_sum", f"loss_{k}_total", f"full_acc_{k}_sum", f"full_acc_{k}_total",
                 f"cond_acc_{k}_sum", f"cond_acc_{k}_total"]
    return keys


def summarize(sums: dict[str, float], ttt_steps: int, prefix: str = "") -> dict[str, float]:
    """Ratios from summed speculators metric counts: loss, loss_k, full_acc_k, cond_acc_k, tau_hat.

    ``full_acc_k``: share of supervised positions whose drafts 0..k were all right; ``cond_acc_k``:
    share right at step k among those right at 0..k-1 (speculators ``compute_accuracy_single_step``).
    """

    def ratio(name: str) -> float:
        t = sums.get(f"{name}_total", 0.0)
        return float(sums.get(f"{name}_sum", 0.0) / t) if t else 0.0

    out = {f"{prefix}loss": ratio("loss")}
    cond = []
    for k in range(ttt_steps):
        out[f"{prefix}loss_{k}"] = ratio(f"loss_{k}")
        out[f"{prefix}full_acc_{k}"] = ratio(f"full_acc_{k}")
        out[f"{prefix}cond_acc_{k}"] = ratio(f"cond_acc_{k}")
        cond.append(out[f"{prefix}cond_acc_{k}"])
    out[f"{prefix}tau_hat"] = tau_hat(cond)
    return out


@dataclass
class StepMetrics:
    """One optimizer step's metrics: float64 tensors on the compute device until :meth:`reduce`.

    Attributes:
        counts: ``[len(metric_keys)]`` summed speculators counts of this rank's micro-batches.
        tokens: ``[]`` real (non-padding) positions trained on.
        grad_nonfinite: ``[]`` 1 when the clipped gradient norm is NaN/Inf.
        stop_signal: ``[]`` 1 when SIGINT/SIGTERM arrived on this rank.
        grad_norm: ``[]`` the gradient norm divided by the world size (the sum over ranks is the mean).
        bad_micro: ``[G]`` 1 at micro-batch ``rank * grad_accum + a`` whose loss was NaN/Inf.
    """

    counts: torch.Tensor
    tokens: torch.Tensor
    grad_nonfinite: torch.Tensor
    stop_signal: torch.Tensor
    grad_norm: torch.Tensor
    bad_micro: torch.Tensor

    @classmethod
    def zeros(cls, n_keys: int, global_batch: int, device) -> StepMetrics:
        """All zeros, float64, on ``device``."""
        z = lambda *shape: torch.zeros(*shape, dtype=torch.float64, device=device)  # noqa: E731
        return cls(z(n_keys), z(()), z(()), z(()), z(()), z(global_batch))

    def pack(self) -> torch.Tensor:
        """``[n_keys + 4 + G]``: counts, tokens, grad_nonfinite, stop_signal, grad_norm, bad_micro."""
        flags = torch.stack([self.tokens, self.grad_nonfinite, self.stop_signal, self.grad_norm])
        return torch.cat([self.counts, flags, self.bad_micro])

    @classmethod
    def unpack(cls, vec: torch.Tensor, n_keys: int) -> StepMetrics:
        """The inverse of :meth:`pack`."""
        return cls(vec[:n_keys], vec[n_keys], vec[n_keys + 1], vec[n_keys + 2], vec[n_keys + 3], vec[n_keys + 4:])

    def reduce(self, ctx) -> StepMetrics:
        """Sum over ranks (ONE all-reduce) and copy to the host (ONE device-to-host sync)."""
        return StepMetrics.unpack(ctx.all_sum(self.pack()).cpu(), len(self.counts))
