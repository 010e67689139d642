"""What a Stage 3 folder holds before a run starts or resumes: :func:`scan` and :class:`FolderScan`.

The stage plans its work from this answer alone (which rows have a good file, what a killed run left
behind, whether the folder was written for another configuration) and never looks at the layout itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3.contracts.hidden_states.layout import (
    ROW_FILE_RE,
    SHARD_DIR_RE,
    clean_temp,
    is_shard_dir_name,
    is_stale_temp,
    journal_paths,
    journal_rank,
    meta_path,
    sample_relpath,
    shard_name,
)
from eagle3.contracts.hidden_states.manifest import finished_records, known_entries, read_meta, sha256_file
from eagle3.contracts.hidden_states.verify import check_sample_file
from eagle3.errors import ExtractError

__all__ = ["RESUME_KEYS", "FolderScan", "scan"]

RESUME_KEYS = ("aux_layer_ids", "num_hidden_layers", "hidden_size", "dtype", "stored_layers",
               "dataset_fingerprint", "shard_size")
"""``meta.json`` keys that must agree for a folder to be resumed: the files' shapes, dtype and rows."""


@dataclass
class FolderScan:
    """A Stage 3 folder as :func:`scan` found it, for one configuration.

    Attributes:
        dir: the stage folder.
        meta: the configuration it was scanned for (``meta.json`` as this run writes it; its
            ``num_samples`` and ``shard_size`` place the rows).
        found_meta: ``meta.json`` as found (None: none yet).
        records: finished-file records by row, from the manifest and every rank's journal (later
            ones win); only hints until :meth:`recheck` has checked the files.
        files: the sample file on disk of each row, where the layout puts it.
        foreign: paths in the row shards that the stage did not write (:meth:`refuse_foreign`).
        temps: temp files a killed writer left in the row shards or the stage folder.
        journals: the rank journals found.
    """

    dir: Path
    meta: dict
    found_meta: dict | None
    records: dict[int, dict]
    files: dict[int, Path]
    foreign: list[Path]
    temps: list[Path]
    journals: list[Path]

    @property
    def num_rows(self) -> int:
        """Rows of Stage 2's train split (``meta["num_samples"]``)."""
        return int(self.meta["num_samples"])

    def finished(self) -> dict[int, dict]:
        """The records whose file exists (counted as done before :meth:`recheck` has looked at them)."""
        return finished_records(self.dir, self.records, self.num_rows)

    def refuse_foreign(self) -> None:
        """Raise when a row shard holds something the stage did not write (nothing is changed).

        Raises:
            ExtractError: the foreign paths (up to five) and what to do.
        """
        if not self.foreign:
            return
        shown = "\n  ".join(str(p) for p in self.foreign[:5]) + ("\n  ..." if len(self.foreign) > 5 else "")
        raise ExtractError(
            f"{len(self.foreign)} file(s) in {self.dir} were not written by Stage 3 (the rows_* folders hold only "
            f"<row:06d>.safetensors files of this dataset):\n  {shown}\nMove them elsewhere and re-run; "
            f"nothing was changed."
        )

    def remove_stale(self, world: int) -> None:
        """Remove what a killed run left: the writer's temp folder, stray temp files, and the journals
        of ranks ``>= world`` (their rows are re-checked through the records already read)."""
        clean_temp(self.dir)
        for p in self.temps:
            p.unlink(missing_ok=True)
        for p in self.journals:
            rank = journal_rank(p)
            if rank is None or rank >= world:
                p.unlink(missing_ok=True)

    def recheck(self, rows, row_ids: Iterable[int]) -> tuple[dict[int, dict], list[dict]]:
        """Check the files of ``row_ids``: ``(good records by row, redone [{row, id, reason}])``.

        A file is good when its header parses, its shapes / dtypes / token ids / loss mask are right
        (:func:`~eagle3.contracts.hidden_states.verify.check_sample_file`) and, when a record names
        it, its size and sha256 match the record (every such file is hashed again: a bit flip that
        keeps the header and the size is caught here); a good file without a record is hashed. A bad
        file is deleted (its row is redone).

        Args:
            rows: Stage 2's rows (``ids``, ``lengths``, ``tokens(r)``, ``mask(r)``).
            row_ids: the rows to check (a data-parallel rank's share).
        """
        shard = self.meta["shard_size"]
        slots, hidden, dtype = len(self.meta["stored_layers"]), self.meta["hidden_size"], getattr(torch, self.meta["dtype"])
        valid: dict[int, dict] = {}
        redone: list[dict] = []
        for r in row_ids:
            path = self.files.get(r)
            if path is None:
                continue
            rel = sample_relpath(r, shard)
            reason = check_sample_file(path, rows.tokens(r), slots, hidden, dtype, rows.mask(r))
            size = path.stat().st_size
            e = self.records.get(r)
            recorded = e is not None and e.get("file") == rel
            if reason is None and recorded and int(e["bytes"]) != size:
                reason = f"size {size} != {e['bytes']} recorded when it was written (truncated?)"
            digest = sha256_file(path) if reason is None else None
            if reason is None and recorded and digest != e["sha256"]:
                reason = "sha256 differs from the one recorded when it was written (the file changed on disk)"
            if reason is not None:
                path.unlink(missing_ok=True)
                redone.append({"row": r, "id": rows.ids[r], "reason": reason})
                continue
            valid[r] = {"row": r, "id": rows.ids[r], "num_tokens": int(rows.lengths[r]), "file": rel,
                        "bytes": size, "sha256": digest}
        return valid, redone


