"""The ONE aux-hidden-state capture of the target, in two modes.

Layer-id convention (docs/DESIGN.md "Conventions that must match the engines"; vLLM's
``LlamaModel.forward`` and speculators' ``launch_vllm.py``):

* id ``k`` (``1 <= k < N``) is the residual stream after decoder layer ``k - 1``, i.e. transformers'
  ``output_hidden_states`` entry ``hidden_states[k]``;
* id ``N`` (``num_hidden_layers``) is the output of the last decoder layer *before* the final norm
  (transformers' ``hidden_states[N]`` is after the norm for Llama-family models), hence hooks rather
  than ``output_hidden_states``;
* id ``0`` (cached mode only) is the embedding output.

Modes:

* :class:`PrefillCapture` (alias :data:`HiddenStateCapture`): one right-padded batch, no KV cache,
  the forward stopped at the last needed layer (final norm and LM head never run); returns
  ``[batch, seq, n_aux + 1, hidden]`` — Stage 3 (extract) and online training;
* :class:`CachedCapture`: a full forward over new tokens with a transformers KV cache; returns the
  target's logits and the concatenated aux states ``[q, n_aux * hidden]`` — offline decoding in
  Stage 5 (evaluate).

This module needs only torch (the GPU benchmark imports it alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

__all__ = [
    "default_aux_layer_ids",
    "resolve_layer_ids",
    "text_config",
    "decoder_layers",
    "PrefillCapture",
    "HiddenStateCapture",
    "CachedCapture",
]


def default_aux_layer_ids(num_hidden_layers: int) -> list[int]:
    """EAGLE-3's default aux layer ids ``[2, N // 2, N - 3]`` (speculators ``launch_vllm.py``)."""
    n = num_hidden_layers
    return [2, n // 2, n - 3]


def resolve_layer_ids(aux_layer_ids: Sequence[int] | None, num_hidden_layers: int,
                      field: str = "extract.aux_layer_ids", error: type[Exception] = ValueError) -> list[int]:
    """Validate the aux layer ids against the target's layer count (``None`` = the default).

    Args:
        aux_layer_ids: the configured ids, or None for ``[2, N // 2, N - 3]``.
        num_hidden_layers: N, the target's decoder layer count.
        field: the params key named in error messages.
        error: the exception class raised (the calling stage's, e.g. ``ExtractError``).

    Returns:
        list[int]: the aux ids, ascending. The stored layers are these plus ``N``.

    Raises:
        error: empty list, an id outside ``1 <= k < N``, a duplicate, or ids not ascending
            (vLLM captures aux layers in layer order, so another order could not match the engine).
    """
    n = int(num_hidden_layers)
    ids = default_aux_layer_ids(n) if aux_layer_ids is None else [int(k) for k in aux_layer_ids]
    src = "default [2, N//2, N-3]" if aux_layer_ids is None else field
    if not ids:
        raise error(f"{field}: at least one aux layer id is needed (EAGLE-3 fuses several layers)")
    bad = [k for k in ids if not 1 <= k < n]
    if bad:
        raise error(
            f"{src} = {ids}: id(s) {bad} out of range for a target with num_hidden_layers N = {n}; "
            f"aux ids must satisfy 1 <= k < {n} (id k = output of decoder layer k-1 = transformers "
            f"hidden_states[k]; id N = {n} is always stored as the last slot, do not list it)."
        )
    dups = sorted({k for k in ids if ids.count(k) > 1})
    if dups:
        raise error(f"{src} = {ids}: duplicated id(s) {dups}; each aux layer may appear once.")
    if ids != sorted(ids):
        raise error(
            f"{src} = {ids}: ids must be ascending ({sorted(ids)}); vLLM returns aux hidden states "
            f"in layer order, so any other order would not match the serving engine."
        )
    return ids


def text_config(config):
    """The text (decoder) config of a model config (``get_text_config()`` for multimodal models)."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def decoder_layers(model, error: type[Exception] = ValueError) -> tuple[torch.nn.Module, torch.nn.ModuleList]:
    """``(decoder, layers)``: the base decoder module (no LM head) and its decoder-layer list.

    Works for transformers causal LMs that follow the ``model.model.layers`` layout (Llama, Qwen,
    Mistral, DeepSeek, ...) or expose ``get_decoder()``.

    Raises:
        error: no decoder layer list could be found.
    """
    dec = None
    get = getattr(model, "get_decoder", None)
    if callable(get):
        try:
            dec = get()
        except Exception:  # noqa: BLE001 - some models raise NotImplementedError here
            dec = None
    if dec is None or not isinstance(getattr(dec, "layers", None), torch.nn.ModuleList):
        dec = getattr(model, "model", model)
    layers = getattr(dec, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise error(
            f"{type(model).__name__}: cannot find the decoder layers (expected model.model.layers or "
            f"get_decoder().layers); this architecture needs backend=vllm or a small adapter."
        )
    return dec, layers


class _StopForward(Exception):
    """Raised by the prefill hook on the last needed layer: nothing after it (final norm, LM head) runs."""


class _LayerHooks:
    """Forward hooks on the modules that produce layer ids ``ids`` (id 0: embeddings, id k: layer k-1)."""

    def __init__(self, model, error: type[Exception]) -> None:
        cfg = text_config(model.config)
        self.error = error
        self.num_hidden_layers = int(cfg.num_hidden_layers)
        self.hidden_size = int(cfg.hidden_size)
        self.decoder, self.layers = decoder_layers(model, error)
        if len(self.layers) != self.num_hidden_layers:
            raise error(
                f"target config says num_hidden_layers = {self.num_hidden_layers} but the model has "
                f"{len(self.layers)} decoder layers; the layer ids would not mean what they say. Fix the "
                f"model's config.json (or the model)."
            )
        self._handles: list = []

    def _module(self, layer_id: int) -> torch.nn.Module:
        return self.decoder.embed_tokens if layer_id == 0 else self.layers[layer_id - 1]

    def _register(self, layer_id: int, fn) -> None:
        self._handles.append(self._module(layer_id).register_forward_hook(fn))

    def close(self) -> None:
        """Remove the hooks (the model behaves as before)."""
        for h in self._handles:
            h.remove()
        self._handles = []


class PrefillCapture(_LayerHooks):
    """Prefill-only forward of the target's decoder that keeps only the stored layers.

    Forward hooks on decoder layers ``k - 1`` (aux id ``k``) and ``N - 1`` (id ``N``, before the final
    norm) copy their outputs into one buffer ``[batch, seq, n_aux + 1, hidden]`` in the storage
    dtype; the hook on the last needed layer stops the forward, so the final norm and the LM head
    never run. No KV cache (``use_cache=False``), under ``torch.inference_mode()``.

    Args:
        model: a transformers causal LM in eval mode (any device/dtype).
        aux_layer_ids: aux ids (validated by :func:`resolve_layer_ids`; None = default).
        storage_dtype: dtype of the returned hidden states (e.g. ``torch.bfloat16``).
        error: the exception class raised (the calling stage's).

    Attributes:
        aux_layer_ids, stored_layers (aux + [N]), num_hidden_layers (N), hidden_size (H), device.

    Raises:
        error: the config's ``num_hidden_layers`` disagrees with the model's decoder layers; a
            captured tensor whose last dimension is not ``hidden_size``; bad aux ids.
    """

    def __init__(self, model, aux_layer_ids: Sequence[int] | None, storage_dtype: torch.dtype,
                 error: type[Exception] = ValueError) -> None:
        super().__init__(model, error)
        self.aux_layer_ids = resolve_layer_ids(aux_layer_ids, self.num_hidden_layers, error=error)
        self.stored_layers = [*self.aux_layer_ids, self.num_hidden_layers]
        self.storage_dtype = storage_dtype
        self.device = next(model.parameters()).device
        self._buf: torch.Tensor | None = None
        last_needed = max(self.stored_layers)
        for slot, k in enumerate(self.stored_layers):
            self._register(k, partial(self._hook, slot, k == last_needed))

    @property
    def num_slots(self) -> int:
        """``n_aux + 1``."""
        return len(self.stored_layers)

    def _hook(self, slot: int, last: bool, module, args, output) -> None:
        if self._buf is None:  # the model is used outside capture(): do nothing
            return
        h = output[0] if isinstance(output, tuple) else output
        if h.shape[-1] != self.hidden_size:
            raise self.error(
                f"decoder layer {self.stored_layers[slot] - 1} returned hidden size {h.shape[-1]} but the "
                f"target config says hidden_size = {self.hidden_size}"
            )
        self._buf[:, :, slot].copy_(h)
        if last:
            raise _StopForward

    @torch.inference_mode()
    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run one right-padded batch and return its stored layers.

        Args:
            input_ids: int64 ``[batch, seq]`` on ``self.device``, right-padded.
            attention_mask: ``[batch, seq]`` (1 = token, 0 = padding) or None when nothing is padded.

        Returns:
            torch.Tensor: ``[batch, seq, n_aux + 1, hidden]`` in the storage dtype on ``self.device``;
            rows at padded positions are meaningless (slice each sample to its true length).
        """
        b, t = input_ids.shape
        self._buf = torch.empty(b, t, self.num_slots, self.hidden_size, dtype=self.storage_dtype,
                                device=input_ids.device)
        try:
            self.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _StopForward:
            pass
        else:
            raise self.error("the forward ended without reaching the last stored layer's hook")
        finally:
            out, self._buf = self._buf, None
        return out


HiddenStateCapture = PrefillCapture


class CachedCapture(_LayerHooks):
    """The whole target with forward hooks that capture aux hidden states, over a KV cache.

    Ids may be any of ``0..N`` (0 = embedding output; N = last decoder layer before the final norm),
    in any order (the order of concatenation; vLLM uses ascending order, which Stage 5's diagnosis
    checks). Used for offline decoding: each call feeds the new tokens only.

    Args:
        model: transformers Llama-family causal LM.
        aux_layer_ids: ids to capture, in the order they are concatenated.
        error: the exception class raised (the calling stage's).

    Raises:
        error: an id outside ``[0, N]``.
    """

    def __init__(self, model, aux_layer_ids: Sequence[int], error: type[Exception] = ValueError) -> None:
        super().__init__(model, error)
        self.model = model
        self.ids = [int(i) for i in aux_layer_ids]
        n = self.num_hidden_layers
        bad = [i for i in self.ids if i < 0 or i > n]
        if bad:
            raise error(f"aux layer ids {bad} are outside [0, {n}] for a target with {n} layers")
        self._store: dict[int, Any] = {}
        for i in sorted(set(self.ids)):
            self._register(i, partial(self._hook, i))

    def _hook(self, layer_id: int, module, args, output) -> None:
        self._store[layer_id] = output[0] if isinstance(output, tuple) else output

    def forward(self, input_ids: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """One target forward over new tokens with a KV cache.

        Args:
            input_ids: int64 ``[1, q]`` new tokens (positions continue the cache).
            cache: transformers ``DynamicCache`` (updated in place).

        Returns:
            ``(logits, aux)``: float ``[q, V]`` and ``[q, n_aux * H]`` (target dtype).
        """
        self._store.clear()
        out = self.model(input_ids=input_ids, past_key_values=cache, use_cache=True)
        aux = torch.cat([self._store[i][0] for i in self.ids], dim=-1)
        return out.logits[0], aux
