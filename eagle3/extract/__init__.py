"""Stage 3 — extract the target's hidden states for EAGLE-3 training.

Public API (docs/DESIGN.md, stage contract 3):

* :func:`run` ``(params, run_dir) -> stats``: the stage (transformers backend, or ``backend: vllm``);
* :func:`preflight`: projected bytes / free disk without loading the model;
* :func:`verify`: a full re-check of an existing folder;
* :class:`HiddenStatesDataset` ``(run_dir)``: the stored samples (``len``, ``ds[i]`` -> dict, ``.meta``);
* :func:`online_samples` ``(params, run_dir, rows)``: the same dicts straight from the target;
* :class:`HiddenStateCapture`, :func:`plan_batches`, :func:`extract_batches`, :class:`SampleWriter`:
  the building blocks (``eagle3.extract.core`` needs only torch, numpy and safetensors; the GPU
  benchmark imports it alone).

Data parallel: ``torchrun --nproc-per-node P -m eagle3.extract PARAMS.yaml --run-dir RUN_DIR``
(or ``extract.data_parallel: P``, which makes :func:`run` launch exactly that).

Names are imported lazily, so ``import eagle3.extract.core`` does not pull in the params machinery.
"""

from __future__ import annotations

import importlib

_CORE = ("ExtractError", "NonFiniteError", "HiddenStateCapture", "SampleWriter", "TokenizedRows",
         "check_sample_file", "default_aux_layer_ids", "plan_batches", "resolve_layer_ids", "sample_relpath",
         "shard_name", "extract_batches", "pad_batch")
_STAGE = ("run", "preflight", "verify", "HiddenStatesDataset", "online_samples", "OnlineExtractor",
          "load_rows", "bytes_per_token")

__all__ = [*_STAGE, *_CORE]


def __getattr__(name: str):
    if name in _CORE:
        return getattr(importlib.import_module("eagle3.extract.core"), name)
    if name in _STAGE:
        return getattr(importlib.import_module("eagle3.extract.stage"), name)
    raise AttributeError(f"module 'eagle3.extract' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
