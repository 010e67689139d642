"""The records of finished files: the rank journals while Stage 3 runs, ``manifest.jsonl`` after it,
and ``meta.json``.

A record is one JSON line with :data:`MANIFEST_KEYS` (``row``, ``id``, ``num_tokens``, ``file``
relative to the stage folder, ``bytes``, ``sha256``). Each data-parallel rank appends to its own
journal (:class:`~eagle3.contracts.hidden_states.writer.SampleWriter`); when every row has its file,
:func:`write_manifest` writes them once, in row order, and removes the journals.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from eagle3.contracts.hidden_states.layout import MANIFEST, journal_name, journal_paths, manifest_path, meta_path
from eagle3.errors import ExtractError
from eagle3.io import atomic_write_json, atomic_write_text, file_sha256, read_json, read_jsonl

__all__ = [
    "MANIFEST_KEYS",
    "sha256_file",
    "read_entries",
    "known_entries",
    "finished_records",
    "write_journal",
    "check_manifest",
    "read_manifest",
    "write_manifest",
    "read_meta",
    "write_meta",
]

MANIFEST_KEYS = ("row", "id", "num_tokens", "file", "bytes", "sha256")

sha256_file = file_sha256  # the digest the manifest records


def read_entries(path: str | Path) -> list[dict]:
    """Records of one journal or manifest file, in file order; [] when it does not exist.

    A torn last line (a killed writer) is dropped (:func:`eagle3.io.read_jsonl`); a record without
    ``row``, ``file``, ``bytes`` and ``sha256`` is skipped (a journal is only a hint that the resume
    scan re-checks against the file itself).

    Raises:
        ExtractError: a line other than the last is not JSON (the file and line are named).
    """
    recs = read_jsonl(path, error=ExtractError, missing_ok=True)
    return [e for e in recs if isinstance(e, dict) and {"row", "file", "bytes", "sha256"} <= e.keys()]



def known_entries(stage_dir: str | Path) -> dict[int, dict]:
    """Finished-file records by row from the manifest and every rank's journal (later ones win)."""
    sd = Path(stage_dir)
    known: dict[int, dict] = {}
    for p in [manifest_path(sd), *journal_paths(sd)]:
        for e in read_entries(p):
            known[int(e["row"])] = e
    return known


def finished_records(stage_dir: str | Path, records: dict[int, dict], num_rows: int) -> dict[int, dict]:
    """The ``records`` (by row, e.g. :func:`known_entries`) of rows ``< num_rows`` whose file exists
    in ``stage_dir`` (existence only: the files are not re-checked)."""
    sd = Path(stage_dir)
    return {r: e for r, e in records.items() if r < num_rows and (sd / e["file"]).is_file()}


def write_journal(stage_dir: str | Path, rank: int, records: Iterable[dict]) -> Path:
    """Replace rank ``rank``'s journal with ``records`` (atomically); returns its path, where the
    rank's :class:`~eagle3.contracts.hidden_states.writer.SampleWriter` appends."""
    journal = Path(stage_dir) / journal_name(rank)
    atomic_write_text(journal, "".join(json.dumps(e) + "\n" for e in records))
    return journal


def check_manifest(entries: Sequence[dict], meta: dict | None, ids: Sequence[str] | None,
                   where: str | Path = MANIFEST) -> list[str]:
    """Compare the manifest's records with ``meta.json``'s sample count and with Stage 2's split.

    A lost manifest line would otherwise drop a sample silently: every row ``0..n-1`` of the split
    must have exactly one record, with the split's id, and ``n`` must equal ``meta["num_samples"]``.

    Args:
        entries: the records (:func:`read_manifest`, by row).
        meta: ``meta.json`` (its ``num_samples`` is checked when present) or None.
        ids: the sample ids of Stage 2's ``train.parquet`` in row order (None: not checked).
        where: the manifest's path, for messages.

    Returns:
        list[str]: problems, each naming the row and id (empty when all agree).
    """
    out: list[str] = []
    by_row = {int(e["row"]): e for e in entries}
    n_meta = (meta or {}).get("num_samples")
    if n_meta is not None and len(by_row) != int(n_meta):
        out.append(f"{where}: {len(by_row)} records but meta.json says num_samples = {n_meta}")
    if ids is not None:
        if len(ids) != len(by_row):
            out.append(f"{where}: {len(by_row)} records but Stage 2's train split has {len(ids)} rows")
        missing = [r for r in range(len(ids)) if r not in by_row]
        if missing:
            out.append(f"{where}: no line for row {missing[0]} (id {ids[missing[0]]})"
                       + (f" and {len(missing) - 1} more row(s)" if len(missing) > 1 else ""))
        extra = sorted(r for r in by_row if r >= len(ids))
        if extra:
            out.append(f"{where}: row {extra[0]} is not in Stage 2's train split ({len(ids)} rows)")
        wrong = [r for r in sorted(by_row) if r < len(ids) and str(by_row[r].get("id")) != str(ids[r])]
        if wrong:
            r = wrong[0]
            out.append(f"{where}: row {r} has id {by_row[r].get('id')} but Stage 2's train split has {ids[r]} "
                       f"there ({len(wrong)} row(s) disagree): Stage 2 changed after Stage 3 ran")
    elif n_meta is not None:
        missing = [r for r in range(int(n_meta)) if r not in by_row]
        if missing:
            out.append(f"{where}: no line for row {missing[0]}")
    return out


def read_manifest(stage_dir: str | Path, missing_ok: bool = False) -> list[dict]:
    """The final manifest's records, one per row, sorted by row (later lines for a row win).

    Args:
        missing_ok: return [] when there is no manifest (or no record in it) instead of raising.

    Raises:
        ExtractError: no ``manifest.jsonl`` or no record in it (Stage 3 has not finished).
    """
    sd = Path(stage_dir)
    by_row = {int(e["row"]): e for e in read_entries(sd / MANIFEST)}
    if not by_row and missing_ok:
        return []
    if not by_row:
        raise ExtractError(f"{sd / MANIFEST} does not exist or is empty: run Stage 3 (extract) to completion "
                           f"first (or set train.online: true)")
    return [by_row[r] for r in sorted(by_row)]


def write_manifest(stage_dir: str | Path, entries: dict[int, dict], num_rows: int) -> int:
    """Write ``manifest.jsonl`` (one record per row ``0..num_rows-1``, keys :data:`MANIFEST_KEYS`)
    atomically and remove the rank journals; returns the total bytes of the files.

    Raises:
        ExtractError: a row without a record.
    """
    sd = Path(stage_dir)
    missing = [r for r in range(num_rows) if r not in entries]
    if missing:
        raise ExtractError(f"{len(missing)} row(s) have no file (first: row {missing[0]}); re-run to resume.")
    lines = [json.dumps({k: entries[r][k] for k in MANIFEST_KEYS}) for r in range(num_rows)]
    atomic_write_text(sd / MANIFEST, "\n".join(lines) + "\n")
    for p in journal_paths(sd):
        p.unlink(missing_ok=True)
    return sum(int(entries[r]["bytes"]) for r in range(num_rows))


def read_meta(stage_dir: str | Path) -> dict | None:
    """``meta.json`` (aux_layer_ids, num_hidden_layers, hidden_size, dtype, stored_layers, ...) or None.

    Raises:
        DamagedFile: not valid JSON (named with line and column).
    """
    return read_json(meta_path(stage_dir))


def write_meta(stage_dir: str | Path, meta: dict) -> None:
    """Write ``meta.json`` atomically."""
    atomic_write_json(meta_path(stage_dir), meta)


