"""Stage 3's computation: token-budget batches, Stage 2's rows in memory, the extraction loop.

The capture itself is :mod:`eagle3.hooks` (layer-id convention there); the files it produces are
:mod:`eagle3.contracts.hidden_states`. This module needs only torch, numpy, pyarrow and safetensors
(the GPU benchmark imports it alone).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from eagle3.contracts.hidden_states import NonFiniteError, SampleWriter, first_non_finite, sample_relpath
from eagle3.errors import ExtractError
from eagle3.hooks import PrefillCapture

__all__ = ["plan_batches", "pad_batch", "TokenizedRows", "finite_flags", "to_host", "extract_batches"]


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


def pad_batch(rows: TokenizedRows, batch: Sequence[int], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
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


class TokenizedRows:
    """Stage 2's ``train.parquet`` (columns ``id``, ``source``, ``input_ids``, ``loss_mask``) in memory.

    Token ids and loss masks are kept as two flat numpy arrays plus offsets (no per-row Python lists).

    Attributes:
        path: the parquet file. ids: sample ids (list[str]). sources: list[str].
        lengths: int64 numpy ``[rows]`` token counts.

    Raises:
        ExtractError: missing file, missing column, a null row, or a loss mask whose length differs from
            its input_ids (the message names the file, row and id).
    """

    COLUMNS = ("id", "source", "input_ids", "loss_mask")

    def __init__(self, path: str | Path) -> None:
        import pyarrow.compute as pc

        from eagle3.contracts import tokenized
        from eagle3.errors import VocabError

        self.path = Path(path)
        if not self.path.is_file():
            raise ExtractError(
                f"{self.path} does not exist: Stage 3 reads Stage 2's tokenized samples. Run stage 2 "
                f"(`eagle3 run PARAMS --stages 2`) first."
            )
        try:  # the split's one reader (columns checked there)
            table = tokenized.read_table(self.path, columns=list(self.COLUMNS))
        except VocabError as exc:
            raise ExtractError(str(exc)) from None
        self.ids = [str(x) for x in table.column("id").to_pylist()]
        self.sources = [str(x) for x in table.column("source").to_pylist()]
        cols = {}
        for name in ("input_ids", "loss_mask"):
            arr = table.column(name).combine_chunks()
            if arr.null_count:
                row = int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
                raise ExtractError(f"{self.path}: row {row} (id {self.ids[row]}): column {name} is null")
            lens = pc.list_value_length(arr).to_numpy(zero_copy_only=False).astype(np.int64)
            cols[name] = (arr.flatten().to_numpy(zero_copy_only=False), lens)
        self.lengths = cols["input_ids"][1]
        bad = np.flatnonzero(cols["loss_mask"][1] != self.lengths)
        if bad.size:
            r = int(bad[0])
            raise ExtractError(
                f"{self.path}: row {r} (id {self.ids[r]}): loss_mask has {cols['loss_mask'][1][r]} entries "
                f"but input_ids has {self.lengths[r]}"
            )
        empty = np.flatnonzero(self.lengths == 0)
        if empty.size:
            r = int(empty[0])
            raise ExtractError(f"{self.path}: row {r} (id {self.ids[r]}): input_ids is empty")
        self._ids_flat = np.array(cols["input_ids"][0], dtype=np.int64)  # owned, writable copies
        self._mask_flat = np.array(cols["loss_mask"][0], dtype=np.int8)
        self._offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)

    @classmethod
    def from_lists(cls, ids: Sequence[str], input_ids: Sequence[Sequence[int]],
                   loss_mask: Sequence[Sequence[int]] | None = None, source: str = "memory") -> TokenizedRows:
        """Rows held in memory (no parquet file; used by the benchmark). Loss masks default to all ones."""
        self = cls.__new__(cls)
        self.path = Path(f"<{source}>")
        self.ids = [str(x) for x in ids]
        self.sources = [source] * len(self.ids)
        self.lengths = np.array([len(x) for x in input_ids], dtype=np.int64)
        self._ids_flat = np.concatenate([np.asarray(x, dtype=np.int64) for x in input_ids]) if len(input_ids) else np.zeros(0, np.int64)
        masks = loss_mask if loss_mask is not None else [np.ones(len(x), np.int8) for x in input_ids]
        self._mask_flat = np.concatenate([np.asarray(x, dtype=np.int8) for x in masks]) if len(masks) else np.zeros(0, np.int8)
        self._offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        return self

    def __len__(self) -> int:
        return len(self.ids)

    def tokens(self, row: int) -> np.ndarray:
        """int64 ``[seq]`` token ids of ``row``."""
        return self._ids_flat[self._offsets[row]: self._offsets[row + 1]]

    def loss_mask(self, row: int) -> np.ndarray:
        """int8 ``[seq]`` loss mask of ``row`` (1 = supervised)."""
        return self._mask_flat[self._offsets[row]: self._offsets[row + 1]]

    @property
    def total_tokens(self) -> int:
        return int(self.lengths.sum())

    def fingerprint(self) -> str:
        """sha256 (16 hex) of ids, token ids and loss masks: which data the stored files belong to."""
        h = hashlib.sha256()
        h.update("\n".join(self.ids).encode())
        h.update(self.lengths.tobytes())
        h.update(self._ids_flat.tobytes())
        h.update(self._mask_flat.tobytes())
        return h.hexdigest()[:16]

    def check_max_len(self, max_seq_len: int, field: str = "vocab.max_seq_len") -> None:
        """Raise ExtractError naming the first row longer than ``max_seq_len`` tokens."""
        over = np.flatnonzero(self.lengths > max_seq_len)
        if over.size:
            r = int(over[0])
            raise ExtractError(
                f"{self.path}: row {r} (id {self.ids[r]}) has {int(self.lengths[r])} tokens, more than "
                f"{field} = {max_seq_len} ({over.size} row(s) too long). Re-run Stage 2 with the same "
                f"max_seq_len, or raise {field}."
            )



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


def extract_batches(capture: PrefillCapture, rows: TokenizedRows, batches: Sequence[Sequence[int]],
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
                       "loss_mask": torch.from_numpy(rows.loss_mask(r).copy()),
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
