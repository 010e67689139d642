"""Stage 3 building blocks: layer ids, hook-based capture, token-budget batches, rows, file writer.

Conventions (docs/DESIGN.md "Conventions that must match the engines", and vLLM's
``LlamaModel.forward`` / speculators' ``launch_vllm.py``):

* aux layer id ``k`` (``1 <= k < N``) is the residual stream after decoder layer ``k - 1``, i.e.
  transformers' ``output_hidden_states`` entry ``hidden_states[k]``;
* id ``N`` (``num_hidden_layers``) is the output of the last decoder layer *before* the final norm
  (transformers' ``hidden_states[N]`` is after the norm for Llama-family models);
* a sample's file holds ``hidden_states [seq, n_aux + 1, hidden]`` with the aux ids in ascending
  order and id ``N`` in the last slot (vLLM's ``extract_hidden_states`` method writes the same
  layout, in layer order, for ``eagle_aux_hidden_state_layer_ids = aux + [N]``).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
from eagle3.errors import ExtractError

__all__ = [
    "ExtractError",
    "NonFiniteError",
    "default_aux_layer_ids",
    "resolve_layer_ids",
    "text_config",
    "decoder_layers",
    "HiddenStateCapture",
    "plan_batches",
    "TokenizedRows",
    "shard_name",
    "sample_relpath",
    "ROW_FILE_RE",
    "SHARD_DIR_RE",
    "SampleWriter",
    "DTYPE_BYTES",
    "storage_dtype",
    "check_sample_file",
    "sha256_file",
    "pad_batch",
    "extract_batches",
    "iter_journal",
    "finite_flags",
    "to_host",
    "save_sample",
]

DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
ROW_FILE_RE = re.compile(r"^(\d{6,})\.safetensors$")
SHARD_DIR_RE = re.compile(r"^rows_(\d{6,})-(\d{6,})$")


class NonFiniteError(ExtractError):
    """A sample's hidden states contain NaN or Inf (the message names the sample id, slot and token)."""


# ----------------------------------------------------------------------------------------------
# Layer ids and model structure
# ----------------------------------------------------------------------------------------------


