"""Stage 1's ``samples.jsonl``: the ONLY code that reads or writes it.

One conversation per line (UTF-8 JSON, ``ensure_ascii=False``, ``\\n``-terminated)::

    {"id", "source", "split": "train"|"heldout", "prompt_hash", "origin",
     "messages": [{"role": "system"|"user"|"assistant", "content", "reasoning"?}],
     "finish_reasons": ["stop"|"length"|..., one per assistant turn],
     "prompt_tokens": int (sum over turns of each request's prompt tokens),
     "completion_tokens": int (sum over turns; a final EOS token counts, as in vLLM's usage),
     "turn_usage": [{"prompt_tokens", "completion_tokens"} per assistant turn],
     "dropped_turns": int (only when later turns no longer fit the context),
     "settings": {"backend", "model", "temperature", "top_p", "max_new_tokens", "seed",
                  "enable_thinking", "reasoning"}}

Reading (:func:`read_samples`) is strict: every line must be JSON and pass :func:`check_sample`, ids
are unique; the error names the file and line. A torn last line (a write cut by a crash, or a stage
still running) is not a sample yet and is skipped (:func:`eagle3.io.read_jsonl`).

Writing: :class:`SampleStore` (append-only while stage 1 runs, crash recovery, final rewrite in
prompt order) and :func:`write_samples` (a whole file at once, atomically).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from eagle3.errors import SynthesisError

__all__ = ["SAMPLES_FILE", "ROLES", "SPLITS", "SamplesError", "samples_path", "check_sample", "read_samples",
           "write_samples", "sample_line", "SampleStore"]

log = logging.getLogger(__name__)

SAMPLES_FILE = "samples.jsonl"  # eagle3.rundir.SAMPLES_FILE
ROLES = ("system", "user", "assistant")
SPLITS = ("train", "heldout")


class SamplesError(SynthesisError, ValueError):
    """``samples.jsonl`` is missing, corrupt or locked; the message names the file (and line)."""


def samples_path(run_dir: str | Path) -> Path:
    """``<stage 1>/samples.jsonl`` of a run."""
    from eagle3.rundir import RunDir

    return RunDir(run_dir).samples


def _where(path: Path | str, lineno: int) -> str:
    return f"{path}:{lineno}"


def check_sample(obj: Any, where: str) -> dict:
    """Check one parsed line against the schema (module docstring); returns it.

    Raises:
        SamplesError: ``"<where>: field ..."`` for the first field that is missing or mistyped.
    """
    if not isinstance(obj, dict):
        raise SamplesError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key in ("id", "source"):
        if not isinstance(obj.get(key), str) or not obj[key]:
            raise SamplesError(f"{where}: field '{key}' must be a non-empty string (got {obj.get(key)!r})")
    if obj.get("split") not in SPLITS:
        raise SamplesError(f"{where}: field 'split' must be 'train' or 'heldout' (got {obj.get('split')!r})")
    msgs = obj.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise SamplesError(f"{where}: field 'messages' must be a non-empty list")
    n_assistant = 0
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise SamplesError(f"{where}: messages[{i}] must be an object")
        if m.get("role") not in ROLES:
            raise SamplesError(f"{where}: messages[{i}].role must be one of {ROLES} (got {m.get('role')!r})")
        if not isinstance(m.get("content"), str):
            raise SamplesError(f"{where}: messages[{i}].content must be a string (got {type(m.get('content')).__name__})")
        if m.get("reasoning") is not None:
            if m["role"] != "assistant":
                raise SamplesError(f"{where}: messages[{i}].reasoning is only allowed on assistant messages")
            if not isinstance(m["reasoning"], str):
                raise SamplesError(f"{where}: messages[{i}].reasoning must be a string")
        n_assistant += m["role"] == "assistant"
    fr = obj.get("finish_reasons")
    if fr is not None and (not isinstance(fr, list) or len(fr) != n_assistant):
        raise SamplesError(f"{where}: field 'finish_reasons' must be a list with one entry per assistant turn "
                           f"({n_assistant}), got {fr!r}")
    settings = obj.get("settings")
    if settings is not None and not isinstance(settings, dict):
        raise SamplesError(f"{where}: field 'settings' must be an object")
    return obj


def _lines(path: Path) -> Iterable[tuple[int, bytes]]:
    """``(line number, bytes)`` of the complete lines (a torn last line is skipped)."""
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.endswith(b"\n"):
                return  # a torn last line of a running/crashed stage: not a sample yet
            yield lineno, line


def _parse(line: bytes, where: str) -> dict:
    try:
        obj = json.loads(line)
    except ValueError as exc:
        detail = f" ({exc.msg} at column {exc.colno})" if isinstance(exc, json.JSONDecodeError) else ""
        raise SamplesError(f"{where}: not valid JSON{detail}") from None
    return check_sample(obj, where)


def read_samples(run_dir: str | Path, split: str | None = None, path: str | Path | None = None) -> list[dict]:
    """The samples of stage 1, validated, in file order.

    Args:
        run_dir: the run directory (ignored when ``path`` is given).
        split: ``"train"``, ``"heldout"`` or None (all).
        path: read this file instead of the run's ``samples.jsonl``.

    Returns:
        list[dict]: one dict per conversation (schema in the module docstring).

    Raises:
        SamplesError: ``split`` not train/heldout/None; the file is missing (run stage 1); a complete
            line is not JSON or fails :func:`check_sample`; a duplicated id (both lines named).
    """
    if split not in (None, *SPLITS):
        raise SamplesError(f"split must be 'train', 'heldout' or None, got {split!r}")
    from eagle3.io import read_jsonl

    p = Path(path) if path is not None else samples_path(run_dir)
    if not p.is_file():
        raise SamplesError(f"{p} does not exist: run stage 1 (synthesize) first")
    out: list[dict] = []
    seen: dict[str, int] = {}
    # the writer writes no blank line, so record i is line i
    for lineno, obj in enumerate(read_jsonl(p, error=SamplesError), start=1):
        check_sample(obj, _where(p, lineno))
        if obj["id"] in seen:
            raise SamplesError(f"{_where(p, lineno)}: duplicate id {obj['id']!r} (first on line {seen[obj['id']]})")
        seen[obj["id"]] = lineno
        if split is None or obj["split"] == split:
            out.append(obj)
    return out


def sample_line(sample: dict) -> bytes:
    """The exact bytes of one sample's line."""
    return (json.dumps(sample, ensure_ascii=False) + "\n").encode("utf-8")


