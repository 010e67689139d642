"""Stage 3 — extract the target's hidden states for EAGLE-3 training.

Public API (docs/DESIGN.md, stage contract 3):

* :func:`run` ``(params, run_dir) -> stats``: the stage (transformers backend, or ``backend: vllm``);
* :func:`preflight`: projected bytes / free disk without loading the model;
* :func:`verify`: a full re-check of an existing folder;
* :func:`online_samples` ``(params, run_dir, rows)``: the stored samples' dicts straight from the target;
* :class:`ExtractStats`: the keys of ``stats.json``.

The files are read through :mod:`eagle3.contracts.hidden_states` (``HiddenStatesDataset``), the
capture is :mod:`eagle3.hooks`. Data parallel: ``torchrun --nproc-per-node P -m eagle3.extract
PARAMS.yaml --run-dir RUN_DIR`` (or ``extract.data_parallel: P``, which makes :func:`run` launch
exactly that).
"""

from eagle3.extract.finalize import ExtractStats, verify
from eagle3.extract.online import online_samples
from eagle3.extract.prepare import load_rows, preflight
from eagle3.extract.stage import run

__all__ = ["run", "preflight", "verify", "online_samples", "load_rows", "ExtractStats"]
