"""The names of stage 5's measurements: ``<backend>/<method>``, one name per column of its grid.

``stats.json`` (``sets[set].methods[name]``), ``results.json`` (``backends``, ``sets``) and the
report key everything by these names; ``vllm/<method>`` takes its method from
``evaluate.vllm_methods`` (the engine's ``speculative_config`` method, ``none`` for no speculation).
"""

from __future__ import annotations

__all__ = ["OFFLINE_EAGLE3", "VLLM_EAGLE3", "VLLM_NGRAM", "VLLM_NONE", "METHODS", "LABELS", "vllm_method", "is_vllm"]

OFFLINE_EAGLE3 = "offline/eagle3"  # the drafter under transformers (eagle3.evaluate.decoding)
VLLM_EAGLE3 = "vllm/eagle3"  # the drafter in vLLM, with its exported config
VLLM_NGRAM = "vllm/ngram"  # vLLM's prompt lookup, the baseline a drafter has to beat
VLLM_NONE = "vllm/none"  # vLLM without speculation: 1 token per target forward, the speed-up's base

METHODS = (VLLM_EAGLE3, VLLM_NGRAM, VLLM_NONE, OFFLINE_EAGLE3)  # the order of tables and figures

LABELS = {OFFLINE_EAGLE3: "EAGLE-3 offline (transformers)", VLLM_EAGLE3: "EAGLE-3 in vLLM",
          VLLM_NGRAM: "n-gram lookup in vLLM", VLLM_NONE: "no speculation (vLLM)"}


def vllm_method(method: str) -> str:
    """The measurement name of an ``evaluate.vllm_methods`` entry: ``"ngram"`` -> ``"vllm/ngram"``."""
    return f"vllm/{method}"


def is_vllm(name: str) -> bool:
    """True for a vLLM measurement (``vllm/<method>``): one with a speed pass (tokens/s)."""
    return name.startswith("vllm/")
