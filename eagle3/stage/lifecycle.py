"""One execution of a stage: :class:`StageRun` (progress, tracking, ``inputs.json``, ``stats.json``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagle3.io import atomic_write_json
from eagle3.rundir import STAGES, RunDir, stage_dir
from eagle3.stage.inputs import input_digests, params_read
from eagle3.stage.progress import Progress
from eagle3.stage.record import Stats, write_stats

__all__ = ["StageRun"]


def _as_dict(stats: Stats | dict[str, Any]) -> dict[str, Any]:
    return stats.to_dict() if isinstance(stats, Stats) else dict(stats)


def _remove_dead_temps(folder: Path) -> None:
    """Remove the temp files of :func:`eagle3.io.atomic_path` (``.<name>.<random>.tmp``) that a killed
    earlier execution left at the top of its stage folder. Safe when the stage starts: this process
    has no atomic write running yet, and other ranks write there only before (stage 3's journals, in
    ``prepare``, which ends with a collective) or into their own sub-folders."""
    for f in folder.glob(".*.tmp") if folder.is_dir() else []:
        if f.is_file():
            f.unlink(missing_ok=True)


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

    On entry (main rank) the temp files a killed earlier execution left at the top of the stage
    folder are removed, and the inputs are put on record (module docstring).

    Attributes:
        dir (Path): the stage folder.
        progress (Progress): the live ``progress.json`` (heartbeat every few seconds).
        inputs (dict): :func:`input_digests` taken at entry (written to ``inputs.json`` on completion).
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
        # what this execution consumes, on record from the start (the partial outputs of a killed
        # run were made from these) and marked complete by finish(); main rank only
        self.inputs = input_digests(self.run_dir, self.stage, self.params) if self.main else {}
        if self.main:
            _remove_dead_temps(self.dir)
            self._write_inputs(False)
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

    def _write_inputs(self, complete: bool) -> None:
        # no timestamp: re-running a finished stage on the same inputs rewrites the same bytes
        record = {"stage": self.stage, "complete": complete, "files": self.inputs}
        read = params_read(self.stage, self.params)
        if read is not None:  # the params the stage reads: a hand edit of params.yaml makes it stale
            record["params"] = read
        atomic_write_json(RunDir(self.run_dir).inputs(self.stage), record)

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
        if complete:  # before stats.json: a complete stage always has its inputs on record
            self._write_inputs(True)
        out = write_stats(self.dir, d, complete=complete)
        self._finished = True
        self.close("done" if complete else "failed")
        return out
