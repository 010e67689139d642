"""Stage 4 tables and figures from ``metrics.jsonl`` and the checkpoints (notebook 04).

Figures are :class:`matplotlib.figure.Figure` objects (no pyplot state: a notebook displays the one a
cell returns; the stage saves them as PNG)."""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.figure import Figure

from eagle3.io import read_json, read_jsonl
from eagle3.rundir import TRAIN, RunDir
from eagle3.stage import stage_record

__all__ = ["load_metrics", "checkpoint_table", "plot_training", "plot_validation", "inputs_table", "export_summary"]


def load_metrics(run_dir: str | Path):
    """Stage 4's ``metrics.jsonl`` as a pandas DataFrame (one row per record; ``kind`` is 'train' or 'val').

    A torn last line (a training killed while appending) is left out; a damaged line elsewhere raises
    ValueError naming the file and line. Train rows: step, epoch, lr, loss, loss_k, full_acc_k, cond_acc_k, tau_hat (training batches),
    grad_norm, tokens, tokens_per_s. Val rows: step, val_loss, val_*_k, val_tau_hat, val_tokens.
    """
    import pandas as pd

    f = RunDir(run_dir).train_metrics
    # a training killed mid-append leaves a torn last line: read_jsonl drops it
    return pd.DataFrame(read_jsonl(f, missing_ok=True))


def checkpoint_table(run_dir: str | Path):
    """One row per kept checkpoint: step, validation tau_hat and loss at that step, and whether it is
    the best (by validation tau_hat) and the exported one."""
    import pandas as pd

    rd = RunDir(run_dir)
    stats = stage_record(run_dir, TRAIN).stats
    rows = []
    for d in sorted(rd.checkpoints_dir.glob("step_*")):
        st = read_json(d / "state.json")
        if not st:
            continue
        val = st.get("val") or {}
        rows.append({"checkpoint": d.name, "step": st["step"], "val_tau_hat": val.get("val_tau_hat"),
                     "val_loss": val.get("val_loss"), "best_so_far": st.get("best_step") == st["step"],
                     "exported": stats.get("best_step") == st["step"]})
    return pd.DataFrame(rows)


def plot_training(df):
    """Loss, per-TTT-step conditional and full accuracy, lr and tokens/s against the step (matplotlib
    Figure), or None when there are no training records."""
    if df is None or df.empty or "kind" not in df:
        return None
    tr = df[df["kind"] == "train"]
    if tr.empty:
        return None
    ks = sorted(int(c.split("_")[-1]) for c in tr.columns if c.startswith("cond_acc_"))
    fig = Figure(figsize=(11, 7))
    ax = fig.subplots(2, 2)
    ax[0, 0].plot(tr["step"], tr["loss"], label="train loss (sum over TTT steps)")
    val = df[df["kind"] == "val"] if "val_loss" in df else None
    if val is not None and not val.empty:
        ax[0, 0].plot(val["step"], val["val_loss"], "o-", label="validation loss")
    ax[0, 0].set_title("loss")
    ax[0, 0].legend()
    for k in ks:
        ax[0, 1].plot(tr["step"], tr[f"cond_acc_{k}"], label=f"cond acc, TTT step {k}")
        ax[0, 1].plot(tr["step"], tr[f"full_acc_{k}"], "--", label=f"full acc, TTT step {k}")
    ax[0, 1].set_title("per-step accuracy (training batches)")
    ax[0, 1].legend(fontsize=7)
    ax[1, 0].plot(tr["step"], tr["lr"])
    ax[1, 0].set_title("learning rate")
    ax[1, 1].plot(tr["step"], tr["tokens_per_s"])
    ax[1, 1].set_title("throughput (tokens/s)")
    for a in ax.flat:
        a.set_xlabel("optimizer step")
    fig.tight_layout()
    return fig


