"""The stage lifecycle, written once: progress, tracking, ``stats.json``, failure status.

Every stage's ``run(params, run_dir)`` has the same shape::

    with StageRun(params, run_dir, 2, total=len(samples), unit="samples") as st:
        for batch in ...:
            ...
            st.progress.update(len(batch), tokens=n)
        st.figure("coverage", fig)                 # PNG in the stage folder + W&B
        return st.finish(VocabStats(...))          # stats.json (complete: true), progress "done"

On an exception inside the block ``progress.json`` gets status ``failed`` (``interrupted`` for
Ctrl-C) and the error's one-line text in ``extra.error``; the W&B run is closed and the exception
propagates. ``stats.json`` is written only by :meth:`StageRun.finish` (``complete=False`` for a
stage that stopped early but wants its numbers on disk).

The W&B run (:class:`eagle3.tracking.Tracker`) is opened on first use of :attr:`StageRun.tracker`,
so a stage whose results come late (stage 5) opens it only then, and a non-main rank that never
touches it opens none.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from eagle3.io import Progress, read_json, write_stats
from eagle3.rundir import STAGES, STATS_FILE, stage_dir

__all__ = ["Stats", "StageRun", "completed_stats"]


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


def _as_dict(stats: Stats | dict[str, Any]) -> dict[str, Any]:
    return stats.to_dict() if isinstance(stats, Stats) else dict(stats)


class StageRun:
    """Context manager around one execution of stage ``stage`` of a run.

    Args:
        params: the resolved :class:`eagle3.config.Params` (the Tracker logs them as the W&B config).
        run_dir: the run directory.
        stage: stage number 1..5; the stage folder ``run_dir/NN_name`` is created.
        total: work units expected (None when unknown), for ``progress.json`` and the bar.
        unit: name of the work unit ("samples", "steps", ...).
        done: units already finished (a resumed stage).
        tokens: tokens already processed (a resumed stage).
        projected_bytes: the expected size of the stage folder, shown by ``eagle3 status``.
        progress: a factory ``(stage_dir) -> Progress`` for a stage with its own Progress subclass
            (stage 3 folds per-rank files in); the arguments above are then unused.
        main: False on non-main ranks: no stats.json and no W&B run from this process.

    Attributes:
        dir (Path): the stage folder.
        progress (Progress): the live ``progress.json`` (heartbeat every few seconds).
        t0 (float): ``time.time()`` at entry; :attr:`elapsed_s` counts from it.
    """

    def __init__(
        self,
        params,
        run_dir: str | Path,
        stage: int,
        *,
        total: int | None = None,
        unit: str = "samples",
        done: int = 0,
        tokens: int = 0,
        projected_bytes: int | None = None,
        progress: Callable[[Path], Progress] | None = None,
        main: bool = True,
    ) -> None:
        self.params = params
        self.run_dir = Path(run_dir)
        self.stage = stage
        self.name = STAGES[stage]
        self.main = main
        self._progress_args = dict(total=total, unit=unit, done=done, tokens=tokens, projected_bytes=projected_bytes)
        self._progress_factory = progress
        self.dir: Path = stage_dir(self.run_dir, stage)
        self.progress: Progress | None = None
        self._tracker = None
        self._finished = False
        self.t0 = time.time()

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> StageRun:
        self.t0 = time.time()
        if self._progress_factory is not None:
            self.progress = self._progress_factory(self.dir)
        else:
            self.progress = Progress(self.dir, desc=self.name, **self._progress_args)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.close("done")
        else:
            if self.progress is not None and exc is not None:
                self.progress.extra["error"] = f"{exc_type.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            self.close("interrupted" if issubclass(exc_type, KeyboardInterrupt) else "failed")
        return False  # never swallow the exception

    def close(self, status: str = "done") -> None:
        """Write the final ``progress.json`` status (done/failed/interrupted/stopped) and close the
        W&B run. Idempotent: the first call wins."""
        if self.progress is not None:
            self.progress.close(status)
        self._finish_tracker()

    def _finish_tracker(self) -> None:
        if self._tracker is not None:
            self._tracker.finish()
            self._tracker = None

    # ------------------------------------------------------------------ results
    @property
    def elapsed_s(self) -> float:
        """Seconds since the stage started (wall clock)."""
        return time.time() - self.t0

    @property
    def tracker(self):
        """The stage's :class:`eagle3.tracking.Tracker` (W&B), opened on first use (main rank only)."""
        if self._tracker is None:
            if not self.main:
                raise RuntimeError("StageRun.tracker on a non-main rank (pass main=True on rank 0 only)")
            from eagle3.tracking import Tracker  # wandb is heavy: imported only by stages that log

            self._tracker = Tracker(self.params, self.run_dir, self.name)
        return self._tracker

    def figure(self, name: str, fig) -> Path | None:
        """Save ``fig`` as ``<stage folder>/<name>.png`` and log it to W&B (main rank only).

        Returns:
            Path | None: the PNG file (None on a non-main rank).
        """
        if not self.main:
            return None
        return self.tracker.figure(name, fig)

    def finish(self, stats: Stats | dict[str, Any], complete: bool = True, log: bool = False) -> dict[str, Any]:
        """End the stage: put the numbers in the W&B summary (and, with ``log``, log the numeric ones),
        write ``stats.json`` (adding ``complete`` and ``finished_at``), set progress to ``done``
        (``failed`` when not ``complete``) and close the W&B run.

        Args:
            stats: a :class:`Stats` or a plain dict of the stage's numbers.
            complete: False for a stage that stopped short (the runner then does not skip it).
            log: also ``tracker.log`` the int/float values (stages 1 and 5 do).

        Returns:
            dict: what ``stats.json`` now holds (on a non-main rank: the stats, nothing written).
        """
        d = _as_dict(stats)
        if not self.main:
            self.close("done" if complete else "failed")
            return d
        if log:
            self.tracker.log({k: v for k, v in d.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        self.tracker.summary(d)
        out = write_stats(self.dir, d, complete=complete)
        self._finished = True
        self.close("done" if complete else "failed")
        return out


def completed_stats(run_dir: str | Path, stage: int, cls: type[Stats]) -> Stats | None:
    """The ``cls`` of stage ``stage``'s ``stats.json`` when it says ``complete``, else None.

    A stage that finds its work finished (its own check of its inputs) returns this instead of
    entering a :class:`StageRun`, so that opening a finished run's notebook leaves ``stats.json``
    and ``progress.json`` byte-identical (issue 16).
    """
    st = read_json(stage_dir(run_dir, stage, create=False) / STATS_FILE, None)
    return cls.from_dict(st) if isinstance(st, dict) and st.get("complete") else None
