"""Stage 4: train the drafter, checkpoint, export the best checkpoint (``run(params, run_dir)``).

Writes the Stage 4 folder: ``metrics.jsonl``, ``checkpoints/step_NNNNNN/``
(:mod:`eagle3.train.checkpoint`), ``drafter/`` (the checkpoint with the best validation tau_hat,
exported by the drafter's kind: :meth:`eagle3.drafters.DrafterKind.export`), ``progress.json``, ``stats.json``
(:class:`TrainStats`) and figures. ``python -m eagle3.train PARAMS.yaml --run-dir DIR`` runs it
(also under ``torchrun``).
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import eagle3.train.checkpoint as ckpt
from eagle3.config import Params
from eagle3.distributed import DistContext, in_torchrun, launch_torchrun
from eagle3.drafters import check_drafter
from eagle3.errors import TrainError
from eagle3.io import atomic_write_json, atomic_write_text, read_json
from eagle3.params_file import dump_params, load_params, params_fingerprint
from eagle3.rundir import TRAIN, RunDir
from eagle3.stage import StageRun, Stats, check_fresh, stage_record
from eagle3.train.loop import Trainer
from eagle3.train.signals import TrainingInterrupted

__all__ = ["TrainStats", "TrainStopped", "run", "main"]


@dataclass
class TrainStats(Stats):
    """Stage 4's summary numbers: exactly the keys of ``stats.json`` (times in s)."""

    HEADLINE: ClassVar[tuple[str, ...]] = ("best_step", "best_val_tau_hat", "final_step", "final_val_tau_hat",
                                           "final_val_tau_sim", "final_train_loss", "total_steps", "tokens_seen", "tokens_per_s",
                                           "train_time_s", "drafter_dir")
    drafter_dir: str
    best_step: int
    best_val_tau_hat: float | None
    export_reason: str
    final_step: int
    final_val_tau_hat: float | None
    final_train_loss: float | None
    tokens_seen: int
    train_time_s: float
    tokens_per_s: float
    verifier: str
    draft_vocab_size: int
    aux_layer_ids: list[int]
    train_samples: int
    val_samples: int
    excluded_heldout: int
    total_steps: int
    global_batch_micro: int
    world_size: int
    grad_accum: int
    token_budget: int
    attn_implementation: str
    loss_implementation: str
    device: str
    setup_s: float
    autocast: str = "none"  # train.autocast as resolved: 'bfloat16' or 'none' (float32)
    optimizer: str | None = None  # train.optimizer as resolved: 'muon' or 'adamw' (None: a stage 4 that did not record it)
    # tau of greedy verification rounds (k = ttt_steps) walked over the validation answers at the last
    # step (eagle3.train.metrics.simulate_rounds); None without a validation split
    final_val_tau_sim: float | None = None


@dataclass
class TrainStopped:
    """A call that stopped early (``stop_after``): what ``last_call.json`` holds; the stage is incomplete.

    Attributes:
        step: the last optimizer step done (and checkpointed). total_steps: the run's steps.
        checkpoint: that checkpoint's folder.
    """

    step: int
    total_steps: int
    checkpoint: str

    @classmethod
    def from_dict(cls, d: dict) -> TrainStopped:
        return cls(int(d["step"]), int(d["total_steps"]), str(d["checkpoint"]))


