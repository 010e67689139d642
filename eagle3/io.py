"""File helpers shared by every stage: atomic writes, JSON/JSONL readers, digests, sizes, disk space.

Every stage writes only its own folder and writes files atomically (temp file + ``os.replace``), so
that a killed process leaves the old file or the new one, never half of one. The stage records
(``progress.json``, ``stats.json``, ``inputs.json``) are :mod:`eagle3.stage`'s. See ``docs/DESIGN.md``
("Stage contracts").
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = [
    "atomic_write_bytes",
    "atomic_write_text",
    "atomic_write_json",
    "atomic_path",
    "read_json",
    "window_rates",
    "dir_bytes",
    "free_bytes",
    "read_jsonl",
    "file_sha256",
    "format_bytes",
    "json_digest",
    "is_disk_full",
    "path_kind",
    "naming_file",
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
    with atomic_path(path) as tmp, naming_file(path):
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
    """Read JSON from ``path``; ``default`` when the file does not exist.

    Raises:
        DamagedFile: the file is not UTF-8 JSON (a ``ValueError``: callers that treat a torn file as
            absent catch it as one); the message names the file, line and column.
    """
    from eagle3.errors import DamagedFile

    p = Path(path)
    if not p.exists():
        return default
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DamagedFile(f"{p}:{exc.lineno}:{exc.colno}: not valid JSON ({exc.msg.removesuffix(' at')}): the file is damaged "
                          f"(cut short or edited); restore it or redo the stage that wrote it") from None
    except ValueError as exc:  # UnicodeDecodeError
        raise DamagedFile(f"{p}: not valid JSON ({exc}): the file is damaged; restore it or redo the stage "
                          f"that wrote it") from None


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


_NOT_FILES = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
              (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"))


def path_kind(path: str | Path) -> tuple[str, str]:
    """What ``path`` is, for a message about a file the user named (a params file, a prompt file).

    Returns:
        tuple: ``(kind, words)``; ``kind`` is ``"file"`` (a regular file), ``"missing"``, ``"folder"``
        or ``"other"`` (a device, pipe or socket: reading it blocks or never ends); ``words`` says it
        in a sentence's terms ("a folder", "a character device", "a named pipe (FIFO)"), with the
        link followed named ("a character device (a link to /dev/zero)").
    """
    p = Path(path)
    link = f" (a link to {os.readlink(p)})" if p.is_symlink() else ""
    try:
        mode = p.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        return "missing", f"missing{link}"
    except OSError as exc:  # a link loop, a folder without search permission
        return "other", f"not accessible{link}: {exc.strerror}"
    if stat.S_ISREG(mode):
        return "file", f"a regular file{link}"
    if stat.S_ISDIR(mode):
        return "folder", f"a folder{link}"
    return "other", next(w for test, w in _NOT_FILES if test(mode)) + link


@contextmanager
def naming_file(path: str | Path) -> Iterator[None]:
    """Re-raise an ``OSError`` without a file name as the same error naming ``path``.

    Python names the file of a failed ``open()``, not of a failed ``write()``/``flush()`` (a full
    disk: ``[Errno 28] No space left on device`` and nothing else); wrap the writes of a file with it.
    """
    try:
        yield
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc


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
