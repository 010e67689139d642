"""``stats.json``: a stage's summary numbers and its completion, written and read here only."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, ClassVar

from eagle3.io import atomic_write_json, read_json
from eagle3.rundir import STATS_FILE, stage_dir

__all__ = ["Stats", "StageRecord", "stage_record", "completed_stats", "write_stats"]


@dataclasses.dataclass
class Stats:
    """Base of a stage's summary numbers; the field names are the ``stats.json`` keys.

    Subclasses list the fields the report's index shows in ``HEADLINE`` (in display order)::

        @dataclass
        class VocabStats(Stats):
            HEADLINE: ClassVar[tuple[str, ...]] = ("draft_vocab_size", "coverage")
            draft_vocab_size: int
            coverage: float
    """

    HEADLINE: ClassVar[tuple[str, ...]] = ()

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (what ``stats.json`` holds, before ``complete``/``finished_at``)."""
        return dataclasses.asdict(self)

    def headline(self) -> dict[str, Any]:
        """``{key: value}`` of the ``HEADLINE`` fields, for the report index."""
        return {k: getattr(self, k) for k in self.HEADLINE}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Stats:
        """Build from a ``stats.json`` dict; keys that are not fields (``complete``, ...) are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})



def write_stats(stage_dir: str | Path, stats: dict, complete: bool = True) -> dict:
    """Write ``<stage_dir>/stats.json`` (the stage's summary numbers) atomically, adding ``complete``
    (True: the stage is done; ``eagle3 run`` skips it) and ``finished_at`` (UTC, ISO 8601); returns
    what the file holds."""
    out = dict(stats)
    out["complete"] = complete
    out["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    atomic_write_json(Path(stage_dir) / STATS_FILE, out)
    return out


@dataclasses.dataclass(frozen=True)
class StageRecord:
    """What stage ``stage``'s ``stats.json`` says now (:func:`stage_record`).

    Attributes:
        stage: the stage number, 1..5.
        complete: True only when the file exists, parses as a JSON object and says ``complete: true``.
        stats: the file's keys (``complete`` and ``finished_at`` included); ``{}`` when the file is
            missing, unreadable or not a JSON object.
    """

    stage: int
    complete: bool
    stats: dict[str, Any]

    def as_stats(self, cls: type[Stats]) -> Stats | None:
        """The numbers as a ``cls`` (:meth:`Stats.from_dict`) when the stage is complete, else None."""
        return cls.from_dict(self.stats) if self.complete else None


def stage_record(run_dir: str | Path, stage: int) -> StageRecord:
    """Read stage ``stage``'s ``stats.json`` in ``run_dir``: is the stage complete, and its numbers.

    A missing file, one torn or damaged (not JSON, not an object) or unreadable (permissions) is a stage
    that is not complete, never an error: ``eagle3 run`` then runs the stage again, which rewrites it.
    Nothing is created.
    """
    try:
        st = read_json(stage_dir(run_dir, stage, create=False) / STATS_FILE, None)
    except (OSError, ValueError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        st = None
    st = st if isinstance(st, dict) else {}
    return StageRecord(stage=stage, complete=bool(st.get("complete")), stats=st)


def completed_stats(run_dir: str | Path, stage: int, cls: type[Stats]) -> Stats | None:
    """The ``cls`` of stage ``stage``'s ``stats.json`` when it says ``complete``, else None.

    A stage that finds its work finished (its own check of its inputs) returns this instead of
    entering a :class:`eagle3.stage.StageRun`, so that opening a finished run's notebook leaves
    ``stats.json`` and ``progress.json`` byte-identical.
    """
    return stage_record(run_dir, stage).as_stats(cls)
