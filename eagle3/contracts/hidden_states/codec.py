"""How hidden states are stored: dtypes, bytes per token, and the scaled float8 codec.

A sample file holds ``hidden_states [seq, n_aux + 1, hidden]`` in the storage dtype; with
``float8_e4m3fn`` storage also :data:`SCALES` (one float32 scale per token and layer slot).
Readers turn stored tensors into values with :func:`read_states` only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from eagle3.errors import ExtractError

__all__ = [
    "NonFiniteError",
    "DTYPE_BYTES",
    "FP8",
    "FP8_MAX",
    "SCALES",
    "quantize_fp8",
    "dequantize_fp8",
    "storage_tensors",
    "as_stored",
    "read_states",
    "storage_dtype",
    "capture_dtype",
    "dtype_name",
    "bytes_per_token",
    "tensor_layout",
    "first_non_finite",
]

DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2, torch.float8_e4m3fn: 1}
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
SCALES = "hidden_states_scales"
"""The tensor beside an fp8 ``hidden_states``: float32 ``[seq, n_aux + 1, 1]``, one scale per token and
layer slot; the value is ``hidden_states.float() * hidden_states_scales`` (broadcast over hidden), the
key and the dequantization hs_connectors' ``FP8Transfer`` uses (its scales are per token, ``[seq, 1, 1]``)."""


class NonFiniteError(ExtractError):
    """A sample's hidden states contain NaN or Inf (the message names the sample id, slot and token)."""


def quantize_fp8(hs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled float8_e4m3fn of ``hs [..., hidden]``: ``(q [..., hidden] fp8, scales float32 [..., 1])``.

    One scale per vector (a token's ``hidden`` channels in one layer slot): its absolute maximum / 448
    (e4m3's largest finite value), so the largest element maps to +-448 and nothing saturates; an
    all-zero vector gets scale 1. Per token and slot rather than per block of channels: on the
    embedded model's states, blocks of 64 channels cut the relative error from 2.2% to 1.6% for 5.6%
    more bytes (benchmarks/RESULTS.md, "fp8 hidden states").
    """
    x = hs.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (x / scales).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scales


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`: ``q.float() * scales`` as ``dtype`` (shape of ``q``)."""
    return (q.float() * scales).to(dtype)


def storage_tensors(hs: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The file tensors that store ``hs [..., hidden]`` in ``dtype``: ``{"hidden_states": hs as dtype}``,
    plus :data:`SCALES` for float8_e4m3fn (:func:`quantize_fp8`)."""
    if dtype == FP8:
        q, sc = quantize_fp8(hs)
        return {"hidden_states": q, SCALES: sc}
    return {"hidden_states": hs.to(dtype)}


def as_stored(hs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 ``hs`` as a reader gets it back from ``dtype`` storage (rounding / quantization only)."""
    t = storage_tensors(hs, dtype)
    return dequantize_fp8(t["hidden_states"], t[SCALES]) if SCALES in t else t["hidden_states"].float()


def read_states(sample: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """A loaded sample file with ``hidden_states`` as values: fp8 codes dequantized with their
    :data:`SCALES` (removed) into ``dtype`` (default float32); other dtypes as stored (cast to
    ``dtype`` when given). The one place a reader turns stored states into numbers."""
    if SCALES in sample:
        out = dict(sample)
        out["hidden_states"] = dequantize_fp8(out["hidden_states"], out.pop(SCALES), dtype or torch.float32)
        return out
    if dtype is not None and sample.get("hidden_states") is not None and sample["hidden_states"].dtype != dtype:
        out = dict(sample)
        out["hidden_states"] = out["hidden_states"].to(dtype)
        return out
    return sample


def storage_dtype(name: str, compute_dtype: torch.dtype) -> torch.dtype:
    """Map ``extract.dtype`` to a torch dtype ('auto' = the target's compute dtype)."""
    if name == "auto":
        return compute_dtype
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
            "float8_e4m3fn": torch.float8_e4m3fn}[name]


def capture_dtype(storage: torch.dtype, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype the target's states are captured in before storage: the storage dtype itself, or for
    fp8 the compute dtype (the scales are taken from the unrounded values, :func:`storage_tensors`)."""
    return compute_dtype if storage == FP8 else storage


def dtype_name(d: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the form meta.json and stats.json hold)."""
    return str(d).replace("torch.", "")


def bytes_per_token(num_slots: int, hidden_size: int, dtype: torch.dtype) -> int:
    """Hidden-state bytes per token: ``num_slots x hidden_size x bytes per element`` (DESIGN "Scale"),
    plus ``num_slots x 4`` for fp8's float32 scales."""
    return num_slots * (hidden_size * DTYPE_BYTES[dtype] + (4 if dtype == FP8 else 0))


def tensor_layout(dtype: torch.dtype, num_slots: int, hidden_size: int) -> dict[str, str]:
    """The tensors of one sample file as ``meta.json`` describes them (name -> ``"dtype [shape]"``)."""
    name = dtype_name(dtype)
    layout = {"token_ids": "int64 [seq]", "loss_mask": "int8 [seq]",
              "hidden_states": f"{name} [seq, {num_slots}, {hidden_size}]"}
    if dtype == FP8:
        layout[SCALES] = f"float32 [seq, {num_slots}, 1] (value = hidden_states x scale)"
    return layout


def first_non_finite(hs: torch.Tensor, stored_layers: Sequence[int]) -> str:
    """Describe the first NaN/Inf in ``hs [seq, slots, hidden]`` as 'layer id L (slot s), token t'."""
    bad = (~torch.isfinite(hs.float())).any(dim=-1).nonzero()
    if not len(bad):
        return "no non-finite value"
    t, s = (int(x) for x in bad[0])
    return f"layer id {stored_layers[s]} (slot {s}), token {t} (first of {len(bad)} bad (token, slot) pairs)"
