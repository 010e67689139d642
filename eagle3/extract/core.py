"""Stage 3's computation: token-budget batches, Stage 2's rows in memory, the extraction loop.

The capture itself is :mod:`eagle3.hooks` (layer-id convention there); the files it produces are
:mod:`eagle3.contracts.hidden_states`. This module needs only torch, numpy, pyarrow and safetensors
(the GPU benchmark imports it alone).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from eagle3.contracts.hidden_states import (
    SCALES,
    NonFiniteError,
    SampleWriter,
    first_non_finite,
    sample_relpath,
    storage_tensors,
)
from eagle3.contracts.tokenized import TokenizedSplit
from eagle3.hooks import PrefillCapture, host_to_device

__all__ = ["BATCHINGS", "resolve_batching", "plan_batches", "consecutive_batches", "batch_cost", "pad_batch", "pack_batch", "finite_flags",
           "finite_flags_packed", "CapturedBatch", "forward_batch", "to_host", "extract_batches"]

BATCHINGS = ("packed", "padded")
"""The two batch layouts. ``packed``: a batch's samples back to back in one row, per-sample position ids,
document-causal attention (:meth:`eagle3.hooks.PrefillCapture.capture_packed`): no compute on padding
and no mask. ``padded``: right-padded rows with an attention mask (the reference the packed states
are tested against, and the layout for targets that cannot run packed, e.g. sliding-window attention)."""


def resolve_batching(requested: str, config) -> str:
    """``extract.batching`` for a target config: ``auto`` is ``packed`` unless the config asks for
    sliding-window attention (``sliding_window`` with ``use_sliding_window`` not False, or a
    ``layer_types`` entry naming it), which the packed attention does not implement.

    Args:
        requested: ``auto``, ``packed`` or ``padded``. config: the target's text config.

    Returns:
        str: ``packed`` or ``padded`` (an explicit choice is returned as it is; a target that cannot
        run packed then fails in :meth:`eagle3.hooks.PrefillCapture.capture_packed` with the reason).
    """
    if requested != "auto":
        return requested
    sliding = bool(getattr(config, "sliding_window", None)) and getattr(config, "use_sliding_window", True) is not False
    sliding = sliding or any("sliding" in str(t) for t in (getattr(config, "layer_types", None) or ()))
    return "padded" if sliding else "packed"


def plan_batches(lengths: Sequence[int], token_budget: int, packed: bool = False) -> list[list[int]]:
    """Group sample indices into batches of at most ``token_budget`` tokens.

    Samples are sorted by length, longest first (ties by index), and cut greedily: padded batches
    keep ``len(batch) * max_len(batch) <= token_budget`` (the padded tokens), packed ones
    ``sum(lengths) <= token_budget`` (the real tokens: nothing is padded). A sample longer than the
    budget gets a batch of its own. Longest-first makes the first batches the heaviest: an
    out-of-memory shows at once and the calibration projects conservatively. Deterministic: the
    same lengths give the same plan.

    Returns:
        list[list[int]]: indices into ``lengths``; each batch's first index is its longest sample.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    batches: list[list[int]] = []
    cur: list[int] = []
    cur_max = cur_sum = 0
    for i in order:
        length = int(lengths[i])
        m = max(cur_max, length)
        cost = cur_sum + length if packed else m * (len(cur) + 1)
        if cur and cost > token_budget:
            batches.append(cur)
            cur, m, cur_sum = [], length, 0
        cur.append(i)
        cur_max = m
        cur_sum += length
    if cur:
        batches.append(cur)
    return batches


