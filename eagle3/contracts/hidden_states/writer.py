"""The sample-file writer: safetensors files written atomically on background threads, journalled.

A file is written under a temp name in the stage's temp folder (:data:`~.layout.TMP_DIR`), hashed,
renamed into its row shard, then recorded as one line of the rank's journal: a killed run leaves
finished files with their records, and at most temp files that the next run removes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from eagle3.contracts.hidden_states.codec import NonFiniteError, first_non_finite
from eagle3.contracts.hidden_states.layout import TMP_DIR
from eagle3.contracts.hidden_states.manifest import sha256_file
from eagle3.errors import ExtractError
from eagle3.io import is_disk_full

__all__ = ["save_sample", "written_sha256", "SampleWriter"]


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
    "Stage 3's writer alone"): 2.2-2.7x with 1-2 threads on the 2-core CPU VM, 1.9x with 1 thread and
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

