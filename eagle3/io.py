"""File helpers shared by every stage: atomic writes, JSON/JSONL readers, digests, ``progress.json``, ``stats.json``.

Every stage writes only its own folder, writes files atomically (temp file + ``os.replace``),
keeps ``progress.json`` fresh (at least every few seconds while it works) and ends with
``stats.json``. See ``docs/DESIGN.md`` ("Stage contracts").
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = [
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_write_json",
    "atomic_path",
    "read_json",
    "Progress",
    "window_rates",
    "write_stats",
    "dir_bytes",
    "free_bytes",
    "read_jsonl",
    "file_sha256",
    "format_bytes",
]


# the process's umask, read once (os.umask can only be read by setting it; at import no thread writes files)
_UMASK = os.umask(0o022)
os.umask(_UMASK)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is renamed over ``path``, with the mode a
    plain ``open()`` gives (``0o666`` less the umask).

    On an exception the temporary file is removed and ``path`` is left untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    # mkstemp makes the file 0600: give it the mode a plain open() would (stats.json, params.yaml and
    # the figures are read by whoever shares the run, as its report's pages are)
    os.fchmod(fd, 0o666 & ~_UMASK)
    os.close(fd)
    tmp_p = Path(tmp)
    try:
        yield tmp_p
        os.replace(tmp_p, path)
    except BaseException:
        tmp_p.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file in the same folder, fsync, rename)."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def read_json(path: str | Path, default: Any = None) -> Any:
    """Read JSON from ``path``; ``default`` when the file does not exist."""
    p = Path(path)
    if not p.exists():
        return default
    return json.loads(p.read_text(encoding="utf-8"))


def read_jsonl(
    path: str | Path,
    *,
    error: type[Exception] = ValueError,
    missing_ok: bool = False,
) -> list[Any]:
    """The records of a JSON-lines file, in file order; tolerant of a torn last line.

    Writers append ``json.dumps(record) + "\\n"`` and flush, so a writer killed mid-write leaves at
    most one incomplete *last* line without its newline. That line is dropped when it does not
    parse (a complete record that merely lacks the final newline is kept). Blank lines are skipped.
    Any other line that is not JSON is corruption and raises.

    Args:
        path: the ``.jsonl`` file.
        error: exception class raised for a corrupt line or a missing file (e.g. the stage's
            ``VocabError``), constructed with one message argument ``"<file>:<line>: ..."``.
        missing_ok: return ``[]`` for a missing file instead of raising ``error``.

    Returns:
        list: one decoded JSON value (usually a dict) per complete line.

    Raises:
        error: the file is missing (unless ``missing_ok``) or a line other than a torn last line
            is not valid JSON.
    """
    p = Path(path)
    if not p.is_file():
        if missing_ok:
            return []
        raise error(f"{p}: no such file")
    out: list[Any] = []
    data = p.read_bytes()
    lines = data.split(b"\n")
    # After the last newline: b"" for a cleanly ended file, else the torn (or unterminated) tail.
    tail = lines.pop()
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError as exc:
            raise error(f"{p}:{lineno}: not valid JSON ({exc})") from None
    if tail.strip():
        try:
            out.append(json.loads(tail))
        except ValueError:
            pass  # torn last line of an interrupted writer: not a record yet
    return out


def json_digest(obj) -> str:
    """A 16-hex-digit sha256 digest of ``obj`` as JSON (sorted keys, ``str`` for what JSON cannot hold):
    the resume key of a measurement's inputs."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def file_sha256(path: str | Path) -> str:
    """Hex sha256 (64 characters) of a file's bytes (``hashlib.file_digest``, streamed)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def format_bytes(n: float | None) -> str:
    """``n`` bytes in binary units for people: ``512 B``, ``1.5 KiB``, ``3.2 GiB``; ``-`` for None."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)  # unreachable: TiB returns above


