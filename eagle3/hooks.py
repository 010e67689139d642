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

* :class:`PrefillCapture` (alias :data:`HiddenStateCapture`): one batch, no KV cache, the forward
  stopped at the last needed layer (final norm and LM head never run) — Stage 3 (extract) and online
  training. Two layouts: :meth:`PrefillCapture.capture_packed` (the default: the samples
  concatenated into one row with per-sample position ids and a document-causal attention, so no
  compute goes to padding; returns ``[tokens, n_aux + 1, hidden]``) and
  :meth:`PrefillCapture.capture` (right-padded ``[batch, seq]`` with an attention mask; returns
  ``[batch, seq, n_aux + 1, hidden]``);
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
    "host_to_device",
    "PACKED_ATTENTION",
    "packed_attention_kernel",
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


# ----------------------------------------------------------------------------------------------
# Packed (unpadded) prefill: document-causal attention through transformers' attention interface
# ----------------------------------------------------------------------------------------------

PACKED_ATTENTION = "eagle3_packed"
"""The name under which :func:`_packed_attention` is registered in transformers' ``AttentionInterface``
(no mask function: transformers then builds no mask for it): the documented way to plug an attention
kernel into a transformers model (``model.config._attn_implementation`` selects it)."""


def packed_attention_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """The kernel that runs packed attention on ``device`` / ``dtype``.

    * ``"varlen"``: ``torch.nn.attention.varlen.varlen_attn`` (flash attention over
      ``cu_seqlens``, one launch per layer): CUDA with float16/bfloat16 and a torch that has it (a
      tiny call checked against SDPA once per device and dtype);
    * ``"sdpa"``: one ``scaled_dot_product_attention(is_causal=True)`` per sample, no mask (SDPA's
      fastest kernel for the device): everything else (CPU, float32).

    Both give each sample exactly its own causal attention; the linear layers run over the packed
    row either way.
    """
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        key = (str(device), dtype)
        if key not in _VARLEN_OK:
            _VARLEN_OK[key] = _probe_varlen(device, dtype)
        return "varlen" if _VARLEN_OK[key] is None else "sdpa"
    return "sdpa"


_VARLEN_OK: dict = {}


