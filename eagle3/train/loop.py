"""Stage 4 training loop: small, nanoGPT-style, around speculators' ``Eagle3DraftModel``.

One optimizer step = ``grad_accum`` micro-batches on each of ``world_size`` ranks (DDP: gloo on CPU,
NCCL on GPU). AdamW (betas 0.9, 0.95), linear warmup then cosine decay to ``min_lr_ratio * lr``,
gradient clipping, bf16 autocast on GPU. Every step appends a line to ``metrics.jsonl`` (and W&B):
loss, per-TTT-step loss, full and conditional accuracy, lr, grad norm, tokens/s. Validation runs
every ``eval_every`` steps and at every checkpoint; it reports the simulated acceptance length
``tau_hat = 1 + sum_k prod_{i<=k} cond_acc_i`` (EAGLE's chain rule: draft token k is accepted only
when tokens 0..k-1 were). Checkpoints (``checkpoints/step_NNNNNN/``, written to a temp folder and
renamed) hold the trainable weights in float32, the optimizer, the scheduler, the RNG states and the
data position, so a resumed run continues bit for bit. SIGTERM/SIGINT save a checkpoint before
exiting. The exported drafter is the checkpoint with the best validation tau_hat.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from eagle3.config import Params, diff_params, dump_params, load_params, params_fingerprint
from eagle3.contracts.drafter import check_drafter, export_drafter
from eagle3.contracts.hidden_states import HiddenStatesDataset, to_training_item
from eagle3.distributed import DistContext, in_torchrun, launch_torchrun
from eagle3.errors import TrainError
from eagle3.io import Progress, atomic_write_json, atomic_write_text, read_json, write_stats
from eagle3.rundir import TRAIN, RunDir

__all__ = [
    "TrainingDiverged",
    "TrainingInterrupted",
    "WarmupCosine",
    "tau_hat",
    "summarize",
    "list_checkpoints",
    "run",
    "main",
]

# Keys that may change between an interrupted run and its resumption without changing the weights.
_RESUME_EXEMPT = (
    "evaluate.",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.eval_every",
    "train.num_workers",
    "train.data_parallel",
    "train.grad_accum",
    "train.device",
    "train.export_embed_tokens",
    "target.served_name",
    "target.device",
    "target.max_model_len",
    "target.tensor_parallel_size",
)


class TrainingDiverged(TrainError):
    """The loss or the gradient became NaN/Inf; the message names the step and the samples."""


class TrainingInterrupted(KeyboardInterrupt):
    """SIGINT/SIGTERM arrived; a checkpoint was saved first (``.checkpoint`` names it)."""

    def __init__(self, signum: int, checkpoint: Path | None) -> None:
        self.signum, self.checkpoint = signum, checkpoint
        super().__init__(f"{signal.Signals(signum).name}: stopped after saving {checkpoint}")


class WarmupCosine:
    """lr multiplier: linear warmup over ``warmup`` steps, then cosine to ``min_ratio`` at ``total``.

    ``m(s) = (s+1)/warmup`` for ``s < warmup``; then ``min_ratio + (1-min_ratio) * (1+cos(pi p))/2``
    with ``p = (s-warmup)/(total-warmup)`` (nanoGPT's schedule; ``s`` = completed optimizer steps).
    """

    def __init__(self, warmup: int, total: int, min_ratio: float) -> None:
        self.warmup, self.total, self.min_ratio = int(warmup), int(total), float(min_ratio)

    def __call__(self, s: int) -> float:
        if s < self.warmup:
            return (s + 1) / self.warmup
        p = min(1.0, (s - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))


def tau_hat(cond_acc: list[float]) -> float:
    """Simulated acceptance length from per-TTT-step conditional accuracies.

    ``tau_hat = 1 + sum_k prod_{i<=k} cond_acc_i``: the bonus token plus the expected number of
    leading draft tokens accepted, when draft token k is accepted with probability ``cond_acc_k``
    given that 0..k-1 were (greedy acceptance; EAGLE-3 paper, Sec. 4). E.g. [0.8, 0.5, 0.25] -> 2.3.
    """
    total, prod = 1.0, 1.0
    for a in cond_acc:
        prod *= a
        total += prod
    return total


def _metric_keys(ttt_steps: int) -> list[str]:
    keys = ["loss_sum", "loss_total"]
    for k in range(ttt_steps):
        keys += [f"loss_{k}_sum", f"loss_{k}_total", f"full_acc_{k}_sum", f"full_acc_{k}_total",
                 f"cond_acc_{k}_sum", f"cond_acc_{k}_total"]
    return keys


def summarize(sums: dict[str, float], ttt_steps: int, prefix: str = "") -> dict[str, float]:
    """Ratios from summed speculators metric counts: loss, loss_k, full_acc_k, cond_acc_k, tau_hat.

    ``full_acc_k``: share of supervised positions whose drafts 0..k were all right; ``cond_acc_k``:
    share right at step k among those right at 0..k-1 (speculators ``compute_accuracy_single_step``).
    """

    def ratio(name: str) -> float:
        t = sums.get(f"{name}_total", 0.0)
        return float(sums.get(f"{name}_sum", 0.0) / t) if t else 0.0

    out = {f"{prefix}loss": ratio("loss")}
    cond = []
    for k in range(ttt_steps):
        out[f"{prefix}loss_{k}"] = ratio(f"loss_{k}")
        out[f"{prefix}full_acc_{k}"] = ratio(f"full_acc_{k}")
        out[f"{prefix}cond_acc_{k}"] = ratio(f"cond_acc_{k}")
        cond.append(out[f"{prefix}cond_acc_{k}"])
    out[f"{prefix}tau_hat"] = tau_hat(cond)
    return out


# ----------------------------------------------------------------------------------------------
# checkpoints


def list_checkpoints(root: str | Path) -> list[int]:
    """Steps of the complete checkpoints under ``root`` (``step_NNNNNN`` folders), ascending."""
    root = Path(root)
    if not root.exists():
        return []
    out = []
    for d in root.iterdir():
        if d.is_dir() and d.name.startswith("step_") and (d / "state.json").exists():
            try:
                out.append(int(d.name[5:]))
            except ValueError:
                continue
    return sorted(out)


def _ckpt(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def _rng_state(device) -> tuple[dict, dict]:
    import torch

    tensors = {"torch_cpu": torch.get_rng_state()}
    if device.type == "cuda":
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    np_state = np.random.get_state()
    py = random.getstate()
    meta = {
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": [py[0], list(py[1]), py[2]],
    }
    return tensors, meta


def _set_rng_state(tensors: dict, meta: dict, device) -> None:
    import torch

    torch.set_rng_state(tensors["torch_cpu"])
    if device.type == "cuda":
        states = [tensors[k] for k in sorted(k for k in tensors if k.startswith("torch_cuda_"))]
        if states:
            torch.cuda.set_rng_state_all(states)
    n = meta["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    p = meta["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))


def _save_checkpoint(root: Path, step: int, model, opt, sched, state: dict, params: Params) -> Path:
    """Write ``root/step_NNNNNN`` atomically (temp folder + rename); no-op when it already exists."""
    import torch
    from safetensors.torch import save_file

    from eagle3.train.model import trainable_state

    final = _ckpt(root, step)
    if (final / "state.json").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-step_{step:06d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        weights = {k: v.float().cpu().contiguous() for k, v in trainable_state(model).items()}
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt", "step": str(step)})
        torch.save(opt.state_dict(), tmp / "optimizer.pt")
        torch.save(sched.state_dict(), tmp / "scheduler.pt")
        rng_t, rng_m = _rng_state(next(model.parameters()).device)
        save_file(rng_t, str(tmp / "rng.safetensors"))
        atomic_write_json(tmp / "rng.json", rng_m)
        atomic_write_text(tmp / "params.yaml", dump_params(params))
        atomic_write_json(tmp / "state.json", state)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if final.exists():  # an incomplete folder from a crash during a previous rename
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _load_checkpoint(path: Path, model, opt, sched, device) -> dict:
    import torch
    from safetensors.torch import load_file

    weights = load_file(str(path / "model.safetensors"))
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if set(weights) != set(params):
        raise TrainError(
            f"{path}/model.safetensors does not match the drafter: missing {sorted(set(params) - set(weights))}, "
            f"unexpected {sorted(set(weights) - set(params))}"
        )
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(weights[n].to(p.dtype))
    opt.load_state_dict(torch.load(path / "optimizer.pt", map_location=device, weights_only=True))
    sched.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    _set_rng_state(load_file(str(path / "rng.safetensors")), read_json(path / "rng.json"), device)
    return read_json(path / "state.json")


def _resume_differences(ckpt_params: Params, params: Params) -> list[str]:
    return [d for d in diff_params(ckpt_params, params) if not d.startswith(_RESUME_EXEMPT)]


def _prune(root: Path, keep: int, protect: set[int]) -> None:
    steps = list_checkpoints(root)
    keep_set = set(steps[-keep:]) | protect
    for s in steps:
        if s not in keep_set:
            d = _ckpt(root, s)
            trash = root / f".trash-{d.name}-{os.getpid()}"
            os.replace(d, trash)
            shutil.rmtree(trash, ignore_errors=True)


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metrics.jsonl records of steps after ``step`` (they are recomputed on resume)."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                keep.append(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
    atomic_write_text(path, "".join(x + "\n" for x in keep))


# ----------------------------------------------------------------------------------------------
# signals


class _StepAborted(BaseException):
    """Raised by the signal handler inside the abortable part of a step (see :class:`_Signals`).

    A BaseException, so that no ``except Exception`` on the way (dynamo, inductor, the DataLoader)
    swallows or wraps it."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


class _Signals:
    """Install SIGINT/SIGTERM handlers (main thread only).

    Normally the handler only records the signal and the loop stops at the end of the step, after
    a checkpoint. While ``abortable`` is set (a step's forward/backward, which may hold the first
    step's ``torch.compile`` for minutes, and validation) the handler raises :class:`_StepAborted`
    at once: nothing there has touched the weights, the optimizer or the scheduler since the last
    completed step, so the loop can save that step and exit within seconds.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self.abortable = False
        self._old: dict[int, Any] = {}

    def _handler(self, signum, frame) -> None:  # noqa: ARG002
        self.received = signum
        if self.abortable:
            self.abortable = False
            raise _StepAborted(signum)

    def __enter__(self) -> "_Signals":
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


# ----------------------------------------------------------------------------------------------
# data sources


class _Prefetch:
    """Hand out micro-batches already on the device; on CUDA the next one is copied on a side stream
    while the current step computes (host tensors are pinned by the DataLoader). On CPU: as is."""

    def __init__(self, batches, device) -> None:
        import torch

        self.it, self.device = iter(batches), device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.next = self._load()

    def _load(self):
        import torch

        b = next(self.it, None)
        if b is None or self.stream is None:
            return b
        with torch.cuda.stream(self.stream):
            return {k: v.to(self.device, non_blocking=True) for k, v in b.items()}

    def __next__(self) -> dict:
        import torch

        b = self.next
        if b is None:
            raise StopIteration
        if self.stream is not None:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_stream(self.stream)
            for v in b.values():
                v.record_stream(cur)
        self.next = self._load()
        return b


def _online_fetch(params: Params, run_dir: Path, refs, inputs):
    from eagle3.extract import online_samples

    def fetch(indices: list[int]) -> list[dict]:
        rows = [refs[i].row for i in indices]
        return [to_training_item(s, inputs.n_aux, inputs.hidden_size, inputs.target_vocab_size,
                                 f"online row {refs[i].row} (id {refs[i].id})")
                for i, s in zip(indices, online_samples(params, run_dir, rows))]

    return fetch


# ----------------------------------------------------------------------------------------------
# the stage


def run(params: Params, run_dir: str | Path, *, stop_after: int | None = None) -> dict:
    """Stage 4: train the drafter, checkpoint, export the best checkpoint to the stage's ``drafter/``.

    Resumes from the newest checkpoint in the stage's ``checkpoints/`` (exactly: weights, optimizer,
    scheduler, RNG states, data position); a finished stage is not trained again. With
    ``train.data_parallel > 1`` (and not already under torchrun) it launches
    ``torchrun --nproc-per-node P -m eagle3.train`` and waits for it.

    Args:
        params: the run's params (``train`` section; ``target``; ``extract.aux_layer_ids`` online).
        run_dir: the run directory (reads Stages 2 and 3; writes Stage 4's folder).
        stop_after: stop (checkpoint, stage left incomplete) after this many optimizer steps in this
            call; a later call resumes. For time-boxed sessions and tests.

    Returns:
        dict: the stats (``drafter_dir``, ``best_step``, ``best_val_tau_hat``, ...; ``complete``
        False when stopped early).

    Raises:
        TrainError: bad inputs (mapping from another run, hidden size / aux count mismatch, empty
            training split, resume from a checkpoint of different params, ...).
        TrainingDiverged: NaN/Inf loss or gradient (step and sample ids named; checkpoints kept).
        TrainingInterrupted: SIGINT (after saving a checkpoint). SIGTERM raises SystemExit(143).
    """
    run_dir = Path(run_dir)
    tp = params.train
    if tp.data_parallel > 1 and not in_torchrun():
        return _launch_torchrun(params, run_dir, stop_after)
    from eagle3.target import pick_device

    ctx = DistContext.from_env(device=pick_device(tp.device))
    try:
        return _Trainer(params, run_dir, ctx).train(stop_after)
    finally:
        ctx.close()


def _launch_torchrun(params: Params, run_dir: Path, stop_after: int | None) -> dict:
    sd = RunDir(run_dir).stage(TRAIN, create=True)
    pfile = sd / ".torchrun_params.yaml"
    atomic_write_text(pfile, dump_params(params))
    extra = ["--stop-after", str(stop_after)] if stop_after is not None else []
    rc, cmd = launch_torchrun("eagle3.train", pfile, run_dir, params.train.data_parallel, extra, omp_threads=True)
    if rc != 0:
        raise TrainError(f"torchrun exited with code {rc}: {' '.join(cmd)} (see its output above)")
    return read_json(sd / "stats.json") or read_json(sd / "last_call.json") or {}


class _Trainer:
    def __init__(self, params: Params, run_dir: Path, ctx: DistContext) -> None:
        self.params, self.run_dir, self.ctx = params, run_dir, ctx
        self.tp = params.train
        self.sd = RunDir(run_dir).stage(TRAIN, create=ctx.main)
        self.ckpt_root = self.sd / "checkpoints"
        self.metrics_file = self.sd / "metrics.jsonl"

    # -- set-up ---------------------------------------------------------------------------------
    def _data(self):
        from eagle3.train.data import heldout_ids, online_refs, read_manifest, split_by_id

        rd = RunDir(self.run_dir)
        if self.tp.online:
            refs = online_refs(self.run_dir)
        else:
            refs = read_manifest(self.run_dir)
        held = heldout_ids(self.run_dir)
        excluded = [r for r in refs if r.id in held]
        refs = [r for r in refs if r.id not in held]
        train, val = split_by_id(refs, self.tp.val_fraction)
        if not train:
            raise TrainError(
                f"empty training split: {len(refs) + len(excluded)} samples in "
                f"{(rd.tokenized('train') if self.tp.online else rd.manifest).relative_to(rd.root)}, "
                f"{len(excluded)} held out, {len(val)} to validation (train.val_fraction={self.tp.val_fraction}). "
                f"Synthesize more samples or lower train.val_fraction."
            )
        self.train_refs, self.val_refs, self.excluded = train, val, excluded
        inp = self.inputs
        if self.tp.online:
            fetch = _online_fetch(self.params, self.run_dir, train, inp)
            vfetch = _online_fetch(self.params, self.run_dir, val, inp)
            self.train_ds = self.val_ds = None
            self.fetch, self.vfetch = fetch, vfetch
        else:
            self.train_ds = HiddenStatesDataset.for_training(train, inp.n_aux, inp.hidden_size, inp.target_vocab_size)
            self.val_ds = HiddenStatesDataset.for_training(val, inp.n_aux, inp.hidden_size, inp.target_vocab_size)
            self.fetch = self.vfetch = None

    def _micro(self, index_lists, val: bool = False):
        import torch

        from eagle3.train.data import MicroBatches, collate_fn

        dtype = torch.bfloat16 if self.ctx.device.type == "cuda" else torch.float32
        coll = collate_fn(self.tp.token_budget, self.inputs.hidden_size, self.inputs.n_aux, dtype)
        return MicroBatches(index_lists, coll, dataset=self.val_ds if val else self.train_ds,
                            fetch=self.vfetch if val else self.fetch,
                            num_workers=0 if self.tp.online else self.tp.num_workers,
                            pin_memory=self.ctx.device.type == "cuda")

    def _model(self):
        import torch

        from eagle3.train.model import build_drafter, configure_compile, default_attn_implementation

        tp = self.tp
        attn = tp.attn_implementation if tp.attn_implementation != "auto" else default_attn_implementation(self.ctx.device.type)
        torch.manual_seed(tp.seed)
        model = build_drafter(self.params, self.inputs, attn).to(self.ctx.device)
        # what torch.compile covers (model.configure_compile): by default only flex attention;
        # EAGLE3_TRAIN_COMPILE=speculators restores speculators' whole compiled forward
        self.compile_mode = configure_compile(model, os.environ.get("EAGLE3_TRAIN_COMPILE", "attention"), attn)
        decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": tp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=tp.lr, betas=(0.9, 0.95), eps=1e-8, fused=self.ctx.device.type == "cuda" or None,
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(tp.warmup_steps, len(self.schedule), tp.min_lr_ratio))
        impl = tp.loss_implementation if tp.loss_implementation != "auto" else (
            "fused" if self.ctx.device.type == "cuda" else "eager")
        from eagle3.train.model import loss_config as make_loss_config

        loss_config = make_loss_config(tp.loss, impl)
        self.fwd_kwargs = dict(ttt_steps=tp.ttt_steps, ttt_step_loss_decay=tp.ttt_step_loss_decay, loss_config=loss_config)
        self.attn, self.loss_impl = attn, impl
        return model, opt, sched

    # -- metrics ----------------------------------------------------------------------------------
    def _log(self, rec: dict) -> None:
        if not self.ctx.main:
            return
        with open(self.metrics_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tracker is not None:
            self.tracker.log(rec)

    def _evaluate(self, model, step: int) -> dict:
        import torch

        if not self.val_plan:
            return {}
        keys = _metric_keys(self.tp.ttt_steps)
        mine = [b for i, b in enumerate(self.val_plan) if i % self.ctx.world == self.ctx.rank]
        acc = torch.zeros(len(keys) + 1, dtype=torch.float64, device=self.ctx.device)
        module = getattr(model, "module", model)
        module.eval()
        with torch.no_grad(), self._autocast():
            for batch in self._micro(mine, val=True):
                batch = {k: v.to(self.ctx.device, non_blocking=True) for k, v in batch.items()}
                _, _, m = module(**batch, **self.fwd_kwargs)
                acc[:-1] += torch.stack([m[k].detach().double() for k in keys])
                acc[-1] += (batch["document_ids"] != -1).sum()
        module.train()
        acc = self.ctx.all_sum(acc).cpu()
        sums = dict(zip(keys, acc[:-1].tolist()))
        rec = {"kind": "val", "step": step, **summarize(sums, self.tp.ttt_steps, prefix="val_"), "val_tokens": int(acc[-1])}
        self._log(rec)
        return rec

    def _autocast(self):
        import torch

        if self.ctx.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # -- main loop --------------------------------------------------------------------------------
    def train(self, stop_after: int | None) -> dict:
        import torch

        from eagle3.train.data import build_schedule, epoch_plan, plan_digest
        from eagle3.train.model import resolve_inputs

        tp, ctx = self.tp, self.ctx
        t_setup = time.time()
        self.inputs = resolve_inputs(self.params, self.run_dir)
        self._data()
        G = ctx.world * tp.grad_accum
        lengths = [max(r.num_tokens - 1, 0) for r in self.train_refs]
        self.schedule = build_schedule(lengths, tp.token_budget, tp.seed, tp.epochs, G, tp.max_steps)
        if not self.schedule:
            raise TrainError(
                f"the training split ({len(self.train_refs)} samples, {sum(lengths)} tokens) packs into fewer "
                f"micro-batches of train.token_budget={tp.token_budget} than one step needs "
                f"(data_parallel x grad_accum = {G}); lower the budget or grad_accum, or add data."
            )
        vlens = [max(r.num_tokens - 1, 0) for r in self.val_refs]
        self.val_plan = epoch_plan(vlens, tp.token_budget, tp.seed, 0)
        total = len(self.schedule)
        digest = plan_digest(self.train_refs)
        model, opt, sched = self._model()

        # ---- resume ----
        state = {"step": 0, "tokens_seen": 0, "elapsed_s": 0.0, "best_step": None, "best_val_tau_hat": None,
                 "val_history": []}
        steps = list_checkpoints(self.ckpt_root)
        if steps:
            path = _ckpt(self.ckpt_root, steps[-1])
            old = load_params(path / "params.yaml")
            diffs = _resume_differences(old, self.params)
            if diffs:
                raise TrainError(
                    f"refusing to resume from {path}: it was trained with different params:\n  "
                    + "\n  ".join(diffs) + f"\nUse a new run directory, or delete {self.ckpt_root} to start over."
                )
            st = read_json(path / "state.json")
            if st.get("global_batch") != G:
                raise TrainError(
                    f"refusing to resume from {path}: global batch {st.get('global_batch')} micro-batches there, "
                    f"{G} now (train.data_parallel x train.grad_accum); keep the product equal to resume exactly"
                )
            if st.get("plan_digest") != digest:
                raise TrainError(
                    f"refusing to resume from {path}: the training samples changed since it was written "
                    f"(stage 3 was re-run?). Delete {self.ckpt_root} to start over."
                )
            state = _load_checkpoint(path, model, opt, sched, ctx.device)
        start = int(state["step"])
        done = read_json(self.sd / "stats.json") or {}
        if start == total and done.get("complete") and (self.sd / "drafter" / "config.json").exists():
            return done  # finished earlier: nothing to redo
        if ctx.main:
            for d in self.ckpt_root.glob(".tmp-*") if self.ckpt_root.exists() else []:
                shutil.rmtree(d, ignore_errors=True)
            _truncate_metrics(self.metrics_file, start)
        ctx.barrier()

        base = model
        if ctx.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                                            broadcast_buffers=False)

        self.tracker = None
        prog = None
        if ctx.main:
            from eagle3.tracking import Tracker

            self.tracker = Tracker(self.params, self.run_dir, self.sd.name)
            prog = Progress(self.sd, total=total, unit="steps", done=start, tokens=int(state["tokens_seen"]), desc=self.sd.name)
            prog.extra.update({"train_samples": len(self.train_refs), "val_samples": len(self.val_refs)})
        info = {"train_samples": len(self.train_refs), "val_samples": len(self.val_refs),
                "excluded_heldout": len(self.excluded), "total_steps": total, "global_batch_micro": G,
                "world_size": ctx.world, "grad_accum": tp.grad_accum, "token_budget": tp.token_budget,
                "attn_implementation": self.attn, "loss_implementation": self.loss_impl, "device": str(ctx.device),
                "setup_s": round(time.time() - t_setup, 2)}

        keys = _metric_keys(tp.ttt_steps)
        A = tp.grad_accum
        my_lists = [mb for _, grp in self.schedule[start:] for mb in grp[ctx.rank * A:(ctx.rank + 1) * A]]
        batches = _Prefetch(self._micro(my_lists), ctx.device)
        trainable = [p for p in base.parameters() if p.requires_grad]
        status, ckpt_path, step, done_here = "running", None, start, 0

        def ckpt_state(epoch: int, ev: dict | None) -> None:
            state.update({"step": step, "epoch": epoch, "global_batch": G, "world_size": ctx.world,
                          "grad_accum": A, "plan_digest": digest, "total_steps": total,
                          "params_fingerprint": params_fingerprint(self.params),
                          "val": {k: v for k, v in (ev or {}).items() if k.startswith("val_")}})

        if prog is not None and start < total:
            # the first step compiles (torch.compile; minutes on a cold cache): say so, the
            # heartbeat keeps progress.json fresh meanwhile
            prog.extra["phase"] = f"first step (torch.compile: {self.compile_mode})" if ctx.device.type == "cuda" else "first step"
            prog.bar.set_postfix_str(prog.extra["phase"], refresh=True)
            prog.update(0)
        try:
            with _Signals() as sig:
                while step < total:
                    t0 = time.time()
                    epoch = self.schedule[step][0]
                    # metrics stay on the device until the one host sync per step (below)
                    vec = torch.zeros(len(keys) + 4 + G, dtype=torch.float64, device=ctx.device)
                    sig.abortable = True  # until the optimizer step: a signal aborts the step (_Signals)
                    for a in range(A):
                        batch = next(batches)
                        sync = model.no_sync() if (ctx.world > 1 and a < A - 1) else contextlib.nullcontext()
                        with sync:
                            with self._autocast():
                                _, loss, m = model(**batch, **self.fwd_kwargs)
                            (loss / A).backward()
                        vec[:len(keys)] += torch.stack([m[k].detach().double() for k in keys])
                        vec[len(keys)] += (batch["document_ids"] != -1).sum()
                        vec[len(keys) + 4 + ctx.rank * A + a] = (~torch.isfinite(loss.detach())).double()
                    sig.abortable = False
                    gnorm = torch.nn.utils.clip_grad_norm_(trainable, tp.grad_clip)
                    vec[len(keys) + 1] = (~torch.isfinite(gnorm)).double()
                    vec[len(keys) + 2] = 1.0 if sig.received is not None else 0.0
                    vec[len(keys) + 3] = gnorm.double() / ctx.world
                    vec = ctx.all_sum(vec).cpu()
                    bad_mb = [i for i in range(G) if vec[len(keys) + 4 + i] > 0]
                    if bad_mb or vec[len(keys) + 1] > 0:
                        self._diverged(step + 1, epoch, bad_mb, float(vec[len(keys) + 3]))
                    lr = opt.param_groups[0]["lr"]
                    opt.step()
                    sched.step()
                    opt.zero_grad(set_to_none=True)
                    step += 1
                    done_here += 1
                    dt = time.time() - t0
                    ntok = int(vec[len(keys)])
                    state["tokens_seen"] = int(state["tokens_seen"]) + ntok
                    state["elapsed_s"] = float(state["elapsed_s"]) + dt
                    sums = dict(zip(keys, vec[:len(keys)].tolist()))
                    rec = {"kind": "train", "step": step, "epoch": epoch, "lr": lr, **summarize(sums, tp.ttt_steps),
                           "grad_norm": float(vec[len(keys) + 3]), "tokens": ntok, "tokens_per_s": ntok / max(dt, 1e-9),
                           "tokens_seen": state["tokens_seen"], "time_s": round(dt, 4), "t": round(time.time(), 3)}
                    self._log(rec)
                    if prog is not None:
                        if done_here == 1:
                            prog.extra["phase"] = "training"
                            prog.extra["first_step_s"] = round(dt, 2)
                            prog.bar.set_postfix_str("", refresh=False)
                        prog.update(1, tokens=ntok, loss=round(rec["loss"], 4), tau_hat=round(rec["tau_hat"], 3))
                    stop_sig = vec[len(keys) + 2] > 0
                    stop_call = stop_after is not None and done_here >= stop_after and step < total
                    periodic = step % tp.checkpoint_every == 0 or step == total
                    ev = None
                    if step % tp.eval_every == 0 or periodic:
                        sig.abortable = sig.received is None  # validation may compile too; `step` is complete
                        ev = self._evaluate(model, step)
                        sig.abortable = False
                        if ev:
                            state["val_history"].append({"step": step, "val_tau_hat": ev["val_tau_hat"], "val_loss": ev["val_loss"]})
                    new_best = bool(ev) and (state["best_val_tau_hat"] is None or ev["val_tau_hat"] > state["best_val_tau_hat"])
                    if new_best:
                        state["best_step"], state["best_val_tau_hat"] = step, ev["val_tau_hat"]
                    if periodic or new_best or stop_sig or stop_call:
                        ckpt_state(epoch, ev)
                        if ctx.main:
                            ckpt_path = _save_checkpoint(self.ckpt_root, step, base, opt, sched, state, self.params)
                            protect = {state["best_step"]} if state["best_step"] is not None else set()
                            _prune(self.ckpt_root, tp.keep_checkpoints, protect)
                        ctx.barrier()
                    if stop_sig:
                        status = "interrupted"
                        signum = sig.received or signal.SIGTERM
                        raise TrainingInterrupted(signum, ckpt_path)
                    if stop_call:
                        status = "stopped"
                        break
        except _StepAborted as exc:
            # a signal inside a step's forward/backward (or validation): the weights, optimizer and
            # scheduler are those of `step`; save them unless a checkpoint of `step` exists
            opt.zero_grad(set_to_none=True)
            have = list_checkpoints(self.ckpt_root)
            if step > start and ctx.main and step not in have:
                ckpt_state(self.schedule[step - 1][0], None)
                ckpt_path = _save_checkpoint(self.ckpt_root, step, base, opt, sched, state, self.params)
            elif have:
                ckpt_path = _ckpt(self.ckpt_root, have[-1])
            if prog is not None:
                prog.close("interrupted")
                prog = None
            self._finish_tracker()
            if exc.signum == signal.SIGTERM:
                raise SystemExit(128 + signal.SIGTERM) from None
            raise TrainingInterrupted(exc.signum, ckpt_path) from None
        except TrainingInterrupted as exc:
            if prog is not None:
                prog.close("interrupted")
                prog = None
            self._finish_tracker()
            if exc.signum == signal.SIGTERM:
                raise SystemExit(128 + signal.SIGTERM) from None
            raise
        except BaseException:
            if prog is not None:
                prog.close("failed")
                prog = None
            self._finish_tracker()
            raise
        if status == "stopped":
            if prog is not None:
                prog.close("stopped")
            self._finish_tracker()
            out = {**info, "complete": False, "step": step, "checkpoint": str(ckpt_path)}
            if ctx.main:
                atomic_write_json(self.sd / "last_call.json", out)
            return out
        stats = self._finish(base, state, info, total)
        if prog is not None:
            prog.close("done")
        return stats

    def _diverged(self, step: int, epoch: int, bad_mb: list[int], gnorm: float) -> None:
        G = self.ctx.world * self.tp.grad_accum
        A = self.tp.grad_accum
        grp = self.schedule[step - 1][1]
        which = bad_mb or list(range(G))
        lines = []
        for i in which:
            ids = [self.train_refs[j].id for j in grp[i]]
            lines.append(f"micro-batch {i} (rank {i // A}, accumulation {i % A}): sample ids {ids}")
        last = list_checkpoints(self.ckpt_root)
        what = "loss" if bad_mb else f"gradient norm ({gnorm})"
        raise TrainingDiverged(
            f"{what} is NaN/Inf at step {step} (epoch {epoch}); training stopped before the optimizer step.\n  "
            + "\n  ".join(lines)
            + f"\nLast good checkpoint: {(_ckpt(self.ckpt_root, last[-1]) if last else 'none (no checkpoint yet)')} "
            f"(kept). Check those samples' hidden states, or lower train.lr."
        )

    def _finish_tracker(self) -> None:
        if getattr(self, "tracker", None) is not None:
            self.tracker.finish()
            self.tracker = None

    def _finish(self, model, state: dict, info: dict, total: int) -> dict:
        """Export the best checkpoint (rank 0), check it, write stats.json."""
        from safetensors.torch import load_file

        from eagle3.target import torch_dtype

        ctx, tp = self.ctx, self.tp
        best = state.get("best_step")
        if best is None:
            best = total
            reason = "no validation split (train.val_fraction = 0): exported the last checkpoint"
        else:
            reason = (f"highest validation tau_hat ({state['best_val_tau_hat']:.4f}) among "
                      f"{len(state['val_history'])} evaluations")
        stats: dict = {}
        if ctx.main:
            import torch

            ck = _ckpt(self.ckpt_root, best)
            weights = load_file(str(ck / "model.safetensors"))
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if p.requires_grad:
                        p.copy_(weights[n].to(p.dtype))
            dtype = torch_dtype("auto", self.inputs.target_path)
            drafter = self.sd / "drafter"
            last_train = self._last_record("train")
            export_drafter(
                model.to("cpu"), drafter, self.inputs.target_name, dtype=dtype, include_embed_tokens=tp.export_embed_tokens,
                info={"best_step": best, "best_val_tau_hat": state.get("best_val_tau_hat"), "total_steps": total,
                      "params_fingerprint": params_fingerprint(self.params), "checkpoint": str(ck), "reason": reason},
            )
            check_drafter(drafter, self.inputs.target_path, raise_on_error=True)
            final_val = next((v for v in reversed(state["val_history"]) if v["step"] == total), None)
            stats = {
                "drafter_dir": str(drafter),
                "best_step": best,
                "best_val_tau_hat": state.get("best_val_tau_hat"),
                "export_reason": reason,
                "final_step": total,
                "final_val_tau_hat": final_val["val_tau_hat"] if final_val else None,
                "final_train_loss": last_train.get("loss") if last_train else None,
                "tokens_seen": state["tokens_seen"],
                "train_time_s": round(state["elapsed_s"], 2),
                "tokens_per_s": round(state["tokens_seen"] / max(state["elapsed_s"], 1e-9), 2),
                "verifier": self.inputs.target_name,
                "draft_vocab_size": self.inputs.draft_vocab_size,
                "aux_layer_ids": self.inputs.aux_layer_ids,
                **info,
            }
            if self.tracker is not None:
                self._figures()
                self.tracker.summary(stats)
            stats = write_stats(self.sd, stats)
        self._finish_tracker()
        ctx.barrier()
        return stats if ctx.main else (read_json(self.sd / "stats.json") or {})

    def _last_record(self, kind: str) -> dict | None:
        if not self.metrics_file.exists():
            return None
        last = None
        for line in self.metrics_file.read_text(encoding="utf-8").splitlines():
            r = json.loads(line)
            if r.get("kind") == kind:
                last = r
        return last

    def _figures(self) -> None:
        from eagle3.train.report import load_metrics, plot_training, plot_validation

        df = load_metrics(self.run_dir)
        for name, fn in (("training_curves", plot_training), ("validation_tau_hat", plot_validation)):
            fig = fn(df)
            if fig is not None:
                self.tracker.figure(name, fig)


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
        print(json.dumps({k: v for k, v in stats.items() if not isinstance(v, (list, dict))}, indent=1, default=str))
    return 0
