"""Stage 3's output folder — the only code that reads or writes it.

Layout (docs/DESIGN.md "Hidden-state files"; one folder per run, see :mod:`eagle3.rundir`):

* ``meta.json``: aux layer ids, N, hidden size, storage dtype, target, stored layers, dataset
  fingerprint, shard size (:func:`read_meta` / :func:`write_meta`);
* ``rows_000000-002000/<row:06d>.safetensors`` (:func:`sample_relpath`): ``token_ids`` int64 ``[seq]``,
  ``loss_mask`` int8 ``[seq]``, ``hidden_states`` ``[seq, n_aux + 1, hidden]`` in the storage dtype,
  slot ``i`` = layer id ``stored_layers[i]``, the last slot = layer N before the final norm
  (:mod:`eagle3.hooks` for the convention); with ``float8_e4m3fn`` storage also ``hidden_states_scales``
  float32 ``[seq, n_aux + 1, 1]`` (:func:`quantize_fp8`; readers dequantize, :func:`read_states`);
  safetensors metadata ``{"id": <sample id>}`` only;
* ``manifest.part-RRR.jsonl``: one journal per data-parallel rank while the stage runs, one JSON line
  per finished file (``row``, ``id``, ``num_tokens``, ``file``, ``bytes``, ``sha256``), appended by
  :class:`SampleWriter`;
* ``manifest.jsonl``: the same records, one per row in row order, written by :func:`write_manifest`
  when every row has its file;
* ``.writing/``: the writer's temp files (:data:`TMP_DIR`): every file is written there under a name of
  its own (safetensors' ``save_file`` adds its own ``.tmpXXXXXX`` beside its target, so that one
  lands there too), then renamed into its ``rows_*`` folder. Whatever a killed writer left there is
  removed on the next run (:meth:`FolderScan.remove_stale`).

Integrity (docs/DESIGN.md "Hidden-state files"): the manifest's ``sha256`` is checked on resume (every
file a journal or the manifest records is hashed again, :meth:`FolderScan.recheck`), on read in stage 4
(the first read of each file in a process call, :class:`HiddenStatesDataset`), and by
:func:`verify_folder` (``eagle3 verify``); :func:`check_manifest` compares the manifest with
``meta.json``'s count and with Stage 2's split.

Modules, one concern each: :mod:`.layout` (names and paths), :mod:`.codec` (dtypes, the fp8 codec),
:mod:`.writer` (the threaded atomic writer), :mod:`.manifest` (journals, manifest, ``meta.json``),
:mod:`.folder` (what a folder holds before a run: :func:`scan`), :mod:`.dataset` (the reader),
:mod:`.verify` (integrity checks). Import the names from this package.

Needs torch, numpy and safetensors, plus the package's own io/rundir/errors (no params machinery).
"""

from eagle3.contracts.hidden_states.codec import (
    DTYPE_BYTES,
    FP8,
    FP8_MAX,
    SCALES,
    NonFiniteError,
    as_stored,
    bytes_per_token,
    capture_dtype,
    dequantize_fp8,
    dtype_name,
    first_non_finite,
    quantize_fp8,
    read_states,
    storage_dtype,
    storage_tensors,
    tensor_layout,
)
from eagle3.contracts.hidden_states.dataset import REDO_HINT, HiddenStatesDataset, SampleRef, ref_of, to_training_item
from eagle3.contracts.hidden_states.folder import RESUME_KEYS, FolderScan, scan
from eagle3.contracts.hidden_states.layout import (
    ROW_FILE_RE,
    SHARD_DIR_RE,
    TMP_DIR,
    clean_temp,
    is_stale_temp,
    journal_name,
    manifest_path,
    meta_path,
    sample_relpath,
    shard_name,
)
from eagle3.contracts.hidden_states.manifest import (
    MANIFEST_KEYS,
    check_manifest,
    finished_records,
    known_entries,
    read_entries,
    read_manifest,
    read_meta,
    sha256_file,
    write_journal,
    write_manifest,
    write_meta,
)
from eagle3.contracts.hidden_states.verify import check_sample_file, verify_folder
from eagle3.contracts.hidden_states.writer import SampleWriter, save_sample, written_sha256

__all__ = [
    "NonFiniteError",
    "TMP_DIR",
    "DTYPE_BYTES",
    "ROW_FILE_RE",
    "SHARD_DIR_RE",
    "MANIFEST_KEYS",
    "RESUME_KEYS",
    "FP8",
    "FP8_MAX",
    "SCALES",
    "quantize_fp8",
    "dequantize_fp8",
    "storage_tensors",
    "as_stored",
    "read_states",
    "storage_dtype",
    "capture_dtype",
    "dtype_name",
    "bytes_per_token",
    "tensor_layout",
    "manifest_path",
    "meta_path",
    "shard_name",
    "sample_relpath",
    "journal_name",
    "sha256_file",
    "first_non_finite",
    "check_sample_file",
    "save_sample",
    "written_sha256",
    "SampleWriter",
    "read_entries",
    "read_manifest",
    "check_manifest",
    "clean_temp",
    "is_stale_temp",
    "known_entries",
    "finished_records",
    "write_journal",
    "write_manifest",
    "read_meta",
    "write_meta",
    "FolderScan",
    "scan",
    "to_training_item",
    "SampleRef",
    "ref_of",
    "REDO_HINT",
    "HiddenStatesDataset",
    "verify_folder",
]
