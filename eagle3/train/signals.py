"""SIGINT/SIGTERM during Stage 4's training loop: stop after a checkpoint, or abort a step that is
still in its forward/backward (which may hold ``torch.compile`` for minutes) within seconds."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

__all__ = ["TrainingInterrupted", "StepAborted", "StepSignals"]


class TrainingInterrupted(KeyboardInterrupt):
    """SIGINT/SIGTERM arrived; a checkpoint was saved first (``.checkpoint`` names it)."""

    def __init__(self, signum: int, checkpoint: Path | None) -> None:
        self.signum, self.checkpoint = signum, checkpoint
        super().__init__(f"{signal.Signals(signum).name}: stopped after saving {checkpoint}")


class StepAborted(BaseException):
    """Raised by the signal handler inside the abortable part of a step (see :class:`StepSignals`).

    A BaseException, so that no ``except Exception`` on the way (dynamo, inductor, the loader)
    swallows or wraps it."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


class StepSignals:
    """Install SIGINT/SIGTERM handlers (main thread only).

    Normally the handler only records the signal and the loop stops at the end of the step, after
    a checkpoint. While ``abortable`` is set (a step's forward/backward, which may hold the first
    step's ``torch.compile`` for minutes, and validation) the handler raises :class:`StepAborted`
    at once: nothing there has touched the weights, the optimizer or the scheduler since the last
    completed step, so the loop can save that step and exit within seconds.

    ``raised`` records that the handler raised: C code on the way (torch building a tensor, safetensors
    reading a file) may turn :class:`StepAborted` into an ordinary exception of its own, e.g.
    "could not determine the shape of object type 'torch.storage.UntypedStorage'", which a reader
    would then blame on its file; once ``raised`` is set the loop treats any exception as the abort.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self.abortable = False
        self.raised = False
        self._old: dict[int, Any] = {}

    def _handler(self, signum, frame) -> None:
        self.received = signum
        if self.abortable:
            self.abortable = False
            self.raised = True
            raise StepAborted(signum)

    def __enter__(self) -> StepSignals:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