def _probe_varlen(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when ``varlen_attn`` runs here and matches SDPA on two tiny causal documents (GQA 4:2);
    else the reason, printed once (the packed attention then runs one SDPA call per sample)."""
    try:
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(7, 4, 64, device=device, dtype=dtype, generator=g)
        k, v = (torch.randn(7, 2, 64, device=device, dtype=dtype, generator=g) for _ in range(2))
        cu = torch.tensor([0, 3, 7], dtype=torch.int32, device=device)
        out = _varlen_call()(q, k, v, cu, 4, None)
        ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1), is_causal=True,
            enable_gqa=True).transpose(0, 1) for s, e in ((0, 3), (3, 7))])
        err = float((out.float() - ref.float()).abs().max())
        if err > 2e-2:
            raise RuntimeError(f"differs from SDPA by {err}")
    except Exception as exc:  # noqa: BLE001 - any failure means: do not use this kernel, say why
        why = f"{type(exc).__name__}: {str(exc)[:200]}"
        print(f"eagle3: torch.nn.attention.varlen.varlen_attn unusable on {device} ({why}); packed attention "
              f"runs one causal SDPA call per sample", flush=True)
        return why
    return None


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a small host tensor (token ids, position ids, sample bounds) to ``device`` without a host sync.

    On CUDA the tensor is staged in pinned memory first: only a copy from pinned memory is asynchronous
    for certain (a copy from pageable memory, or ``torch.tensor(..., device=)``, may wait for the stream).
    With pageable copies the H200 profile of stage 3 showed two ``cudaStreamSynchronize`` per batch,
    0.3 s each, under ``aten::to``: the host waited for every batch's forward and the GPU idled while
    the next one was prepared (benchmarks/RESULTS.md, extraction vs the unpadded forward: 0.931x ->
    0.937x the unpadded forward with pinned copies). The pinned block returns to PyTorch's
    caching host allocator, which records the copy's event before reusing it. Elsewhere a plain
    ``.to(device)``.

    Args:
        t: a CPU tensor, any dtype and shape. device: the target device.

    Returns:
        torch.Tensor: the same values on ``device`` (on CUDA the copy may still be in flight; work queued
        on the current stream sees it complete).
    """
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class _Packing:
    """What the packed attention needs, passed to every layer through the forward's kwargs.

    Attributes:
        bounds: ``[(start, end), ...]`` per sample in the packed row (host ints: no sync per layer).
        cu_seqlens: int32 ``[n + 1]`` on the device (varlen kernel). max_len: longest sample.
        kernel: ``"varlen"`` or ``"sdpa"`` (:func:`packed_attention_kernel`).
    """

    def __init__(self, lengths: Sequence[int], device: torch.device, kernel: str) -> None:
        ends = [0]
        for n in lengths:
            ends.append(ends[-1] + int(n))
        self.bounds = list(zip(ends[:-1], ends[1:]))
        self.max_len = max(int(n) for n in lengths)
        self.kernel = kernel
        self.cu_seqlens = (host_to_device(torch.tensor(ends, dtype=torch.int32), device)
                           if kernel == "varlen" else None)


def _varlen_call():
    """``varlen_attn`` with causal masking, across its two signatures (``is_causal=`` in torch 2.9-2.10,
    ``window_size=(-1, 0)`` later) and with or without ``enable_gqa`` (the flash kernel takes fewer
    KV heads natively; newer torch asks for the flag)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    names = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in names else {"is_causal": True}
    gqa = "enable_gqa" in names

    def call(q, k, v, cu, max_len, scale):
        kw = dict(causal, scale=scale)
        if gqa:
            kw["enable_gqa"] = q.shape[1] != k.shape[1]
        return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kw)

    return call


_VARLEN = None


def _packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      eagle3_packing: _Packing | None = None, **kwargs):
    """transformers attention function for one packed row: each sample attends causally to itself only.

    Args:
        query: ``[1, heads, tokens, head_dim]``; key/value: ``[1, kv_heads, tokens, head_dim]``
            (after RoPE with per-sample position ids).
        attention_mask: ignored (None: transformers builds no mask for an attention without a mask function).
        eagle3_packing: the sample boundaries (:class:`_Packing`).

    Returns:
        ``(out [1, tokens, heads, head_dim], None)`` as transformers' own attention functions.

    Raises:
        RuntimeError: called without ``eagle3_packing`` (the model was used outside
            :meth:`PrefillCapture.capture_packed` while switched to this implementation).
    """
    global _VARLEN
    p = eagle3_packing
    if p is None:
        raise RuntimeError(f"{PACKED_ATTENTION} attention called without sample boundaries")
    if p.kernel == "varlen":
        if _VARLEN is None:
            _VARLEN = _varlen_call()
        # [1, H, T, D] -> [T, H, D]: a view (the projections were laid out [T, H, D] before the transpose)
        out = _VARLEN(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                      p.cu_seqlens, p.max_len, scaling)
        return out.unsqueeze(0), None
    gqa = query.shape[1] != key.shape[1]
    out = torch.empty(query.shape[0], query.shape[2], query.shape[1], value.shape[-1], dtype=query.dtype,
                      device=query.device)
    for s, e in p.bounds:
        o = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True, scale=scaling, enable_gqa=gqa)
        out[:, s:e] = o.transpose(1, 2)
    return out, None


_REGISTERED = False


def _register_packed_attention() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface

    # No mask function is registered (AttentionMaskInterface): for an attention name without one,
    # transformers' mask creation returns None at once ("custom attention without equivalent mask
    # creation", masking_utils._preprocess_mask_arguments). With one, it ran its packed-sequence
    # detection on our position ids, whose `if (...).all()` read a device value: one
    # cudaStreamSynchronize per batch, ~20 ms of GPU idle each on the H200 (benchmarks/RESULTS.md,
    # the last host sync of the packed forward).
    AttentionInterface.register(PACKED_ATTENTION, _packed_attention)
    _REGISTERED = True


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
    norm) copy their outputs into one buffer ``[batch, seq, n_aux + 1, hidden]`` (packed: batch 1) in the storage
    dtype; the hook on the last needed layer stops the forward, so the final norm and the LM head
    never run. No KV cache (``use_cache=False``), under ``torch.inference_mode()``.

    Args:
        model: a transformers causal LM in eval mode (any device/dtype).
        aux_layer_ids: aux ids (validated by :func:`resolve_layer_ids`; None = default).
        storage_dtype: dtype of the returned hidden states (e.g. ``torch.bfloat16``).
        error: the exception class raised (the calling stage's).

    Attributes:
        aux_layer_ids, stored_layers (aux + [N]), num_hidden_layers (N), hidden_size (H), device,
        compute_dtype, packed_kernel (:func:`packed_attention_kernel`: what :meth:`capture_packed` runs).

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
        self.compute_dtype = next(model.parameters()).dtype
        self.packed_kernel = packed_attention_kernel(self.device, self.compute_dtype)
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

    def packing_problem(self) -> str | None:
        """Why this target cannot run packed (None when it can).

        Packed attention is plain causal attention within each sample; a layer with a sliding window
        or without causal attention would need more than that.
        """
        for i, layer in enumerate(self.layers):
            attn = getattr(layer, "self_attn", None)
            if attn is None:
                return f"decoder layer {i} has no self_attn module"
            if getattr(attn, "sliding_window", None):
                return f"decoder layer {i} uses sliding-window attention ({attn.sliding_window})"
            if getattr(attn, "is_causal", True) is False:
                return f"decoder layer {i} attention is not causal"
        return None

    def _configs(self) -> list:
        """The config objects whose ``_attn_implementation`` the attention modules read."""
        seen: dict[int, Any] = {id(self.decoder.config): self.decoder.config}
        for layer in self.layers:
            cfg = getattr(getattr(layer, "self_attn", None), "config", None)
            if cfg is not None:
                seen.setdefault(id(cfg), cfg)
        return list(seen.values())

    @torch.inference_mode()
    def capture_packed(self, input_ids: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        """Run several samples packed into one row (no padding) and return their stored layers.

        The samples are concatenated; each gets its own position ids ``0..len-1`` (RoPE as if alone)
        and attends causally to its own tokens only, through :data:`PACKED_ATTENTION` (registered
        in transformers' attention interface and selected for this call only). Every linear layer
        runs over real tokens only. Per sample the result equals :meth:`capture` of that sample (up
        to the rounding of other reduction shapes).

        Args:
            input_ids: int64 ``[tokens]`` (or ``[1, tokens]``) on ``self.device``: the samples back to back.
            lengths: the samples' lengths (sum = tokens).

        Returns:
            torch.Tensor: ``[tokens, n_aux + 1, hidden]`` in the storage dtype on ``self.device``;
            sample ``i`` is rows ``sum(lengths[:i]) : sum(lengths[:i + 1])``.

        Raises:
            error: lengths that do not sum to the tokens; a target that cannot run packed
                (:meth:`packing_problem`).
        """
        ids = input_ids.reshape(1, -1)
        t = ids.shape[1]
        if sum(int(n) for n in lengths) != t or min(int(n) for n in lengths) < 1:
            raise self.error(f"capture_packed: lengths {list(lengths)[:8]}... do not split {t} tokens")
        why = self.packing_problem()
        if why:
            raise self.error(f"this target cannot run packed: {why}; use extract.batching: padded")
        _register_packed_attention()
        packing = _Packing(lengths, ids.device, self.packed_kernel)
        pos = host_to_device(torch.cat([torch.arange(int(n)) for n in lengths]).unsqueeze(0), ids.device)
        cfgs = self._configs()
        before = [c._attn_implementation for c in cfgs]
        self._buf = torch.empty(1, t, self.num_slots, self.hidden_size, dtype=self.storage_dtype, device=ids.device)
        try:
            for c in cfgs:
                c._attn_implementation = PACKED_ATTENTION
            self.decoder(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False,
                         eagle3_packing=packing)
        except _StopForward:
            pass
        else:
            raise self.error("the forward ended without reaching the last stored layer's hook")
        finally:
            for c, b in zip(cfgs, before):
                c._attn_implementation = b
            out, self._buf = self._buf, None
        return out[0]

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