def run(params: Params, run_dir: str | Path, *, stop_after: int | None = None) -> TrainStats | TrainStopped:
    """Stage 4: train the drafter, checkpoint, export the best checkpoint to the stage's ``drafter/``.

    Resumes from the newest checkpoint in the stage's ``checkpoints/`` (exactly: weights, optimizer,
    scheduler, RNG states, data position); a finished stage is not trained again. With
    ``train.data_parallel > 1`` (and not already under torchrun) it launches
    ``torchrun --nproc-per-node P -m eagle3.train`` and waits for it.

    Args:
        params: the run's params (``train`` section; ``target``; ``extract.aux_layer_ids`` online).
        run_dir: the run directory (reads Stages 2 and 3; writes Stage 4's folder).
        stop_after: stop (checkpoint, stage left incomplete) after this many optimizer steps in this
            call; a later call resumes (a time-boxed call, a test).

    Returns:
        TrainStats: what ``stats.json`` holds; :class:`TrainStopped` when ``stop_after`` ended the call.

    Raises:
        TrainError: bad inputs (mapping from another run, hidden size / aux count mismatch, empty
            training split, a manifest that disagrees with meta.json or the train split, a hidden-state
            file whose sha256 differs from the manifest, resume from a checkpoint of different params
            or another vocab mapping, a finished stage whose inputs changed since, ...).
        TrainingDiverged: NaN/Inf loss or gradient (step and sample ids named; checkpoints kept).
        TrainingInterrupted: SIGINT (after saving a checkpoint). SIGTERM raises SystemExit(143).
    """
    run_dir = Path(run_dir)
    if params.train.data_parallel > 1 and not in_torchrun():
        return _launch_torchrun(params, run_dir, stop_after)
    from eagle3.target import pick_device

    ctx = DistContext.from_env(device=pick_device(params.train.device))
    try:
        out = _train(params, run_dir, ctx, stop_after)
        return TrainStats.from_dict(out) if out.get("complete") else TrainStopped.from_dict(out)
    except TrainingInterrupted as exc:
        if exc.signum == signal.SIGTERM:
            raise SystemExit(128 + signal.SIGTERM) from None
        raise
    finally:
        ctx.close()


def _launch_torchrun(params: Params, run_dir: Path, stop_after: int | None) -> TrainStats | TrainStopped:
    sd = RunDir(run_dir).stage(TRAIN, create=True)
    pfile = sd / ".torchrun_params.yaml"
    atomic_write_text(pfile, dump_params(params))
    extra = ["--stop-after", str(stop_after)] if stop_after is not None else []
    rc, cmd = launch_torchrun("eagle3.train", pfile, run_dir, params.train.data_parallel, extra, omp_threads=True)
    if rc != 0:
        raise TrainError(f"torchrun exited with code {rc}: {' '.join(cmd)} (see its output above)")
    rec = stage_record(run_dir, TRAIN)
    return TrainStats.from_dict(rec.stats) if rec.complete else TrainStopped.from_dict(read_json(sd / "last_call.json"))


def _train(params: Params, run_dir: Path, ctx: DistContext, stop_after: int | None) -> dict:
    t_setup = time.time()
    done = stage_record(run_dir, TRAIN)
    if done.complete:
        check_fresh(run_dir, TRAIN, params, TrainError)  # finished on other inputs: refuse, say how to redo
    tr = Trainer(params, run_dir, ctx)
    state = tr.setup()
    if int(state["step"]) == tr.total and done.complete and (RunDir(run_dir).drafter_dir / "config.json").exists():
        return done.stats  # finished earlier: nothing to redo
    tr.clean_for_resume()
    progress = None if ctx.main else (lambda d: None)  # one progress.json: rank 0's
    with StageRun(params, run_dir, TRAIN, total=tr.total, unit="steps", done=int(state["step"]),
                  tokens=int(state["tokens_seen"]), progress=progress, main=ctx.main) as st:
        if ctx.main:
            tr.tracker = st.tracker
            st.progress.extra.update({"train_samples": len(tr.train_refs), "val_samples": len(tr.val_refs)})
        info = tr.info(time.time() - t_setup)
        res = tr.loop(st.progress, stop_after)
        if res.status == "stopped":
            st.close("stopped")
            out = {**info, "complete": False, "step": res.step, "checkpoint": str(res.checkpoint)}
            if ctx.main:
                atomic_write_json(tr.sd / "last_call.json", out)
            return out
        out = {}
        if ctx.main:
            stats = _export(tr, info)
            _figures(run_dir, st)
            out = st.finish(stats)
    ctx.barrier()
    return out if ctx.main else stage_record(run_dir, TRAIN).stats