def default_aux_layer_ids(num_hidden_layers: int) -> list[int]:
    """EAGLE-3's default aux layer ids ``[2, N // 2, N - 3]`` (speculators ``launch_vllm.py``)."""
    n = num_hidden_layers
    return [2, n // 2, n - 3]


def resolve_layer_ids(aux_layer_ids: Sequence[int] | None, num_hidden_layers: int,
                      field: str = "extract.aux_layer_ids") -> list[int]:
    """Validate the aux layer ids against the target's layer count (``None`` = the default).

    Args:
        aux_layer_ids: the configured ids, or None for ``[2, N // 2, N - 3]``.
        num_hidden_layers: N, the target's decoder layer count.
        field: the params key named in error messages.

    Returns:
        list[int]: the aux ids, ascending. The stored layers are these plus ``N``.

    Raises:
        ExtractError: empty list, an id outside ``1 <= k < N``, a duplicate, or ids not ascending
            (vLLM captures aux layers in layer order, so another order could not match the engine).
    """
    n = int(num_hidden_layers)
    ids = default_aux_layer_ids(n) if aux_layer_ids is None else [int(k) for k in aux_layer_ids]
    src = "default [2, N//2, N-3]" if aux_layer_ids is None else field
    if not ids:
        raise ExtractError(f"{field}: at least one aux layer id is needed (EAGLE-3 fuses several layers)")
    bad = [k for k in ids if not 1 <= k < n]
    if bad:
        raise ExtractError(
            f"{src} = {ids}: id(s) {bad} out of range for a target with num_hidden_layers N = {n}; "
            f"aux ids must satisfy 1 <= k < {n} (id k = output of decoder layer k-1 = transformers "
            f"hidden_states[k]; id N = {n} is always stored as the last slot, do not list it)."
        )
    dups = sorted({k for k in ids if ids.count(k) > 1})
    if dups:
        raise ExtractError(f"{src} = {ids}: duplicated id(s) {dups}; each aux layer may appear once.")
    if ids != sorted(ids):
        raise ExtractError(
            f"{src} = {ids}: ids must be ascending ({sorted(ids)}); vLLM returns aux hidden states "
            f"in layer order, so any other order would not match the serving engine."
        )
    return ids


def text_config(config):
    """The text (decoder) config of a model config (``get_text_config()`` for multimodal models)."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def decoder_layers(model) -> tuple[torch.nn.Module, torch.nn.ModuleList]:
    """``(decoder, layers)``: the base decoder module (no LM head) and its decoder-layer list.

    Works for transformers causal LMs that follow the ``model.model.layers`` layout (Llama, Qwen,
    Mistral, DeepSeek, ...) or expose ``get_decoder()``.

    Raises:
        ExtractError: no decoder layer list could be found.
    """
    dec = None
    get = getattr(model, "get_decoder", None)
    if callable(get):
        try:
            dec = get()
        except Exception:  # noqa: BLE001 - some models raise NotImplementedError here
            dec = None
    if dec is None or not isinstance(getattr(dec, "layers", None), torch.nn.ModuleList):
        dec = getattr(model, "model", model)
    layers = getattr(dec, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ExtractError(
            f"{type(model).__name__}: cannot find the decoder layers (expected model.model.layers or "
            f"get_decoder().layers); this architecture needs backend=vllm or a small adapter."
        )
    return dec, layers


class _StopForward(Exception):
    """Raised by the hook on the last needed layer: nothing after it (final norm, LM head) runs."""


class HiddenStateCapture:
    """Prefill-only forward of the target's decoder that keeps only the stored layers.

    Forward hooks on decoder layers ``k - 1`` (aux id ``k``) and ``N - 1`` (id ``N``, before the final
    norm) copy their outputs into one buffer ``[batch, seq, n_aux + 1, hidden]`` in the storage
    dtype; the hook on the last needed layer stops the forward, so the final norm and the LM head
    never run. No KV cache (``use_cache=False``), under ``torch.inference_mode()``.

    Args:
        model: a transformers causal LM in eval mode (any device/dtype).
        aux_layer_ids: aux ids (validated by :func:`resolve_layer_ids`; None = default).
        storage_dtype: dtype of the returned hidden states (e.g. ``torch.bfloat16``).

    Attributes:
        aux_layer_ids, stored_layers (aux + [N]), num_hidden_layers (N), hidden_size (H), device.

    Raises:
        ExtractError: the config's ``num_hidden_layers`` disagrees with the model's decoder layers;
            a captured tensor whose last dimension is not ``hidden_size``; bad aux ids.
    """

    def __init__(self, model, aux_layer_ids: Sequence[int] | None, storage_dtype: torch.dtype) -> None:
        cfg = text_config(model.config)
        self.num_hidden_layers = int(cfg.num_hidden_layers)
        self.hidden_size = int(cfg.hidden_size)
        self.decoder, layers = decoder_layers(model)
        if len(layers) != self.num_hidden_layers:
            raise ExtractError(
                f"target config says num_hidden_layers = {self.num_hidden_layers} but the model has "
                f"{len(layers)} decoder layers; the layer ids would not mean what they say. Fix the "
                f"model's config.json (or the model)."
            )
        self.aux_layer_ids = resolve_layer_ids(aux_layer_ids, self.num_hidden_layers)
        self.stored_layers = [*self.aux_layer_ids, self.num_hidden_layers]
        self.storage_dtype = storage_dtype
        self.device = next(model.parameters()).device
        self._buf: torch.Tensor | None = None
        last_needed = max(self.stored_layers) - 1
        self._handles = [
            layers[k - 1].register_forward_hook(partial(self._hook, slot, k - 1 == last_needed))
            for slot, k in enumerate(self.stored_layers)
        ]

    @property
    def num_slots(self) -> int:
        """``n_aux + 1``."""
        return len(self.stored_layers)

    def _hook(self, slot: int, last: bool, module, args, output) -> None:
        if self._buf is None:  # the model is used outside capture(): do nothing
            return
        h = output[0] if isinstance(output, tuple) else output
        if h.shape[-1] != self.hidden_size:
            raise ExtractError(
                f"decoder layer {self.stored_layers[slot] - 1} returned hidden size {h.shape[-1]} but the "
                f"target config says hidden_size = {self.hidden_size}"
            )
        self._buf[:, :, slot].copy_(h)
        if last:
            raise _StopForward

    @torch.inference_mode()
    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run one right-padded batch and return its stored layers.

        Args:
            input_ids: int64 ``[batch, seq]`` on ``self.device``, right-padded.
            attention_mask: ``[batch, seq]`` (1 = token, 0 = padding) or None when nothing is padded.

        Returns:
            torch.Tensor: ``[batch, seq, n_aux + 1, hidden]`` in the storage dtype on ``self.device``;
            rows at padded positions are meaningless (slice each sample to its true length).
        """
        b, t = input_ids.shape
        self._buf = torch.empty(b, t, self.num_slots, self.hidden_size, dtype=self.storage_dtype,
                                device=input_ids.device)
        try:
            self.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _StopForward:
            pass
        else:
            raise ExtractError("the forward ended without reaching the last stored layer's hook")
        finally:
            out, self._buf = self._buf, None
        return out

    def close(self) -> None:
        """Remove the hooks (the model behaves as before)."""
        for h in self._handles:
            h.remove()
        self._handles = []


def plan_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Group sample indices into batches of at most ``token_budget`` padded tokens.

    Samples are sorted by length, longest first (ties by index), and cut greedily so that
    ``len(batch) * max_len(batch) <= token_budget``; a sample longer than the budget gets a batch of
    its own. Longest-first makes the first batches the heaviest: an out-of-memory shows at once and
    the calibration projects conservatively. Deterministic: the same lengths give the same plan.

    Returns:
        list[list[int]]: indices into ``lengths``; each batch's first index is its longest sample.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    batches: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in order:
        length = int(lengths[i])
        m = max(cur_max, length)
        if cur and m * (len(cur) + 1) > token_budget:
            batches.append(cur)
            cur, m = [], length
        cur.append(i)
        cur_max = m
    if cur:
        batches.append(cur)
    return batches


def pad_batch(rows: "TokenizedRows", batch: Sequence[int], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """Right-padded ``(input_ids [B, T] int64, attention_mask [B, T] int64 or None, lengths)`` on CPU.

    The mask is None when every sample has the full length (no padding in the batch).
    """
    lens = [int(rows.lengths[r]) for r in batch]
    t = max(lens)
    ids = torch.full((len(batch), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), t), dtype=torch.long)
    for j, r in enumerate(batch):
        ids[j, : lens[j]] = torch.from_numpy(rows.tokens(r))
        mask[j, : lens[j]] = 1
    return ids, (None if min(lens) == t else mask), lens


# ----------------------------------------------------------------------------------------------
# Input rows (Stage 2's tokenized parquet)
# ----------------------------------------------------------------------------------------------


class TokenizedRows:
    """Stage 2's ``train.parquet`` (columns ``id``, ``source``, ``input_ids``, ``loss_mask``) in memory.

    Token ids and loss masks are kept as two flat numpy arrays plus offsets (no per-row Python lists).

    Attributes:
        path: the parquet file. ids: sample ids (list[str]). sources: list[str].
        lengths: int64 numpy ``[rows]`` token counts.

    Raises:
        ExtractError: missing file, missing column, a null row, or a loss mask whose length differs from
            its input_ids (the message names the file, row and id).
    """

    COLUMNS = ("id", "source", "input_ids", "loss_mask")

    def __init__(self, path: str | Path) -> None:
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        self.path = Path(path)
        if not self.path.is_file():
            raise ExtractError(
                f"{self.path} does not exist: Stage 3 reads Stage 2's tokenized samples. Run stage 2 "
                f"(`eagle3 run PARAMS --stages 2`) first."
            )
        schema = pq.read_schema(self.path)
        missing = [c for c in self.COLUMNS if c not in schema.names]
        if missing:
            raise ExtractError(f"{self.path}: missing column(s) {missing}; expected {list(self.COLUMNS)}")
        table = pq.read_table(self.path, columns=list(self.COLUMNS))
        self.ids = [str(x) for x in table.column("id").to_pylist()]
        self.sources = [str(x) for x in table.column("source").to_pylist()]
        cols = {}
        for name in ("input_ids", "loss_mask"):
            arr = table.column(name).combine_chunks()
            if arr.null_count:
                row = int(np.flatnonzero(arr.is_null().to_numpy(zero_copy_only=False))[0])
                raise ExtractError(f"{self.path}: row {row} (id {self.ids[row]}): column {name} is null")
            lens = pc.list_value_length(arr).to_numpy(zero_copy_only=False).astype(np.int64)
            cols[name] = (arr.flatten().to_numpy(zero_copy_only=False), lens)
        self.lengths = cols["input_ids"][1]
        bad = np.flatnonzero(cols["loss_mask"][1] != self.lengths)
        if bad.size:
            r = int(bad[0])
            raise ExtractError(
                f"{self.path}: row {r} (id {self.ids[r]}): loss_mask has {cols['loss_mask'][1][r]} entries "
                f"but input_ids has {self.lengths[r]}"
            )
        empty = np.flatnonzero(self.lengths == 0)
        if empty.size:
            r = int(empty[0])
            raise ExtractError(f"{self.path}: row {r} (id {self.ids[r]}): input_ids is empty")
        self._ids_flat = np.array(cols["input_ids"][0], dtype=np.int64)  # owned, writable copies
        self._mask_flat = np.array(cols["loss_mask"][0], dtype=np.int8)
        self._offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)

    @classmethod
    def from_lists(cls, ids: Sequence[str], input_ids: Sequence[Sequence[int]],
                   loss_mask: Sequence[Sequence[int]] | None = None, source: str = "memory") -> "TokenizedRows":
        """Rows held in memory (no parquet file; used by the benchmark). Loss masks default to all ones."""
        self = cls.__new__(cls)
        self.path = Path(f"<{source}>")
        self.ids = [str(x) for x in ids]
        self.sources = [source] * len(self.ids)
        self.lengths = np.array([len(x) for x in input_ids], dtype=np.int64)
        self._ids_flat = np.concatenate([np.asarray(x, dtype=np.int64) for x in input_ids]) if len(input_ids) else np.zeros(0, np.int64)
        masks = loss_mask if loss_mask is not None else [np.ones(len(x), np.int8) for x in input_ids]
        self._mask_flat = np.concatenate([np.asarray(x, dtype=np.int8) for x in masks]) if len(masks) else np.zeros(0, np.int8)
        self._offsets = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int64)
        return self

    def __len__(self) -> int:
        return len(self.ids)

    def tokens(self, row: int) -> np.ndarray:
        """int64 ``[seq]`` token ids of ``row``."""
        return self._ids_flat[self._offsets[row]: self._offsets[row + 1]]

    def loss_mask(self, row: int) -> np.ndarray:
        """int8 ``[seq]`` loss mask of ``row`` (1 = supervised)."""
        return self._mask_flat[self._offsets[row]: self._offsets[row + 1]]

    @property
    def total_tokens(self) -> int:
        return int(self.lengths.sum())

    def fingerprint(self) -> str:
        """sha256 (16 hex) of ids, token ids and loss masks: which data the stored files belong to."""
        h = hashlib.sha256()
        h.update("\n".join(self.ids).encode())
        h.update(self.lengths.tobytes())
        h.update(self._ids_flat.tobytes())
        h.update(self._mask_flat.tobytes())
        return h.hexdigest()[:16]

    def check_max_len(self, max_seq_len: int, field: str = "vocab.max_seq_len") -> None:
        """Raise ExtractError naming the first row longer than ``max_seq_len`` tokens."""
        over = np.flatnonzero(self.lengths > max_seq_len)
        if over.size:
            r = int(over[0])
            raise ExtractError(
                f"{self.path}: row {r} (id {self.ids[r]}) has {int(self.lengths[r])} tokens, more than "
                f"{field} = {max_seq_len} ({over.size} row(s) too long). Re-run Stage 2 with the same "
                f"max_seq_len, or raise {field}."
            )


