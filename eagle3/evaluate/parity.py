"""The parity check: at temperature 0, offline τ and vLLM τ of the same drafter on the same prompts
must agree (``docs/DESIGN.md``, "Acceptance"); a gap exposes a train/serve mismatch."""

from __future__ import annotations

import math

__all__ = ["parity_check", "parity_result"]


def parity_check(tau_offline: float, tau_vllm: float, tolerance: float) -> tuple[bool, float]:
    """``(ok, gap)`` with ``gap = |tau_offline - tau_vllm| / tau_offline`` and ``ok = gap <= tolerance``.

    A missing or non-finite τ gives ``(False, nan)``.
    """
    if tau_offline is None or tau_vllm is None or not math.isfinite(tau_offline) or not math.isfinite(tau_vllm):
        return False, float("nan")
    gap = abs(tau_offline - tau_vllm) / tau_offline
    return gap <= tolerance, gap


def parity_result(offline: dict | None, vllm: dict | None, temperature: float, tolerance: float) -> dict:
    """The results.json ``parity`` entry from the offline and vLLM EAGLE-3 summaries.

    Returns:
        dict: ``checked`` and ``tolerance``; when checked (both measured, temperature 0) also ``ok``,
        ``relative_gap``, ``tau_offline``, ``tau_vllm``; at temperature > 0 a ``reason``.
    """
    parity: dict = {"checked": False, "tolerance": tolerance}
    if offline is not None and vllm is not None and temperature <= 0:
        ok, gap = parity_check(offline["tau"], vllm["tau"], tolerance)
        parity = {"checked": True, "ok": ok, "relative_gap": gap, "tolerance": tolerance,
                  "tau_offline": offline["tau"], "tau_vllm": vllm["tau"]}
    elif temperature > 0:
        parity["reason"] = "parity is checked at temperature 0 only"
    return parity