def _last_record(metrics_file: Path, kind: str) -> dict | None:
    if not metrics_file.exists():
        return None
    last = None
    for line in metrics_file.read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        if r.get("kind") == kind:
            last = r
    return last


def _export(tr: Trainer, info: dict) -> TrainStats:
    """Load the best checkpoint into the drafter, export it, check it against the target (rank 0).

    Raises:
        DrafterCheckError: the export fails :func:`eagle3.drafters.check_drafter`.
    """
    import torch
    from safetensors.torch import load_file

    from eagle3.target import torch_dtype

    state, total, model = tr.state, tr.total, tr.model
    best = state.get("best_step")
    if best is None:
        best = total
        reason = "no validation split (train.val_fraction = 0): exported the last checkpoint"
    else:
        reason = (f"highest validation tau_hat ({state['best_val_tau_hat']:.4f}) among "
                  f"{len(state['val_history'])} evaluations")
    ck = ckpt.checkpoint_path(tr.ckpt_root, best)
    weights = load_file(str(ck / "model.safetensors"))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(weights[n].to(p.dtype))
    drafter = RunDir(tr.run_dir).drafter_dir
    last_train = _last_record(tr.metrics_file, "train")
    tr.kind.export(
        model.to("cpu"), drafter, tr.inputs.target_name, dtype=torch_dtype("auto", tr.inputs.target_path),
        include_embed_tokens=tr.train_params.export_embed_tokens,
        info={"best_step": best, "best_val_tau_hat": state.get("best_val_tau_hat"), "total_steps": total,
              "params_fingerprint": params_fingerprint(tr.params), "checkpoint": str(ck), "reason": reason},
    )
    check_drafter(drafter, tr.inputs.target_path, raise_on_error=True)
    final_val = next((v for v in reversed(state["val_history"]) if v["step"] == total), None)
    return TrainStats(
        drafter_dir=str(drafter), best_step=best, best_val_tau_hat=state.get("best_val_tau_hat"), export_reason=reason,
        final_step=total, final_val_tau_hat=final_val["val_tau_hat"] if final_val else None,
        final_val_tau_sim=final_val.get("val_tau_sim") if final_val else None,
        final_train_loss=last_train.get("loss") if last_train else None, tokens_seen=state["tokens_seen"],
        train_time_s=round(state["elapsed_s"], 2),
        tokens_per_s=round(state["tokens_seen"] / max(state["elapsed_s"], 1e-9), 2),
        verifier=tr.inputs.target_name, draft_vocab_size=tr.inputs.draft_vocab_size,
        aux_layer_ids=tr.inputs.aux_layer_ids, **info,
    )


def _figures(run_dir: Path, st: StageRun) -> None:
    from eagle3.train.report import load_metrics, plot_training, plot_validation

    df = load_metrics(run_dir)
    for name, fn in (("training_curves", plot_training), ("validation_tau_hat", plot_validation)):
        fig = fn(df)
        if fig is not None:
            st.figure(name, fig)


def main(argv: list[str] | None = None) -> int:
    """``python -m eagle3.train PARAMS.yaml --run-dir DIR [--stop-after N]`` (also under torchrun)."""
    import argparse

    from eagle3.rundir import resolve_run_dir

    ap = argparse.ArgumentParser(prog="python -m eagle3.train", description=__doc__.splitlines()[0])
    ap.add_argument("params_file")
    ap.add_argument("--run-dir", default=None, help="default: <run.output_dir>/<run.name>")
    ap.add_argument("--stop-after", type=int, default=None)
    ap.add_argument("--set", action="append", default=[], help="section.key=value override")
    a = ap.parse_args(argv)
    params = load_params(a.params_file, a.set or None)
    run_dir = Path(a.run_dir) if a.run_dir else resolve_run_dir(params)
    stats = run(params, run_dir, stop_after=a.stop_after)
    if int(os.environ.get("RANK", "0")) == 0:
        d = stats.to_dict() if isinstance(stats, TrainStats) else vars(stats)
        print(json.dumps({k: v for k, v in d.items() if not isinstance(v, (list, dict))}, indent=1, default=str))
    return 0
