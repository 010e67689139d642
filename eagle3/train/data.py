"""Stage 4 data: Stage 3's hidden-state files (or its online iterator) as packed micro-batches.

Per sample (file contract, DESIGN.md): ``token_ids`` int64 ``[seq]``, ``loss_mask`` ``[seq]``,
``hidden_states`` ``[seq, n_aux+1, H]``. The first ``n_aux`` slots, concatenated, are the drafter's
``hidden_states`` input ``[seq, n_aux*H]``; the last slot (layer N, before the final norm) is
``verifier_last_hidden_states`` ``[seq, H]``. speculators' ``shift_batch`` then aligns
``(x[t+1], g[t], y[t+1], l[t+1])``; speculators' ``CollateFn`` packs samples into one row of
``token_budget`` positions with ``document_ids`` (-1 = padding), and its
``MultipackDistributedBatchSamplerV2`` decides (seeded, per epoch) which samples share a row.

A *step* is ``G = world_size x grad_accum`` consecutive micro-batches of one epoch's packing plan;
micro-batch ``r * grad_accum + a`` of a step goes to rank ``r``, accumulation round ``a``. The plan
depends only on the data, the token budget, the seed and G, so one process with ``grad_accum=2``
and two processes with ``grad_accum=1`` see exactly the same micro-batches.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from eagle3.train.model import TrainError

__all__ = [
    "SampleRef",
    "read_manifest",
    "heldout_ids",
    "split_by_id",
    "ExtractedSamples",
    "sample_to_item",
    "epoch_plan",
    "build_schedule",
    "plan_digest",
    "collate_fn",
    "MicroBatches",
    "tokens_in",
]


@dataclass(frozen=True)
class SampleRef:
    """One training sample: its row in Stage 2's train split, id, token count and (offline) file."""

    row: int
    id: str
    num_tokens: int
    file: Path | None = None


