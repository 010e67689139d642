"""Stage 3's output folder — the ONLY code that reads or writes it.

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
  removed by :func:`clean_temp` on the next run.

Integrity (docs/DESIGN.md "Hidden-state files"): the manifest's ``sha256`` is checked on resume (every
file a journal or the manifest records is hashed again), on read in stage 4 (the first read of each
file in a process call, :class:`HiddenStatesDataset`), and by :func:`verify_folder` (``eagle3 verify``);
:func:`check_manifest` compares the manifest with ``meta.json``'s count and with Stage 2's split.

Readers: :func:`read_manifest` (records), :class:`HiddenStatesDataset` (the samples, raw or as
speculators' training items), :func:`verify_folder` (a full re-check).

Needs torch, numpy and safetensors, plus the package's own io/rundir/errors (no params machinery).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3.errors import ExtractError, TrainError
from eagle3.io import atomic_write_json, atomic_write_text, file_sha256, is_disk_full, read_jsonl
from eagle3.rundir import EXTRACT_META_FILE, MANIFEST_FILE

__all__ = [
    "NonFiniteError",
    "TMP_DIR",
    "DTYPE_BYTES",
    "ROW_FILE_RE",
    "SHARD_DIR_RE",
    "MANIFEST_KEYS",
    "FP8",
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
    "write_manifest",
    "read_meta",
    "write_meta",
    "to_training_item",
    "SampleRef",
    "ref_of",
    "REDO_HINT",
    "HiddenStatesDataset",
    "verify_folder",
]

DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2, torch.float8_e4m3fn: 1}
ROW_FILE_RE = re.compile(r"^(\d{6,})\.safetensors$")
SHARD_DIR_RE = re.compile(r"^rows_(\d{6,})-(\d{6,})$")
MANIFEST = MANIFEST_FILE
META = EXTRACT_META_FILE
MANIFEST_KEYS = ("row", "id", "num_tokens", "file", "bytes", "sha256")
# The writer's temp folder inside the stage folder: every temp file of Stage 3 is created there.
TMP_DIR = ".writing"
_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F8_E4M3": torch.float8_e4m3fn,
              "I64": torch.int64, "I8": torch.int8}


class NonFiniteError(ExtractError):
    """A sample's hidden states contain NaN or Inf (the message names the sample id, slot and token)."""


# ----------------------------------------------------------------------------------------------
# Names, dtypes, sizes
# ----------------------------------------------------------------------------------------------


FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
SCALES = "hidden_states_scales"
"""The tensor beside an fp8 ``hidden_states``: float32 ``[seq, n_aux + 1, 1]``, one scale per token and
layer slot; the value is ``hidden_states.float() * hidden_states_scales`` (broadcast over hidden), the
key and the dequantization hs_connectors' ``FP8Transfer`` uses (its scales are per token, ``[seq, 1, 1]``)."""


