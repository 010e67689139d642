"""Stage 2's tokenized splits: the ONLY code that reads or writes them.

Files (in the stage-2 folder of a run):

* ``train.parquet``, ``heldout.parquet``: one row per training sequence, columns ``id`` (str),
  ``source`` (str), ``input_ids`` (list<int64> ``[seq]``), ``loss_mask`` (list<int8> ``[seq]``,
  1 = supervised), written in row groups of 1,024 rows;
* ``row_lengths_train.npy``, ``row_lengths_heldout.npy``: int64 ``[rows]``, each row's length
  before truncation to ``vocab.max_seq_len`` (file order).

Readers: :func:`read_table` (arrow, memory-mapped), :func:`read_dataset` (``datasets.Dataset``),
:func:`read_rows` (flat numpy arrays + offsets, every row checked), :func:`read_ids`,
:func:`read_row_tokens` (tokens per row) and :func:`read_row_lengths`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from eagle3.errors import VocabError

__all__ = [
    "SPLITS",
    "COLUMNS",
    "TokenizedError",
    "TokenizedRow",
    "TokenizedSplit",
    "schema",
    "split_path",
    "row_lengths_path",
    "write_split",
    "write_rows",
    "read_table",
    "iter_batches",
    "split_complete",
    "read_dataset",
    "read_rows",
    "read_ids",
    "read_row_tokens",
    "read_row_lengths",
]

SPLITS = ("train", "heldout")
COLUMNS = ("id", "source", "input_ids", "loss_mask")


class TokenizedError(VocabError):
    """A tokenized split is missing or malformed (the message names the file, row and id)."""


@dataclass
class TokenizedRow:
    """One training row: ``input_ids`` int64 ``[seq]`` and ``loss_mask`` int8 ``[seq]`` (1 = supervised);
    ``full_len`` is the length before truncation to ``max_seq_len``."""

    id: str
    source: str
    input_ids: np.ndarray
    loss_mask: np.ndarray
    full_len: int


def schema():
    """The arrow schema of a split file (columns in :data:`COLUMNS` order)."""
    import pyarrow as pa

    return pa.schema([
        ("id", pa.string()), ("source", pa.string()),
        ("input_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.int8())),
    ])


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise TokenizedError(f"split must be one of {SPLITS}, got {split!r}")


def split_path(run_dir: str | Path, split: str = "train") -> Path:
    """``<stage 2>/<split>.parquet`` of a run."""
    from eagle3.rundir import RunDir

    _check_split(split)
    return RunDir(run_dir).tokenized(split)


def row_lengths_path(run_dir: str | Path, split: str = "train") -> Path:
    """``<stage 2>/row_lengths_<split>.npy`` of a run."""
    from eagle3.rundir import VOCAB, RunDir

    _check_split(split)
    return RunDir(run_dir).stage(VOCAB) / f"row_lengths_{split}.npy"


# --------------------------------------------------------------------------- writing


def _table(rows: Sequence[TokenizedRow]):
    import pyarrow as pa

    offs = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum([len(r.input_ids) for r in rows], out=offs[1:])
    ids = np.concatenate([r.input_ids for r in rows]) if rows else np.zeros(0, np.int64)
    mask = np.concatenate([r.loss_mask for r in rows]) if rows else np.zeros(0, np.int8)
    return pa.Table.from_arrays([
        pa.array([r.id for r in rows], pa.string()),
        pa.array([r.source for r in rows], pa.string()),
        pa.ListArray.from_arrays(pa.array(offs), pa.array(ids.astype(np.int64))),
        pa.ListArray.from_arrays(pa.array(offs), pa.array(mask.astype(np.int8))),
    ], schema=schema())


def write_rows(path: str | Path, row_chunks: Iterable[Sequence[TokenizedRow]], row_group_rows: int = 1024) -> list[int]:
    """Stream row chunks to one parquet file atomically (an empty file with the schema when no rows).

    Returns:
        list[int]: the rows' lengths before truncation (``full_len``), in file order.
    """
    import pyarrow.parquet as pq

    from eagle3.io import atomic_path

    lengths: list[int] = []
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        with pq.ParquetWriter(tmp, schema()) as w:
            buf: list = []
            for chunk in row_chunks:
                buf.extend(chunk)
                lengths.extend(r.full_len for r in chunk)
                while len(buf) >= row_group_rows:
                    w.write_table(_table(buf[:row_group_rows]))
                    buf = buf[row_group_rows:]
            if buf or not lengths:
                w.write_table(_table(buf))
    return lengths


def write_split(run_dir: str | Path, split: str, row_chunks: Iterable[Sequence[TokenizedRow]],
                row_group_rows: int = 1024) -> list[int]:
    """Write one split of a run: ``<split>.parquet`` then ``row_lengths_<split>.npy`` (both atomic).

    Returns:
        list[int]: the rows' lengths before truncation, in file order.
    """
    from eagle3.io import atomic_path

    lengths = write_rows(split_path(run_dir, split), row_chunks, row_group_rows)
    with atomic_path(row_lengths_path(run_dir, split)) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, np.asarray(lengths, dtype=np.int64))
    return lengths


def split_complete(run_dir: str | Path, split: str) -> bool:
    """Both files of a split exist and agree: the parquet footer reads and holds as many rows as the
    row lengths (a resumed or redone stage 2 skips such a split when its hashes match, and rewrites a
    file cut short or overwritten)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    p, lengths = split_path(run_dir, split), row_lengths_path(run_dir, split)
    if not (p.is_file() and lengths.is_file()):
        return False
    try:
        return pq.ParquetFile(p).metadata.num_rows == len(np.load(lengths, mmap_mode="r"))
    except (pa.ArrowException, OSError, ValueError):
        return False