# ----------------------------------------------------------------------------------------------
# File layout, checks and the background writer
# ----------------------------------------------------------------------------------------------


def storage_dtype(name: str, compute_dtype: torch.dtype) -> torch.dtype:
    """Map ``extract.dtype`` to a torch dtype ('auto' = the target's compute dtype)."""
    if name == "auto":
        return compute_dtype
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def shard_name(row: int, shard_size: int) -> str:
    """``rows_000000-002000`` for ``row`` in ``[0, 2000)`` with shard size 2000."""
    start = row // shard_size * shard_size
    return f"rows_{start:06d}-{start + shard_size:06d}"


def sample_relpath(row: int, shard_size: int) -> str:
    """Path of a sample's file relative to the stage folder: ``rows_000000-002000/000017.safetensors``."""
    return f"{shard_name(row, shard_size)}/{row:06d}.safetensors"


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64, "I8": torch.int8}


def check_sample_file(path: str | Path, tokens: np.ndarray | None, num_slots: int, hidden_size: int,
                      dtype: torch.dtype, loss_mask: np.ndarray | None = None) -> str | None:
    """Check one stored sample without reading its hidden states; None when it is good.

    Checks: the safetensors header parses and covers the file exactly (safetensors' own validation),
    the three tensors exist with shapes ``[seq]``, ``[seq]``, ``[seq, num_slots, hidden_size]``, the
    dtypes (int64, int8, ``dtype``), and that ``token_ids`` (and ``loss_mask``) equal the expected
    ones.

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


def save_sample(tmp_path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write one sample with ``safetensors.torch.save_file`` (from the tensors' memory, without the GIL
    held for the copy in safetensors >= 0.8)."""
    from safetensors.torch import save_file

    save_file(tensors, str(tmp_path), metadata=metadata)


