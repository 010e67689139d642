"""Names inside Stage 3's folder: row shards, sample files, rank journals, the writer's temp folder.

Every path of the format is built or recognised here; the other modules of the contract ask these
functions, and code outside the contract asks the contract (:func:`~eagle3.contracts.hidden_states.scan`).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from eagle3.rundir import EXTRACT_META_FILE, MANIFEST_FILE

__all__ = [
    "MANIFEST",
    "META",
    "TMP_DIR",
    "ROW_FILE_RE",
    "SHARD_DIR_RE",
    "manifest_path",
    "meta_path",
    "shard_name",
    "sample_relpath",
    "is_shard_dir_name",
    "journal_name",
    "journal_rank",
    "journal_paths",
    "is_stale_temp",
    "clean_temp",
]

MANIFEST = MANIFEST_FILE
META = EXTRACT_META_FILE
# The writer's temp folder inside the stage folder: every temp file of Stage 3 is created there.
TMP_DIR = ".writing"
ROW_FILE_RE = re.compile(r"^(\d{6,})\.safetensors$")
SHARD_DIR_RE = re.compile(r"^rows_(\d{6,})-(\d{6,})$")
_SHARD_PREFIX = "rows_"
_JOURNAL_PREFIX, _JOURNAL_SUFFIX = "manifest.part-", ".jsonl"


def manifest_path(stage_dir: str | Path) -> Path:
    """The final manifest, ``manifest.jsonl``, of a stage folder."""
    return Path(stage_dir) / MANIFEST


def meta_path(stage_dir: str | Path) -> Path:
    """``meta.json`` of a stage folder."""
    return Path(stage_dir) / META


def shard_name(row: int, shard_size: int) -> str:
    """``rows_000000-002000`` for ``row`` in ``[0, 2000)`` with shard size 2000."""
    start = row // shard_size * shard_size
    return f"{_SHARD_PREFIX}{start:06d}-{start + shard_size:06d}"


def sample_relpath(row: int, shard_size: int) -> str:
    """Path of a sample's file relative to the stage folder: ``rows_000000-002000/000017.safetensors``."""
    return f"{shard_name(row, shard_size)}/{row:06d}.safetensors"


def is_shard_dir_name(name: str) -> bool:
    """True for a name in the row shards' namespace (``rows_*``): the stage owns everything there."""
    return name.startswith(_SHARD_PREFIX)


def journal_name(rank: int) -> str:
    """``manifest.part-RRR.jsonl``: the journal of data-parallel rank ``rank``."""
    return f"{_JOURNAL_PREFIX}{rank:03d}{_JOURNAL_SUFFIX}"


def journal_rank(path: Path) -> int | None:
    """The rank of a journal file (``manifest.part-RRR.jsonl`` -> RRR), None when the part is not a number."""
    m = path.name[len(_JOURNAL_PREFIX):-len(_JOURNAL_SUFFIX)]
    return int(m) if m.isdigit() else None


def journal_paths(stage_dir: str | Path) -> list[Path]:
    """Every rank's journal in the stage folder, sorted by name."""
    return sorted(Path(stage_dir).glob(f"{_JOURNAL_PREFIX}*{_JOURNAL_SUFFIX}"))


def is_stale_temp(p: Path) -> bool:
    """True for a temp file a killed Stage 3 writer left behind: ours (``.<name>.<random>.tmp``) or
    safetensors' own (``.tmpXXXXXX``, written beside its target by ``save_file``: in a ``rows_*``
    folder when a writer saved there directly instead of in :data:`TMP_DIR`)."""
    n = p.name
    return n.startswith(".") and (n.endswith(".tmp") or n.startswith(".tmp")) and p.is_file()


def clean_temp(stage_dir: str | Path) -> int:
    """Remove the writer's temp folder (:data:`TMP_DIR`) with whatever a killed run left in it.

    Call it only while no writer runs (Stage 3 calls it before its writers start and after they
    finish). Returns the number of files removed.
    """
    d = Path(stage_dir) / TMP_DIR
    if not d.exists():
        return 0
    n = sum(1 for p in d.rglob("*") if p.is_file())
    shutil.rmtree(d, ignore_errors=True)
    return n