def quantize_fp8(hs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled float8_e4m3fn of ``hs [..., hidden]``: ``(q [..., hidden] fp8, scales float32 [..., 1])``.

    One scale per vector (a token's ``hidden`` channels in one layer slot): its absolute maximum / 448
    (e4m3's largest finite value), so the largest element maps to +-448 and nothing saturates; an
    all-zero vector gets scale 1. Per token and slot rather than per block of channels: on the
    embedded model's states, blocks of 64 channels cut the relative error from 2.2% to 1.6% for 5.6%
    more bytes (benchmarks/RESULTS.md, "fp8 hidden states").
    """
    x = hs.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (x / scales).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scales


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`: ``q.float() * scales`` as ``dtype`` (shape of ``q``)."""
    return (q.float() * scales).to(dtype)


def storage_tensors(hs: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The file tensors that store ``hs [..., hidden]`` in ``dtype``: ``{"hidden_states": hs as dtype}``,
    plus :data:`SCALES` for float8_e4m3fn (:func:`quantize_fp8`)."""
    if dtype == FP8:
        q, sc = quantize_fp8(hs)
        return {"hidden_states": q, SCALES: sc}
    return {"hidden_states": hs.to(dtype)}


def as_stored(hs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 ``hs`` as a reader gets it back from ``dtype`` storage (rounding / quantization only)."""
    t = storage_tensors(hs, dtype)
    return dequantize_fp8(t["hidden_states"], t[SCALES]) if SCALES in t else t["hidden_states"].float()


def read_states(sample: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """A loaded sample file with ``hidden_states`` as values: fp8 codes dequantized with their
    :data:`SCALES` (removed) into ``dtype`` (default float32); other dtypes as stored (cast to
    ``dtype`` when given). The one place a reader turns stored states into numbers."""
    if SCALES in sample:
        out = dict(sample)
        out["hidden_states"] = dequantize_fp8(out["hidden_states"], out.pop(SCALES), dtype or torch.float32)
        return out
    if dtype is not None and sample.get("hidden_states") is not None and sample["hidden_states"].dtype != dtype:
        out = dict(sample)
        out["hidden_states"] = out["hidden_states"].to(dtype)
        return out
    return sample


def storage_dtype(name: str, compute_dtype: torch.dtype) -> torch.dtype:
    """Map ``extract.dtype`` to a torch dtype ('auto' = the target's compute dtype)."""
    if name == "auto":
        return compute_dtype
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
            "float8_e4m3fn": torch.float8_e4m3fn}[name]


def capture_dtype(storage: torch.dtype, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype the target's states are captured in before storage: the storage dtype itself, or for
    fp8 the compute dtype (the scales are taken from the unrounded values, :func:`storage_tensors`)."""
    return compute_dtype if storage == FP8 else storage


def dtype_name(d: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the form meta.json and stats.json hold)."""
    return str(d).replace("torch.", "")


def bytes_per_token(num_slots: int, hidden_size: int, dtype: torch.dtype) -> int:
    """Hidden-state bytes per token: ``num_slots x hidden_size x bytes per element`` (DESIGN "Scale"),
    plus ``num_slots x 4`` for fp8's float32 scales."""
    return num_slots * (hidden_size * DTYPE_BYTES[dtype] + (4 if dtype == FP8 else 0))


def shard_name(row: int, shard_size: int) -> str:
    """``rows_000000-002000`` for ``row`` in ``[0, 2000)`` with shard size 2000."""
    start = row // shard_size * shard_size
    return f"rows_{start:06d}-{start + shard_size:06d}"


def sample_relpath(row: int, shard_size: int) -> str:
    """Path of a sample's file relative to the stage folder: ``rows_000000-002000/000017.safetensors``."""
    return f"{shard_name(row, shard_size)}/{row:06d}.safetensors"


def journal_name(rank: int) -> str:
    """``manifest.part-RRR.jsonl``: the journal of data-parallel rank ``rank``."""
    return f"manifest.part-{rank:03d}.jsonl"


sha256_file = file_sha256  # the digest the manifest records


def first_non_finite(hs: torch.Tensor, stored_layers: Sequence[int]) -> str:
    """Describe the first NaN/Inf in ``hs [seq, slots, hidden]`` as 'layer id L (slot s), token t'."""
    bad = (~torch.isfinite(hs.float())).any(dim=-1).nonzero()
    if not len(bad):
        return "no non-finite value"
    t, s = (int(x) for x in bad[0])
    return f"layer id {stored_layers[s]} (slot {s}), token {t} (first of {len(bad)} bad (token, slot) pairs)"


# ----------------------------------------------------------------------------------------------
# One sample file: check and write
# ----------------------------------------------------------------------------------------------


def check_sample_file(path: str | Path, tokens: np.ndarray | None, num_slots: int, hidden_size: int,
                      dtype: torch.dtype, loss_mask: np.ndarray | None = None) -> str | None:
    """Check one stored sample without reading its hidden states; None when it is good.

    Checks: the safetensors header parses and covers the file exactly (safetensors' own validation),
    the three tensors exist with shapes ``[seq]``, ``[seq]``, ``[seq, num_slots, hidden_size]``, the
    dtypes (int64, int8, ``dtype``), for fp8 the float32 scales ``[seq, num_slots, 1]``, and that
    ``token_ids`` (and ``loss_mask``) equal the expected ones.

    Returns:
        str | None: the first problem found, as a short reason.
    """
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            need = {"token_ids", "loss_mask", "hidden_states"}
            if not need <= keys:
                return f"missing tensors {sorted(need - keys)}"
            seq = len(tokens) if tokens is not None else None
            hs = f.get_slice("hidden_states")
            shape = list(hs.get_shape())
            if seq is None:
                seq = shape[0]
            if shape != [seq, num_slots, hidden_size]:
                return f"hidden_states shape {shape} != {[seq, num_slots, hidden_size]}"
            if _ST_DTYPES.get(hs.get_dtype()) != dtype:
                return f"hidden_states dtype {hs.get_dtype()} != {dtype}"
            if dtype == FP8:
                if SCALES not in keys:
                    return f"fp8 hidden_states without {SCALES}"
                sc = f.get_slice(SCALES)
                if list(sc.get_shape()) != [seq, num_slots, 1] or sc.get_dtype() != "F32":
                    return f"{SCALES} {sc.get_dtype()} {list(sc.get_shape())} != F32 {[seq, num_slots, 1]}"
            tok = f.get_tensor("token_ids")
            lm = f.get_tensor("loss_mask")
            if tok.dtype != torch.int64 or list(tok.shape) != [seq]:
                return f"token_ids {tok.dtype} {list(tok.shape)} != int64 [{seq}]"
            if lm.dtype != torch.int8 or list(lm.shape) != [seq]:
                return f"loss_mask {lm.dtype} {list(lm.shape)} != int8 [{seq}]"
            if tokens is not None and not np.array_equal(tok.numpy(), tokens):
                return "token_ids differ from the dataset row"
            if loss_mask is not None and not np.array_equal(lm.numpy(), loss_mask):
                return "loss_mask differs from the dataset row"
    except Exception as exc:  # noqa: BLE001 - any unreadable file is a reason to redo it
        return f"unreadable ({type(exc).__name__}: {str(exc)[:200]})"
    return None


def save_sample(tmp_path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str | None:
    """Write one sample with ``safetensors.torch.save_file`` (from the tensors' memory, without the GIL
    held for the copy in safetensors >= 0.8).

    Returns:
        str | None: the file's sha256 hex from :func:`written_sha256` (None when it cannot vouch for the
        bytes: the caller then hashes the file).
    """
    from safetensors.torch import save_file

    save_file(tensors, str(tmp_path), metadata=metadata)
    return written_sha256(tmp_path, tensors)


def written_sha256(path: Path, tensors: dict[str, torch.Tensor]) -> str | None:
    """sha256 hex of a safetensors file just written from ``tensors``, without reading its data back.

    The file is ``8-byte little-endian header length | JSON header | tensor bytes`` (the safetensors
    format, https://github.com/huggingface/safetensors#format), the tensors back to back in the order of
    their ``data_offsets``, each in little-endian row-major bytes: exactly the tensors' memory on a
    little-endian host. So the digest is the header read from the file (a few hundred bytes) followed by
    each tensor's memory: the file's data is not read back through the page cache. Writer throughput vs
    write + re-read (``benchmarks/bench_writer.py``, 64 MiB bf16 samples; benchmarks/RESULTS.md,
    2026-12-04 session 11): 2.2-2.7x with 1-2 threads on the 2-core CPU VM, 1.9x with 1 thread and
    1.1x with 8-16 threads on the H200's host (there the page cache bounds it at ~2.3 GB/s).

    Args:
        path: the file. tensors: what was written (any dtype, any shape; made contiguous here).

    Returns:
        str | None: the hex digest, or None when the file does not match ``tensors`` by name, offsets
        and sizes, or the host is big-endian (callers then hash the file itself).
    """
    if sys.byteorder != "little":
        return None
    with open(path, "rb") as f:
        prefix = f.read(8)
        header = f.read(int.from_bytes(prefix, "little")) if len(prefix) == 8 else b""
    try:
        spec = json.loads(header)
        spans = sorted((tuple(v["data_offsets"]), k) for k, v in spec.items() if k != "__metadata__")
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    digest = hashlib.sha256(prefix)
    digest.update(header)
    end = 0
    for (start, stop), name in spans:
        t = tensors.get(name)
        if t is None or start != end:
            return None
        data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        if stop - start != data.nbytes:
            return None
        digest.update(data)  # hashlib releases the GIL on large buffers
        end = stop
    if set(tensors) != {name for _, name in spans} or os.path.getsize(path) != 8 + len(header) + end:
        return None
    return digest.hexdigest()


def _atomic_save(path: Path, tmp_dir: Path, tensors: dict, metadata: dict, write_fn: Callable) -> tuple[int, str]:
    """Save to a temp file in ``tmp_dir`` (via ``write_fn``), hash it, rename it over ``path``.

    The hash is what ``write_fn`` returns when that is a str (:func:`save_sample`: from the header and
    the tensors' memory, :func:`written_sha256`), else the file's (:func:`sha256_file`).

    The protocol of :func:`eagle3.io.atomic_path` (temp name ``.<name>.<random>.tmp``, removed on any
    failure), but in the stage's own temp folder (:data:`TMP_DIR`, same file system as ``path``):
    whatever ``write_fn`` creates beside its target (safetensors' ``.tmpXXXXXX``) is in a folder the
    stage cleans, never in a ``rows_*`` folder. The hash is taken before the rename.

    Returns:
        tuple: ``(bytes, sha256 hex)`` of the file.
    """
    tmp_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=tmp_dir)
    os.close(fd)
    tmp_p = Path(tmp)
    try:
        digest = write_fn(tmp_p, tensors, metadata)
        size = tmp_p.stat().st_size
        if not isinstance(digest, str):
            digest = sha256_file(tmp_p)
        os.replace(tmp_p, path)
    except BaseException:
        tmp_p.unlink(missing_ok=True)
        raise
    return size, digest


class SampleWriter:
    """Background writer: serializes samples to safetensors, writes them atomically, journals them.

    Compute never waits for disk unless more than ``max_pending_bytes`` of hidden states are queued.
    Each finished file is appended as one JSON line to ``journal`` (``row``, ``id``, ``num_tokens``,
    ``file``, ``bytes``, ``sha256``) and flushed, so a killed run knows what it finished.

    Args:
        stage_dir: the stage folder (files go to ``stage_dir / entry['file']``).
        journal: the journal file (appended).
        stored_layers: layer ids per slot (named in non-finite errors).
        threads: writer threads (safetensors and hashlib release the GIL for large buffers).
        max_pending_bytes: back-pressure threshold.
        write_fn: ``write_fn(tmp_path, tensors, metadata)`` writes one file (default :func:`save_sample`;
            tests pass one that fails like a full disk) and may return its sha256 hex (else the file is
            hashed here); the rename and the removal of the temp file on failure are done here.

    Raises (from :meth:`submit`, :meth:`raise_if_failed`, :meth:`close`):
        NonFiniteError: a sample with NaN/Inf (nothing written for it).
        ExtractError: a write failed (``ENOSPC``: disk full, with the numbers); the temp file is gone.
    """

    def __init__(self, stage_dir: str | Path, journal: str | Path, stored_layers: Sequence[int],
                 threads: int = 2, max_pending_bytes: int = 1 << 30,
                 write_fn: Callable[[Path, dict, dict], None] | None = None) -> None:
        self.stage_dir = Path(stage_dir)
        self.journal_path = Path(journal)
        self.stored_layers = list(stored_layers)
        self.write_fn = write_fn or save_sample
        self.max_pending_bytes = max_pending_bytes
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="eagle3-extract-writer")
        self._journal = open(self.journal_path, "a", encoding="utf-8")
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._pending = 0
        self.error: BaseException | None = None
        self.bytes_written = 0
        self.files_written = 0
        self.busy_s = 0.0
        self.entries: list[dict] = []

    def submit(self, entry: dict, tensors: dict[str, torch.Tensor], finite: bool | torch.Tensor = True,
               ready: Any = None, after: Callable[[], None] | None = None) -> None:
        """Queue one sample.

        Args:
            entry: ``{"row", "id", "file"}`` (``file`` relative to the stage folder).
            tensors: ``token_ids`` int64 ``[seq]``, ``loss_mask`` int8 ``[seq]``, ``hidden_states``
                ``[seq, slots, hidden]`` (CPU; may still be filling when ``ready`` is given).
            finite: whether the sample's hidden states are all finite (bool or 0-dim CPU bool tensor,
                read after ``ready``).
            ready: an object with ``synchronize()`` (a CUDA event) completing the device-to-host copy.
            after: called on the writer thread once the file and its journal line are written.
        """
        self.raise_if_failed()
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        with self._cond:
            while self._pending > 0 and self._pending + nbytes > self.max_pending_bytes and self.error is None:
                self._cond.wait(timeout=1.0)
            self._pending += nbytes
        self._pool.submit(self._task, dict(entry), tensors, finite, ready, nbytes, after)

    def _write_file(self, entry: dict, tensors: dict) -> tuple[int, str]:
        # one metadata key only: safetensors keeps metadata in a hash map whose order changes
        # from process to process, and the bytes (and sha256) of a file must not
        meta = {"id": str(entry["id"])}
        path = self.stage_dir / entry["file"]
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            return _atomic_save(path, self.stage_dir / TMP_DIR, {k: v.contiguous() for k, v in tensors.items()}, meta,
                                self.write_fn)
        except Exception as exc:
            if is_disk_full(exc):
                raise ExtractError(
                    f"disk full while writing {path}: {exc}. Free space now: "
                    f"{shutil.disk_usage(self.stage_dir).free} bytes; this run wrote {self.bytes_written} bytes in "
                    f"{self.files_written} files before it. Finished files are kept and the partial "
                    f"file was removed: free space (or move the run) and re-run to resume."
                ) from exc
            raise ExtractError(f"writing {path} failed: {type(exc).__name__}: {exc}") from exc

    def _task(self, entry: dict, tensors: dict, finite, ready, nbytes: int, after=None) -> None:
        t0 = time.perf_counter()
        try:
            if self.error is not None:
                return
            if ready is not None:
                ready.synchronize()  # host sync: the device-to-host copy of this batch is complete
            if not bool(finite):
                where = first_non_finite(tensors["hidden_states"], self.stored_layers)
                raise NonFiniteError(
                    f"non-finite hidden states (NaN/Inf) in sample id {entry['id']} (row {entry['row']}): "
                    f"{where}. Nothing was written for it; check the target's dtype (float16 overflows are "
                    f"common: use bfloat16) and the sample."
                )
            nbytes_file, digest = self._write_file(entry, tensors)
            line = {"row": int(entry["row"]), "id": str(entry["id"]), "num_tokens": int(tensors["token_ids"].shape[0]),
                    "file": entry["file"], "bytes": nbytes_file, "sha256": digest}
            with self._lock:
                self._journal.write(json.dumps(line) + "\n")
                self._journal.flush()
                self.entries.append(line)
                self.bytes_written += nbytes_file
                self.files_written += 1
            if after is not None:
                after()
        except BaseException as exc:  # noqa: BLE001 - surfaced on the main thread
            with self._lock:
                if self.error is None:
                    self.error = exc
        finally:
            with self._cond:
                self._pending -= nbytes
                self.busy_s += time.perf_counter() - t0
                self._cond.notify_all()

    def raise_if_failed(self) -> None:
        """Re-raise the first writer error on the calling thread."""
        err = self.error
        if err is None:
            return
        if isinstance(err, ExtractError):
            raise err
        raise ExtractError(f"writer failed: {type(err).__name__}: {err}") from err

    def close(self, wait: bool = True) -> None:
        """Wait for queued writes (``wait``) and close the journal; raises the first writer error."""
        self._pool.shutdown(wait=wait, cancel_futures=not wait)
        try:
            self._journal.close()
        except OSError:
            pass
        self.raise_if_failed()


# ----------------------------------------------------------------------------------------------
# Manifest, journals and meta.json
# ----------------------------------------------------------------------------------------------


def read_entries(path: str | Path) -> list[dict]:
    """Records of one journal or manifest file, in file order; [] when it does not exist.

    A torn last line (a killed writer) is dropped (:func:`eagle3.io.read_jsonl`); a record without
    ``row``, ``file``, ``bytes`` and ``sha256`` is skipped (a journal is only a hint that the resume
    scan re-checks against the file itself).

    Raises:
        ExtractError: a line other than the last is not JSON (the file and line are named).
    """
    recs = read_jsonl(path, error=ExtractError, missing_ok=True)
    return [e for e in recs if isinstance(e, dict) and {"row", "file", "bytes", "sha256"} <= e.keys()]


def known_entries(stage_dir: str | Path) -> dict[int, dict]:
    """Finished-file records by row from the manifest and every rank's journal (later ones win)."""
    sd = Path(stage_dir)
    known: dict[int, dict] = {}
    for p in [sd / MANIFEST, *sorted(sd.glob("manifest.part-*.jsonl"))]:
        for e in read_entries(p):
            known[int(e["row"])] = e
    return known


def is_stale_temp(p: Path) -> bool:
    """True for a temp file a killed Stage 3 writer left behind: ours (``.<name>.<random>.tmp``) or
    safetensors' own (``.tmpXXXXXX``, written beside its target by ``save_file``; found in ``rows_*``
    folders of runs made before the writer used :data:`TMP_DIR`)."""
    n = p.name
    return n.startswith(".") and (n.endswith(".tmp") or n.startswith(".tmp")) and p.is_file()


def clean_temp(stage_dir: str | Path) -> int:
    """Remove the writer's temp folder (:data:`TMP_DIR`) with whatever a killed run left in it.

    Call it only while no writer runs (Stage 3 calls it before its writers start and after they
    finish). Returns the number of files removed.
    """
    d = Path(stage_dir) / TMP_DIR
    if not d.exists():
        return 0
    n = sum(1 for p in d.rglob("*") if p.is_file())
    shutil.rmtree(d, ignore_errors=True)
    return n


def check_manifest(entries: Sequence[dict], meta: dict | None, ids: Sequence[str] | None,
                   where: str | Path = MANIFEST) -> list[str]:
    """Compare the manifest's records with ``meta.json``'s sample count and with Stage 2's split.

    A lost manifest line would otherwise drop a sample silently: every row ``0..n-1`` of the split
    must have exactly one record, with the split's id, and ``n`` must equal ``meta["num_samples"]``.

    Args:
        entries: the records (:func:`read_manifest`, by row).
        meta: ``meta.json`` (its ``num_samples`` is checked when present) or None.
        ids: the sample ids of Stage 2's ``train.parquet`` in row order (None: not checked).
        where: the manifest's path, for messages.

    Returns:
        list[str]: problems, each naming the row and id (empty when all agree).
    """
    out: list[str] = []
    by_row = {int(e["row"]): e for e in entries}
    n_meta = (meta or {}).get("num_samples")
    if n_meta is not None and len(by_row) != int(n_meta):
        out.append(f"{where}: {len(by_row)} records but meta.json says num_samples = {n_meta}")
    if ids is not None:
        if len(ids) != len(by_row):
            out.append(f"{where}: {len(by_row)} records but Stage 2's train split has {len(ids)} rows")
        missing = [r for r in range(len(ids)) if r not in by_row]
        if missing:
            out.append(f"{where}: no line for row {missing[0]} (id {ids[missing[0]]})"
                       + (f" and {len(missing) - 1} more row(s)" if len(missing) > 1 else ""))
        extra = sorted(r for r in by_row if r >= len(ids))
        if extra:
            out.append(f"{where}: row {extra[0]} is not in Stage 2's train split ({len(ids)} rows)")
        wrong = [r for r in sorted(by_row) if r < len(ids) and str(by_row[r].get("id")) != str(ids[r])]
        if wrong:
            r = wrong[0]
            out.append(f"{where}: row {r} has id {by_row[r].get('id')} but Stage 2's train split has {ids[r]} "
                       f"there ({len(wrong)} row(s) disagree): Stage 2 changed after Stage 3 ran")
    elif n_meta is not None:
        missing = [r for r in range(int(n_meta)) if r not in by_row]
        if missing:
            out.append(f"{where}: no line for row {missing[0]}")
    return out


def read_manifest(stage_dir: str | Path) -> list[dict]:
    """The final manifest's records, one per row, sorted by row (later lines for a row win).

    Raises:
        ExtractError: no ``manifest.jsonl`` or no record in it (Stage 3 has not finished).
    """
    sd = Path(stage_dir)
    by_row = {int(e["row"]): e for e in read_entries(sd / MANIFEST)}
    if not by_row:
        raise ExtractError(f"{sd / MANIFEST} does not exist or is empty: run Stage 3 (extract) to completion "
                           f"first (or set train.online: true)")
    return [by_row[r] for r in sorted(by_row)]


def write_manifest(stage_dir: str | Path, entries: dict[int, dict], num_rows: int) -> int:
    """Write ``manifest.jsonl`` (one record per row ``0..num_rows-1``, keys :data:`MANIFEST_KEYS`)
    atomically and remove the rank journals; returns the total bytes of the files.

    Raises:
        ExtractError: a row without a record.
    """
    sd = Path(stage_dir)
    missing = [r for r in range(num_rows) if r not in entries]
    if missing:
        raise ExtractError(f"{len(missing)} row(s) have no file (first: row {missing[0]}); re-run to resume.")
    lines = [json.dumps({k: entries[r][k] for k in MANIFEST_KEYS}) for r in range(num_rows)]
    atomic_write_text(sd / MANIFEST, "\n".join(lines) + "\n")
    for p in sd.glob("manifest.part-*.jsonl"):
        p.unlink(missing_ok=True)
    return sum(int(entries[r]["bytes"]) for r in range(num_rows))


def read_meta(stage_dir: str | Path) -> dict | None:
    """``meta.json`` (aux_layer_ids, num_hidden_layers, hidden_size, dtype, stored_layers, ...) or None."""
    p = Path(stage_dir) / META
    return json.loads(p.read_text(encoding="utf-8")) if p.exists() else None


def write_meta(stage_dir: str | Path, meta: dict) -> None:
    """Write ``meta.json`` atomically."""
    atomic_write_json(Path(stage_dir) / META, meta)


# ----------------------------------------------------------------------------------------------
# Samples for training
# ----------------------------------------------------------------------------------------------


def to_training_item(sample: dict, n_aux: int, hidden_size: int, vocab_size: int, where: str) -> dict:
    """One stored sample (file or online dict) -> speculators' per-sample training dict.

    Args:
        sample: ``token_ids`` int ``[seq]``, ``loss_mask`` ``[seq]``, ``hidden_states`` ``[seq, n_aux+1, H]``.
        where: file name or sample id, for messages.

    Returns:
        dict: ``hidden_states`` ``[seq, n_aux, H]`` (the aux slots in order, a view of the stored
        tensor: the collate, :class:`eagle3.train.data.PackedCollate`, writes them side by side as
        speculators' ``[T, n_aux*H]`` with one copy), ``input_ids`` int64 ``[seq]``,
        ``verifier_last_hidden_states`` ``[seq, H]`` (last slot), ``loss_mask`` bool ``[seq]``,
        ``lengths`` int64 ``[1]``, ``position_ids`` int64 ``[seq]`` (speculators'
        ``BaseDataset.__getitem__`` adds the last two the same way).

    Raises:
        TrainError: missing tensors; an aux count or hidden size that disagrees with the model;
            lengths that disagree; token ids outside the target vocab.
    """
    missing = [k for k in ("token_ids", "loss_mask", "hidden_states") if k not in sample]
    if missing:
        raise TrainError(f"{where}: missing tensor(s) {missing}")
    hs, ids, lm = sample["hidden_states"], sample["token_ids"], sample["loss_mask"]
    if hs.dim() != 3:
        raise TrainError(f"{where}: hidden_states has shape {list(hs.shape)}, expected [seq, {n_aux + 1}, {hidden_size}]")
    if hs.shape[1] != n_aux + 1:
        raise TrainError(
            f"{where}: hidden_states has {hs.shape[1]} layer slots but the drafter uses {n_aux} aux layers "
            f"(+1 for layer N): aux count disagrees; re-run stage 3 or fix extract.aux_layer_ids"
        )
    if hs.shape[2] != hidden_size:
        raise TrainError(
            f"{where}: hidden size {hs.shape[2]} but the target/drafter has hidden size {hidden_size}: "
            f"the hidden states come from another model"
        )
    if ids.dim() != 1 or ids.shape[0] != hs.shape[0] or lm.shape[0] != hs.shape[0]:
        raise TrainError(
            f"{where}: token_ids {list(ids.shape)}, loss_mask {list(lm.shape)} and hidden_states "
            f"{list(hs.shape)} disagree in length"
        )
    if ids.numel() and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
        raise TrainError(f"{where}: token id {int(ids.max())} outside the target vocab [0, {vocab_size})")
    n = ids.shape[0]
    return {
        "hidden_states": hs[:, :n_aux],
        "input_ids": ids.to(torch.long),
        "verifier_last_hidden_states": hs[:, n_aux],
        "loss_mask": lm.to(torch.bool),
        "lengths": torch.tensor([n], dtype=torch.long),
        "position_ids": torch.arange(n, dtype=torch.long),
    }


@dataclass(frozen=True)
class SampleRef:
    """One sample: its row in Stage 2's train split, id, token count and (offline) file, with the
    manifest's ``sha256`` and ``bytes`` of that file (checked on its first read, see
    :class:`HiddenStatesDataset`)."""

    row: int
    id: str
    num_tokens: int
    file: Path | None = None
    sha256: str | None = None
    bytes: int | None = None


def ref_of(stage_dir: Path, e: dict) -> SampleRef:
    """The :class:`SampleRef` of one manifest record (``file`` under ``stage_dir``)."""
    return SampleRef(int(e["row"]), str(e["id"]), int(e["num_tokens"]), Path(stage_dir) / e["file"],
                     e.get("sha256"), int(e["bytes"]) if e.get("bytes") is not None else None)


REDO_HINT = ("Re-run stage 3 with `eagle3 run PARAMS --stages 3-5 --redo 3`: it re-checks every file against "
             "the manifest and redoes the broken ones (the rest are kept); `eagle3 verify RUN` lists them.")


class HiddenStatesDataset(torch.utils.data.Dataset):
    """The stored samples of a finished Stage 3 — the one dataset over these files.

    ``HiddenStatesDataset(stage_dir)`` (or :meth:`from_run`) indexes every row (``ds[i]`` = row ``i`` of train.parquet);
    :meth:`for_training` takes a subset of :class:`SampleRef` and yields speculators' training items.

    ``ds[i]`` -> raw: ``{"token_ids": int64 [seq], "loss_mask": int8 [seq], "hidden_states": [seq, n_aux + 1,
    hidden] (meta dtype; fp8 files dequantized to float32)}`` (``hidden_states[:, -1]`` is layer N before the
    final norm); training: :func:`to_training_item`'s dict.

    Integrity on read: ``ds[(i, True)]`` checks the file's size and sha256 (one streamed pass)
    against the manifest record, then decodes it; ``ds[i]`` (= ``ds[(i, False)]``) decodes without
    hashing. :meth:`first_reads` turns a read plan into such keys, marking the first read of each
    sample in this process call (the rule Stage 4 uses: every file it trains or validates on is
    hashed once per call, later epochs trust it). Cost (``benchmarks/bench_integrity.py``, 2-core CI
    machine): sha256 at 290-450 MiB/s per core, i.e. +2-7 ms per MiB on a checked read (1.8-3x a
    plain read from the page cache); for the embedded default ~0.3 % of a training call.

    Attributes:
        dir: the stage folder. meta: ``meta.json``. refs: the samples. lengths: token counts.
        ids: sample ids. entries: manifest records (raw mode). verified: sample indices already
        hashed in this process (:meth:`first_reads`).

    Raises:
        ExtractError: the folder has no meta.json / manifest.jsonl (Stage 3 has not finished).
        TrainError (training items): a listed file missing or unreadable; its size or sha256 differs
            from the manifest (the message says how to redo it); shapes that disagree.
    """

    def __init__(self, stage_dir: str | Path) -> None:
        self.dir = Path(stage_dir)
        self.meta = read_meta(self.dir)
        if not self.meta:
            raise ExtractError(f"{self.dir}: no meta.json/manifest.jsonl; run Stage 3 (extract) to completion first")
        self.entries = read_manifest(self.dir)
        self.refs = [ref_of(self.dir, e) for e in self.entries]
        self._item: Callable[[dict, str], dict] | None = None
        self._set_refs(self.refs)

    def _set_refs(self, refs: Sequence[SampleRef]) -> None:
        self.refs = list(refs)
        self.lengths = [r.num_tokens for r in self.refs]
        self.ids = [r.id for r in self.refs]
        self.verified: set[int] = set()

    @classmethod
    def from_run(cls, run_dir: str | Path) -> HiddenStatesDataset:
        """The Stage 3 folder of run directory ``run_dir``."""
        from eagle3.rundir import EXTRACT, RunDir

        return cls(RunDir(run_dir).stage(EXTRACT))

    @classmethod
    def for_training(cls, refs: Sequence[SampleRef], n_aux: int, hidden_size: int, vocab_size: int,
                     dtype: torch.dtype | None = None) -> HiddenStatesDataset:
        """The samples ``refs`` (their ``file`` set) as speculators' training items; fp8 files are
        dequantized into ``dtype`` (the training dtype; default float32), others keep their dtype."""
        self = cls.__new__(cls)
        self.dir, self.meta, self.entries = None, None, None
        self._set_refs(refs)
        self._item = lambda s, where: to_training_item(read_states(s, dtype if SCALES in s else None), n_aux,
                                                       hidden_size, vocab_size, where)
        return self

    def __len__(self) -> int:
        return len(self.refs)

    def first_reads(self, index_lists: Sequence[Sequence[int]]) -> list[list[tuple[int, bool]]]:
        """``index_lists`` as keys ``(i, verify)``: ``verify`` is True on the first read of sample ``i``
        in this process (marked here, where the reads are planned, so the loader threads get the
        flag with the index)."""
        out = []
        for b in index_lists:
            keys = []
            for i in b:
                i = int(i)
                keys.append((i, i not in self.verified))
                self.verified.add(i)
            out.append(keys)
        return out

    def _read(self, ref: SampleRef, verify: bool) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        if verify and ref.sha256 is not None:
            # one streamed pass (hashlib releases the GIL); the decode below then reads from the page cache
            with open(ref.file, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if ref.bytes is not None and size != ref.bytes:
                    raise TrainError(f"{ref.file} (row {ref.row}, id {ref.id}): {size} bytes but the manifest records "
                                     f"{ref.bytes} (truncated or replaced after Stage 3 wrote it). {REDO_HINT}")
                digest = hashlib.file_digest(f, "sha256").hexdigest()
            if digest != ref.sha256:
                raise TrainError(f"{ref.file} (row {ref.row}, id {ref.id}): sha256 {digest[:16]}... differs from the "
                                 f"manifest's {ref.sha256[:16]}... (the file changed after Stage 3 wrote it). {REDO_HINT}")
        return load_file(str(ref.file))

    def __getitem__(self, key: int | tuple[int, bool]) -> dict[str, torch.Tensor]:
        i, verify = key if isinstance(key, tuple) else (key, False)
        ref = self.refs[i]
        if self._item is None:
            return read_states(self._read(ref, verify))
        try:
            sample = self._read(ref, verify)
        except FileNotFoundError:
            raise TrainError(f"{ref.file} (row {ref.row}, id {ref.id}) is listed in the manifest but missing. "
                             f"{REDO_HINT}") from None
        except TrainError:
            raise
        except Exception as exc:  # noqa: BLE001 - any undecodable file is named with the way out
            raise TrainError(f"{ref.file} (id {ref.id}): unreadable safetensors file ({exc}). {REDO_HINT}") from None
        return self._item(sample, f"{ref.file} (id {ref.id})")


# ----------------------------------------------------------------------------------------------
# Full re-check
# ----------------------------------------------------------------------------------------------


def _check_entry(sd: Path, e: dict, rows, meta: dict, check_hashes: bool, check_values: bool) -> str | None:
    from safetensors.torch import load_file

    r, path = int(e["row"]), sd / e["file"]
    if r >= len(rows) or rows.ids[r] != e.get("id"):
        return "row/id not in the dataset"
    if not path.is_file():
        return "missing"
    if path.stat().st_size != int(e["bytes"]):
        return f"size {path.stat().st_size} != manifest {e['bytes']}"
    dtype = getattr(torch, meta["dtype"])
    reason = check_sample_file(path, rows.tokens(r), len(meta["stored_layers"]), meta["hidden_size"], dtype,
                               rows.mask(r))
    if reason:
        return reason
    if check_hashes and sha256_file(path) != e["sha256"]:
        return "sha256 differs from the manifest"
    if check_values:
        hs = read_states(load_file(str(path)))["hidden_states"]
        if not bool(torch.isfinite(hs).all()):
            return "non-finite hidden states: " + first_non_finite(hs, meta["stored_layers"])
    return None


def verify_folder(stage_dir: str | Path, rows, *, check_hashes: bool = True, check_values: bool = True,
                  raise_on_problem: bool = False) -> dict:
    """Full re-check of a Stage 3 folder against its manifest and Stage 2's rows.

    For every manifest line: the file exists with the recorded size and sha256, its header, shapes,
    dtypes, token ids and loss mask are right, and its hidden states are finite.

    Args:
        stage_dir: the Stage 3 folder. rows: Stage 2's tokenized rows (``ids``, ``tokens(r)``,
            ``loss_mask(r)``, ``len``).

    Returns:
        dict: ``files``, ``bytes``, ``problems`` (list of ``{"row", "id", "file", "problem"}``).

    Raises:
        ExtractError: no manifest (the stage has not finished); with ``raise_on_problem``, any problem.
    """
    sd = Path(stage_dir)
    meta = read_meta(sd)
    manifest = read_entries(sd / MANIFEST)
    if not meta or not manifest:
        raise ExtractError(f"{sd}: no meta.json/manifest.jsonl; run Stage 3 to completion first")
    problems = []
    for e in manifest:
        why = _check_entry(sd, e, rows, meta, check_hashes, check_values)
        if why:
            problems.append({"row": int(e["row"]), "id": e.get("id"), "file": str(sd / e["file"]), "problem": why})
    seen = {int(e["row"]) for e in manifest}
    problems += [{"row": r, "id": rows.ids[r], "file": None, "problem": "no manifest line"}
                 for r in range(len(rows)) if r not in seen]
    if meta.get("num_samples") is not None and int(meta["num_samples"]) != len(manifest):
        problems.append({"row": None, "id": None, "file": str(sd / MANIFEST),
                         "problem": f"{len(manifest)} manifest lines but meta.json says num_samples = {meta['num_samples']}"})
    report = {"files": len(manifest), "bytes": sum(int(e["bytes"]) for e in manifest), "problems": problems}
    if problems and raise_on_problem:
        p = problems[0]
        raise ExtractError(f"verify {sd}: {len(problems)} problem(s); first: row {p['row']} (id {p['id']}) "
                           f"{p['file']}: {p['problem']}")
    return report
