"""Masked-token frequencies, the coverage curve, and the draft vocabulary mapping (d2t / t2d).

Conventions (docs/DESIGN.md, "Draft vocab mapping", same as speculators'
``speculators/train/vocab_mapping.py::build_vocab_mappings_from_distribution``): count loss-masked
tokens; rank by (-frequency, id); keep the top ``draft_vocab_size`` ids, padding with the lowest
unused ids when the corpus has fewer distinct tokens; sort the kept ids ascending;
``d2t[i] = kept[i] - i`` (int64 offsets: target id = ``i + d2t[i]``); ``t2d`` is a bool mask over
the target vocab with ``t2d.sum() == draft_vocab_size``. A full-size draft vocab has no mapping.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from eagle3.vocab.render import VocabError

__all__ = [
    "VocabMappingError",
    "count_masked_tokens",
    "Coverage",
    "build_vocab_mapping",
    "validate_vocab_mapping",
    "mapping_cache_key",
    "cached_vocab_mapping",
    "COMMON_SIZES",
]

log = logging.getLogger(__name__)

COMMON_SIZES = (8192, 16384, 32768, 65536)


class VocabMappingError(VocabError):
    """A d2t/t2d mapping fails validation (the message says which check and where)."""


# --------------------------------------------------------------------------- counting


def _record_batches(data: Any, batch_rows: int):
    """Arrow record batches holding ``input_ids``/``loss_mask`` (and ``id`` when present)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if isinstance(data, (str, Path)):
        pf = pq.ParquetFile(data)
        cols = [c for c in ("id", "input_ids", "loss_mask") if c in pf.schema_arrow.names]
        yield from pf.iter_batches(batch_size=batch_rows, columns=cols)
        return
    if getattr(data, "_indices", None) is not None:  # a datasets.Dataset after select/shuffle/filter
        data = data.flatten_indices()
    table = getattr(data, "data", data)  # datasets.Dataset -> its arrow table
    table = getattr(table, "table", table)
    if not isinstance(table, pa.Table):
        raise VocabError(f"count_masked_tokens: expected a parquet path, pyarrow Table or datasets.Dataset, got {type(data).__name__}")
    yield from table.to_batches(max_chunksize=batch_rows)


def count_masked_tokens(data: Any, vocab_size: int, batch_rows: int = 65536) -> np.ndarray:
    """Frequency of every target token id over loss-masked positions (vectorized, streaming).

    Args:
        data: a parquet file path, a ``pyarrow.Table`` or a ``datasets.Dataset`` with columns
            ``input_ids`` (list<int>) and ``loss_mask`` (list<int>, 1 = supervised).
        vocab_size: target vocab size V.
        batch_rows: rows per arrow record batch (bounds memory).

    Returns:
        np.ndarray: int64 ``[V]``, ``counts[t]`` = number of supervised positions holding token t.

    Raises:
        VocabError: a row whose ``input_ids`` and ``loss_mask`` lengths differ (row id named), or a
            token id outside ``[0, V)`` (tokenizer / model config mismatch).
    """
    import pyarrow.compute as pc

    counts = np.zeros(vocab_size, dtype=np.int64)
    row0 = 0
    for batch in _record_batches(data, batch_rows):
        ids_col = batch.column(batch.schema.get_field_index("input_ids"))
        mask_col = batch.column(batch.schema.get_field_index("loss_mask"))
        li = pc.list_value_length(ids_col).to_numpy(zero_copy_only=False)
        lm = pc.list_value_length(mask_col).to_numpy(zero_copy_only=False)
        if not np.array_equal(li, lm):
            bad = int(np.flatnonzero(li != lm)[0])
            rid = batch.column(batch.schema.get_field_index("id"))[bad].as_py() if "id" in batch.schema.names else row0 + bad
            raise VocabError(f"row {rid!r}: input_ids has {li[bad]} tokens but loss_mask has {lm[bad]}")
        ids = ids_col.flatten().to_numpy(zero_copy_only=False)
        mask = mask_col.flatten().to_numpy(zero_copy_only=False).astype(bool, copy=False)
        sel = ids[mask]
        if sel.size:
            lo, hi = int(sel.min()), int(sel.max())
            if lo < 0 or hi >= vocab_size:
                raise VocabError(
                    f"token id {hi if hi >= vocab_size else lo} is outside the target vocab [0, {vocab_size}): "
                    "the tokenized data does not belong to this target (tokenizer/config mismatch)"
                )
            counts += np.bincount(sel, minlength=vocab_size)
        row0 += batch.num_rows
    return counts


# --------------------------------------------------------------------------- coverage


