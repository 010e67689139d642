"""Reading a finished Stage 3: :class:`HiddenStatesDataset` (raw samples or speculators' training
items), with each file's size and sha256 checked against the manifest on its first read."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3.contracts.hidden_states.codec import SCALES, read_states
from eagle3.contracts.hidden_states.manifest import read_manifest, read_meta
from eagle3.errors import ExtractError, TrainError

__all__ = ["to_training_item", "SampleRef", "ref_of", "REDO_HINT", "HiddenStatesDataset"]


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