# --------------------------------------------------------------------------- reading


def _existing(path_or_run_dir: str | Path, split: str) -> Path:
    p = Path(path_or_run_dir)
    p = p if p.suffix == ".parquet" else split_path(p, split)
    if not p.is_file():
        raise TokenizedError(f"{p} does not exist: run stage 2 (vocab) first")
    return p


@contextmanager
def _readable(p: Path):
    """Re-raise pyarrow's error on a damaged split (cut short, overwritten: "Parquet magic bytes not
    found in footer", naming no file) as a :class:`TokenizedError` naming the file and the redo."""
    import pyarrow as pa

    try:
        yield
    except (pa.ArrowException, OSError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise TokenizedError(f"{p}: not a readable Parquet file ({type(exc).__name__}: {first}); redo stage 2 "
                             f"(`eagle3 run PARAMS --stages 2 --redo 2`)") from None


def read_table(run_dir: str | Path, split: str = "train", columns: Sequence[str] | None = None):
    """One split as a memory-mapped ``pyarrow.Table`` (``columns`` = a subset of :data:`COLUMNS`).

    ``run_dir`` may also be the parquet file itself.

    Raises:
        TokenizedError: unknown split, missing file (run stage 2), a file pyarrow cannot read,
            missing column.
    """
    import pyarrow.parquet as pq

    p = _existing(run_dir, split)
    with _readable(p):
        names = pq.read_schema(p).names
    missing = [c for c in (columns or COLUMNS) if c not in names]
    if missing:
        raise TokenizedError(f"{p}: missing column(s) {missing}; expected {list(COLUMNS)}")
    with _readable(p):
        return pq.read_table(p, columns=list(columns) if columns else None, memory_map=True)


def iter_batches(run_dir: str | Path, split: str = "train", batch_rows: int = 65536,
                 columns: Sequence[str] = ("id", "input_ids", "loss_mask")):
    """Arrow record batches of one split (``columns`` present in the file), ``batch_rows`` rows each:
    streams a split larger than memory. ``run_dir`` may also be the parquet file itself."""
    import pyarrow.parquet as pq

    p = _existing(run_dir, split)
    with _readable(p):
        pf = pq.ParquetFile(p)
        yield from pf.iter_batches(batch_size=batch_rows, columns=[c for c in columns if c in pf.schema_arrow.names])


def read_dataset(run_dir: str | Path, split: str = "train"):
    """One split as a ``datasets.Dataset`` over the memory-mapped table (:func:`read_table`)."""
    import datasets

    return datasets.Dataset(read_table(run_dir, split))


def read_ids(run_dir: str | Path, split: str = "train") -> list[str]:
    """The row ids of a split, in file order."""
    return [str(x) for x in read_table(run_dir, split, ["id"]).column("id").to_pylist()]


def read_row_tokens(run_dir: str | Path, split: str = "train") -> tuple[list[str], np.ndarray]:
    """``(ids, lengths)``: row ids and int64 ``[rows]`` tokens per row (after truncation), file order."""
    import pyarrow.compute as pc

    t = read_table(run_dir, split, ["id", "input_ids"])
    lens = pc.list_value_length(t.column("input_ids")).to_numpy(zero_copy_only=False)
    return [str(x) for x in t.column("id").to_pylist()], np.nan_to_num(lens).astype(np.int64)


def read_row_lengths(run_dir: str | Path, split: str = "train") -> np.ndarray | None:
    """int64 ``[rows]`` row lengths before truncation, or None when the file is absent."""
    p = row_lengths_path(run_dir, split)
    return np.load(p) if p.is_file() else None


@dataclass
class TokenizedSplit:
    """A split held as flat numpy arrays plus offsets (no per-row Python lists).

    Attributes:
        path: the parquet file. ids, sources: ``list[str]`` per row.
        lengths: int64 ``[rows]`` tokens per row. input_ids: int64 ``[tokens]``; loss_mask: int8
            ``[tokens]`` (owned, writable copies). offsets: int64 ``[rows + 1]``.
    """

    path: Path
    ids: list
    sources: list
    lengths: np.ndarray
    input_ids: np.ndarray
    loss_mask: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)

    def tokens(self, row: int) -> np.ndarray:
        """int64 ``[seq]`` token ids of ``row``."""
        return self.input_ids[self.offsets[row]: self.offsets[row + 1]]

    def mask(self, row: int) -> np.ndarray:
        """int8 ``[seq]`` loss mask of ``row`` (1 = supervised)."""
        return self.loss_mask[self.offsets[row]: self.offsets[row + 1]]

    @property
    def total_tokens(self) -> int:
        """Tokens over all rows."""
        return int(self.lengths.sum())

    def fingerprint(self) -> str:
        """sha256 (16 hex) of ids, token ids and loss masks: which data Stage 3's files belong to."""
        h = hashlib.sha256()
        h.update("\n".join(self.ids).encode())
        h.update(self.lengths.tobytes())
        h.update(self.input_ids.tobytes())
        h.update(self.loss_mask.tobytes())
        return h.hexdigest()[:16]

    def check_max_len(self, max_seq_len: int, field: str = "vocab.max_seq_len", error: type[Exception] = TokenizedError) -> None:
        """Raise ``error`` naming the first row longer than ``max_seq_len`` tokens (and how many are)."""
        over = np.flatnonzero(self.lengths > max_seq_len)
        if over.size:
            r = int(over[0])
            raise error(
                f"{self.path}: row {r} (id {self.ids[r]}) has {int(self.lengths[r])} tokens, more than "
                f"{field} = {max_seq_len} ({over.size} row(s) too long). Re-run Stage 2 with the same "
                f"max_seq_len, or raise {field}."
            )

    @classmethod
    def from_lists(cls, ids, input_ids, loss_mask=None, source: str = "memory") -> TokenizedSplit:
        """Rows held in memory (no parquet file; benchmarks and tests). Loss masks default to all ones.

        Args:
            ids: ``[rows]`` sample ids. input_ids: ``[rows]`` token id sequences. loss_mask: same
                shape as input_ids (1 = supervised) or None. source: recorded per row.
        """
        lengths = np.array([len(x) for x in input_ids], dtype=np.int64)
        masks = loss_mask if loss_mask is not None else [np.ones(n, np.int8) for n in lengths]

        def flat(xs, dt):
            return np.concatenate([np.asarray(x, dtype=dt) for x in xs]) if len(xs) else np.zeros(0, dt)

        return cls(Path(f"<{source}>"), [str(x) for x in ids], [source] * len(lengths), lengths,
                   flat(input_ids, np.int64), flat(masks, np.int8),
                   np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))


