"""Stage 4 data: Stage 3's hidden-state files (or its online iterator) as packed micro-batches.

Per sample (file contract, DESIGN.md): ``token_ids`` int64 ``[seq]``, ``loss_mask`` ``[seq]``,
``hidden_states`` ``[seq, n_aux+1, H]``. The first ``n_aux`` slots, concatenated, are the drafter's
``hidden_states`` input ``[seq, n_aux*H]``; the last slot (layer N, before the final norm) is
``verifier_last_hidden_states`` ``[seq, H]``. :class:`PackedCollate` packs samples into one row of
``token_budget`` positions with ``document_ids`` (-1 = padding) in the layout of speculators'
``CollateFn`` with ``shift_batch`` (which aligns ``(x[t+1], g[t], y[t+1], l[t+1])``); speculators'
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
    "BATCH_KEYS",
    "PackedCollate",
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


BATCH_KEYS = ("input_ids", "hidden_states", "verifier_last_hidden_states", "loss_mask", "position_ids", "document_ids")


class PackedCollate:
    """Pack training items into one micro-batch of ``token_budget`` positions: the layout of
    speculators' ``CollateFn`` with ``shift_batch`` as preprocessing (``tests/test_train.py`` compares
    the two on random items), written with one copy per tensor into given or fresh buffers.

    speculators' version zero-fills fresh buffers and copies the aux states twice (their flatten,
    then the packing); at a GPU token budget (8,192 tokens x 4 slots x 4,096 x bf16 = 268 MB per
    micro-batch) that is most of the loader's time (benchmarks/RESULTS.md). Here only the
    padding tail is filled, and :class:`MicroBatches` reuses pinned buffers.

    Layout (``shift_batch``: token ``t + 1`` is paired with the states of position ``t``): item ``d``
    of ``n`` tokens fills ``L = min(n - 1, T - offset)`` positions from ``offset`` with
    ``input_ids[1:L+1]``, ``hidden_states[:L]`` as ``[L, n_aux*H]``, ``verifier_last_hidden_states[1:L+1]``,
    ``loss_mask[1:L+1]``, ``position_ids[1:L+1]`` (so from 1 in each document) and ``document_ids = d``;
    items after the one that reaches ``T`` are dropped; the tail is padding (zeros, ``loss_mask``
    False, ``document_ids`` -1).

    Args:
        token_budget: ``T``, positions per micro-batch. hidden_size: ``H``. n_aux: aux layer slots.
        dtype: dtype of the two hidden-state tensors in the batch (cast on the copy).
    """

    def __init__(self, token_budget: int, hidden_size: int, n_aux: int, dtype) -> None:
        self.token_budget, self.hidden_size, self.n_aux, self.dtype = int(token_budget), int(hidden_size), int(n_aux), dtype

    def buffers(self, device="cpu", pin_memory: bool = False) -> dict:
        """Uninitialised buffers of one micro-batch (:data:`BATCH_KEYS`): ``[1, T]`` int64 / bool,
        ``hidden_states`` ``[1, T, n_aux*H]`` and ``verifier_last_hidden_states`` ``[1, T, H]`` in ``dtype``."""
        import torch

        T, H = self.token_budget, self.hidden_size

        def new(shape, dtype):
            return torch.empty(shape, dtype=dtype, device=device, pin_memory=pin_memory)

        return {"input_ids": new((1, T), torch.long), "hidden_states": new((1, T, self.n_aux * H), self.dtype),
                "verifier_last_hidden_states": new((1, T, H), self.dtype), "loss_mask": new((1, T), torch.bool),
                "position_ids": new((1, T), torch.long), "document_ids": new((1, T), torch.long)}

    def __call__(self, items: Sequence[dict], out: dict | None = None) -> dict:
        """Pack ``items`` (:func:`eagle3.contracts.hidden_states.to_training_item` dicts; ``hidden_states``
        ``[seq, n_aux, H]`` or ``[seq, n_aux*H]``) into ``out`` (from :meth:`buffers`; default: fresh
        ones on the first item's device). Returns the batch dict (``out`` itself when given)."""
        T = self.token_budget
        if out is None:
            out = self.buffers(items[0]["input_ids"].device if items else "cpu")
        ids, hs, ver = out["input_ids"][0], out["hidden_states"][0], out["verifier_last_hidden_states"][0]
        mask, pos, doc = out["loss_mask"][0], out["position_ids"][0], out["document_ids"][0]
        offset = 0
        for d, item in enumerate(items):
            if offset >= T:
                break
            n = min(max(int(item["input_ids"].shape[0]) - 1, 0), T - offset)
            if n:
                rows = slice(offset, offset + n)
                ids[rows].copy_(item["input_ids"][1:n + 1])
                aux = item["hidden_states"][:n]
                hs[rows].view(aux.shape).copy_(aux)  # [n, n_aux, H] written as [n, n_aux*H]
                ver[rows].copy_(item["verifier_last_hidden_states"][1:n + 1])
                mask[rows].copy_(item["loss_mask"][1:n + 1])
                pos[rows].copy_(item["position_ids"][1:n + 1])
                doc[rows].fill_(d)
                offset += n
        for t in (ids[offset:], hs[offset:], ver[offset:], mask[offset:], pos[offset:]):
            t.zero_()
        doc[offset:].fill_(-1)
        return out


def collate_fn(token_budget: int, hidden_size: int, n_aux: int, dtype) -> PackedCollate:
    """The stage's collate: :class:`PackedCollate` (speculators' ``CollateFn(shift_batch)`` layout).

    The batch: ``input_ids`` ``[1, T]``, ``hidden_states`` ``[1, T, n_aux*H]`` (``dtype``),
    ``verifier_last_hidden_states`` ``[1, T, H]``, ``loss_mask`` ``[1, T]``, ``position_ids``
    ``[1, T]`` (from 1 within each document), ``document_ids`` ``[1, T]`` (-1 = padding).
    """
    return PackedCollate(token_budget, hidden_size, n_aux, dtype)


class MicroBatches:
    """Iterate collated micro-batches for a list of index lists (one per micro-batch), in order, on ``device``.

    Offline (``dataset``: :class:`eagle3.contracts.hidden_states.HiddenStatesDataset`; the first read of
    each file in this call checks its sha256 against the manifest): with ``num_workers`` 0 each batch
    is read and packed in the calling thread (on CUDA: by one loader thread); otherwise ``num_workers`` threads read and pack the next
    batches while the caller trains (the reads, hashes, copies and fp8 dequantization are torch,
    hashlib and safetensors code that releases the GIL; threads instead of DataLoader processes save
    the move of every batch into shared memory and back). On CUDA every thread packs into one of a
    ring of ``max(1, num_workers) + 1`` pinned host buffers that are reused (no fresh pages, no zero fill, no
    second copy into pinned memory); the calling thread copies each to the device on a side stream one
    batch ahead (the batch in use and the next one on the device), and a buffer is packed again only after
    its copy's CUDA event completed. Online: ``fetch(indices) -> list of training items`` (hidden states
    on the device, token ids on the host) is called per micro-batch in the calling thread and packed
    into fresh buffers on ``device``.

    Measured on the H200 (benchmarks/RESULTS.md): the DataLoader path cost 12-15% of the
    step rate against the same loop with the batches already on the device.

    Args:
        index_lists: sample indices per micro-batch. collate: :class:`PackedCollate`.
        device: where the batches are yielded (None: where the collate puts them, the host).
        ring: pack into reused buffers (default: on CUDA); a CPU ring (tests) yields copies.

    Raises:
        TrainError: from the dataset (a missing, changed or unreadable file), in the caller's thread.
    """

    def __init__(self, index_lists: Sequence[np.ndarray], collate: Callable, dataset=None,
                 fetch: Callable[[list[int]], list[dict]] | None = None, num_workers: int = 0,
                 device=None, ring: bool | None = None) -> None:
        import torch

        self.index_lists = [list(map(int, b)) for b in index_lists]
        self.collate, self.dataset, self.fetch, self.num_workers = collate, dataset, fetch, num_workers
        self.device = torch.device(device) if device is not None else None
        self.cuda = self.device is not None and self.device.type == "cuda"
        self.ring = self.cuda if ring is None else bool(ring)

    def __len__(self) -> int:
        return len(self.index_lists)

    def __iter__(self) -> Iterator[dict]:
        if not self.index_lists:
            return (b for b in ())  # a generator like every other path (the loop closes it)
        if self.fetch is not None:  # online: the hidden states are on the device, the token ids on the host
            return (self.collate(items, out=self.collate.buffers(self.device or items[0]["hidden_states"].device))
                    for items in map(self.fetch, self.index_lists))
        # keys (i, verify): each file's first read in this call checks its sha256 (HiddenStatesDataset)
        plan = (self.dataset.first_reads(self.index_lists) if hasattr(self.dataset, "first_reads")
                else self.index_lists)
        if self.num_workers == 0 and not self.ring:
            return (self._to_device(self.collate([self.dataset[k] for k in keys])) for keys in plan)
        return self._threaded(plan)

    def _to_device(self, batch: dict) -> dict:
        if self.device is None or self.device.type == "cpu":
            return batch
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def _threaded(self, plan: list) -> Iterator[dict]:
        """Loader threads pack ahead (into the ring on CUDA); the calling thread starts each batch's copy
        to the device one batch ahead of the one it yields and yields it once its stream has waited for
        that copy. On the device: the batch in use, the next one in flight, and the previous one until the
        caller drops it. A loader error is raised after the batches before it were yielded."""
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor

        import torch

        workers = max(1, self.num_workers)
        ring = _Ring(self, workers + 1)  # batches being packed or packed; batch j packs into slot j % depth
        # each loader thread on this rank's device (its pinned memory and event waits; a thread's device is its own)
        pool = ThreadPoolExecutor(workers, thread_name_prefix="eagle3-batches",
                                  initializer=torch.cuda.set_device if self.cuda else None,
                                  initargs=(self.device,) if self.cuda else ())
        pending: deque = deque()
        todo = iter(enumerate(plan))

        def submit() -> None:
            nxt = next(todo, None)
            if nxt is not None:
                pending.append(pool.submit(ring.pack, *nxt))

        try:
            for _ in range(ring.depth):
                submit()
            j, ahead = 0, None
            while pending:
                done_packing = pending.popleft()
                if done_packing.exception() is not None:  # the batch before the bad one still goes out first
                    if ahead is not None:
                        yield ring.hand_over(ahead)
                        ahead = None
                    raise done_packing.exception()
                sent = ring.send(j, done_packing.result())
                submit()
                j += 1
                if ahead is not None:
                    yield ring.hand_over(ahead)
                ahead = sent
            if ahead is not None:
                yield ring.hand_over(ahead)
        finally:
            for f in pending:
                f.cancel()
            pool.shutdown(wait=True)


class _Ring:
    """:class:`MicroBatches`' ``depth`` host buffers (pinned on CUDA), reused round-robin: batch ``j``
    packs into slot ``j % depth`` once the copy out of it (batch ``j - depth``) has finished; each copy
    to the device runs on a side stream and the caller's stream waits for it before use."""

    def __init__(self, loader: MicroBatches, depth: int) -> None:
        import torch

        self.loader, self.depth = loader, depth
        self.slots: list[dict] = [{"host": None, "done": None} for _ in range(depth)]
        self.copy_stream = torch.cuda.Stream(loader.device) if loader.cuda else None

    def pack(self, j: int, keys) -> dict:
        """Read and pack batch ``j`` (a loader thread)."""
        ld = self.loader
        items = [ld.dataset[k] for k in keys]
        if not ld.ring:
            return ld.collate(items)
        slot = self.slots[j % self.depth]
        if slot["done"] is not None:
            slot["done"].synchronize()  # the copy out of this buffer (batch j - depth) has finished
        if slot["host"] is None:
            slot["host"] = ld.collate.buffers("cpu", pin_memory=ld.cuda)
        return ld.collate(items, out=slot["host"])

    def send(self, j: int, host: dict) -> tuple[dict, object]:
        """Start batch ``j``'s copy to the device (the calling thread): ``(batch, its copy's event)``."""
        import torch

        ld = self.loader
        if not ld.ring:
            return ld._to_device(host), None
        if not ld.cuda:
            return {k: v.clone() for k, v in host.items()}, None  # a CPU ring (tests): the buffer is reused
        with torch.cuda.stream(self.copy_stream):
            batch = {k: v.to(ld.device, non_blocking=True) for k, v in host.items()}
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        self.slots[j % self.depth]["done"] = done  # before batch j + depth, which reuses the slot, is submitted
        return batch, done

    def hand_over(self, sent: tuple[dict, object]) -> dict:
        """The batch, once the caller's stream waits for its copy (its allocator learns the use)."""
        import torch

        batch, done = sent
        if done is not None:
            stream = torch.cuda.current_stream(self.loader.device)
            stream.wait_event(done)
            for v in batch.values():
                v.record_stream(stream)
        return batch


def tokens_in(batch: dict) -> int:
    """Real (non-padding) positions of a collated micro-batch."""
    return int((batch["document_ids"] != -1).sum())

