"""Stage 3: extract the target's aux hidden states (plus layer N before the norm) for every row.

``run(params, run_dir)`` reads Stage 2's ``train.parquet`` and writes the Stage 3 folder, whose
layout :mod:`eagle3.contracts.hidden_states` owns; besides it: ``preflight.json`` (projected bytes
and free disk before the model is loaded, projected time after a short calibration),
``progress.json``, ``timeline.jsonl`` (throughput over time), ``stats.json`` and figures (PNG).

Steps: :func:`eagle3.extract.prepare.prepare` (inputs, resume scan, preflight), the loop
(:func:`eagle3.extract.core.extract_batches` over :class:`eagle3.hooks.PrefillCapture`), then
:func:`eagle3.extract.finalize.finalize` (manifest, stats, figures). ``backend: vllm`` goes through
:mod:`eagle3.extract.vllm_backend` with the same first and last steps.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from pathlib import Path

from eagle3.config import Params
from eagle3.contracts.hidden_states import SampleWriter, capture_dtype
from eagle3.distributed import DistContext, in_torchrun, launch_torchrun
from eagle3.errors import ExtractError
from eagle3.extract.core import batch_cost, extract_batches
from eagle3.extract.finalize import ExtractStats, finalize
from eagle3.extract.prepare import Prepared, extract_dir, prepare
from eagle3.extract.progress import make_progress
from eagle3.hooks import PrefillCapture
from eagle3.io import atomic_write_json, atomic_write_text
from eagle3.params_file import dump_params
from eagle3.rundir import EXTRACT
from eagle3.stage import StageRun, check_fresh, stage_record

__all__ = ["run"]

# gloo (CPU tensors only, works beside CUDA) with a long timeout: ranks finish their shares at
# different times and wait at the final barrier.
_DIST_TIMEOUT = datetime.timedelta(hours=72)


def run(params: Params, run_dir: str | Path, *, write_fn: Callable | None = None) -> ExtractStats | None:
    """Stage 3: extract the target's aux hidden states (plus layer N before the norm) for every row.

    Re-running resumes: complete files are kept (header, shapes, token ids checked), truncated or
    corrupt ones are redone, and the final manifest and tensors equal those of an uninterrupted run.
    With ``extract.data_parallel = P > 1`` it launches ``torchrun --nproc-per-node P`` itself; under
    torchrun each rank takes every P-th batch of the global plan, so the files are the same as with
    one process.

    Args:
        params: the run's params (``target``, ``vocab.max_seq_len``, ``extract``).
        run_dir: the run directory.
        write_fn: ``write_fn(tmp_path, tensors, metadata)`` writes one file (default: safetensors);
            tests pass one that fails like a full disk.

    Returns:
        ExtractStats: what ``stats.json`` holds (None on a data-parallel rank other than 0).

    Raises:
        ExtractError: missing or malformed Stage 2 output; a row longer than ``vocab.max_seq_len``;
            bad aux layer ids; a folder written for another model / layers / dtype / dataset; a
            foreign file in a row shard; a preflight refusal (not enough disk, with the
            numbers and the options); a full disk during the run (resumable); a finished stage whose
            input (``train.parquet``) changed since (:func:`eagle3.stage.check_fresh`: redo it).
        NonFiniteError: a sample with NaN/Inf hidden states (names the sample id).
    """
    run_dir = Path(run_dir)
    ep = params.extract
    if ep.data_parallel > 1 and not in_torchrun():
        return ExtractStats.from_dict(_launch_data_parallel(params, run_dir, ep.data_parallel))
    sd = extract_dir(run_dir)
    rec = stage_record(run_dir, EXTRACT)
    if rec.complete:
        check_fresh(run_dir, EXTRACT, params, ExtractError)  # finished on other inputs: refuse, say how to redo
        return ExtractStats.from_dict(rec.stats)
    if ep.backend == "vllm":
        from eagle3.extract.vllm_backend import run_vllm

        return ExtractStats.from_dict(run_vllm(params, run_dir))
    out = _run_transformers(params, run_dir, sd, write_fn)
    return ExtractStats.from_dict(out) if out is not None else None


def _launch_data_parallel(params: Params, run_dir: Path, nproc: int) -> dict:
    """Run this stage under ``torchrun --standalone --nproc-per-node nproc`` and return its stats."""
    sd = extract_dir(run_dir)
    pfile = sd / "torchrun_params.yaml"
    atomic_write_text(pfile, dump_params(params))
    rc, cmd = launch_torchrun("eagle3.extract", pfile, run_dir, nproc)
    rec = stage_record(run_dir, EXTRACT)
    if rc != 0 or not rec.complete:
        raise ExtractError(
            f"data-parallel extraction failed (exit code {rc}); see the output above and "
            f"{sd / 'progress.json'}. Re-running resumes. Command: {' '.join(cmd)}"
        )
    return rec.stats


class _Calibration:
    """After ``extract.calibration_batches`` batches: the measured rate and the projected time left,
    written into ``preflight.json`` (rank 0) and printed."""

    def __init__(self, sd: Path, pf: dict, n_batches: int, remaining_computed: int, main: bool) -> None:
        self.sd, self.pf, self.n_batches, self.remaining, self.main = sd, pf, n_batches, remaining_computed, main
        self.batches = self.computed = 0
        self.t0 = time.perf_counter()
        self.result: dict = {}

    def start(self) -> None:
        """The clock starts once the model is loaded."""
        self.t0 = time.perf_counter()

    def batch_done(self, computed: int) -> None:
        self.batches += 1
        self.computed += computed
        if self.batches != self.n_batches or self.result:
            return
        dt = time.perf_counter() - self.t0
        rate = self.computed / dt if dt > 0 else 0.0
        left = max(self.remaining - self.computed, 0)
        self.result.update(batches=self.batches, tokens=self.computed, seconds=round(dt, 3),
                           tokens_per_s=round(rate, 2), projected_seconds=round(left / rate, 1) if rate > 0 else None)
        if self.main:
            self.pf.update(calibration=dict(self.result), projected_seconds=self.result["projected_seconds"])
            atomic_write_json(self.sd / "preflight.json", self.pf)
            print(f"eagle3 extract: calibration {rate:.0f} tokens/s -> about "
                  f"{self.result['projected_seconds']:.0f} s left for this process's share", flush=True)


def _load_capture(params: Params, prep: Prepared, dist: DistContext):
    """The target on this rank's device, hooked for the stored layers; ``(model, capture, pad_id)``."""
    from eagle3.target import load_target, pick_device

    device = pick_device(params.target.device)
    if device == "cuda" and dist.world > 1:
        device = f"cuda:{dist.local_rank}"
    model, tok, _ = load_target(params.target, device=device)
    capture = PrefillCapture(model, prep.setup.aux, capture_dtype(prep.setup.sdtype, next(model.parameters()).dtype),
                             error=ExtractError)
    if capture.hidden_size != prep.setup.hidden:
        raise ExtractError(f"model hidden size {capture.hidden_size} != config {prep.setup.hidden}")
    return model, capture, (tok.pad_token_id if tok.pad_token_id is not None else 0)