def _is_disk_full(exc: BaseException) -> bool:
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return True
    msg = str(exc)
    return "No space left on device" in msg or "os error 28" in msg


def _atomic_save(path: Path, tensors: dict, metadata: dict, write_fn: Callable) -> tuple[int, str]:
    """Save to a temp file beside ``path`` (via ``write_fn``), hash it, rename it over ``path``.

    The same protocol as :func:`eagle3.io.atomic_path` (temp name ``.<name>.<random>.tmp`` in the same
    folder, removed on any failure), kept here so that this module needs only torch, numpy and
    safetensors (the GPU benchmark runs on machines without the project's other dependencies).

    Returns:
        tuple: ``(bytes, sha256 hex)`` of the file.
    """
    import tempfile

    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_p = Path(tmp)
    try:
        write_fn(tmp_p, tensors, metadata)
        size, digest = tmp_p.stat().st_size, sha256_file(tmp_p)
        os.replace(tmp_p, path)
    except BaseException:
        tmp_p.unlink(missing_ok=True)
        raise
    return size, digest


def first_non_finite(hs: torch.Tensor, stored_layers: Sequence[int]) -> str:
    """Describe the first NaN/Inf in ``hs [seq, slots, hidden]`` as 'layer id L (slot s), token t'."""
    bad = (~torch.isfinite(hs.float())).any(dim=-1).nonzero()
    if not len(bad):
        return "no non-finite value"
    t, s = (int(x) for x in bad[0])
    return f"layer id {stored_layers[s]} (slot {s}), token {t} (first of {len(bad)} bad (token, slot) pairs)"


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
            tests pass one that fails like a full disk); the hash, the rename and the removal of the
            temp file on failure are done here.

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

    def _task(self, entry: dict, tensors: dict, finite, ready, nbytes: int, after=None) -> None:
        t0 = time.perf_counter()
        try:
            if self.error is not None:
                return
            if ready is not None:
                ready.synchronize()
            if not bool(finite):
                where = first_non_finite(tensors["hidden_states"], self.stored_layers)
                raise NonFiniteError(
                    f"non-finite hidden states (NaN/Inf) in sample id {entry['id']} (row {entry['row']}): "
                    f"{where}. Nothing was written for it; check the target's dtype (float16 overflows are "
                    f"common: use bfloat16) and the sample."
                )
            # one metadata key only: safetensors keeps metadata in a hash map whose order changes
            # from process to process, and the bytes (and sha256) of a file must not
            meta = {"id": str(entry["id"])}
            path = self.stage_dir / entry["file"]
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                nbytes_file, digest = _atomic_save(path, {k: v.contiguous() for k, v in tensors.items()}, meta,
                                                   self.write_fn)
            except Exception as exc:
                if _is_disk_full(exc):
                    import shutil

                    raise ExtractError(
                        f"disk full while writing {path}: {exc}. Free space now: "
                        f"{shutil.disk_usage(self.stage_dir).free} bytes; this run wrote {self.bytes_written} bytes in "
                        f"{self.files_written} files before it. Finished files are kept and the partial "
                        f"file was removed: free space (or move the run) and re-run to resume."
                    ) from exc
                raise ExtractError(f"writing {path} failed: {type(exc).__name__}: {exc}") from exc
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
# The extraction loop (used by the stage, online mode and the benchmark)
# ----------------------------------------------------------------------------------------------