def _check_resumable(sd: Path, old: dict | None, meta: dict) -> None:
    """Refuse to resume a folder written for another model, layer set, dtype or dataset."""
    if not old:
        return
    diffs = [f"{k}: {old.get(k)!r} in {meta_path(sd)}, {meta[k]!r} now" for k in RESUME_KEYS if old.get(k) != meta[k]]
    if not diffs:
        return
    hint = ""
    if any(d.startswith(("hidden_size", "num_hidden_layers")) for d in diffs):
        hint = " The target model's hidden size / layer count disagrees with the stored files."
    if all(d.startswith("dataset_fingerprint") for d in diffs):
        hint = (" Stage 2's train split changed since these files were written: redo stage 3 with "
                "`eagle3 run PARAMS --stages 3-5 --redo 3` (it starts over on the new split).")
    raise ExtractError(
        f"{sd} holds hidden states of a different configuration:\n  " + "\n  ".join(diffs) +
        f"\n{hint} Delete {sd} to extract again, or start a new run (run.name)."
    )


def _list_shards(sd: Path, n_rows: int, shard_size: int) -> tuple[dict[int, Path], list[Path], list[Path]]:
    """``(files by row, foreign, stale temps)`` of the row shards. The writer's temp folder is not
    listed: everything in it is a temp file (:meth:`FolderScan.remove_stale` removes it whole)."""
    files: dict[int, Path] = {}
    foreign: list[Path] = []
    temps: list[Path] = []
    for d in sorted(sd.iterdir()) if sd.exists() else []:
        if is_stale_temp(d):
            temps.append(d)
            continue
        if not is_shard_dir_name(d.name):
            continue
        m = SHARD_DIR_RE.match(d.name)
        if not d.is_dir() or not m or int(m.group(2)) - int(m.group(1)) != shard_size:
            foreign.append(d)
            continue
        for f in sorted(d.iterdir()):
            if is_stale_temp(f):
                temps.append(f)
                continue
            fm = ROW_FILE_RE.match(f.name)
            row = int(fm.group(1)) if fm else -1
            if not fm or not f.is_file() or row >= n_rows or shard_name(row, shard_size) != d.name:
                foreign.append(f)
            else:
                files[row] = f
    return files, foreign, temps


def scan(stage_dir: str | Path, meta: dict) -> FolderScan:
    """What the Stage 3 folder ``stage_dir`` holds for the configuration ``meta``; changes nothing.

    Args:
        stage_dir: the stage folder (may not exist yet).
        meta: ``meta.json`` as this run would write it (:data:`RESUME_KEYS`, ``num_samples``).

    Returns:
        FolderScan: records, files, foreign paths, temp files and journals found.

    Raises:
        ExtractError: the folder's ``meta.json`` disagrees with ``meta`` on a :data:`RESUME_KEYS` key
            (each difference named, with how to start over); a journal or the manifest has a corrupt
            line other than the last.
    """
    sd = Path(stage_dir)
    found = read_meta(sd)
    _check_resumable(sd, found, meta)
    files, foreign, temps = _list_shards(sd, int(meta["num_samples"]), int(meta["shard_size"]))
    return FolderScan(sd, meta, found, known_entries(sd), files, foreign, temps, journal_paths(sd))