def dir_bytes(path: str | Path) -> int:
    """Total size in bytes of the regular files under ``path`` (0 when it does not exist)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


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
    an ETA of 1,175 s on a run with ~560 s to go (benchmarks/RESULTS.md, session 22); the window also
    follows a machine whose load changes. ``tokens_per_s`` stays the phase's average.

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
        self.path = self.dir / "progress.json"
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
        # (elapsed_s of this phase, own units, own tokens) at each write: the ETA's window
        self.history: collections.deque[tuple[float, int, int]] = collections.deque()
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
        return (self.tokens - self._start_tokens) / self.elapsed_s

    ETA_WINDOW_S = 120.0
    ETA_MIN_UNITS = 8

    def eta_rate(self, of: str = "units") -> float:
        """Units (``of="units"``) or tokens (``of="tokens"``: stage 3's token-based ETA) per second that
        ``eta_s`` divides by (see the class docstring): the rate over the last :attr:`ETA_WINDOW_S`
        seconds of this phase's own work, or the phase's average while the phase is younger than that or
        the window holds fewer than :attr:`ETA_MIN_UNITS` units (a stage 5 measurement takes minutes:
        one unit more or less in a window would swing its ETA twofold)."""
        now = self.elapsed_s
        own = (self.done - self._start_done, self.tokens - self._start_tokens)
        col = 1 if of == "units" else 2
        then = None
        for point in self.history:  # oldest first: the newest point at least a window old
            if point[0] > now - self.ETA_WINDOW_S:
                break
            then = point
        if then is None or own[0] - then[1] < self.ETA_MIN_UNITS:
            return own[col - 1] / now
        return (own[col - 1] - then[col]) / max(now - then[0], 1e-9)

    def snapshot(self, status: str) -> dict:
        rate = (self.done - self._start_done) / self.elapsed_s
        remaining = (self.total - self.done) if self.total is not None else None
        eta_rate = self.eta_rate()
        eta = remaining / eta_rate if (remaining is not None and eta_rate > 0) else None
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
            "updated": time.time(),
            "pid": os.getpid(),
            "extra": self.extra,
        }

    def _write(self, status: str, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._last < self.interval_s:
            return
        with self._lock:
            if self._closed.is_set() and status == "running":
                return
            self._last = now
            elapsed = now - self.t0
            self.history.append((elapsed, self.done - self._start_done, self.tokens - self._start_tokens))
            # keep one point older than the window (the ETA's start), none before it
            while len(self.history) > 1 and self.history[1][0] <= elapsed - self.ETA_WINDOW_S:
                self.history.popleft()
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


def write_stats(stage_dir: str | Path, stats: dict, complete: bool = True) -> dict:
    """Write ``stats.json`` (the stage's summary numbers) atomically; ``complete`` marks the stage done."""
    out = dict(stats)
    out["complete"] = complete
    out["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    atomic_write_json(Path(stage_dir) / "stats.json", out)
    return out


def is_disk_full(exc: BaseException, folder: str | Path | None = None) -> bool:
    """Whether ``exc`` (raised by a write) means the disk is full: ``ENOSPC``, its text ("No space left
    on device", Rust's "os error 28"), or - with ``folder`` - any OSError/RuntimeError while that
    folder's file system has less than 64 MiB free (``torch.save`` reports a full disk as
    ``RuntimeError: [enforce fail at inline_container.cc:...] unexpected pos``)."""
    import errno

    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    msg = str(exc)
    if "No space left on device" in msg or "os error 28" in msg:
        return True
    if folder is None or not isinstance(exc, (OSError, RuntimeError)):
        return False
    try:
        return free_bytes(folder) < 64 * 2**20
    except OSError:
        return False


def free_bytes(path: str | Path) -> int:
    """Free bytes on the filesystem holding ``path`` (its nearest existing parent)."""
    p = Path(path).resolve()
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def window_rates(points: list[tuple[float, float]], min_window_s: float) -> list[tuple[float, float, float]]:
    """Rates of a cumulative counter over windows of at least ``min_window_s`` seconds.

    A rate between two progress points a few milliseconds apart (a batch written just after a
    heartbeat) is a huge number that flattens a throughput plot; here every window spans at least
    ``min_window_s``, except a whole series shorter than that. Points with the same time are never
    split, and a short remainder at the end is merged into the window before it.

    Args:
        points: ``(t, total)`` pairs, ``t`` in seconds (ascending), ``total`` cumulative (tokens, samples).
        min_window_s: the shortest window in seconds (e.g. 1/30 of the run, or a few heartbeats).

    Returns:
        ``[(t_from, t_to, rate per second), ...]``; empty for fewer than two points or no elapsed time.
    """
    wins: list[tuple[float, float, float, float]] = []  # (t_from, total_from, t_to, total_to)
    if len(points) < 2:
        return []
    (t_prev, c_prev), last = points[0], len(points) - 1
    for i in range(1, len(points)):
        t, c = points[i]
        if i < last and (t - t_prev < min_window_s or points[i + 1][0] <= t):
            continue
        if i == last and t - t_prev < min_window_s and wins:  # a short remainder joins the window before it
            t_prev, c_prev, _, _ = wins.pop()
        if t > t_prev:
            wins.append((t_prev, c_prev, t, c))
        t_prev, c_prev = t, c
    return [(a, b, (cb - ca) / (b - a)) for a, ca, b, cb in wins]
