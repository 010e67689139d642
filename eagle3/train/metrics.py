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

__all__ = ["tau_hat", "metric_keys", "summarize", "StepMetrics"]


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