def finite_flags(hs: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """bool ``[B]`` on ``hs``'s device: sample ``b`` has no NaN/Inf in its real (unpadded) tokens."""
    fin = torch.isfinite(hs).flatten(2).all(-1)  # [B, T]
    if mask is not None:
        fin = fin | (mask == 0)
    return fin.all(-1)


def to_host(hs: torch.Tensor, mask: torch.Tensor | None, lens: Sequence[int]):
    """Start copying a captured batch to the host.

    Args:
        hs: ``[B, T, slots, hidden]`` from :meth:`HiddenStateCapture.capture`.
        mask: ``[B, T]`` attention mask or None. lens: true lengths.

    Returns:
        tuple: ``(hs_host, finite, ready)``: on CUDA a pinned host tensor and a bool ``[B]`` flag tensor
        being filled asynchronously, and the CUDA event that completes them (``ready.synchronize()``
        before reading; the writer threads do); on CPU the inputs themselves and ``ready = None``.
    """
    fin = finite_flags(hs, mask)
    if hs.device.type != "cuda":
        return hs, fin, None
    host = torch.empty(hs.shape, dtype=hs.dtype, pin_memory=True)
    host.copy_(hs, non_blocking=True)
    fin_host = torch.empty(fin.shape, dtype=torch.bool, pin_memory=True)
    fin_host.copy_(fin, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record()
    return host, fin_host, ev


def extract_batches(capture: HiddenStateCapture, rows: TokenizedRows, batches: Sequence[Sequence[int]],
                    writer: SampleWriter | None, *, shard_size: int, skip: set[int] | frozenset = frozenset(),
                    pad_id: int = 0, on_batch: Callable[[int, int, int], None] | None = None) -> dict:
    """Run ``batches`` through ``capture`` and queue every sample not in ``skip`` on ``writer``.

    A batch is always computed whole (even when some of its rows are done) so that a resumed run
    computes every sample in the same batch shape as an uninterrupted one: identical tensors.

    Args:
        capture: the hooked target.
        rows: the tokenized samples.
        batches: lists of row indices (from :func:`plan_batches`).
        writer: where samples go (None: compute only, e.g. a benchmark).
        shard_size: rows per ``rows_*`` folder.
        skip: rows whose files are already done.
        on_batch: ``on_batch(new_samples, new_tokens, computed_tokens)`` after each batch.

    Returns:
        dict: ``samples``, ``tokens`` (new), ``computed_tokens``, ``seconds`` (loop wall time,
        the writer drained).

    Raises:
        NonFiniteError / ExtractError: from the writer (NaN/Inf sample, disk full).
    """
    t0 = time.perf_counter()
    new_samples = new_tokens = computed = 0
    dev = capture.device
    for batch in batches:
        ids, mask, lens = pad_batch(rows, batch, pad_id)
        ids = ids.to(dev, non_blocking=True)
        mask = mask.to(dev, non_blocking=True) if mask is not None else None
        hs = capture.capture(ids, mask)
        hs_host, fin, ready = to_host(hs, mask, lens)
        n_new = t_new = 0
        for j, r in enumerate(batch):
            if r in skip:
                continue
            n_new += 1
            t_new += lens[j]
            if writer is None:
                if ready is None and not bool(fin[j]):
                    raise NonFiniteError(f"non-finite hidden states in sample id {rows.ids[r]} (row {r}): "
                                         f"{first_non_finite(hs_host[j, : lens[j]], capture.stored_layers)}")
                continue
            tensors = {"token_ids": torch.from_numpy(rows.tokens(r).copy()),
                       "loss_mask": torch.from_numpy(rows.loss_mask(r).copy()),
                       "hidden_states": hs_host[j, : lens[j]]}
            writer.submit({"row": r, "id": rows.ids[r], "file": sample_relpath(r, shard_size)}, tensors,
                          finite=fin[j], ready=ready)
        if ready is not None and writer is None:
            ready.synchronize()
        new_samples += n_new
        new_tokens += t_new
        computed += sum(lens)
        if on_batch is not None:
            on_batch(n_new, t_new, sum(lens))
    if writer is not None:
        writer.close()
    elif dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return {"samples": new_samples, "tokens": new_tokens, "computed_tokens": computed,
            "seconds": time.perf_counter() - t0}


def iter_journal(path: str | Path) -> Iterable[dict]:
    """Entries of a journal / manifest file; a torn last line (killed writer) is skipped."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for line in p.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(e, dict) and {"row", "file", "bytes", "sha256"} <= e.keys():
            out.append(e)
    return out