def consecutive_batches(lengths: Sequence[int], order: Sequence[int], token_budget: int, packed: bool) -> list[list[int]]:
    """Cut ``order`` (row indices, kept in that order: online training's sample order) into consecutive
    batches of at most ``token_budget`` tokens (real tokens when packed, ``len x longest`` when padded);
    a row longer than the budget gets a batch of its own."""
    batches: list[list[int]] = []
    cur: list[int] = []
    m = tot = 0
    for r in order:
        n = int(lengths[r])
        if cur and (tot + n if packed else max(m, n) * (len(cur) + 1)) > token_budget:
            batches.append(cur)
            cur, m, tot = [], 0, 0
        cur.append(int(r))
        m, tot = max(m, n), tot + n
    if cur:
        batches.append(cur)
    return batches


def batch_cost(lengths: Sequence[int], batch: Sequence[int], packed: bool) -> int:
    """Tokens a batch computes: its real tokens when packed, ``len(batch) x longest`` when padded."""
    lens = [int(lengths[r]) for r in batch]
    return sum(lens) if packed else len(lens) * max(lens)


def pad_batch(rows: TokenizedSplit, batch: Sequence[int], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """Right-padded ``(input_ids [B, T] int64, attention_mask [B, T] int64 or None, lengths)`` on CPU.

    The mask is None when every sample has the full length (no padding in the batch).
    """
    lens = [int(rows.lengths[r]) for r in batch]
    t = max(lens)
    ids = torch.full((len(batch), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), t), dtype=torch.long)
    for j, r in enumerate(batch):
        ids[j, : lens[j]] = torch.from_numpy(rows.tokens(r))
        mask[j, : lens[j]] = 1
    return ids, (None if min(lens) == t else mask), lens


