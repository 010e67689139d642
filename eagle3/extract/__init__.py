"""Stage 3 — extract the target's hidden states for EAGLE-3 training.

Public API (docs/DESIGN.md, stage contract 3):

* :func:`run` ``(params, run_dir) -> stats``: the stage (transformers backend, or ``backend: vllm``);
* :func:`preflight`: projected bytes / free disk without loading the model;
* :func:`verify`: a full re-check of an existing folder;
* :class:`HiddenStatesDataset` ``(run_dir)``: the stored samples (``len``, ``ds[i]`` -> dict, ``.meta``);
* :func:`online_samples` ``(params, run_dir, rows)``: the same dicts straight from the target;
* :class:`HiddenStateCapture`, :func:`plan_batches`, :func:`extract_batches`: the building blocks
  (used by the benchmark).

Data parallel: ``torchrun --nproc-per-node P -m eagle3.extract PARAMS.yaml --run-dir RUN_DIR``
(or ``extract.data_parallel: P``, which makes :func:`run` launch exactly that).
"""

from eagle3.extract.core import (
    ExtractError,
    HiddenStateCapture,
    NonFiniteError,
    SampleWriter,
    TokenizedRows,
    check_sample_file,
    default_aux_layer_ids,
    plan_batches,
    resolve_layer_ids,
    sample_relpath,
    shard_name,
)
from eagle3.extract.stage import (
    HiddenStatesDataset,
    OnlineExtractor,
    bytes_per_token,
    extract_batches,
    load_rows,
    online_samples,
    preflight,
    run,
    verify,
)

__all__ = [
    "run",
    "preflight",
    "verify",
    "HiddenStatesDataset",
    "online_samples",
    "OnlineExtractor",
    "HiddenStateCapture",
    "SampleWriter",
    "TokenizedRows",
    "ExtractError",
    "NonFiniteError",
    "plan_batches",
    "extract_batches",
    "load_rows",
    "resolve_layer_ids",
    "default_aux_layer_ids",
    "bytes_per_token",
    "check_sample_file",
    "sample_relpath",
    "shard_name",
]
