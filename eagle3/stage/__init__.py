"""The stage lifecycle, written once: progress, inputs on record, ``stats.json``, failure status.

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
stage that stopped early but wants its numbers on disk) and read only by :func:`stage_record`
("is this stage complete, and what are its numbers").

The W&B run (:class:`eagle3.tracking.Tracker`) is opened on first use of :attr:`StageRun.tracker`,
so a stage whose results come late (stage 5) opens it only then, and a non-main rank that never
touches it opens none.

Modules: :mod:`~eagle3.stage.progress` (``progress.json``), :mod:`~eagle3.stage.record`
(``stats.json``), :mod:`~eagle3.stage.inputs` (``inputs.json`` and stale stages),
:mod:`~eagle3.stage.lifecycle` (:class:`StageRun`, which drives the three), :mod:`~eagle3.stage.lock`
(``run.lock``: one writer per run directory).
"""

from eagle3.stage.inputs import (
           PARAMS_READ,
           QUICK_HASH_BYTES,
           check_fresh,
           consumed_files,
           input_digests,
           params_read,
           record_shared,
           shared_from,
           stale_inputs,
           stale_message,
)
from eagle3.stage.lifecycle import StageRun
from eagle3.stage.lock import LOCK_ENV, RunLock, this_command
from eagle3.stage.progress import Progress
from eagle3.stage.record import StageRecord, Stats, completed_stats, stage_record, write_stats

__all__ = ["Stats", "StageRun", "StageRecord", "Progress", "stage_record", "completed_stats", "write_stats",
           "consumed_files", "input_digests", "stale_inputs", "stale_message", "check_fresh", "QUICK_HASH_BYTES", "RunLock", "LOCK_ENV",
           "this_command", "record_shared", "shared_from",
           "PARAMS_READ", "params_read"]