def pack_batch(rows: TokenizedSplit, batch: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
    """``(input_ids [sum(lengths)] int64 on CPU, lengths)``: the batch's samples back to back."""
    lens = [int(rows.lengths[r]) for r in batch]
    return torch.from_numpy(np.concatenate([rows.tokens(r) for r in batch]).astype(np.int64, copy=False)), lens


def finite_flags(hs: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """bool ``[B]`` on ``hs``'s device: sample ``b`` of a padded ``hs [B, T, ...]`` has no NaN/Inf in
    its real (unpadded) tokens."""
    fin = torch.isfinite(hs).flatten(2).all(-1)  # [B, T]
    if mask is not None:
        fin = fin | (mask == 0)
    return fin.all(-1)


def finite_flags_packed(hs: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """bool ``[n]`` on ``hs``'s device: sample ``i`` of a packed ``hs [tokens, ...]`` has no NaN/Inf.

    One reduction over the whole row and a cumulative count of bad tokens read at the sample
    boundaries (no per-sample kernel launch, no host sync).
    """
    bad = (~torch.isfinite(hs).flatten(1).all(-1)).to(torch.int32)  # [tokens]
    csum = torch.nn.functional.pad(bad.cumsum(0), (1, 0))
    ends = host_to_device(torch.from_numpy(np.cumsum([0, *lengths])), hs.device)
    return (csum[ends[1:]] - csum[ends[:-1]]) == 0


@dataclass
class CapturedBatch:
    """One batch through the hooked target.

    Attributes:
        hs: packed ``[tokens, slots, hidden]`` or padded ``[B, T, slots, hidden]`` (storage dtype, device).
        finite: bool ``[B]`` (device): each sample's states are all finite (before any quantization).
        lengths: the samples' lengths. offsets: packed start of each sample (None when padded).
        mask: the padded batch's attention mask (None when packed or unpadded).
        scales: fp8 storage: float32 ``[..., slots, 1]`` beside ``hs`` (same leading layout), else None.
    """

    hs: torch.Tensor
    finite: torch.Tensor
    lengths: list[int]
    offsets: list[int] | None
    mask: torch.Tensor | None = None
    scales: torch.Tensor | None = None

    def quantize(self, dtype: torch.dtype) -> CapturedBatch:
        """The states as stored in ``dtype`` (:func:`eagle3.contracts.hidden_states.storage_tensors`:
        a cast, or fp8 codes and their scales), on the device; ``finite`` stays that of the capture."""
        if dtype == self.hs.dtype and self.scales is None:
            return self
        t = storage_tensors(self.hs, dtype)
        return CapturedBatch(t["hidden_states"], self.finite, self.lengths, self.offsets, self.mask, t.get(SCALES))

    def sample(self, j: int, hs: torch.Tensor | None = None) -> torch.Tensor:
        """Sample ``j``'s ``[len, slots, hidden]`` (a view) of ``hs`` (default ``self.hs``; e.g. the host copy)."""
        t = self.hs if hs is None else hs
        if self.offsets is None:
            return t[j, : self.lengths[j]]
        return t[self.offsets[j]: self.offsets[j] + self.lengths[j]]


def forward_batch(capture: PrefillCapture, rows: TokenizedSplit, batch: Sequence[int], *, packed: bool,
                  pad_id: int = 0) -> CapturedBatch:
    """Run the rows ``batch`` through ``capture`` in the chosen layout (:data:`BATCHINGS`).

    Args:
        capture: the hooked target. rows: the tokenized samples. batch: row indices.
        packed: one packed row (:meth:`PrefillCapture.capture_packed`) or a right-padded batch.
        pad_id: the padding token (padded layout only; masked out, so any id works).

    Returns:
        CapturedBatch: the states on the device and per-sample finite flags (nothing synchronised).
    """
    dev = capture.device
    if packed:
        ids, lens = pack_batch(rows, batch)
        hs = capture.capture_packed(host_to_device(ids, dev), lens)
        offs = np.cumsum([0, *lens[:-1]]).tolist()
        return CapturedBatch(hs, finite_flags_packed(hs, lens), lens, offs)
    ids, mask, lens = pad_batch(rows, batch, pad_id)
    mask = host_to_device(mask, dev) if mask is not None else None
    hs = capture.capture(host_to_device(ids, dev), mask)
    return CapturedBatch(hs, finite_flags(hs, mask), lens, None, mask)


def to_host(*tensors: torch.Tensor | None):
    """Start copying a captured batch's tensors (states, finite flags, fp8 scales; None passes) to the host.

    On CUDA the copies run on a side stream of their own (:func:`_copy_stream`), after the work already
    queued on the current stream: the device-to-host DMA (about 1 GB per 32K-token batch of an 8B
    target's states) overlaps the next batch's forward instead of queueing behind it on the compute
    stream. Each device tensor is marked as used by that stream (``record_stream``), so the caching
    allocator does not hand its memory to the next forward before the copy has read it.

    Returns:
        tuple: ``(*host_tensors, ready)``: on CUDA pinned host tensors being filled asynchronously and
        the CUDA event that completes them (``ready.synchronize()`` before reading; the writer threads
        do); on CPU the inputs themselves and ``ready = None``.
    """
    cuda = [t for t in tensors if t is not None and t.device.type == "cuda"]
    if not cuda:
        return (*tensors, None)
    device = cuda[0].device
    stream = _copy_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    out = []
    with torch.cuda.stream(stream):
        for t in tensors:
            if t is None:
                out.append(None)
                continue
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            h.copy_(t, non_blocking=True)
            t.record_stream(stream)
            out.append(h)
        ev = torch.cuda.Event()
        ev.record(stream)
    return (*out, ev)


_COPY_STREAMS: dict[int, torch.cuda.Stream] = {}


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The device-to-host copy stream of a CUDA device (one per device and process, made on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _COPY_STREAMS:
        _COPY_STREAMS[index] = torch.cuda.Stream(device=index)
    return _COPY_STREAMS[index]


def _queue_new_samples(writer: SampleWriter | None, rows: TokenizedSplit, batch: Sequence[int], cb: CapturedBatch,
                       host: tuple, skip: set[int] | frozenset, shard_size: int,
                       stored_layers: Sequence[int]) -> tuple[int, int]:
    """Queue the samples of ``batch`` not in ``skip`` on ``writer`` (their host copies ``host`` from
    :func:`to_host` may still be filling; the writer waits for ``ready``). Without a writer a CPU
    batch's finite flags are checked here. Returns ``(new samples, their tokens)``."""
    hs_host, fin, sc_host, ready = host
    n_new = t_new = 0
    for j, r in enumerate(batch):
        if r in skip:
            continue
        n_new += 1
        t_new += cb.lengths[j]
        if writer is None:
            if ready is None and not bool(fin[j]):
                raise NonFiniteError(f"non-finite hidden states in sample id {rows.ids[r]} (row {r}): "
                                     f"{first_non_finite(cb.sample(j, hs_host), stored_layers)}")
            continue
        tensors = {"token_ids": torch.from_numpy(rows.tokens(r).copy()),
                   "loss_mask": torch.from_numpy(rows.mask(r).copy()),
                   "hidden_states": cb.sample(j, hs_host)}
        if sc_host is not None:
            tensors[SCALES] = cb.sample(j, sc_host)
        writer.submit({"row": r, "id": rows.ids[r], "file": sample_relpath(r, shard_size)}, tensors,
                      finite=fin[j], ready=ready)
    return n_new, t_new


def extract_batches(capture: PrefillCapture, rows: TokenizedSplit, batches: Sequence[Sequence[int]],
                    writer: SampleWriter | None, *, shard_size: int, skip: set[int] | frozenset = frozenset(),
                    pad_id: int = 0, on_batch: Callable[[int, int, int], None] | None = None,
                    packed: bool = False, storage: torch.dtype | None = None) -> dict:
    """Run ``batches`` through ``capture`` and queue every sample not in ``skip`` on ``writer``.

    A batch is always computed whole (even when some of its rows are done) so that a resumed run
    computes every sample in the same batch shape as an uninterrupted one: identical tensors.

    Args:
        capture: the hooked target.
        rows: the tokenized samples.
        batches: lists of row indices (from :func:`plan_batches`).
        writer: where samples go (None: compute only, e.g. a benchmark).
        shard_size: rows per shard folder (:func:`eagle3.contracts.hidden_states.sample_relpath`).
        skip: rows whose files are already done.
        on_batch: ``on_batch(new_samples, new_tokens, computed_tokens)`` after each batch.
        packed: the batch layout (:data:`BATCHINGS`); must match how ``batches`` were planned.
        storage: the files' dtype (default: the capture's); ``float8_e4m3fn`` quantizes on the device
            with per-token scales (:func:`eagle3.contracts.hidden_states.quantize_fp8`).

    Returns:
        dict: ``samples``, ``tokens`` (new), ``computed_tokens`` (padding included), ``seconds``
        (loop wall time, the writer drained).

    Raises:
        NonFiniteError / ExtractError: from the writer (NaN/Inf sample, disk full).
    """
    t0 = time.perf_counter()
    new_samples = new_tokens = computed = 0
    dev = capture.device
    storage = storage or capture.storage_dtype
    for batch in batches:
        cb = forward_batch(capture, rows, batch, packed=packed, pad_id=pad_id).quantize(storage)
        host = to_host(cb.hs, cb.finite, cb.scales)  # fp8: half the bytes cross PCIe
        n_new, t_new = _queue_new_samples(writer, rows, batch, cb, host, skip, shard_size, capture.stored_layers)
        ready = host[-1]
        if ready is not None and writer is None:
            ready.synchronize()
        lens = cb.lengths
        cost = sum(lens) if packed else len(lens) * max(lens)
        new_samples += n_new
        new_tokens += t_new
        computed += cost
        if on_batch is not None:
            on_batch(n_new, t_new, cost)
    if writer is not None:
        writer.close()
    elif dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return {"samples": new_samples, "tokens": new_tokens, "computed_tokens": computed,
            "seconds": time.perf_counter() - t0}