def plot_validation(df):
    """Validation tau_hat and tau_sim (and per-step conditional accuracy) against the step, or None."""
    if df is None or df.empty or "val_tau_hat" not in df:
        return None
    val = df[df["kind"] == "val"]
    if val.empty:
        return None
    fig = Figure(figsize=(11, 3.8))
    ax = fig.subplots(1, 2)
    ax[0].plot(val["step"], val["val_tau_hat"], "o-", label="tau_hat (every position)")
    if "val_tau_sim" in val and val["val_tau_sim"].notna().any():  # metrics without tau_sim (older runs) plot tau_hat only
        ax[0].plot(val["step"], val["val_tau_sim"], "s--", label="tau_sim (verification rounds)")
    best = val.loc[val["val_tau_hat"].idxmax()]
    ax[0].axvline(best["step"], color="gray", ls=":", label=f"best: step {int(best['step'])}")
    ax[0].set_title("validation acceptance length")
    ax[0].legend()
    for c in sorted(c for c in val.columns if c.startswith("val_cond_acc_")):
        ax[1].plot(val["step"], val[c], "o-", label=c[4:])
    ax[1].set_title("validation conditional accuracy per TTT step")
    ax[1].legend(fontsize=7)
    for a in ax:
        a.set_xlabel("optimizer step")
    fig.tight_layout()
    return fig


def inputs_table(params, run_dir: str | Path) -> dict:
    """What Stage 4 will train on: target, draft vocab, aux layer ids, samples and the step plan."""
    from eagle3.train.data import heldout_ids, read_manifest, split_by_id
    from eagle3.train.model import resolve_inputs

    inp = resolve_inputs(params, run_dir)
    out = {"target": str(inp.target_path), "exported verifier name": inp.target_name,
           "target hidden size": inp.hidden_size, "target layers": inp.num_hidden_layers,
           "target vocab": inp.target_vocab_size, "draft vocab": inp.draft_vocab_size,
           "aux hidden state layer ids": inp.aux_layer_ids}
    if not params.train.online:
        refs = read_manifest(run_dir)
        held = heldout_ids(run_dir)
        train, val = split_by_id([r for r in refs if r.id not in held], params.train.val_fraction)
        out.update({"train samples": len(train), "validation samples": len(val),
                    "train tokens": sum(r.num_tokens for r in train)})
    train_params = params.train
    out.update({"draft layers": train_params.num_layers, "TTT steps": train_params.ttt_steps,
                "token budget / micro-batch": train_params.token_budget,
                "global batch (micro-batches)": train_params.grad_accum * train_params.data_parallel,
                "epochs": train_params.epochs, "lr": train_params.lr})
    return out


def export_summary(run_dir: str | Path) -> dict:
    """The exported drafter: which checkpoint and why, its check against the target, how to serve it."""
    from eagle3.contracts.drafter import kind_name
    from eagle3.drafters import check_drafter, get

    rd = RunDir(run_dir)
    rec = stage_record(run_dir, TRAIN)
    stats, d = rec.stats, rd.drafter_dir
    if not rec.complete or not d.exists():
        return {"exported": False}
    cfg = json.loads((d / "config.json").read_text())
    verifier = cfg["speculators_config"]["verifier"]["name_or_path"]
    target = _target_dir(run_dir) if rd.params_file.exists() else verifier
    problems = check_drafter(d, target)
    k = cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    spec = json.dumps(get(kind_name(d)).speculative_config(d, k))
    return {"drafter": str(d), "exported checkpoint": f"step_{stats['best_step']:06d}", "why": stats.get("export_reason"),
            "best validation tau_hat": stats.get("best_val_tau_hat"), "final validation tau_hat": stats.get("final_val_tau_hat"),
            "final validation tau_sim (rounds)": stats.get("final_val_tau_sim"),
            "verifier in config.json": verifier, "check_drafter problems": problems or "none",
            "serve with": f"vllm serve {target} --speculative-config '{spec}' (stage 5 prints the measured command)"}


def _target_dir(run_dir: str | Path) -> str:
    from eagle3.params_file import load_params
    from eagle3.target import resolve_target

    return str(resolve_target(load_params(RunDir(run_dir).params_file).target).path)
