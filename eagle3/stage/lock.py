"""One writer per run directory: ``run.lock``, held by ``eagle3 run`` or by a notebook running its stage.

Two writers on one run folder destroy each other's files (two ``eagle3 run --stages 3`` rewrote
the same hidden-state shards and journals; a notebook in JupyterLab can run the stage ``eagle3 run``
is running). The writer holds an exclusive ``fcntl.flock`` on an open descriptor of ``run.lock`` for
its whole life: the kernel releases it when the process ends, killed or not, so a lock is never
left behind by a dead process. The file's JSON (pid, host, command, since, token) only names the
holder in the refusal; a second writer is refused at once (never waits).

A stage notebook that ``eagle3 run`` executes runs in a child process (the Jupyter kernel, and
torchrun's ranks under it): the holder puts its token in the environment (:data:`LOCK_ENV`), which
children inherit, and a process whose environment carries the token of the lock's holder is one of
its own and goes on without taking the lock. ``eagle3 status``, ``verify`` and ``report`` only read,
and never touch the lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
import uuid
from pathlib import Path

from eagle3.errors import RunLocked
from eagle3.rundir import RunDir

__all__ = ["LOCK_ENV", "RunLock", "this_command"]

# the token of the run lock the parent process holds (set by the holder for its children)
LOCK_ENV = "EAGLE3_RUN_LOCK"


def this_command() -> str:
    """This process's command line as a user would recognise it (for the lock's record)."""
    argv0 = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"
    if argv0 == "__main__.py" and Path(sys.argv[0]).parent.name == "eagle3":
        argv0 = "eagle3"
    return " ".join([argv0, *sys.argv[1:]])


class RunLock:
    """The exclusive writer's lock of one run directory (``<run_dir>/run.lock``).

    Args:
        run_dir: the run directory (created if missing).
        command: what holds it, as the refusal names it (``eagle3 run params/ci.yaml --stages 3``,
            ``notebook 03_extract_hidden_states``).

    Use :meth:`acquire` / :meth:`release`, or ``with RunLock(...)``. While held, ``os.environ``
    carries :data:`LOCK_ENV` so that the processes this one starts (the stage's kernel) are
    recognised as its own.
    """

    def __init__(self, run_dir: str | Path, command: str | None = None) -> None:
        self.path = RunDir(run_dir).lock_file
        self.command = command or this_command()
        self._fd: int | None = None
        self._env_before: str | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock (False when it defers to its parent's)."""
        return self._fd is not None

    def acquire(self) -> RunLock:
        """Take the lock, or go on under the parent's (the token in :data:`LOCK_ENV` is the holder's).

        Prints one line when it takes over the record of a writer whose process is gone.

        Raises:
            RunLocked: another live process holds it (the message names its pid, host, command and
                since when, and what to do).
        """
        if self._fd is not None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_record(fd)
            os.close(fd)
            if holder.get("token") and holder.get("token") == os.environ.get(LOCK_ENV):
                return self  # a child of the holder (the kernel eagle3 run started): its writes are the holder's
            raise RunLocked(_refusal(self.path.parent, holder)) from None
        previous = _read_record(fd)
        if previous:
            print(f"eagle3: {self.path} named {_describe(previous)}, which is gone: taking the run over", flush=True)
        token = uuid.uuid4().hex
        record = {"pid": os.getpid(), "host": socket.gethostname(), "command": self.command,
                  "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "token": token}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self._fd = fd
        self._env_before = os.environ.get(LOCK_ENV)
        os.environ[LOCK_ENV] = token
        return self

    def release(self) -> None:
        """Empty the record and let go of the lock (a no-op when not held)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        if self._env_before is None:
            os.environ.pop(LOCK_ENV, None)
        else:
            os.environ[LOCK_ENV] = self._env_before
        try:
            os.ftruncate(fd, 0)  # an empty file: released normally (a record left means a writer died)
        finally:
            os.close(fd)  # closing the descriptor releases the flock

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_record(fd: int) -> dict:
    """The holder's record in the lock file ({} when empty or torn)."""
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode("utf-8", "replace") or "{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _describe(holder: dict) -> str:
    return (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} (`{holder.get('command', '?')}`, "
            f"since {holder.get('since', '?')})")


def _refusal(run_dir: Path, holder: dict) -> str:
    who = _describe(holder) if holder else "another process (its record is not written yet)"
    pid = holder.get("pid")
    if "Jupyter kernel" in str(holder.get("command", "")):
        stop = "shut down that notebook's kernel"
    else:
        stop = f"stop it (kill {pid}; it keeps what it wrote)" if pid else "stop it"
    return (f"{run_dir} is being written by {who}; one writer at a time. Wait for it to end "
            f"(watch it: `eagle3 status {run_dir}`) or {stop}, then run again.")