def write_samples(run_dir: str | Path, samples: Iterable[dict], path: str | Path | None = None) -> Path:
    """Write a whole ``samples.jsonl`` atomically (each sample checked first); returns its path.

    Raises:
        SamplesError: a sample fails :func:`check_sample` (``<file>:<line>``) or an id repeats.
    """
    from eagle3.io import atomic_write_bytes

    p = Path(path) if path is not None else samples_path(run_dir)
    seen: set[str] = set()
    blob = bytearray()
    for i, s in enumerate(samples, start=1):
        check_sample(s, _where(p, i))
        if s["id"] in seen:
            raise SamplesError(f"{_where(p, i)}: duplicate id {s['id']!r}")
        seen.add(s["id"])
        blob += sample_line(s)
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(p, bytes(blob))
    return p


class SampleStore:
    """Append-only ``samples.jsonl`` with crash recovery (stage 1's writer).

    On open: an exclusive lock on ``.samples.jsonl.lock`` (``fcntl.flock``; released by the OS when
    the process dies, even by SIGKILL) keeps a second process from appending to the same file; a
    last line without its newline (a write torn by a crash) is cut off (``torn_lines``); every
    complete line must pass :func:`check_sample` (else :class:`SamplesError` naming the line).

    Attributes:
        path: the file.
        done: ids present, mapped to their ``completion_tokens``.
        torn_lines: 1 when a torn last line was dropped on open, else 0.

    Raises:
        SamplesError: another process holds the lock; a corrupt line.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.done: dict[str, int] = {}
        self.torn_lines = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.path.parent / f".{self.path.name}.lock", "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock.close()
            raise SamplesError(
                f"{self.path} is being written by another process (stage 1 already running on this run "
                f"directory?); wait for it or stop it first."
            ) from None
        if self.path.exists() and self.path.stat().st_size:
            self._cut_torn_line()
            for lineno, line in _lines(self.path):
                try:
                    obj = _parse(line, _where(self.path, lineno))
                except SamplesError as exc:
                    self._lock.close()
                    raise SamplesError(
                        f"{_where(self.path, lineno)}: not a sample line ({str(exc).split(': ', 1)[-1]}). Move the "
                        f"file away to start the stage afresh, or delete that line to keep the rest."
                    ) from None
                self.done.setdefault(obj["id"], int(obj.get("completion_tokens") or 0))
        self._f = open(self.path, "a", encoding="utf-8")

    def _cut_torn_line(self) -> None:
        with open(self.path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            torn = f.read(1) != b"\n"
        if not torn:
            return
        data = self.path.read_bytes()
        cut = data.rfind(b"\n") + 1
        with open(self.path, "r+b") as f:
            f.truncate(cut)
            f.flush()
            os.fsync(f.fileno())
        self.torn_lines = 1
        log.warning("%s: dropped a torn last line (%d bytes) left by an interrupted run", self.path, len(data) - cut)

    def append(self, sample: dict) -> None:
        """Write one sample line and flush it to the OS (survives SIGKILL of this process)."""
        self._f.write(json.dumps(sample, ensure_ascii=False) + "\n")
        self._f.flush()
        self.done[sample["id"]] = int(sample.get("completion_tokens") or 0)

    def close(self) -> None:
        """Flush, fsync and close the file; release the lock."""
        if not self._f.closed:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
        if not self._lock.closed:
            self._lock.close()  # releases the flock

    def finalize(self, order: list[str]) -> int:
        """Rewrite the file atomically with lines in ``order`` (ids not in ``order`` follow in file
        order), then close and unlock. Returns the number of such extra lines. No rewrite when the
        file is already in order.

        Raises:
            OSError: a failed write (a full disk) names ``samples.jsonl``; the file is left as it was.
        """
        from eagle3.io import atomic_path, naming_file

        with naming_file(self.path):  # a full disk: the error names the file
            self._f.flush()
            os.fsync(self._f.fileno())
        self._f.close()
        lines: dict[str, bytes] = {}
        file_order: list[str] = []
        for _, line in _lines(self.path):
            sid = json.loads(line)["id"]
            if sid not in lines:
                lines[sid] = line
                file_order.append(sid)
        wanted = [i for i in order if i in lines]
        order_set = set(order)
        extra = [i for i in file_order if i not in order_set]
        final = wanted + extra
        if final != file_order:
            with atomic_path(self.path) as tmp, naming_file(self.path):
                with open(tmp, "wb") as out:
                    for sid in final:
                        out.write(lines[sid])
                    out.flush()
                    os.fsync(out.fileno())
        self.close()
        return len(extra)
