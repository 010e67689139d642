"""``progress.json``: the live state of a running stage, and its tqdm bar."""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagle3.io import atomic_write_json, dir_bytes, read_json
from eagle3.rundir import PROGRESS_FILE

__all__ = ["Progress"]


class Progress:
    """Keeps ``<stage_dir>/progress.json`` current and drives a tqdm bar.

    Fields written: ``stage``, ``status`` (running/done/failed/interrupted), ``done``, ``total`` (work
    units, e.g. samples), ``tokens``, ``rate_units_per_s``, ``tokens_per_s``, ``eta_s`` (seconds; 0
    once ``done``), ``elapsed_s``, ``bytes_on_disk``, ``projected_bytes``, ``updated`` (unix seconds),
    ``extra``. The file is rewritten at most every ``interval_s`` seconds (default 2 s) and on ``close``.

    ``eta_s`` divides the units left by the rate of the last :attr:`ETA_WINDOW_S` seconds of this phase
    once the phase is that old and the window holds at least :attr:`ETA_MIN_UNITS` units, else by the
    phase's average rate: a training run's first step compiles (51 s on an H200) and its first epoch
    reads the hidden states from disk where later ones find them in the page cache, so the average put
    an ETA of 1,175 s on a training run with ~560 s to go (benchmarks/RESULTS.md); the window also
    follows a machine whose load changes. ``tokens_per_s`` stays the phase's average.

    The rate ends at the last finished unit, and the ETA counts down from what it was then: work that
    finishes in batches (stage 1 answers 64 prompts per call; stage 5's vLLM measurements take
    minutes each) reports nothing while a batch is in flight, and a rate over the time since would
    make the ETA grow by a minute per minute until the batch lands. The countdown stops at the time of
    the work after the batch in flight (taken as large as the last one), so a batch slower than the
    last keeps the rest's ETA rather than showing 0.

    ``machine_busy``: text while other processes keep the CPUs busy (:class:`eagle3.machine.OtherLoad`:
    they used more than half a CPU of the last interval), else None: the rates and ETAs then follow
    the other load, not this run.

    ``elapsed_s`` is the stage's time, not this object's: when the folder's ``progress.json`` is of an
    execution that did not end ``done`` (an interrupted, failed or killed run being resumed, or stage
    1's self-prompting phase, closed ``running``, before its answering phase), its ``elapsed_s`` is
    carried on. The rates (``tokens_per_s``, ``rate_units_per_s``, the ETA) count only this
    execution's own work of the current phase (:meth:`next_phase`): units passed as
    ``done``/``tokens`` or :meth:`resumed` are not in them.

    Args:
        stage_dir: the stage folder; ``progress.json`` goes there.
        total: number of work units expected (None when unknown).
        unit: name of the work unit shown in the bar (e.g. "samples").
        done: units already finished (resume).
        tokens: tokens already processed (resume).
        bytes_dir: folder whose size is reported as ``bytes_on_disk`` (default: stage_dir), walked at
            every write: for stages with a few files only.
        bytes_fn: ``bytes_fn() -> int`` reports ``bytes_on_disk`` instead of a walk (a stage writing many
            files counts its own bytes: Stage 3's writer and manifest), so the heartbeat never lists a folder.
    """

    def __init__(
        self,
        stage_dir: str | Path,
        total: int | None,
        unit: str = "samples",
        done: int = 0,
        tokens: int = 0,
        desc: str | None = None,
        bytes_dir: str | Path | None = None,
        projected_bytes: int | None = None,
        interval_s: float = 2.0,
        bytes_fn: Callable[[], int] | None = None,
    ) -> None:
        from tqdm.auto import tqdm

        self.dir = Path(stage_dir)
        self.path = self.dir / PROGRESS_FILE
        self.total = total
        self.unit = unit
        self.done = done
        self.tokens = tokens
        self._start_done = done
        self._start_tokens = tokens
        self.bytes_dir = Path(bytes_dir) if bytes_dir else self.dir
        self.bytes_fn = bytes_fn
        self.projected_bytes = projected_bytes
        self.interval_s = interval_s
        from eagle3.machine import OtherLoad

        self.other_load = OtherLoad()  # its first walk of /proc before the clock starts
        self.t0 = time.time()
        try:
            prev = read_json(self.path, None)
        except (OSError, ValueError):  # a damaged file of an earlier execution: its time is unknown
            prev = None
        # the stage's time before this execution (see the class docstring); a finished one starts anew
        self.elapsed_before = float(prev.get("elapsed_s") or 0.0) if isinstance(prev, dict) and prev.get(
            "status") != "done" else 0.0
        self._last = 0.0
        self.extra: dict = {}
        # (elapsed_s of this phase, own units, own tokens) at the phase's start and at each update that
        # counted work: the ETA's window starts and ends where work landed, never inside a batch
        self.history: collections.deque[tuple[float, int, int]] = collections.deque([(0.0, 0, 0)])
        # elapsed_s of this phase when a unit last finished, and how many units that update counted
        self._last_unit_at: float | None = None
        self._last_n = 0
        self.bar = tqdm(total=total, initial=done, unit=f" {unit}", desc=desc or self.dir.name, dynamic_ncols=True)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._write("running", force=True)
        # Heartbeat: keep progress.json fresh while a long unit of work (a generate batch, a
        # forward pass) runs, so that `eagle3 status` can tell "busy" from "dead".
        self._beat = threading.Thread(target=self._heartbeat, name="progress-heartbeat", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._closed.wait(max(self.interval_s, 1.0) * 2.5):
            self._write("running", force=True)

    def update(self, n: int = 1, tokens: int = 0, **extra: Any) -> None:
        """Record ``n`` more finished units and ``tokens`` more tokens; ``extra`` goes in the file."""
        self.done += n
        self.tokens += tokens
        if n > 0 or tokens > 0:  # stage 3 counts tokens between rows
            self._last_unit_at, self._last_n = self.elapsed_s, n
            self._remember(self._last_unit_at)
        self.extra.update(extra)
        self.bar.update(n)
        if tokens:
            self.bar.set_postfix(tok_s=f"{self.tokens_per_s:.0f}", refresh=False)
        self._write("running")

    def resumed(self, n: int = 1, tokens: int = 0) -> None:
        """Count ``n`` units (``tokens`` tokens) that an earlier execution finished and this one reuses
        (a resumed stage finding its records): in ``done`` and ``tokens``, not in the rates or the ETA."""
        self.done += n
        self.tokens += tokens
        self._start_done += n
        self._start_tokens += tokens
        self.bar.update(n)
        self._write("running")

    def next_phase(self, total: int | None, unit: str, desc: str | None = None) -> None:
        """Start the stage's next phase in the same ``progress.json``: a new unit and total, ``done``
        from 0, and rates (so the ETA) of this phase's own work. Stage 5's offline prompts take seconds
        each and its vLLM measurements minutes: one rate over both put its ETA minutes short.
        ``elapsed_s`` runs on (the earlier phases' time is kept) and ``tokens`` keeps counting."""
        from tqdm.auto import tqdm

        with self._lock:
            self.elapsed_before += self.elapsed_s
            self.t0 = time.time()
            self.total, self.unit = total, unit
            self.done = self._start_done = 0
            self._start_tokens = self.tokens
            self.history.clear()
            self.history.append((0.0, 0, 0))
            self._last_unit_at, self._last_n = None, 0
            self.bar.close()
            self.bar = tqdm(total=total, unit=f" {unit}", desc=desc or self.dir.name, dynamic_ncols=True)
        self._write("running", force=True)

    @property
    def elapsed_s(self) -> float:
        """Seconds of this phase of this execution (the rates' denominator; :meth:`next_phase`)."""
        return max(time.time() - self.t0, 1e-9)

    @property
    def stage_elapsed_s(self) -> float:
        """Seconds of the stage so far: earlier unfinished executions plus this one (``elapsed_s`` in the file)."""
        return self.elapsed_before + self.elapsed_s

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second of this phase's own work (resumed tokens excluded)."""
        return (self.tokens - self._start_tokens) / self.elapsed_s

    ETA_WINDOW_S = 120.0
    ETA_MIN_UNITS = 8

    def eta_rate(self, of: str = "units") -> float:
        """Units (``of="units"``) or tokens (``of="tokens"``: stage 3's token-based ETA) per second that
        ``eta_s`` divides by (see the class docstring): the rate over the :attr:`ETA_WINDOW_S` seconds of
        this phase's own work up to its last finished unit, or the phase's average up to then while the
        phase is younger than that or the window holds fewer than :attr:`ETA_MIN_UNITS` units (a stage 5
        measurement takes minutes: one unit more or less in a window would swing its ETA twofold).
        0.0 before the first unit finished."""
        end = self._last_unit_at
        if end is None:
            return 0.0
        own = (self.done - self._start_done, self.tokens - self._start_tokens)
        col = 1 if of == "units" else 2
        then = None
        for point in list(self.history):  # oldest first: the newest point at least a window before the last unit
            if point[0] > end - self.ETA_WINDOW_S:
                break
            then = point
        if then is None or own[0] - then[1] < self.ETA_MIN_UNITS:
            return own[col - 1] / max(end, 1e-9)
        return (own[col - 1] - then[col]) / max(end - then[0], 1e-9)

    def eta_s(self) -> float | None:
        """Seconds left (class docstring): the units left at the rate of :meth:`eta_rate`, less the time
        since the last unit finished, at least the time of the units after the batch in flight; None
        while the rate is unknown (no unit finished yet, or no total)."""
        rate = self.eta_rate()
        if self.total is None or rate <= 0 or self._last_unit_at is None:
            return None
        remaining = max(self.total - self.done, 0)
        after_batch = max(remaining - self._last_n, 0) / rate
        return max(remaining / rate - (self.elapsed_s - self._last_unit_at), after_batch)

    def snapshot(self, status: str) -> dict:
        """The ``progress.json`` object with ``status`` (the fields of the class docstring, plus ``pid``)."""
        rate = (self.done - self._start_done) / self.elapsed_s
        eta = self.eta_s()
        return {
            "stage": self.dir.name,
            "status": status,
            "unit": self.unit,
            "done": self.done,
            "total": self.total,
            "tokens": self.tokens,
            "rate_units_per_s": round(rate, 4),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "eta_s": 0.0 if status == "done" else (round(eta, 1) if eta is not None else None),
            "elapsed_s": round(self.stage_elapsed_s, 2),
            "bytes_on_disk": self.bytes_fn() if self.bytes_fn is not None else dir_bytes(self.bytes_dir),
            "projected_bytes": self.projected_bytes,
            "machine_busy": self.other_load.busy_text(),
            "updated": time.time(),
            "pid": os.getpid(),
            "extra": self.extra,
        }

    def _remember(self, elapsed: float) -> None:
        """Add the point of work landed at ``elapsed`` to the ETA's window (:attr:`history`)."""
        with self._lock:
            self.history.append((elapsed, self.done - self._start_done, self.tokens - self._start_tokens))
            # keep one point older than the window (the ETA's start), none before it
            while len(self.history) > 1 and self.history[1][0] <= elapsed - self.ETA_WINDOW_S:
                self.history.popleft()

    def _write(self, status: str, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._last < self.interval_s:
            return
        with self._lock:
            if self._closed.is_set() and status == "running":
                return
            self._last = now
            atomic_write_json(self.path, self.snapshot(status))

    def close(self, status: str = "done") -> None:
        """Write the final state (``done`` or ``failed``) and close the bar."""
        if self._closed.is_set():
            return
        self._write(status, force=True)
        self._closed.set()
        self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close("failed" if exc_type else "done")
