"""``eagle3 status``: each stage's state from its ``progress.json`` and ``stats.json``, as a table;
and the same numbers live in ``eagle3 run``'s terminal while a stage's notebook runs (:class:`ProgressEcho`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

from eagle3.io import format_bytes, read_json
from eagle3.rundir import STAGES, RunDir, read_run_params
from eagle3.stage import stage_record, stale_inputs

__all__ = ["ProgressEcho", "status_rows", "format_status"]


def _format_duration(s: float | None) -> str:
    """Seconds for a terminal column: ``4m05s``, ``1h02m`` from an hour on; ``-`` for None."""
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class ProgressEcho:
    """Shows a running stage's ``progress.json`` in the terminal of ``eagle3 run`` while papermill runs
    its notebook (whose own tqdm bars are notebook widgets, invisible there).

    A thread reads the file every ``interval_s``. On a terminal it drives a tqdm bar on ``file``
    (done/total, the stage's own tokens/s and ETA, bytes on disk); elsewhere (a log file, CI) it writes
    one line per ``log_every_s`` when something changed, and at once when a phase ends (the last
    state seen of the phase that ended, then the next phase's first), each ending with the file's
    time (``(HH:MM:SS UTC)``). A file left by an earlier execution (older
    than this echo) is not shown until the stage rewrites it. The numbers are the ones ``eagle3
    status`` shows (:class:`eagle3.stage.Progress` writes them); a new unit or total (a stage's next
    phase) starts a new bar.

    Args:
        path: the stage's ``progress.json``. desc: the bar's label (``stage 3 (extract)``).
        file: where to write (default ``sys.stderr``). interval_s: poll period, seconds.
        log_every_s: seconds between lines when ``file`` is not a terminal.
        tty: draw a bar (True) or write lines (False); None: a bar where ``file`` is a terminal that
            reports a width (a pseudo-terminal of width 0, e.g. ``script`` run without a terminal, would
            make tqdm draw empty lines).
    """

    def __init__(self, path: str | Path, desc: str, file=None, interval_s: float = 2.0,
                 log_every_s: float = 60.0, tty: bool | None = None) -> None:
        self.path, self.desc = Path(path), desc
        self.file = file if file is not None else sys.stderr
        self.interval_s, self.log_every_s = interval_s, log_every_s
        if tty is None:
            try:
                tty = self.file.isatty() and os.get_terminal_size(self.file.fileno()).columns > 0
            except (AttributeError, OSError, ValueError):
                tty = False
        self.tty = tty
        self.t0 = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="eagle3-progress-echo", daemon=True)
        self._bar = None
        self._key = None
        self._last_line = (0.0, None)
        self._phase = self._seen = None  # log mode: the (unit, total) and the line of the last poll

    def __enter__(self) -> ProgressEcho:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.poll(final=True)
        if self._bar is not None:
            self._bar.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - the echo must never stop a stage
                pass

    def poll(self, final: bool = False) -> None:
        """Read the file once and show it (``final``: write the last line even if not due)."""
        prog = read_json(self.path, None)
        if not isinstance(prog, dict) or float(prog.get("updated") or 0) < self.t0:
            return
        extras = [f"{prog.get('tokens_per_s') or 0:.0f} tokens/s"]
        if prog.get("status") == "running" and prog.get("eta_s") is not None:
            extras.append(f"ETA {_format_duration(prog['eta_s'])}")
        if prog.get("bytes_on_disk"):
            extras.append(f"{format_bytes(prog['bytes_on_disk'])} on disk")
        if prog.get("status") == "running" and prog.get("machine_busy"):  # the rate and ETA are a share of the machine
            extras.append(str(prog["machine_busy"]))
        if self.tty:
            self._show_bar(int(prog.get("done") or 0), prog.get("total"), str(prog.get("unit") or ""), ", ".join(extras))
            return
        line = f"eagle3: {self.desc}: {_done_text(prog)}, {', '.join(extras)}"
        # the file's own time on each printed line (not in `line`, which says whether anything changed):
        # the ETAs of a log can be checked afterwards
        stamped = f"{line} ({time.strftime('%H:%M:%S', time.gmtime(float(prog['updated'])))} UTC)"
        # a new unit or total is the stage's next phase: the last state seen of the one that ended and
        # the new one's first are written at once (at one line a minute a log would skip whole phases)
        phase = (prog.get("unit"), prog.get("total"))
        new_phase = self._phase is not None and phase != self._phase
        if new_phase and self._seen is not None and self._seen[0] != self._last_line[1]:
            print(self._seen[1], file=self.file, flush=True)
        self._phase, self._seen = phase, (line, stamped)
        due = time.time() - self._last_line[0] >= self.log_every_s
        if line != self._last_line[1] and (due or final or new_phase):
            print(stamped, file=self.file, flush=True)
            self._last_line = (time.time(), line)

    def _show_bar(self, done: int, total, unit: str, postfix: str) -> None:
        from tqdm import tqdm

        if self._key != (unit, total):
            if self._bar is not None:
                self._bar.close()
            head = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} " if total else "{desc}: {n_fmt} "
            fmt = head + unit + "{postfix}"  # tqdm puts ", " before a postfix
            self._bar = tqdm(total=total, initial=done, desc=self.desc, file=self.file, bar_format=fmt,
                             dynamic_ncols=True, leave=True)
            self._key = (unit, total)
        self._bar.n = done
        self._bar.set_postfix_str(postfix, refresh=False)
        self._bar.refresh()


def _done_text(prog: dict) -> str:
    """``done/total unit`` of a ``progress.json`` (``?`` for an unknown total): status table and terminal echo."""
    total = prog.get("total")
    return f"{prog.get('done', 0)}/{total if total is not None else '?'} {prog.get('unit', '')}".strip()


def _run_params(run_dir: str | Path):
    """The run's resolved params (which files a stage consumes depends on a few), None if unreadable."""
    try:
        return read_run_params(run_dir)
    except Exception:  # noqa: BLE001 - status must show what it can of a damaged run directory
        return None


def status_rows(run_dir: str | Path) -> list[dict]:
    """One dict per stage from its ``progress.json`` and ``stats.json`` (missing -> 'not started').

    A 'running' stage whose progress file is older than 60 s is reported as 'stalled?' (its
    process may have died; re-running resumes it). A complete stage whose inputs changed size since
    it ran is 'stale' (sizes only, nothing is read: ``eagle3 verify`` hashes them). Only a running
    stage has an ETA; ``elapsed`` is the stage's time over all its executions (:class:`eagle3.stage.Progress`).
    """
    rows = []
    params = _run_params(run_dir)
    for s, name in STAGES.items():
        prog = read_json(RunDir(run_dir).progress(s), None)
        if stage_record(run_dir, s).complete:
            state = "stale" if stale_inputs(run_dir, s, params, quick=True) else "complete"
        elif prog is None:
            state = "not started"
        else:
            state = prog.get("status", "?")
            if state == "running" and time.time() - prog.get("updated", 0) > 60:
                state = "stalled?"
        p = prog or {}
        rows.append(
            {
                "stage": f"{s} {name[3:]}",
                "state": state,
                "done": _done_text(p) if prog else "-",
                "tokens/s": f"{p.get('tokens_per_s', 0):.0f}" if prog else "-",
                "elapsed": _format_duration(p.get("elapsed_s")) if prog else "-",
                "ETA": _format_duration(p.get("eta_s")) if prog and state == "running" else "-",  # none once it stopped
                "on disk": format_bytes(p.get("bytes_on_disk")) if prog else "-",
                "projected": format_bytes(p.get("projected_bytes")) if prog else "-",
                "updated": time.strftime("%H:%M:%S", time.localtime(p["updated"])) if p.get("updated") else "-",
            }
        )
    return rows


def format_status(run_dir: str | Path) -> str:
    """``eagle3 status`` as a fixed-width text table."""
    rows = status_rows(run_dir)
    cols = list(rows[0])
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    line = "  ".join(c.ljust(widths[c]) for c in cols)
    out = [f"run: {Path(run_dir).resolve()}", line, "  ".join("-" * widths[c] for c in cols)]
    out += ["  ".join(str(r[c]).ljust(widths[c]) for c in cols) for r in rows]
    # The two clocks differ on a resumed stage: say which one each column reads.
    out.append("tokens/s: this execution over its wall time (the report's tokens_per_s, where a stage has one, "
               "is its stats.json figure); ETA: at the phase's last 2 minutes' rate; elapsed: the stage's time over "
               "every execution")
    return "\n".join(out)
