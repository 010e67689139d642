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

Stale stages: when a stage starts, :class:`StageRun` takes the sha256 of every earlier stage's file
it consumes (:func:`consumed_files`) and writes them to ``inputs.json`` (``complete: false``: the
partial outputs of an interrupted run were made from them); :meth:`StageRun.finish` marks the record
complete before it writes ``stats.json``. :func:`stale_inputs` compares a finished stage's record with the files now: the
runner refuses to skip a finished stage whose inputs changed (or redoes it with ``--redo``), and a
stage called directly on such a folder refuses too (:func:`check_fresh`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from eagle3.io import Progress, atomic_write_json, file_sha256, read_json, write_stats
from eagle3.rundir import EVALUATE, EXTRACT, STAGES, STATS_FILE, SYNTHESIZE, TRAIN, VOCAB, RunDir, stage_dir

__all__ = ["Stats", "StageRun", "completed_stats", "consumed_files", "input_digests", "stale_inputs", "stale_message",
           "check_fresh"]


# ----------------------------------------------------------------------------------------------
# Input digests (inputs.json)
# ----------------------------------------------------------------------------------------------


def consumed_files(run_dir: str | Path, stage: int, params=None) -> list[Path]:
    """The earlier stages' files that stage ``stage`` reads (docs/DESIGN.md "Stage contracts").

    1: the local prompt files (``kind: file`` sources of ``synthesize.sources``; embedded sets and
    Hugging Face datasets are versioned by the package / the hub). 2: ``samples.jsonl``.
    3: ``train.parquet``. 4: both tokenized splits, the vocab mapping (``vocab_mapping.safetensors``,
    ``mapping.json``) and, offline, Stage 3's ``meta.json`` and ``manifest.jsonl`` (whose sha256 lines
    stand for the hidden-state files). 5: ``samples.jsonl``, both tokenized splits (training prompts
    are excluded by their ids; the diagnosis reads held-out rows), the vocab mapping, Stage 3's
    ``meta.json``, the drafter (``config.json``, ``model.safetensors``; ``evaluate.drafter_dir`` when
    set) and the local files of ``evaluate.sources``.
    A file that does not exist is recorded as absent (a full-size vocab has no mapping file).
    """
    rd = RunDir(run_dir)

    def local_files(section) -> list[Path]:
        from eagle3.prompts import source_file

        return [f for src in getattr(section, "sources", None) or [] if (f := source_file(src)) is not None]

    if stage == SYNTHESIZE:
        return local_files(getattr(params, "synthesize", None))
    if stage == VOCAB:
        return [rd.samples]
    if stage == EXTRACT:
        return [rd.tokenized("train")]
    mapping = [rd.vocab_mapping, rd.mapping_json]
    if stage == TRAIN:
        online = bool(getattr(getattr(params, "train", None), "online", False))
        return [rd.tokenized("train"), rd.tokenized("heldout"), *mapping,
                *([] if online else [rd.extract_meta, rd.manifest])]
    if stage == EVALUATE:
        drafter = rd.evaluated_drafter(params)
        return [rd.samples, rd.tokenized("train"), rd.tokenized("heldout"), *mapping, rd.extract_meta,
                drafter / "config.json", drafter / "model.safetensors", *local_files(getattr(params, "evaluate", None))]
    raise ValueError(f"no stage {stage}")


# eagle3 status hashes an input of at most this size (sha256 ~450 MiB/s per core on the CI machine)
QUICK_HASH_BYTES = 32 * 2**20


def _key(run_dir: Path, f: Path) -> str:
    try:
        return f.relative_to(run_dir).as_posix()
    except ValueError:
        return str(f)  # outside the run (evaluate.drafter_dir): the absolute path


def input_digests(run_dir: str | Path, stage: int, params=None) -> dict[str, dict | None]:
    """``{path relative to the run: {"sha256", "bytes"} or None when absent}`` of :func:`consumed_files`.

    Cost: one sha256 pass over each file (~450 MiB/s on one core of the CI machine); the hidden-state
    files are covered through the manifest's digests, not hashed here."""
    run_dir = Path(run_dir)
    out: dict[str, dict | None] = {}
    for f in consumed_files(run_dir, stage, params):
        out[_key(run_dir, f)] = {"sha256": file_sha256(f), "bytes": f.stat().st_size} if f.is_file() else None
    return out


def stale_inputs(run_dir: str | Path, stage: int, params=None, quick: bool = False) -> list[str]:
    """Why a stage's outputs (finished or partial) no longer match its inputs: one line per changed,
    new or removed input (empty: unchanged, or no ``inputs.json``: a stage that never started, or one
    that ran before stages recorded their inputs, which is not checked).

    ``quick`` (``eagle3 status``) compares the sizes and hashes only files of at most
    :data:`QUICK_HASH_BYTES` (prompt files, splits, mappings, the drafter: well under a second in
    all); a change that keeps the size of a larger file is then missed, which the full check (the
    runner, ``eagle3 verify``) catches."""
    rec = read_json(RunDir(run_dir).inputs(stage), None)
    if not rec or "files" not in rec:
        return []
    then = rec["files"]
    if quick:
        run_dir = Path(run_dir)
        now = {_key(run_dir, f): ({"sha256": None, "bytes": f.stat().st_size} if f.is_file() else None)
               for f in consumed_files(run_dir, stage, params)}
        same = {k for k in set(then) | set(now)
                if (then.get(k) is None) == (now.get(k) is None) and (then.get(k) or {}).get("bytes") == (now.get(k) or {}).get("bytes")}
        for k in same:
            a = then.get(k)
            f = run_dir / k  # an absolute key (a file outside the run) stays itself
            now[k] = a if a is None or a["bytes"] > QUICK_HASH_BYTES else {"sha256": file_sha256(f), "bytes": a["bytes"]}
    else:
        now = input_digests(run_dir, stage, params)
    out = []
    # A file the record does not name at all was not an input when the stage ran (an older version
    # of consumed_files): nothing to compare it with, as for a folder without inputs.json. Absent
    # files are recorded as null, so a file that appeared since is still caught.
    for k in sorted(then):
        a, b = then.get(k), now.get(k)
        if (a or {}).get("sha256") == (b or {}).get("sha256"):
            continue
        if a is None:
            out.append(f"{k}: absent when stage {stage} ran, present now")
        elif b is None:
            out.append(f"{k}: removed since stage {stage} ran")
        elif b["sha256"] is None:  # quick: sizes only
            out.append(f"{k}: {a['bytes']} bytes when stage {stage} ran, {b['bytes']} now")
        else:
            out.append(f"{k}: sha256 {a['sha256'][:16]} ({a['bytes']} bytes) when stage {stage} ran, "
                       f"{b['sha256'][:16]} ({b['bytes']} bytes) now")
    return out


def stale_message(stage: int, reasons: list[str], params_file: str | Path | None = None) -> str:
    """The refusal of a finished stage whose inputs changed, with the command that redoes it."""
    pf = str(params_file) if params_file else "PARAMS"
    return (f"stage {stage} ({STAGES[stage]}) is complete, but its inputs changed since it ran:\n  "
            + "\n  ".join(reasons)
            + f"\nIts outputs were made from the old inputs; nothing was changed. Redo it with "
            f"`eagle3 run {pf} --stages {stage}-5 --redo {stage}` (the stage starts over; a later stage "
            f"whose inputs change with it is redone too).")


def check_fresh(run_dir: str | Path, stage: int, params, error: type[Exception]) -> None:
    """Raise ``error`` (:func:`stale_message`) when finished stage ``stage``'s inputs changed.

    Called by a stage before it returns its finished results without running (extract, train), so
    that a notebook opened on a stale run refuses as the runner does."""
    reasons = stale_inputs(run_dir, stage, params)
    if reasons:
        raise error(stale_message(stage, reasons))


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
        atomic_write_json(RunDir(self.run_dir).inputs(self.stage),
                          {"stage": self.stage, "complete": complete, "files": self.inputs})

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


def completed_stats(run_dir: str | Path, stage: int, cls: type[Stats]) -> Stats | None:
    """The ``cls`` of stage ``stage``'s ``stats.json`` when it says ``complete``, else None.

    A stage that finds its work finished (its own check of its inputs) returns this instead of
    entering a :class:`StageRun`, so that opening a finished run's notebook leaves ``stats.json``
    and ``progress.json`` byte-identical (issue 16).
    """
    st = read_json(stage_dir(run_dir, stage, create=False) / STATS_FILE, None)
    return cls.from_dict(st) if isinstance(st, dict) and st.get("complete") else None
