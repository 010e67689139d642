"""Stage 4's training loop, nanoGPT-style, around speculators' ``Eagle3DraftModel``.

One optimizer step = ``grad_accum`` micro-batches on each of ``world_size`` ranks (DDP: gloo on CPU,
NCCL on GPU). AdamW (betas 0.9, 0.95), or Muon on the matrices (``train.optimizer``,
:mod:`eagle3.train.optim`), linear warmup then cosine decay to ``min_lr_ratio * lr``,
gradient clipping, bf16 autocast on GPU (``train.autocast``). Every step appends a line to ``metrics.jsonl`` (and W&B):
loss, per-TTT-step loss, full and conditional accuracy, lr, grad norm, tokens/s. Validation runs
every ``eval_every`` steps and at every checkpoint; it reports the simulated acceptance length
``tau_hat`` (:func:`eagle3.train.metrics.tau_hat`, per-position accuracies averaged over every position)
and ``tau_sim`` (greedy verification rounds walked over the validation answers,
:func:`eagle3.train.metrics.simulate_rounds`: what the engine measures on that text). Checkpoints (:mod:`eagle3.train.checkpoint`)
make a resumed run continue bit for bit. SIGTERM/SIGINT save a checkpoint before exiting.

Host-device syncs: ONE per step (the packed metrics' all-reduce and copy to the host,
:meth:`eagle3.train.metrics.StepMetrics.reduce`), plus two per validation and the checkpoint writes.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import eagle3.drafters as drafters
import eagle3.train.checkpoint as ckpt
from eagle3.config import Params
from eagle3.contracts.hidden_states import HiddenStatesDataset, to_training_item
from eagle3.distributed import DistContext
from eagle3.errors import TrainError
from eagle3.params_file import params_fingerprint
from eagle3.rundir import TRAIN, RunDir
from eagle3.train.metrics import StepMetrics, chain_lengths, draft_positions, metric_keys, simulate_rounds, summarize
from eagle3.train.optim import build_optimizer, resolve_optimizer
from eagle3.train.signals import StepAborted, StepSignals, TrainingInterrupted

__all__ = ["TrainingDiverged", "Trainer", "LoopResult", "autocast_dtype"]


class TrainingDiverged(TrainError):
    """The loss or the gradient became NaN/Inf; the message names the step and the samples."""


def autocast_dtype(mode: str, device_type: str):
    """The autocast dtype of the drafter's training (``train.autocast``), or None for float32.

    Args:
        mode: ``train.autocast``: 'bfloat16', 'none', or 'auto' = bfloat16 on CUDA, float32 on CPU
            (on a CPU with AMX, bf16 autocast ran at 0.99x the float32 rate at the default's shapes:
            no gain for a numerics change; benchmarks/RESULTS.md, ``bench_train.py --compare-autocast``).
        device_type: 'cuda' or 'cpu' (the training device's type).

    Returns:
        ``torch.bfloat16`` or None. Master weights, gradients and AdamW state stay float32 either way.
    """
    import torch

    if mode == "bfloat16" or (mode == "auto" and device_type == "cuda"):
        return torch.bfloat16
    return None


def _online_fetch(params: Params, run_dir: Path, refs, inputs, device):
    """``fetch(indices)`` for online training: the target runs on this rank's device and its hidden
    states stay there (the collate packs them into device buffers, train.data.MicroBatches): no round trip
    through host memory; each sample's token ids, loss mask and positions (host) are small blocking copies."""
    from eagle3.extract import online_samples

    dev = str(device)
    # target.device "auto"/"cuda" means this rank's device (under DDP: cuda:LOCAL_RANK, not every rank on cuda:0)
    tdev = dev if params.target.device in ("auto", "cuda") else params.target.device

    def fetch(indices: list[int]) -> list[dict]:
        rows = [refs[i].row for i in indices]
        return [to_training_item(s, inputs.n_aux, inputs.hidden_size, inputs.target_vocab_size,
                                 f"online row {refs[i].row} (id {refs[i].id})")
                for i, s in zip(indices, online_samples(params, run_dir, rows, device=tdev, out_device=dev))]

    return fetch



@dataclass
class LoopResult:
    """How the loop ended: ``status`` "done" or "stopped" (``stop_after``), the last step and checkpoint."""

    status: str
    step: int
    checkpoint: Path | None


class Trainer:
    """The drafter, its optimizer and data for one run; :meth:`setup` then :meth:`loop`.

    Args:
        params: the run's params. run_dir: the run directory. ctx: this rank's :class:`DistContext`.
    """

    def __init__(self, params: Params, run_dir: Path, ctx: DistContext) -> None:
        self.params, self.run_dir, self.ctx = params, run_dir, ctx
        self.train_params = params.train
        self.kind = drafters.get(params.train.drafter, TrainError)  # build, export and check of the drafter
        self.sd = RunDir(run_dir).stage(TRAIN, create=ctx.main)
        self.ckpt_root = RunDir(run_dir).checkpoints_dir
        self.metrics_file = RunDir(run_dir).train_metrics
        self.tracker = None

    # -- set-up ---------------------------------------------------------------------------------
    def _data(self) -> None:
        """Training / validation samples (held-out ids excluded) and their datasets or online fetchers."""
        from eagle3.train.data import heldout_ids, online_refs, read_manifest, split_by_id

        rd = RunDir(self.run_dir)
        refs = online_refs(self.run_dir) if self.train_params.online else read_manifest(self.run_dir)
        held = heldout_ids(self.run_dir)
        excluded = [r for r in refs if r.id in held]
        refs = [r for r in refs if r.id not in held]
        train, val = split_by_id(refs, self.train_params.val_fraction)
        if not train:
            raise TrainError(
                f"empty training split: {len(refs) + len(excluded)} samples in "
                f"{(rd.tokenized('train') if self.train_params.online else rd.manifest).relative_to(rd.root)}, "
                f"{len(excluded)} held out, {len(val)} to validation (train.val_fraction={self.train_params.val_fraction}). "
                f"Synthesize more samples or lower train.val_fraction."
            )
        self.train_refs, self.val_refs, self.excluded = train, val, excluded
        inp = self.inputs
        if self.train_params.online:
            self.train_ds = self.val_ds = None
            self.fetch = _online_fetch(self.params, self.run_dir, train, inp, self.ctx.device)
            self.vfetch = _online_fetch(self.params, self.run_dir, val, inp, self.ctx.device)
        else:
            dtype = self._batch_dtype()  # fp8 files are dequantized straight into it (in the loader threads)
            self.train_ds = HiddenStatesDataset.for_training(train, inp.n_aux, inp.hidden_size, inp.target_vocab_size, dtype)
            self.val_ds = HiddenStatesDataset.for_training(val, inp.n_aux, inp.hidden_size, inp.target_vocab_size, dtype)
            self.fetch = self.vfetch = None

    def _plan(self) -> None:
        """The run's optimizer steps (packing plan), the validation plan and the data digest."""
        from eagle3.train.data import build_schedule, epoch_plan, plan_digest

        train_params = self.train_params
        G = self.ctx.world * train_params.grad_accum
        lengths = [max(r.num_tokens - 1, 0) for r in self.train_refs]
        self.schedule = build_schedule(lengths, train_params.token_budget, train_params.seed, train_params.epochs, G,
                                       train_params.max_steps)
        if not self.schedule:
            raise TrainError(
                f"the training split ({len(self.train_refs)} samples, {sum(lengths)} tokens) packs into fewer "
                f"micro-batches of train.token_budget={train_params.token_budget} than one step needs "
                f"(data_parallel x grad_accum = {G}); lower the budget or grad_accum, or add data."
            )
        vlens = [max(r.num_tokens - 1, 0) for r in self.val_refs]
        self.val_plan = epoch_plan(vlens, train_params.token_budget, train_params.seed, 0)
        self.total = len(self.schedule)
        self.digest = plan_digest(self.train_refs)

    def _model(self):
        """The drafter of ``train.drafter``'s kind (seeded), the optimizer and lr schedule of
        ``train.optimizer`` (:func:`eagle3.train.optim.build_optimizer`), the loss config."""
        import torch

        from eagle3.train.model import configure_compile, default_attn_implementation, loss_config, use_supervised_rows

        train_params, dev = self.train_params, self.ctx.device
        attn = train_params.attn_implementation if train_params.attn_implementation != "auto" else default_attn_implementation(dev.type)
        torch.manual_seed(train_params.seed)
        model = self.kind.build(self.params, self.inputs, attn).to(dev)
        # what torch.compile covers (train.compile, model.configure_compile): by default only flex
        # attention; 'speculators' restores speculators' whole compiled forward
        self.compile_mode = configure_compile(model, train_params.compile, attn, train_params.ttt_steps)
        opt, sched = build_optimizer(model, train_params, len(self.schedule), dev.type)
        impl = (train_params.loss_implementation if train_params.loss_implementation != "auto"
                else ("fused" if dev.type == "cuda" else "eager"))
        losses = loss_config(train_params.loss, impl)
        # heads and loss on the supervised rows only, where the kind has that path (the same loss and
        # gradients; for EAGLE-3 drafters.eagle3.SupervisedRows)
        if use_supervised_rows(train_params.supervised_rows, dev.type, self.compile_mode):
            wrapped = self.kind.supervise_rows(model, losses)
            losses = losses if wrapped is None else wrapped
        self.fwd_kwargs = dict(ttt_steps=train_params.ttt_steps, ttt_step_loss_decay=train_params.ttt_step_loss_decay,
                               loss_config=losses)
        self.attn, self.loss_impl = attn, impl
        return model, opt, sched

    def setup(self) -> dict:
        """Inputs, data, plan, model and optimizer; resume from the newest checkpoint.

        Returns:
            dict: the loop state (``step``, ``tokens_seen``, ``elapsed_s``, ``best_step``,
            ``best_val_tau_hat``, ``val_history``).

        Raises:
            TrainError: bad inputs (see :func:`eagle3.train.run`); a checkpoint this run may not resume.
        """
        from eagle3.contracts.vocab_mapping import mapping_digest
        from eagle3.train.model import resolve_inputs

        self.inputs = resolve_inputs(self.params, self.run_dir)
        self.mapping_digest = mapping_digest(self.inputs.d2t, self.inputs.t2d)
        self._data()
        self._plan()
        self.model, self.opt, self.sched = self._model()
        self.state = {"step": 0, "tokens_seen": 0, "elapsed_s": 0.0, "best_step": None, "best_val_tau_hat": None,
                      "val_history": []}
        path = ckpt.resume_state(self.ckpt_root, self.params, self.ctx.world * self.train_params.grad_accum, self.digest,
                                 self.mapping_digest)
        if path is not None:
            self.state = ckpt.load_checkpoint(path, self.model, self.opt, self.sched, self.ctx.device)
        return self.state

    def clean_for_resume(self) -> None:
        """Remove a killed run's temp checkpoint folders (and pruned ones half removed), a killed
        export's temp folders, and the metrics of steps not checkpointed."""
        if self.ctx.main:
            import shutil

            from eagle3.contracts.drafter import clean_export_temps

            for pat in (".tmp-*", ".trash-*"):
                for d in self.ckpt_root.glob(pat) if self.ckpt_root.exists() else []:
                    shutil.rmtree(d, ignore_errors=True)
            clean_export_temps(RunDir(self.run_dir).drafter_dir)
            ckpt.truncate_metrics(self.metrics_file, int(self.state["step"]))
        self.ctx.barrier()

    def info(self, setup_s: float) -> dict:
        """The run's shape, for stats.json."""
        train_params, ctx = self.train_params, self.ctx
        return {"train_samples": len(self.train_refs), "val_samples": len(self.val_refs),
                "excluded_heldout": len(self.excluded), "total_steps": self.total,
                "global_batch_micro": ctx.world * train_params.grad_accum, "world_size": ctx.world, "grad_accum": train_params.grad_accum,
                "token_budget": train_params.token_budget, "attn_implementation": self.attn,
                "loss_implementation": self.loss_impl, "device": str(ctx.device),
                "autocast": str(self._autocast_dtype() or "none").replace("torch.", ""),
                "optimizer": resolve_optimizer(train_params.optimizer, ctx.device.type), "setup_s": round(setup_s, 2)}

    # -- batches, logging, validation -----------------------------------------------------------
    def _autocast_dtype(self):
        """bfloat16 when the drafter trains under autocast (``train.autocast``, see
        :func:`autocast_dtype`), else None (float32)."""
        return autocast_dtype(self.train_params.autocast, self.ctx.device.type)

    def _batch_dtype(self):
        """The dtype of the collated hidden states: the autocast dtype (bf16: the stored states' own dtype,
        so no copy in float32), else float32."""
        import torch

        return self._autocast_dtype() or torch.float32

    def _micro(self, index_lists, val: bool = False):
        from eagle3.train.data import MicroBatches, collate_fn

        coll = collate_fn(self.train_params.token_budget, self.inputs.hidden_size, self.inputs.n_aux, self._batch_dtype())
        # on CUDA: packed by loader threads into reused pinned buffers, copied on a side stream (data.MicroBatches)
        return MicroBatches(index_lists, coll, dataset=self.val_ds if val else self.train_ds,
                            fetch=self.vfetch if val else self.fetch,
                            num_workers=0 if self.train_params.online else self.train_params.num_workers,
                            device=self.ctx.device)

    def _log(self, rec: dict) -> None:
        if not self.ctx.main:
            return
        with open(self.metrics_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tracker is not None:
            self.tracker.log(rec)

    def _autocast(self):
        import torch

        dt = self._autocast_dtype()
        return torch.autocast(self.ctx.device.type, dtype=dt) if dt is not None else contextlib.nullcontext()

    def evaluate(self, model, step: int) -> dict:
        """Validation over this rank's share of the validation plan; logs and returns the ``val_*`` record
        ({} without a validation split)."""
        import torch

        if not self.val_plan:
            return {}
        keys = metric_keys(self.train_params.ttt_steps)
        K = self.train_params.ttt_steps
        mine = [b for i, b in enumerate(self.val_plan) if i % self.ctx.world == self.ctx.rank]
        # counts, tokens, then (tokens, rounds) of simulated verification with k = 1..K drafts
        acc = torch.zeros(len(keys) + 1 + 2 * K, dtype=torch.float64, device=self.ctx.device)
        module = getattr(model, "module", model)
        module.eval()
        chains = []
        # closing: an exception (a signal's abort) ends the loader threads at once, not when the traceback goes
        with torch.no_grad(), self._autocast(), contextlib.closing(iter(self._micro(mine, val=True))) as batches:
            for batch in batches:  # on the device
                drafts, _, m = module(**batch, **self.fwd_kwargs)
                acc[:len(keys)] += torch.stack([m[k].detach().double() for k in keys])
                acc[len(keys)] += (batch["document_ids"] != -1).sum()
                # the verifier's argmax, as speculators' forward computes its targets (a second call of
                # the head after the forward is a full one under the kind's supervised rows too)
                target_ids = module.verifier_lm_head(module.verifier_norm(batch["verifier_last_hidden_states"])).argmax(-1)
                pos = draft_positions(batch["loss_mask"], batch["document_ids"])
                chains.append((chain_lengths(drafts, target_ids, pos, batch["document_ids"]), pos,
                               batch["document_ids"].reshape(-1)))
        module.train()
        if chains:  # host sync: one per validation, then the rounds on the host
            chain, pos, doc = (torch.cat(x).cpu().numpy() for x in zip(*chains))
            sim = [v for k in range(1, K + 1) for v in simulate_rounds(chain, pos, doc, k)]
            acc[len(keys) + 1:] += torch.tensor(sim, dtype=torch.float64, device=acc.device)
        acc = self.ctx.all_sum(acc).cpu()  # host sync: the second per validation
        sums = dict(zip(keys, acc[:len(keys)].tolist()))
        sim = acc[len(keys) + 1:].tolist()
        taus = {f"val_tau_sim_k{k}": (sim[2 * k - 2] / sim[2 * k - 1] if sim[2 * k - 1] else None) for k in range(1, K + 1)}
        rec = {"kind": "val", "step": step, **summarize(sums, K, prefix="val_"), "val_tau_sim": taus[f"val_tau_sim_k{K}"],
               **taus, "val_tokens": int(acc[len(keys)])}
        self._log(rec)
        return rec

    def _diverged(self, step: int, epoch: int, bad_mb: list[int], gnorm: float) -> None:
        G = self.ctx.world * self.train_params.grad_accum
        A = self.train_params.grad_accum
        grp = self.schedule[step - 1][1]
        lines = []
        for i in bad_mb or list(range(G)):
            ids = [self.train_refs[j].id for j in grp[i]]
            lines.append(f"micro-batch {i} (rank {i // A}, accumulation {i % A}): sample ids {ids}")
        last = ckpt.list_checkpoints(self.ckpt_root)
        what = "loss" if bad_mb else f"gradient norm ({gnorm})"
        raise TrainingDiverged(
            f"{what} is NaN/Inf at step {step} (epoch {epoch}); training stopped before the optimizer step.\n  "
            + "\n  ".join(lines)
            + f"\nLast good checkpoint: {(ckpt.checkpoint_path(self.ckpt_root, last[-1]) if last else 'none (no checkpoint yet)')} "
            f"(kept). Check those samples' hidden states, or lower train.lr."
        )

    def _record_state(self, step: int, epoch: int, ev: dict | None) -> None:
        train_params, ctx = self.train_params, self.ctx
        self.state.update({"step": step, "epoch": epoch, "global_batch": ctx.world * train_params.grad_accum,
                           "world_size": ctx.world, "grad_accum": train_params.grad_accum, "plan_digest": self.digest,
                           "mapping_digest": self.mapping_digest,
                           "total_steps": self.total, "params_fingerprint": params_fingerprint(self.params),
                           "val": {k: v for k, v in (ev or {}).items() if k.startswith("val_")}})

    def _checkpoint(self, base, step: int, epoch: int, ev: dict | None) -> Path | None:
        """Record the loop state and write ``step_NNNNNN`` (rank 0), prune old ones; every rank waits."""
        train_params, ctx = self.train_params, self.ctx
        self._record_state(step, epoch, ev)
        path = None
        if ctx.main:
            path = ckpt.save_checkpoint(self.ckpt_root, step, base, self.opt, self.sched, self.state, self.params)
            protect = {self.state["best_step"]} if self.state["best_step"] is not None else set()
            ckpt.prune(self.ckpt_root, train_params.keep_checkpoints, protect)
        ctx.barrier()
        return path

    def _aborted(self, base, step: int, start: int, signum: int) -> TrainingInterrupted:
        """A signal inside a step's forward/backward (or validation): the weights, optimizer and
        scheduler are those of ``step``; save them unless a checkpoint of ``step`` exists."""
        self.opt.zero_grad(set_to_none=True)
        have = ckpt.list_checkpoints(self.ckpt_root)
        path = None
        if step > start and self.ctx.main and step not in have:
            self._record_state(step, self.schedule[step - 1][0], None)
            path = ckpt.save_checkpoint(self.ckpt_root, step, base, self.opt, self.sched, self.state, self.params)
        elif have:
            path = ckpt.checkpoint_path(self.ckpt_root, have[-1])
        return TrainingInterrupted(signum, path)

    def _first_step_status(self, progress, start: int) -> None:
        """The first step compiles (torch.compile; minutes on a cold cache): say so in progress.json
        (its heartbeat keeps the file fresh meanwhile)."""
        if progress is None or start >= self.total:
            return
        on_gpu = self.ctx.device.type == "cuda"
        progress.extra["phase"] = f"first step (torch.compile: {self.compile_mode})" if on_gpu else "first step"
        progress.bar.set_postfix_str(progress.extra["phase"], refresh=True)
        progress.update(0)

    # -- one step's parts ------------------------------------------------------------------------
    def _forward_backward(self, model, batches) -> StepMetrics:
        """``grad_accum`` micro-batches forward and backward; DDP all-reduces the gradients on the last
        one only. The metrics stay on the device (no sync)."""
        import torch

        ctx, A = self.ctx, self.train_params.grad_accum
        keys = metric_keys(self.train_params.ttt_steps)
        m = StepMetrics.zeros(len(keys), ctx.world * A, ctx.device)
        for a in range(A):
            batch = next(batches)
            sync = model.no_sync() if (ctx.world > 1 and a < A - 1) else contextlib.nullcontext()
            with sync:
                with self._autocast():
                    _, loss, out = model(**batch, **self.fwd_kwargs)
                (loss / A).backward()
            m.counts += torch.stack([out[k].detach().double() for k in keys])
            m.tokens += (batch["document_ids"] != -1).sum()
            m.bad_micro[ctx.rank * A + a] = (~torch.isfinite(loss.detach())).double()
        return m

    def _clip_and_reduce(self, m: StepMetrics, stop_received: bool) -> StepMetrics:
        """Clip the gradients (the norm stays a device tensor: ``clip_grad_norm_`` does not sync), pack
        the flags, then THE host sync of the step (all-reduce of the packed metrics, then ``.cpu()``)."""
        import torch

        trainable = [p for p in self.model.parameters() if p.requires_grad]
        gnorm = torch.nn.utils.clip_grad_norm_(trainable, self.train_params.grad_clip)
        m.grad_nonfinite = (~torch.isfinite(gnorm)).double()
        m.stop_signal.fill_(1.0 if stop_received else 0.0)
        m.grad_norm = gnorm.double() / self.ctx.world
        return m.reduce(self.ctx)

    def _log_step(self, progress, step: int, start: int, epoch: int, lr: float, m: StepMetrics, dt: float) -> None:
        """metrics.jsonl (+ W&B) and progress.json, from the host copy of the step's metrics."""
        state, ttt = self.state, self.train_params.ttt_steps
        ntok = int(m.tokens)
        state["tokens_seen"] = int(state["tokens_seen"]) + ntok
        state["elapsed_s"] = float(state["elapsed_s"]) + dt
        rec = {"kind": "train", "step": step, "epoch": epoch, "lr": lr,
               **summarize(dict(zip(metric_keys(ttt), m.counts.tolist())), ttt),
               "grad_norm": float(m.grad_norm), "tokens": ntok, "tokens_per_s": ntok / max(dt, 1e-9),
               "tokens_seen": state["tokens_seen"], "time_s": round(dt, 4), "t": round(time.time(), 3)}
        self._log(rec)
        if progress is None:
            return
        if step - start == 1:
            progress.extra["phase"] = "training"
            progress.extra["first_step_s"] = round(dt, 2)
            progress.bar.set_postfix_str("", refresh=False)
        # named by where they come from: this step's training batch (the TTT chain on the batch just
        # learned from) reads higher than the last validation
        progress.update(1, tokens=ntok, train_loss=round(rec["loss"], 4), train_batch_tau_hat=round(rec["tau_hat"], 3))

    def _eval_checkpoint(self, model, step: int, epoch: int, sig, progress, stopping: bool) -> Path | None:
        """Validation every ``eval_every`` steps and at each checkpoint (host syncs), recorded in the state
        and progress.json; a checkpoint periodically, at a new best and when ``stopping`` (a signal, the
        end of this call). Returns the checkpoint written, or None."""
        train_params, state = self.train_params, self.state
        periodic = step % train_params.checkpoint_every == 0 or step == self.total
        ev = None
        if step % train_params.eval_every == 0 or periodic:
            sig.abortable = sig.received is None  # validation may compile too; `step` is complete
            ev = self.evaluate(model, step)
            sig.abortable = False
        if ev:
            state["val_history"].append({"step": step, "val_tau_hat": ev["val_tau_hat"], "val_loss": ev["val_loss"],
                                         "val_tau_sim": ev["val_tau_sim"]})
            if progress is not None:
                progress.extra.update({"val_step": step, **{k: None if ev[k] is None else round(ev[k], 3)
                                                            for k in ("val_tau_hat", "val_tau_sim")}})
        new_best = bool(ev) and (state["best_val_tau_hat"] is None or ev["val_tau_hat"] > state["best_val_tau_hat"])
        if new_best:
            state["best_step"], state["best_val_tau_hat"] = step, ev["val_tau_hat"]
        if periodic or new_best or stopping:
            return self._checkpoint(self.model, step, epoch, ev)
        return None

    def _step_batches(self, start: int):
        """This rank's micro-batches from step ``start`` on, on the device; the next ones are read and
        copied meanwhile. The loop closes the iterator on its way out: an interrupted or diverged run
        does not leave loader threads reading for its traceback."""
        A, rank = self.train_params.grad_accum, self.ctx.rank
        return iter(self._micro([mb for _, grp in self.schedule[start:] for mb in grp[rank * A:(rank + 1) * A]]))

    def _ddp_model(self):
        """The drafter as the loop calls it: DDP-wrapped across ranks (gradients all-reduced), else itself."""
        ctx = self.ctx
        if ctx.world == 1:
            return self.model
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(self.model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                                       broadcast_buffers=False)

    # -- the loop -------------------------------------------------------------------------------
    def loop(self, progress, stop_after: int | None) -> LoopResult:
        """Train from ``state["step"]`` to the last step (or ``stop_after`` steps in this call).

        Raises:
            TrainingDiverged: NaN/Inf loss or gradient (before that step's optimizer update).
            TrainingInterrupted: SIGINT/SIGTERM (after a checkpoint).
        """
        ctx, opt, sched, A = self.ctx, self.opt, self.sched, self.train_params.grad_accum
        base, model = self.model, self._ddp_model()
        step = start = int(self.state["step"])
        batches = self._step_batches(start)  # closed in the finally below
        path = None
        self._first_step_status(progress, start)
        with StepSignals() as sig:
            try:
                while step < self.total:
                    t0, epoch = time.time(), self.schedule[step][0]
                    lr = opt.param_groups[0]["lr"]  # LambdaLR set it for this step at the previous sched.step()

                    # forward/backward: a signal aborts the step until the optimizer step (StepSignals)
                    sig.abortable = True
                    m = self._forward_backward(model, batches)
                    sig.abortable = False

                    # clip, then host sync: THE one per step
                    m = self._clip_and_reduce(m, sig.received is not None)
                    bad_mb = [i for i in range(ctx.world * A) if m.bad_micro[i] > 0]
                    if bad_mb or m.grad_nonfinite > 0:
                        self._diverged(step + 1, epoch, bad_mb, float(m.grad_norm))

                    # step: optimizer, lr schedule, gradients dropped
                    opt.step()
                    sched.step()
                    opt.zero_grad(set_to_none=True)
                    step += 1

                    # log: metrics.jsonl (+ W&B) and progress.json
                    self._log_step(progress, step, start, epoch, lr, m, time.time() - t0)

                    # eval/checkpoint: validation (host syncs); a checkpoint periodically, at a new best, on
                    # a signal and when this call stops
                    stop_sig = m.stop_signal > 0
                    stop_call = stop_after is not None and step - start >= stop_after and step < self.total
                    path = self._eval_checkpoint(model, step, epoch, sig, progress, stop_sig or stop_call) or path
                    if stop_sig:
                        raise TrainingInterrupted(sig.received or signal.SIGTERM, path)
                    if stop_call:
                        return LoopResult("stopped", step, path)
            except StepAborted as exc:
                raise self._aborted(base, step, start, exc.signum) from None
            except Exception:
                if not sig.raised:
                    raise
                # the handler's StepAborted, turned into another exception by C code on its way out
                raise self._aborted(base, step, start, sig.received) from None
            finally:
                sig.abortable = False  # a signal while the loader threads end is handled after, not inside, this
                batches.close()
        return LoopResult("done", step, path)