def read_rows(run_dir: str | Path, split: str = "train") -> TokenizedSplit:
    """One split as :class:`TokenizedSplit`, every row checked.

    Raises:
        TokenizedError: missing file or column; a null row; a loss mask whose length differs from its
            input_ids; an empty row (the message names the file, the row and its id).
    """
    import pyarrow.compute as pc

    table = read_table(run_dir, split)
    p = _existing(run_dir, split)
    ids = [str(x) for x in table.column("id").to_pylist()]
    cols = {}
    for name in ("input_ids", "loss_mask"):
        arr = table.column(name).combine_chunks()
        if arr.null_count:
            r = int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
            raise TokenizedError(f"{p}: row {r} (id {ids[r]}): column {name} is null")
        lens = pc.list_value_length(arr).to_numpy(zero_copy_only=False).astype(np.int64)
        cols[name] = (arr.flatten().to_numpy(zero_copy_only=False), lens)
    lengths = cols["input_ids"][1]
    bad = np.flatnonzero(cols["loss_mask"][1] != lengths)
    if bad.size:
        r = int(bad[0])
        raise TokenizedError(f"{p}: row {r} (id {ids[r]}): loss_mask has {cols['loss_mask'][1][r]} entries "
                             f"but input_ids has {lengths[r]}")
    empty = np.flatnonzero(lengths == 0)
    if empty.size:
        r = int(empty[0])
        raise TokenizedError(f"{p}: row {r} (id {ids[r]}): input_ids is empty")
    return TokenizedSplit(p, ids, [str(x) for x in table.column("source").to_pylist()], lengths,
                          np.array(cols["input_ids"][0], dtype=np.int64), np.array(cols["loss_mask"][0], dtype=np.int8),
                          np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
