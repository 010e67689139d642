"""The project's exceptions: one base, one class per layer.

Every error the package raises on purpose (bad params, a missing target, a corrupt stage file, a
failed parity check, ...) is an :class:`Eagle3Error`. The CLI prints the message of these as one
clean line and exits 2; anything else is a bug and gets the full traceback.

The classes keep ``ValueError`` (input is wrong) or ``RuntimeError`` (a run cannot proceed) as a
second base, because callers and tests catch those (``pytest.raises(ValueError)``, pydantic
validators re-raising ``ValueError``).
"""

from __future__ import annotations

__all__ = [
    "Eagle3Error",
    "ParamsError",
    "TargetError",
    "PromptsError",
    "SelfPromptError",
    "SynthesisError",
    "VocabError",
    "ExtractError",
    "TrainError",
    "EvaluateError",
    "ParityError",
    "StageFailed",
    "RunnerError",
    "StaleStage",
    "RunLocked",
    "RunInterrupted",
    "DamagedFile",
]


class Eagle3Error(Exception):
    """Base of every deliberate error of the package; the message says what is wrong and the fix."""


class ParamsError(Eagle3Error, ValueError):
    """A params file or override is invalid; the message names the file, the key and the fix."""


class TargetError(Eagle3Error, RuntimeError):
    """The target model cannot be found or loaded; the message says which model and what to do."""


class PromptsError(Eagle3Error, ValueError):
    """A prompt source cannot be read; the message names the file (and line) or dataset and the field."""


class SelfPromptError(Eagle3Error, ValueError):
    """Self-prompting (``kind: self`` sources) cannot run: the target's chat template cannot be cut
    into a user-turn prefix, a setting is invalid, or the server refused a request; the message says which."""


class SynthesisError(Eagle3Error, RuntimeError):
    """Stage 1 stopped (circuit breaker, too many failed samples, a corrupt samples file); the
    message names the sample ids and the file. Samples written so far are kept: re-run to resume."""


class VocabError(Eagle3Error, ValueError):
    """Bad input or an impossible request in stage 2; the message names the file/line/field."""


class ExtractError(Eagle3Error, RuntimeError):
    """Stage 3 cannot proceed; the message names the file / row / field and what to do."""


class TrainError(Eagle3Error, RuntimeError):
    """Stage 4 cannot run on its inputs; the message names the file/field and the fix."""


class EvaluateError(Eagle3Error, RuntimeError):
    """Stage 5 cannot run (missing stage output, bad drafter directory, failed vLLM job)."""


class ParityError(Eagle3Error, RuntimeError):
    """Offline τ and vLLM τ disagree beyond the tolerance; ``.diagnosis`` lists the suspects.

    Args:
        message: what disagreed (the two τ values and the tolerance).
        diagnosis: suspects found by the drafter/vocab checks, one line each.
    """

    def __init__(self, message: str, diagnosis: list[str]):
        super().__init__(message + "\nDiagnosis:\n  - " + "\n  - ".join(diagnosis or ["(none found)"]))
        self.diagnosis = diagnosis


class StageFailed(Eagle3Error, RuntimeError):
    """A stage notebook raised; the message names the stage, the cell and the error."""


class RunnerError(Eagle3Error, RuntimeError):
    """``eagle3 run`` / ``eagle3 report`` cannot start: the Jupyter kernel is not registered, or a run
    directory has nothing to render yet; the message says what to run."""


class StaleStage(RunnerError):
    """A finished stage whose inputs (earlier stages' files) changed since it ran: the message names
    each changed file with both digests and the ``--redo`` command that redoes the stage."""


class RunLocked(RunnerError):
    """Another live process writes the run directory (``eagle3 run`` or a stage notebook holds its
    ``run.lock``); the message names its pid, host, command and start, and what to do."""


class RunInterrupted(Eagle3Error, RuntimeError):
    """``eagle3 run`` was stopped by Ctrl-C (SIGINT). What the stages wrote is kept and each stage
    resumes its own work, so re-running resumes; the CLI prints that command and exits 130
    (128 + SIGINT) without a traceback.

    Args:
        message: what was stopped.
        stage: the stage that was running (None: the signal came between stages).
        run_dir: the run directory (for ``eagle3 status``), None before it was opened.
    """

    def __init__(self, message: str, stage: int | None = None, run_dir=None):
        super().__init__(message)
        self.stage = stage
        self.run_dir = run_dir


class DamagedFile(Eagle3Error, ValueError):
    """A run's JSON file (``mapping.json``, ``meta.json``, ``state.json``, ...) is not valid JSON: cut
    short by a crash or a full disk, or edited by hand; the message names the file and the place."""
