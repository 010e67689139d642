"""Online mode: Stage 3's samples straight from the target, nothing written (``train.online``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from eagle3.config import Params
from eagle3.contracts.hidden_states import NonFiniteError, as_stored, capture_dtype, first_non_finite, storage_dtype
from eagle3.errors import ExtractError
from eagle3.extract.core import consecutive_batches, forward_batch, resolve_batching
from eagle3.extract.prepare import load_rows
from eagle3.hooks import PrefillCapture, text_config

__all__ = ["OnlineExtractor", "online_samples"]

_ONLINE: dict = {}


class OnlineExtractor:
    """The hooked target held in memory for :func:`online_samples` (loaded once per configuration).

    Args:
        params: the run's params (``target``, ``extract.aux_layer_ids``, ``extract.dtype``).
        device: where the forward runs (default ``target.device``).
    """

    def __init__(self, params: Params, device: str | None = None) -> None:
        from eagle3.target import load_target, pick_device

        self.device = pick_device(device or params.target.device)
        model, tok, resolved = load_target(params.target, device=self.device)
        cdtype = next(model.parameters()).dtype
        self.model = model
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        self.storage = storage_dtype(params.extract.dtype, cdtype)
        self.capture = PrefillCapture(model, params.extract.aux_layer_ids, capture_dtype(self.storage, cdtype),
                                      error=ExtractError)
        # the same layout as Stage 3 (extract.batching): packed rows, no padding, unless the target can't
        self.packed = resolve_batching(params.extract.batching, text_config(model.config)) == "packed"

    def rows(self, run_dir: str | Path):
        """Stage 2's train split, read once per file version (online training fetches every micro-batch
        through :func:`online_samples`; re-reading the parquet each time cost 0.3-0.5 s per fetch)."""
        from eagle3.rundir import RunDir

        f = RunDir(run_dir).tokenized("train")
        st = f.stat() if f.exists() else None
        key = (str(f.resolve()), st.st_mtime_ns if st else None, st.st_size if st else None)
        if getattr(self, "_rows_key", None) != key:
            self._rows, self._rows_key = load_rows(run_dir), key
        return self._rows

    @classmethod
    def get(cls, params: Params, device: str | None = None) -> OnlineExtractor:
        key = (params.target.model_dump_json(), tuple(params.extract.aux_layer_ids or ()), params.extract.dtype,
               params.extract.batching, device)
        if key not in _ONLINE:
            _ONLINE.clear()  # one target in memory at a time
            _ONLINE[key] = cls(params, device)
        return _ONLINE[key]


def online_samples(params: Params, run_dir: str | Path, rows: Iterable[int] | None = None, *,
                   device: str | None = None, out_device: str = "cpu",
                   extractor: OnlineExtractor | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """Yield the same per-sample dicts as :class:`eagle3.contracts.hidden_states.HiddenStatesDataset`, straight from the target.

    Rows are taken in the given order, grouped into consecutive batches of at most
    ``extract.token_budget`` tokens in Stage 3's layout (``extract.batching``: packed rows without
    padding by default); nothing is written to disk.

    Args:
        params: the run's params.
        run_dir: the run directory (reads Stage 2's train split).
        rows: row indices (default: all, in order).
        device: forward device (default ``target.device``).
        out_device: where the yielded hidden states live (``"cpu"``, or the forward device to skip the
            round trip through host memory); token ids and loss mask stay on the host (small, and
            checked there without a device sync).
        extractor: a loaded :class:`OnlineExtractor` (default: cached per target/layers/dtype).

    Yields:
        dict: ``token_ids`` int64 ``[seq]``, ``loss_mask`` int8 ``[seq]``, ``hidden_states``
        ``[seq, n_aux + 1, hidden]`` in the storage dtype (fp8: dequantized into the target's dtype,
        the values an fp8 file gives back).

    Raises:
        ExtractError: bad inputs as in :func:`run`; NonFiniteError naming the sample id.
    """
    ex = extractor or OnlineExtractor.get(params, device)
    data = ex.rows(run_dir)
    data.check_max_len(params.vocab.max_seq_len)
    order = list(range(len(data))) if rows is None else [int(r) for r in rows]
    for batch in consecutive_batches(data.lengths, order, params.extract.token_budget, ex.packed):
        cb = forward_batch(ex.capture, data, batch, packed=ex.packed, pad_id=ex.pad_id)
        fin = cb.finite.tolist()  # host sync: one per batch
        for j, r in enumerate(batch):
            h = cb.sample(j)
            if ex.storage != h.dtype:  # fp8: the values training reads back from fp8 files (quantize + dequantize)
                h = as_stored(h, ex.storage).to(h.dtype)
            if not fin[j]:
                raise NonFiniteError(f"non-finite hidden states in sample id {data.ids[r]} (row {r}): "
                                     f"{first_non_finite(h.cpu(), ex.capture.stored_layers)}")
            yield {"token_ids": torch.from_numpy(data.tokens(r).copy()),
                   "loss_mask": torch.from_numpy(data.mask(r).copy()),
                   "hidden_states": h.to(out_device)}
