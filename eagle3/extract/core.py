"""Stage 3's computation: token-budget batches, Stage 2's rows in memory, the extraction loop.

The capture itself is :mod:`eagle3.hooks` (layer-id convention there); the files it produces are
:mod:`eagle3.contracts.hidden_states`. This module needs only torch, numpy, pyarrow and safetensors
(the GPU benchmark imports it alone).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from eagle3.contracts.hidden_states import NonFiniteError, SampleWriter, first_non_finite, sample_relpath
from eagle3.contracts.tokenized import TokenizedSplit
from eagle3.hooks import PrefillCapture

__all__ = ["plan_batches", "pad_batch", "finite_flags", "to_host", "extract_batches"]


def plan_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Group sample indices into batches of at most ``token_budget`` padded tokens.

    Samples are sorted by length, longest first (ties by index), and cut greedily so that
    ``len(batch) * max_len(batch) <= token_budget``; a sample longer than the budget gets a batch of
    its own. Longest-first makes the first batches the heaviest: an out-of-memory shows at once and
    the calibration projects conservatively. Deterministic: the same lengths give the same plan.

    Returns:
        list[list[int]]: indices into ``lengths``; each batch's first index is its longest sample.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    batches: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in order:
        length = int(lengths[i])
        m = max(cur_max, length)
        if cur and m * (len(cur) + 1) > token_budget:
            batches.append(cur)
            cur, m = [], length
        cur.append(i)
        cur_max = m
    if cur:
        batches.append(cur)
    return batches


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



# ----------------------------------------------------------------------------------------------
# Input rows (Stage 2's tokenized parquet)
# ----------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------
# The extraction loop (used by the stage, online mode and the benchmark)
# ----------------------------------------------------------------------------------------------


def finite_flags(hs: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """bool ``[B]`` on ``hs``'s device: sample ``b`` has no NaN/Inf in its real (unpadded) tokens."""
    fin = torch.isfinite(hs).flatten(2).all(-1)  # [B, T]
    if mask is not None:
        fin = fin | (mask == 0)
    return fin.all(-1)


def to_host(hs: torch.Tensor, mask: torch.Tensor | None, lens: Sequence[int]):
    """Start copying a captured batch to the host.

    Args:
        hs: ``[B, T, slots, hidden]`` from :meth:`eagle3.hooks.PrefillCapture.capture`.
        mask: ``[B, T]`` attention mask or None. lens: true lengths.

    Returns:
        tuple: ``(hs_host, finite, ready)``: on CUDA a pinned host tensor and a bool ``[B]`` flag tensor
        being filled asynchronously, and the CUDA event that completes them (``ready.synchronize()``
        before reading; the writer threads do); on CPU the inputs themselves and ``ready = None``.
    """
    fin = finite_flags(hs, mask)
    if hs.device.type != "cuda":
        return hs, fin, None
    host = torch.empty(hs.shape, dtype=hs.dtype, pin_memory=True)
    host.copy_(hs, non_blocking=True)
    fin_host = torch.empty(fin.shape, dtype=torch.bool, pin_memory=True)
    fin_host.copy_(fin, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record()
    return host, fin_host, ev


def extract_batches(capture: PrefillCapture, rows: TokenizedSplit, batches: Sequence[Sequence[int]],
                    writer: SampleWriter | None, *, shard_size: int, skip: set[int] | frozenset = frozenset(),
                    pad_id: int = 0, on_batch: Callable[[int, int, int], None] | None = None) -> dict:
    """Run ``batches`` through ``capture`` and queue every sample not in ``skip`` on ``writer``.

    A batch is always computed whole (even when some of its rows are done) so that a resumed run
    computes every sample in the same batch shape as an uninterrupted one: identical tensors.

    Args:
        capture: the hooked target.
        rows: the tokenized samples.
        batches: lists of row indices (from :func:`plan_batches`).
        writer: where samples go (None: compute only, e.g. a benchmark).
        shard_size: rows per ``rows_*`` folder.
        skip: rows whose files are already done.
        on_batch: ``on_batch(new_samples, new_tokens, computed_tokens)`` after each batch.

    Returns:
        dict: ``samples``, ``tokens`` (new), ``computed_tokens``, ``seconds`` (loop wall time,
        the writer drained).

    Raises:
        NonFiniteError / ExtractError: from the writer (NaN/Inf sample, disk full).
    """
    t0 = time.perf_counter()
    new_samples = new_tokens = computed = 0
    dev = capture.device
    for batch in batches:
        ids, mask, lens = pad_batch(rows, batch, pad_id)
        ids = ids.to(dev, non_blocking=True)
        mask = mask.to(dev, non_blocking=True) if mask is not None else None
        hs = capture.capture(ids, mask)
        hs_host, fin, ready = to_host(hs, mask, lens)
        n_new = t_new = 0
        for j, r in enumerate(batch):
            if r in skip:
                continue
            n_new += 1
            t_new += lens[j]
            if writer is None:
                if ready is None and not bool(fin[j]):
                    raise NonFiniteError(f"non-finite hidden states in sample id {rows.ids[r]} (row {r}): "
                                         f"{first_non_finite(hs_host[j, : lens[j]], capture.stored_layers)}")
                continue
            tensors = {"token_ids": torch.from_numpy(rows.tokens(r).copy()),
                       "loss_mask": torch.from_numpy(rows.mask(r).copy()),
                       "hidden_states": hs_host[j, : lens[j]]}
            writer.submit({"row": r, "id": rows.ids[r], "file": sample_relpath(r, shard_size)}, tensors,
                          finite=fin[j], ready=ready)
        if ready is not None and writer is None:
            ready.synchronize()
        new_samples += n_new
        new_tokens += t_new
        computed += sum(lens)
        if on_batch is not None:
            on_batch(n_new, t_new, sum(lens))
    if writer is not None:
        writer.close()
    elif dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return {"samples": new_samples, "tokens": new_tokens, "computed_tokens": computed,
            "seconds": time.perf_counter() - t0}