@dataclass
class Coverage:
    """Cumulative share of masked-token mass against draft vocab size.

    Attributes:
        counts: int64 ``[V]`` masked-token frequencies.
        order: int64 ``[V]`` token ids ranked by (-count, id) - the draft vocab of size k is
            ``order[:k]`` (padded when k exceeds ``distinct``).
        cumulative: int64 ``[V]``, ``cumulative[k-1]`` = masked tokens covered by the top k.
    """

    counts: np.ndarray
    order: np.ndarray
    cumulative: np.ndarray

    @classmethod
    def from_counts(cls, counts: np.ndarray) -> "Coverage":
        """Rank token ids by (-count, id) and accumulate. ``counts`` int ``[V]``, non-negative."""
        c = np.asarray(counts, dtype=np.int64)
        if c.ndim != 1 or (c < 0).any():
            raise VocabError("token counts must be a 1-D array of non-negative integers")
        order = np.lexsort((np.arange(c.size), -c))
        return cls(c, order, np.cumsum(c[order]))

    @property
    def total(self) -> int:
        """Masked tokens counted."""
        return int(self.cumulative[-1]) if self.cumulative.size else 0

    @property
    def distinct(self) -> int:
        """Distinct token ids among masked tokens."""
        return int(np.count_nonzero(self.counts))

    @property
    def vocab_size(self) -> int:
        return int(self.counts.size)

    def at(self, size: int) -> float:
        """Share of masked tokens whose id is in the top ``size`` (1.0 for ``size >= distinct``)."""
        if self.total == 0:
            return float("nan")
        k = min(max(int(size), 0), self.vocab_size)
        return float(self.cumulative[k - 1] / self.total) if k else 0.0

    def lost(self, size: int) -> int:
        """Masked tokens whose id falls outside a draft vocab of ``size``."""
        k = min(max(int(size), 0), self.vocab_size)
        return self.total - (int(self.cumulative[k - 1]) if k else 0)

    def size_for(self, target: float) -> int:
        """Smallest draft vocab size whose coverage (as :meth:`at` reports it) is >= ``target``.

        Raises:
            VocabError: ``target`` outside (0, 1] or no masked tokens.
        """
        if not 0 < target <= 1:
            raise VocabError(f"vocab.target_coverage must be in (0, 1], got {target}")
        if self.total == 0:
            raise VocabError("no masked tokens: cannot pick a draft vocab size from a coverage target")
        share = self.cumulative / self.total
        return int(min(np.searchsorted(share, target, side="left") + 1, self.distinct))

    def kept_mask(self, size: int) -> np.ndarray:
        """bool ``[V]``: token ids inside the top ``size`` by rank (no padding)."""
        m = np.zeros(self.vocab_size, dtype=bool)
        m[self.order[: min(size, self.distinct)]] = True
        return m


# --------------------------------------------------------------------------- mapping


def validate_vocab_mapping(d2t, t2d, draft_vocab_size: int, target_vocab_size: int, counts=None) -> None:
    """Check a d2t/t2d pair against the conventions (module docstring).

    Checks: dtypes (int64 / bool), lengths (``[draft_vocab_size]`` / ``[target_vocab_size]``),
    kept ids ``i + d2t[i]`` inside ``[0, V)``, strictly increasing (sorted, unique),
    ``t2d.sum() == draft_vocab_size``, ``t2d`` true exactly at the kept ids, and - when ``counts``
    is given - the kept ids contain the top ``min(size, distinct)`` tokens by (-count, id).

    Raises:
        VocabMappingError: the first failed check, with the offending index.
    """
    import torch

    d2t = torch.as_tensor(d2t)
    t2d = torch.as_tensor(t2d)
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        raise VocabMappingError(f"d2t must be int64 and t2d bool, got {d2t.dtype} and {t2d.dtype}")
    if tuple(d2t.shape) != (draft_vocab_size,):
        raise VocabMappingError(f"d2t has shape {tuple(d2t.shape)}, expected ({draft_vocab_size},)")
    if tuple(t2d.shape) != (target_vocab_size,):
        raise VocabMappingError(f"t2d has shape {tuple(t2d.shape)}, expected ({target_vocab_size},)")
    kept = torch.arange(draft_vocab_size, dtype=torch.int64) + d2t
    if kept.numel():
        if int(kept.min()) < 0 or int(kept.max()) >= target_vocab_size:
            i = int(torch.nonzero((kept < 0) | (kept >= target_vocab_size))[0])
            raise VocabMappingError(f"i + d2t[i] = {int(kept[i])} at i={i} is outside [0, {target_vocab_size})")
        steps = kept[1:] - kept[:-1]
        if (steps <= 0).any():
            i = int(torch.nonzero(steps <= 0)[0]) + 1
            raise VocabMappingError(f"kept ids are not strictly increasing at i={i} ({int(kept[i-1])}, {int(kept[i])})")
    if int(t2d.sum()) != draft_vocab_size:
        raise VocabMappingError(f"t2d.sum() = {int(t2d.sum())}, expected {draft_vocab_size}")
    if not bool(t2d[kept].all()):
        raise VocabMappingError("t2d is not true at every kept id i + d2t[i]")
    if counts is not None:
        cov = Coverage.from_counts(np.asarray(counts))
        top = cov.order[: min(draft_vocab_size, cov.distinct)]
        missing = top[~t2d.numpy()[top]]
        if missing.size:
            raise VocabMappingError(f"token id {int(missing[0])} is among the top {draft_vocab_size} but not kept")