def _extract_share(params: Params, sd: Path, prep: Prepared, dist: DistContext, todo: list[list[int]],
                   writer: SampleWriter, progress, tracker, calib: _Calibration) -> dict:
    """Load the target and run this rank's batches through it; returns the loop's counts."""
    model, capture, pad_id = _load_capture(params, prep, dist)
    calib.start()
    logged = {"t": 0.0}

    def on_batch(n_new: int, t_new: int, computed: int) -> None:
        progress.update(n_new, tokens=t_new)
        if tracker is not None and time.perf_counter() - logged["t"] > 5.0:
            logged["t"] = time.perf_counter()
            tracker.log({k: v for k, v in progress.last_point.items() if k not in ("t", "status")})
        calib.batch_done(computed)

    loop = extract_batches(capture, prep.setup.rows, todo, writer, shard_size=params.extract.shard_size,
                           skip=set(prep.valid), pad_id=pad_id, on_batch=on_batch, packed=prep.setup.packed,
                           storage=prep.setup.sdtype)
    capture.close()
    del model
    loop["attention_kernel"] = capture.packed_kernel if prep.setup.packed else "sdpa (padded, masked)"
    return loop


def _run_transformers(params: Params, run_dir: Path, sd: Path, write_fn) -> dict | None:
    ep = params.extract
    dist = DistContext.from_env(backend="gloo", timeout=_DIST_TIMEOUT)
    prep = prepare(params, run_dir, sd, dist)
    rows = prep.setup.rows
    todo = [b for b in prep.my_batches if any(r not in prep.valid for r in b)]
    loop: dict = {"samples": 0, "tokens": 0, "computed_tokens": 0, "seconds": 0.0}
    writer = None
    calib = _Calibration(sd, prep.pf, ep.calibration_batches,
                         sum(batch_cost(rows.lengths, b, prep.setup.packed) for b in todo), dist.main)

    def progress(_: Path):
        return make_progress(sd, dist, prep, lambda: writer.bytes_written if writer is not None else 0)

    with StageRun(params, run_dir, EXTRACT, progress=progress, main=dist.main) as st:
        tracker = st.tracker if dist.main else None  # the W&B run opens now, as the stage starts
        try:
            if todo:
                writer = SampleWriter(sd, prep.journal, prep.setup.stored, threads=ep.writer_threads,
                                      max_pending_bytes=ep.max_pending_mb << 20, write_fn=write_fn)
                loop = _extract_share(params, sd, prep, dist, todo, writer, st.progress, tracker, calib)
        except BaseException:
            if writer is not None:
                try:
                    writer.close(wait=True)
                except BaseException:  # noqa: BLE001 - the first error is the one raised
                    pass
            raise
        mine = {"samples": loop["samples"], "tokens": loop["tokens"], "computed_tokens": loop["computed_tokens"],
                "seconds": loop["seconds"], "bytes_written": writer.bytes_written if writer is not None else 0,
                "writer_busy_s": writer.busy_s if writer is not None else 0.0, "calibration": calib.result or None,
                "attention_kernel": loop.get("attention_kernel")}
        loops = dist.gather(mine)
        if not dist.main and st.progress is not None:
            # final write of .rankRRR/progress.json before the barrier: rank 0 removes that folder after
            # it, and a later write (close, heartbeat) would create it again
            st.progress.close("done")
        dist.barrier()
        if not dist.main:
            return None
        return finalize(params, run_dir, sd, prep.setup, prep.pf, loops, prep.redone, dist.world, st)
