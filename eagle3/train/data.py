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
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from eagle3.contracts import hidden_states as hsc
from eagle3.contracts.hidden_states import SampleRef
from eagle3.errors import ExtractError, TrainError
from eagle3.rundir import EXTRACT, RunDir

__all__ = [
    "SampleRef",
    "read_manifest",
    "online_refs",
    "heldout_ids",
    "split_by_id",
    "epoch_plan",
    "build_schedule",
    "plan_digest",
    "collate_fn",
    "MicroBatches",
    "tokens_in",
]


def read_manifest(run_dir: str | Path) -> list[SampleRef]:
    """Stage 3's samples as :class:`SampleRef` (row, id, token count, file, sha256, bytes), by row.

    The manifest must agree with ``meta.json``'s sample count and with Stage 2's train split (one
    line per row, the split's ids: :func:`eagle3.contracts.hidden_states.check_manifest`), so a lost
    line or a Stage 2 re-run after Stage 3 is refused instead of training on a subset.

    Raises:
        TrainError: no manifest (run stage 3 first, or set train.online: true); a manifest that
            disagrees with meta.json or with the train split (first problem named, and the fix).
    """
    from eagle3.contracts import tokenized

    rd = RunDir(run_dir)
    sd = rd.stage(EXTRACT)
    try:
        entries = hsc.read_manifest(sd)
    except ExtractError as exc:
        raise TrainError(str(exc)) from None
    ids = tokenized.read_ids(run_dir, "train") if rd.tokenized("train").exists() else None
    problems = hsc.check_manifest(entries, hsc.read_meta(sd), ids, where=rd.manifest)
    if problems:
        raise TrainError(
            "Stage 3's manifest does not match its inputs:\n  " + "\n  ".join(problems[:5])
            + f"\n{hsc.REDO_HINT}"
        )
    return [hsc.ref_of(sd, e) for e in entries]


def online_refs(run_dir: str | Path) -> list[SampleRef]:
    """Stage 2's train split as :class:`SampleRef` without files (online training)."""
    from eagle3.contracts import tokenized

    f = RunDir(run_dir).tokenized("train")
    if not f.exists():
        raise TrainError(f"{f} does not exist: online training reads Stage 2's tokenized samples. Run stage 2 first.")
    ids, lens = tokenized.read_row_tokens(run_dir, "train")
    return [SampleRef(i, x, int(n), None) for i, (x, n) in enumerate(zip(ids, lens))]


def heldout_ids(run_dir: str | Path) -> set[str]:
    """Ids of Stage 2's held-out split (``heldout.parquet``); empty when absent."""
    from eagle3.contracts import tokenized

    if not RunDir(run_dir).tokenized("heldout").exists():
        return set()
    return set(tokenized.read_ids(run_dir, "heldout"))


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

    Offline: a torch ``DataLoader`` over :class:`eagle3.contracts.hidden_states.HiddenStatesDataset`
    (``num_workers`` background readers; the first read of each file in this call checks its sha256
    against the manifest). Online: ``fetch(indices) -> list of per-sample dicts`` is called per
    micro-batch.
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

        # keys (i, verify): each file's first read in this call checks its sha256 (HiddenStatesDataset)
        plan = self.dataset.first_reads(self.index_lists) if hasattr(self.dataset, "first_reads") else self.index_lists
        loader = DataLoader(self.dataset, batch_sampler=plan, collate_fn=self.collate,
                            num_workers=self.num_workers, pin_memory=self.pin_memory,
                            prefetch_factor=2 if self.num_workers else None,
                            persistent_workers=False)
        return (_strip(b) for b in loader)


def tokens_in(batch: dict) -> int:
    """Real (non-padding) positions of a collated micro-batch."""
    return int((batch["document_ids"] != -1).sum())