def build_vocab_mapping(counts, draft_vocab_size: int):
    """Draft vocab mapping from masked-token counts (speculators' builder, then validated).

    Args:
        counts: int ``[V]`` masked-token frequencies (numpy array, torch tensor or list); V is
            the target vocab size.
        draft_vocab_size: number of draft ids, 1..V.

    Returns:
        tuple: ``(d2t, t2d)`` - ``torch.int64 [draft_vocab_size]`` offsets (target id = i + d2t[i])
        and ``torch.bool [V]`` - or ``(None, None)`` when ``draft_vocab_size == V`` (full size).

    Raises:
        VocabError: ``draft_vocab_size`` outside 1..V, counts not 1-D non-negative.
        VocabMappingError: the built mapping fails :func:`validate_vocab_mapping`.
    """
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    c = np.asarray(counts.cpu() if hasattr(counts, "cpu") else counts, dtype=np.int64)
    if c.ndim != 1 or (c < 0).any():
        raise VocabError("token counts must be a 1-D array of non-negative integers [target_vocab_size]")
    V = int(c.size)
    if not 1 <= int(draft_vocab_size) <= V:
        raise VocabError(f"draft_vocab_size must be in 1..{V} (the target vocab size), got {draft_vocab_size}")
    if int(draft_vocab_size) == V:
        return None, None
    nz = np.flatnonzero(c)
    freq = dict(zip(nz.tolist(), c[nz].tolist()))
    d2t, t2d = build_vocab_mappings_from_distribution(freq, int(draft_vocab_size), V)
    validate_vocab_mapping(d2t, t2d, int(draft_vocab_size), V, counts=c)
    return d2t, t2d


# --------------------------------------------------------------------------- cache


def mapping_cache_key(corpus_hash: str, tokenizer_hash: str, draft_vocab_size: int, target_vocab_size: int) -> str:
    """sha256 (24 hex chars) of corpus hash, tokenizer hash, draft and target vocab sizes."""
    blob = json.dumps(
        {"corpus": corpus_hash, "tokenizer": tokenizer_hash, "draft_vocab_size": int(draft_vocab_size),
         "target_vocab_size": int(target_vocab_size)},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _counts_digest(counts: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(counts, dtype=np.int64).tobytes()).hexdigest()[:24]


def cached_vocab_mapping(
    counts, draft_vocab_size: int, corpus_hash: str, tokenizer_hash: str, cache_dir: str | Path
) -> tuple[Any, Any, str, bool]:
    """:func:`build_vocab_mapping` through a cache keyed by corpus, tokenizer and size.

    The cache file ``<cache_dir>/<key>.safetensors`` stores ``d2t``/``t2d`` with metadata (key,
    corpus hash, tokenizer hash, sizes, digest of the counts). A file is used only when every
    metadata field equals the request and the mapping passes validation against ``counts``;
    otherwise it is rebuilt and replaced (atomically), so a mapping made for another size or
    corpus is never picked up.

    Returns:
        tuple: ``(d2t, t2d, key, hit)``; ``d2t``/``t2d`` are None for a full-size vocab.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    from eagle3.io import atomic_path

    c = np.asarray(counts, dtype=np.int64)
    V = int(c.size)
    key = mapping_cache_key(corpus_hash, tokenizer_hash, draft_vocab_size, V)
    if int(draft_vocab_size) == V:
        return None, None, key, False
    meta = {
        "format": "eagle3.vocab_mapping/1",
        "cache_key": key,
        "corpus_hash": corpus_hash,
        "tokenizer_hash": tokenizer_hash,
        "draft_vocab_size": str(int(draft_vocab_size)),
        "target_vocab_size": str(V),
        "counts_sha256": _counts_digest(c),
    }
    path = Path(cache_dir) / f"{key}.safetensors"
    if path.is_file():
        try:
            with safe_open(str(path), framework="pt") as f:
                got = f.metadata() or {}
                d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
            bad = [k for k, v in meta.items() if got.get(k) != v]
            if bad:
                raise VocabMappingError(f"metadata differs in {bad}")
            validate_vocab_mapping(d2t, t2d, int(draft_vocab_size), V, counts=c)
            return d2t, t2d, key, True
        except Exception as exc:  # noqa: BLE001 - any unreadable/mismatched cache is rebuilt
            log.warning("vocab mapping cache %s not used (%s); rebuilding", path, exc)
    d2t, t2d = build_vocab_mapping(c, draft_vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        save_file({"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}, str(tmp), metadata=meta)
    return d2t, t2d, key, False


def default_cache_dir(target_cache_dir: str | None = None) -> Path:
    """``<target.cache_dir | $EAGLE3_CACHE | ~/.cache/eagle3>/vocab_mappings``."""
    root = target_cache_dir or os.environ.get("EAGLE3_CACHE") or Path.home() / ".cache" / "eagle3"
    return Path(root) / "vocab_mappings"
