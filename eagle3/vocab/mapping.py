"""Masked-token frequencies, the coverage computation, and the draft vocab mapping's cache.

The mapping itself (its rule, check and files) is :mod:`eagle3.contracts.vocab_mapping`;
:class:`Coverage` ranks ids with the same :func:`~eagle3.contracts.vocab_mapping.rank_ids`, so the
coverage and OOV numbers of a size are those of the mapping of that size, padding ids included.
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

from eagle3.contracts import tokenized
from eagle3.contracts.vocab_mapping import VocabMapping, VocabMappingError, load_tensors, rank_ids, save_tensors
from eagle3.errors import VocabError

__all__ = [
    "count_masked_tokens",
    "Coverage",
    "mapping_cache_key",
    "cached_vocab_mapping",
    "default_cache_dir",
    "write_counts",
    "read_counts",
    "COMMON_SIZES",
]

log = logging.getLogger(__name__)

COMMON_SIZES = (8192, 16384, 32768, 65536)


# --------------------------------------------------------------------------- counting


def _record_batches(data: Any, batch_rows: int):
    """Arrow record batches holding ``input_ids``/``loss_mask`` (and ``id`` when present)."""
    import pyarrow as pa

    if isinstance(data, (str, Path)):
        yield from tokenized.iter_batches(data, batch_rows=batch_rows)
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
            ``order[:k]``, padding included (zero-count ids rank last, lowest id first: exactly the
            ids :meth:`~eagle3.contracts.vocab_mapping.VocabMapping.build` pads with).
        cumulative: int64 ``[V]``, ``cumulative[k-1]`` = masked tokens covered by the top k.
    """

    counts: np.ndarray
    order: np.ndarray
    cumulative: np.ndarray

    @classmethod
    def from_counts(cls, counts: np.ndarray) -> Coverage:
        """Rank token ids by (-count, id) and accumulate. ``counts`` int ``[V]``, non-negative."""
        c = np.asarray(counts, dtype=np.int64)
        if c.ndim != 1 or (c < 0).any():
            raise VocabError("token counts must be a 1-D array of non-negative integers")
        order = rank_ids(c)
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
        """bool ``[V]``: the token ids a draft vocab of ``size`` keeps - the top ids by rank, then the
        padding ids, as in the mapping itself (so ``kept_mask(V)`` is all true)."""
        m = np.zeros(self.vocab_size, dtype=bool)
        m[self.order[: max(int(size), 0)]] = True
        return m

    def oov_rate(self, other_counts, size: int) -> float | None:
        """Share of ``other_counts`` (int ``[V]``, e.g. the held-out split's) outside a draft vocab of
        ``size`` built from these counts; None when ``other_counts`` is empty. 0.0 at full size. The
        one coverage computation behind ``stats.json``, the explorer's tables, widget and plot."""
        other = np.asarray(other_counts, dtype=np.int64)
        total = int(other.sum())
        if total == 0:
            return None
        return float(other[~self.kept_mask(size)].sum() / total)

    def curve(self, other_counts=None) -> np.ndarray:
        """float ``[V]``: coverage of a draft vocab of size ``k + 1`` at index ``k`` - of these counts, or
        of ``other_counts`` (same ranking and padding as :meth:`kept_mask`)."""
        if other_counts is None:
            return self.cumulative / max(self.total, 1)
        other = np.asarray(other_counts, dtype=np.float64)
        return np.cumsum(other[self.order]) / max(other.sum(), 1)


# --------------------------------------------------------------------------- mapping


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
) -> tuple[VocabMapping, bool]:
    """:meth:`VocabMapping.build` through a cache keyed by corpus, tokenizer and size.

    The cache file ``<cache_dir>/<key>.safetensors`` stores ``d2t``/``t2d`` with metadata (key,
    corpus hash, tokenizer hash, sizes, digest of the counts). A file is used only when every
    metadata field equals the request and the mapping passes its check against ``counts``;
    otherwise it is rebuilt and replaced (atomically), so a mapping made for another size or
    corpus is never picked up.

    A cache that cannot be written (read-only, or a file where its folder should be) is logged as
    a warning: the mapping is built all the same.

    Returns:
        tuple: ``(mapping, hit)``; ``mapping.cache_key`` is the key, d2t/t2d None at full size.
    """
    c = np.asarray(counts, dtype=np.int64)
    V = int(c.size)
    key = mapping_cache_key(corpus_hash, tokenizer_hash, draft_vocab_size, V)
    if int(draft_vocab_size) == V:
        return VocabMapping.build(c, V, key), False
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
            d2t, t2d, got = load_tensors(path)
            bad = [k for k, v in meta.items() if got.get(k) != v]
            if bad:
                raise VocabMappingError(f"metadata differs in {bad}")
            return VocabMapping(d2t, t2d, int(draft_vocab_size), V, key).check(str(path), counts=c), True
        except Exception as exc:  # noqa: BLE001 - any unreadable/mismatched cache is rebuilt
            log.warning("vocab mapping cache %s not used (%s); rebuilding", path, exc)
    m = VocabMapping.build(c, draft_vocab_size, key)
    try:
        save_tensors(path, m.d2t, m.t2d, meta)
    except OSError as exc:  # a read-only or misdirected cache ($EAGLE3_CACHE a file) only costs the reuse
        log.warning("vocab mapping cache %s not written (%s); the run's own mapping is unaffected", path, exc)
    return m, False


def default_cache_dir(target_cache_dir: str | None = None) -> Path:
    """``<target.cache_dir | $EAGLE3_CACHE | ~/.cache/eagle3>/vocab_mappings``."""
    root = target_cache_dir or os.environ.get("EAGLE3_CACHE") or Path.home() / ".cache" / "eagle3"
    return Path(root) / "vocab_mappings"


# --------------------------------------------------------------------------- count files

def _counts_path(run_dir: str | Path, split: str) -> Path:
    from eagle3.rundir import RunDir

    rd = RunDir(run_dir)
    return rd.token_counts if split == "train" else rd.heldout_token_counts


def write_counts(run_dir: str | Path, train: np.ndarray, heldout: np.ndarray) -> None:
    """Write int64 ``[V]`` masked-token frequencies of both splits (``token_counts.npy``,
    ``heldout_token_counts.npy``) atomically."""
    from eagle3.io import atomic_path

    for split, arr in (("train", train), ("heldout", heldout)):
        with atomic_path(_counts_path(run_dir, split)) as tmp:
            with open(tmp, "wb") as f:
                np.save(f, arr)


def read_counts(run_dir: str | Path) -> tuple[np.ndarray, np.ndarray | None]:
    """``(train, heldout)`` int64 ``[V]`` masked-token frequencies (heldout None when absent).

    Raises:
        VocabError: the train counts are missing (run stage 2).
    """
    p = _counts_path(run_dir, "train")
    if not p.is_file():
        raise VocabError(f"{p} does not exist: run stage 2 (vocab) first")
    h = _counts_path(run_dir, "heldout")
    return np.load(p), (np.load(h) if h.is_file() else None)