def read_manifest(stage3_dir: str | Path) -> list[SampleRef]:
    """Rows of ``03_extract/manifest.jsonl`` (later lines for the same row win).

    Raises:
        TrainError: missing manifest, or a line that is not JSON / lacks row, id, num_tokens, file
            (the message names the line).
    """
    d = Path(stage3_dir)
    f = d / "manifest.jsonl"
    if not f.exists():
        raise TrainError(f"{f} does not exist: run stage 3 first (or set train.online: true)")
    rows: dict[int, SampleRef] = {}
    with open(f, encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                ref = SampleRef(int(r["row"]), str(r["id"]), int(r["num_tokens"]), d / r["file"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise TrainError(f"{f} line {i}: not a manifest record ({type(exc).__name__}: {exc})") from None
            rows[ref.row] = ref
    return [rows[k] for k in sorted(rows)]


def heldout_ids(run_dir: str | Path) -> set[str]:
    """Ids of Stage 2's held-out split (``02_vocab/heldout.parquet``); empty when absent."""
    f = Path(run_dir) / "02_vocab" / "heldout.parquet"
    if not f.exists():
        return set()
    import pyarrow.parquet as pq

    return {str(x) for x in pq.read_table(f, columns=["id"]).column("id").to_pylist()}


def _id_unit(sample_id: str) -> float:
    """sha256(id) as a number in [0, 1): the split key (independent of order and seed)."""
    return int(hashlib.sha256(sample_id.encode("utf-8")).hexdigest()[:15], 16) / float(16**15)


def split_by_id(refs: Sequence[SampleRef], val_fraction: float) -> tuple[list[SampleRef], list[SampleRef]]:
    """Deterministic train/validation split by sample id.

    A sample is in validation when ``sha256(id)`` (as a fraction of 2^60) is below
    ``val_fraction``: stable under reordering and under adding samples. When that leaves validation
    empty although ``val_fraction > 0`` and there are at least two samples, the sample with the
    smallest key goes to validation.

    Returns:
        tuple: ``(train_refs, val_refs)``, each in the input order.
    """
    keyed = [(_id_unit(r.id), i) for i, r in enumerate(refs)]
    val = {i for u, i in keyed if u < val_fraction}
    if val_fraction > 0 and not val and len(refs) >= 2:
        val = {min(keyed)[1]}
    return [r for i, r in enumerate(refs) if i not in val], [r for i, r in enumerate(refs) if i in val]


def sample_to_item(sample: dict, n_aux: int, hidden_size: int, vocab_size: int, where: str) -> dict:
    """One Stage 3 sample (file or online dict) -> speculators' per-sample training dict.

    Args:
        sample: ``token_ids`` int ``[seq]``, ``loss_mask`` ``[seq]``, ``hidden_states`` ``[seq, n_aux+1, H]``.
        where: file name or sample id, for messages.

    Returns:
        dict: ``input_ids`` int64 ``[seq]``, ``hidden_states`` ``[seq, n_aux*H]`` (aux slots concatenated
        in order), ``verifier_last_hidden_states`` ``[seq, H]`` (last slot), ``loss_mask`` bool ``[seq]``.

    Raises:
        TrainError: missing tensors; an aux count or hidden size that disagrees with the model;
            lengths that disagree; token ids outside the target vocab.
    """
    import torch

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
    return {
        "hidden_states": hs[:, :n_aux].flatten(1),
        "input_ids": ids.to(torch.long),
        "verifier_last_hidden_states": hs[:, n_aux],
        "loss_mask": lm.to(torch.bool),
    }


def _base_dataset():
    from speculators.train.data import BaseDataset

    return BaseDataset


class ExtractedSamples(_base_dataset()):  # type: ignore[misc]
    """Stage 3 files as a speculators ``BaseDataset`` (adds ``lengths`` and ``position_ids``).

    ``approx_lengths`` are the token counts after ``shift_batch`` (``num_tokens - 1``), which is
    what the packing sampler must budget.
    """

    def __init__(self, refs: Sequence[SampleRef], n_aux: int, hidden_size: int, vocab_size: int, max_len: int) -> None:
        import torch

        self.refs = list(refs)
        self.n_aux, self.hidden_size, self.vocab_size = n_aux, hidden_size, vocab_size
        super().__init__(max_len=max_len, hidden_states_dtype=torch.float32)

    def __len__(self) -> int:
        return len(self.refs)

    def _compute_approx_lengths(self) -> list[int]:
        return [max(r.num_tokens - 1, 0) for r in self.refs]

    def _get_raw_data(self, index: int) -> dict:
        from safetensors.torch import load_file

        ref = self.refs[index]
        try:
            sample = load_file(str(ref.file))
        except FileNotFoundError:
            raise TrainError(f"{ref.file} (row {ref.row}, id {ref.id}) is listed in the manifest but missing") from None
        except Exception as exc:  # noqa: BLE001
            raise TrainError(f"{ref.file} (id {ref.id}): unreadable safetensors file ({exc})") from None
        return sample_to_item(sample, self.n_aux, self.hidden_size, self.vocab_size, f"{ref.file} (id {ref.id})")


def epoch_plan(lengths: Sequence[int], token_budget: int, seed: int, epoch: int) -> list[np.ndarray]:
    """One epoch's packing: lists of sample indices whose lengths sum to <= ``token_budget``.

    speculators' ``MultipackDistributedBatchSamplerV2`` with one replica: the samples are shuffled
    with ``numpy.random.default_rng(seed + epoch)`` and packed greedily in that order; longer samples
    are truncated to the budget by the collate function.
    """
    import warnings

    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    if not len(lengths):
        return []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = MultipackDistributedBatchSamplerV2(token_budget, list(lengths), num_replicas=1, rank=0, seed=seed)
    s.set_epoch(epoch)
    return [np.asarray(b, dtype=np.int64) for b in s]


def build_schedule(lengths: Sequence[int], token_budget: int, seed: int, epochs: int, group: int,
                   max_steps: int | None = None) -> list[tuple[int, list[np.ndarray]]]:
    """The run's optimizer steps: ``[(epoch, [G micro-batches of sample indices]), ...]``.

    Each epoch's plan (:func:`epoch_plan`) is cut into groups of ``group`` micro-batches; a last
    group shorter than ``group`` is dropped. ``max_steps`` caps the total.
    """
    steps: list[tuple[int, list[np.ndarray]]] = []
    for e in range(epochs):
        mbs = epoch_plan(lengths, token_budget, seed, e)
        for s in range(len(mbs) // group):
            steps.append((e, mbs[s * group:(s + 1) * group]))
            if max_steps is not None and len(steps) >= max_steps:
                return steps
    return steps


def plan_digest(refs: Sequence[SampleRef]) -> str:
    """sha256 (16 hex) of the training samples (ids and token counts): detects changed data on resume."""
    h = hashlib.sha256()
    for r in refs:
        h.update(f"{r.id}\t{r.num_tokens}\n".encode())
    return h.hexdigest()[:16]


def collate_fn(token_budget: int, hidden_size: int, n_aux: int, dtype) -> Callable:
    """speculators' ``CollateFn`` packing to ``token_budget`` with ``shift_batch`` as preprocessing.

    The batch it returns: ``input_ids`` ``[1, T]``, ``hidden_states`` ``[1, T, n_aux*H]`` (``dtype``),
    ``verifier_last_hidden_states`` ``[1, T, H]``, ``loss_mask`` ``[1, T]``, ``position_ids``
    ``[1, T]`` (from 1 within each document), ``document_ids`` ``[1, T]`` (-1 = padding).
    """
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    return CollateFn(token_budget, hidden_size, num_target_layers=n_aux, dtype=dtype, preprocess=shift_batch)


def _strip(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k in (
        "input_ids", "hidden_states", "verifier_last_hidden_states", "loss_mask", "position_ids", "document_ids")}


class MicroBatches:
    """Iterate collated micro-batches for a list of index lists (one per micro-batch), in order.

    Offline: a torch ``DataLoader`` over :class:`ExtractedSamples` (``num_workers`` background
    readers). Online: ``fetch(indices) -> list of per-sample dicts`` is called per micro-batch.
    """

    def __init__(self, index_lists: Sequence[np.ndarray], collate: Callable, dataset=None,
                 fetch: Callable[[list[int]], list[dict]] | None = None, num_workers: int = 0,
                 pin_memory: bool = False) -> None:
        self.index_lists = [list(map(int, b)) for b in index_lists]
        self.collate, self.dataset, self.fetch, self.num_workers = collate, dataset, fetch, num_workers
        self.pin_memory = pin_memory

    def __len__(self) -> int:
        return len(self.index_lists)

    def __iter__(self) -> Iterator[dict]:
        if not self.index_lists:
            return iter(())
        if self.fetch is not None:
            return (_strip(self.collate(self.fetch(b))) for b in self.index_lists)
        from torch.utils.data import DataLoader

        loader = DataLoader(self.dataset, batch_sampler=self.index_lists, collate_fn=self.collate,
                            num_workers=self.num_workers, pin_memory=self.pin_memory,
                            prefetch_factor=2 if self.num_workers else None,
                            persistent_workers=False)
        return (_strip(b) for b in loader)


def tokens_in(batch: dict) -> int:
    """Real (non-padding) positions of a collated micro-batch."""
    return int((batch["document_ids"] != -1).sum())

