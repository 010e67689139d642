"""Stage 5's exceptions (until ``eagle3.errors`` holds every stage's)."""

from __future__ import annotations

__all__ = ["EvaluateError", "ParityError"]


class EvaluateError(RuntimeError):
    """Stage 5 cannot run (missing stage output, bad drafter directory, failed vLLM job)."""


class ParityError(RuntimeError):
    """Offline τ and vLLM τ disagree beyond the tolerance; ``.diagnosis`` lists the suspects."""

    def __init__(self, message: str, diagnosis: list[str]):
        super().__init__(message + "\nDiagnosis:\n  - " + "\n  - ".join(diagnosis or ["(none found)"]))
        self.diagnosis = diagnosis
