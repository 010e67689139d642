"""Stage 3 tables and figures for notebook 03 (and the PNGs written beside the stage's files).

Figures are :class:`matplotlib.figure.Figure` objects (no pyplot state: a notebook displays the one
a cell returns, the stage saves them without a GUI backend).

* :func:`preflight_rows` — the preflight as (quantity, value) rows;
* :func:`fig_throughput` — tokens/s and samples done over time (``timeline.jsonl``);
* :func:`fig_bytes_per_token` — bytes per token per file against the projection;
* :func:`layer_norms` / :func:`fig_layer_norms` — mean hidden-state L2 norm per stored layer and per
  position, from the stored files;
* :func:`convention_check` — recompute a few samples with transformers' ``output_hidden_states`` and
  compare: stored slot k vs ``hidden_states[k]``, ``final_norm(last slot)`` vs ``hidden_states[N]``;
  its figure draws every layer's norm with the stored slots on top.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure

from eagle3.contracts import hidden_states as hsc
from eagle3.io import read_json, window_rates
from eagle3.rundir import EXTRACT, RunDir

__all__ = [
    "preflight_rows",
    "timeline",
    "throughput_windows",
    "fig_throughput",
    "fig_bytes_per_token",
    "layer_norms",
    "fig_layer_norms",
    "convention_check",
]


def _sd(run_dir: str | Path) -> Path:
    return RunDir(run_dir).stage(EXTRACT)


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.3f} GiB ({int(n):,} B)"


def preflight_rows(run_dir: str | Path) -> list[dict]:
    """``preflight.json`` as rows ``{"quantity", "value"}`` for a table (bytes also in GiB)."""
    pf = read_json(_sd(run_dir) / "preflight.json", None)
    if not pf:
        return []
    order = ["samples", "tokens", "mean_seq_len", "max_seq_len", "stored_layers", "hidden_size", "dtype",
             "bytes_per_token", "formula", "projected_hidden_bytes", "projected_bytes", "done_samples",
             "todo_bytes", "disk_margin", "required_free_bytes", "free_bytes", "fits", "num_batches",
             "token_budget", "padding_efficiency", "projected_seconds", "world_size", "backend"]
    out = []
    for k in order:
        v = pf.get(k)
        if k.endswith("bytes") and k != "bytes_per_token" and v is not None:
            v = _gib(v)
        elif k == "projected_seconds" and v is not None:
            v = f"{v:.1f} s (calibrated at {pf['calibration']['tokens_per_s']:.0f} tokens/s)"
        out.append({"quantity": k, "value": v})
    return out


def timeline(run_dir: str | Path) -> list[dict]:
    """The progress points of ``timeline.jsonl`` (one every ~2 s while the stage runs; runs appended)."""
    p = _sd(run_dir) / "timeline.jsonl"
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def throughput_windows(points: list[dict], min_window_s: float = 2.0) -> list[tuple[float, float, float]]:
    """Tokens/s of ``timeline.jsonl`` points over windows of at least ``max(min_window_s, span/30)``
    seconds (:func:`eagle3.io.window_rates`), per run: a resumed run (its ``elapsed_s`` restarts)
    starts new windows. Returns ``[(t_from, t_to, tokens_per_s)]`` in the points' unix seconds."""
    runs: list[list[dict]] = []
    for p in points:
        if not runs or p.get("elapsed_s", 0) < runs[-1][-1].get("elapsed_s", 0) or p["tokens"] < runs[-1][-1]["tokens"]:
            runs.append([])
        runs[-1].append(p)
    out: list[tuple[float, float, float]] = []
    for r in runs:
        span = r[-1]["t"] - r[0]["t"]
        out += window_rates([(p["t"], float(p["tokens"])) for p in r], max(min_window_s, span / 30))
    return out


def fig_throughput(run_dir: str | Path):
    """Tokens done over wall time (left; the slope is the throughput) and tokens/s (right: the running
    average of each run as ``progress.json`` reports it, and the rate over windows of at least 2 s or
    1/30 of the run, :func:`throughput_windows`, so that two progress points a few ms apart do not
    make an outlier that flattens the plot)."""
    pts = [p for p in timeline(run_dir) if p.get("tokens") is not None]
    fig = Figure(figsize=(10, 3.2))
    ax = fig.subplots(1, 2)
    if pts:
        t0 = pts[0]["t"]
        t = np.array([p["t"] - t0 for p in pts])
        tok = np.array([p["tokens"] for p in pts], dtype=float)
        ax[0].plot(t, tok, marker=".")
        ax[1].plot(t, [p.get("tokens_per_s") or 0.0 for p in pts], marker=".", label="running average")
        for i, (a, b, rate) in enumerate(throughput_windows(pts)):
            ax[1].plot([a - t0, b - t0], [rate, rate], color="C1", lw=2,
                       label="over windows of >= 2 s" if i == 0 else None)
        ax[1].set_ylim(bottom=0)
        ax[1].legend(fontsize=8)
    ax[0].set(xlabel="wall time (s)", ylabel="tokens done", title="progress")
    ax[1].set(xlabel="wall time (s)", ylabel="tokens / s", title="extraction throughput")
    for a in ax:
        a.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def fig_bytes_per_token(run_dir: str | Path):
    """Bytes per token of every stored file vs its length, with the hidden-state-only projection."""
    sd = _sd(run_dir)
    meta = hsc.read_meta(sd) or {}
    ents = hsc.read_manifest(sd, missing_ok=True)
    fig = Figure(figsize=(6, 3.2))
    ax = fig.subplots()
    if ents:
        n = np.array([e["num_tokens"] for e in ents], dtype=float)
        b = np.array([e["bytes"] for e in ents], dtype=float)
        ax.scatter(n, b / n, s=8, label="stored file")
        ax.set_xscale("log")
    if meta:
        dt = getattr(torch, meta["dtype"])
        bpe = hsc.DTYPE_BYTES[dt]
        per = hsc.bytes_per_token(len(meta["stored_layers"]), meta["hidden_size"], dt)
        scales = " + scales" if dt == hsc.FP8 else ""
        ax.axhline(per, color="k", ls="--", lw=1, label=f"(n_aux+1) x hidden x {bpe}{scales} = {per} B")
        ax.axhline(per + 9, color="C1", ls=":", lw=1, label="+ token ids and loss mask")
    ax.set(xlabel="tokens in sample", ylabel="bytes / token", title="storage per token")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def layer_norms(run_dir: str | Path, max_samples: int = 16) -> dict:
    """Mean per-token L2 norm of each stored slot over up to ``max_samples`` evenly spaced files.

    Returns:
        dict: ``stored_layers``, ``mean_norm`` (list per slot), ``per_position`` (``[slots, seq]`` of the
        longest sampled file), ``samples`` (rows used).
    """
    from safetensors.torch import load_file

    sd = _sd(run_dir)
    meta = hsc.read_meta(sd)
    ents = hsc.read_manifest(sd, missing_ok=True)
    if not meta or not ents:
        return {"stored_layers": [], "mean_norm": [], "per_position": [], "samples": []}
    idx = sorted(set(np.linspace(0, len(ents) - 1, min(max_samples, len(ents))).round().astype(int).tolist()))
    sums = np.zeros(len(meta["stored_layers"]))
    count = 0
    longest = None
    for i in idx:
        hs = hsc.read_states(load_file(str(sd / ents[i]["file"])))["hidden_states"].float()  # [seq, slots, hidden]
        nrm = hs.norm(dim=-1)  # [seq, slots]
        sums += nrm.sum(0).numpy()
        count += nrm.shape[0]
        if longest is None or nrm.shape[0] > longest.shape[0]:
            longest = nrm
    return {"stored_layers": meta["stored_layers"], "mean_norm": (sums / max(count, 1)).tolist(),
            "per_position": longest.T.numpy().tolist(), "samples": [ents[i]["row"] for i in idx]}


def fig_layer_norms(run_dir: str | Path, max_samples: int = 16):
    """Bar chart of the mean norm per stored layer and the per-position norms of one sample."""
    ln = layer_norms(run_dir, max_samples)
    fig = Figure(figsize=(10, 3.2))
    ax = fig.subplots(1, 2)
    labels = [f"id {k}" + (" (N, pre-norm)" if j == len(ln["stored_layers"]) - 1 else "")
              for j, k in enumerate(ln["stored_layers"])]
    ax[0].bar(labels, ln["mean_norm"], color=[f"C{j}" for j in range(len(labels))])
    ax[0].set(ylabel="mean ||h|| per token", title=f"stored layers ({len(ln['samples'])} samples)")
    ax[0].tick_params(axis="x", labelsize=8)
    for j, row in enumerate(ln["per_position"]):
        ax[1].plot(row, lw=1, label=labels[j], color=f"C{j}")
    ax[1].set(xlabel="token position", ylabel="||h||", title="norm by position (longest sample)", yscale="log")
    ax[1].legend(fontsize=7)
    for a in ax:
        a.grid(alpha=0.3)
    fig.tight_layout()
    return fig


@torch.inference_mode()
def convention_check(params, run_dir: str | Path, n_samples: int = 2, model=None) -> tuple[list[dict], object]:
    """Recompute ``n_samples`` stored samples with ``output_hidden_states=True`` and compare.

    For each stored slot with id ``k < N``: ``max |stored - hidden_states[k]|``; for the last slot
    (id N): ``max |final_norm(stored) - hidden_states[N]|`` (transformers' last entry is after the
    norm), and ``max |stored - hidden_states[N]|`` for contrast (large: the pre-norm state is not
    what ``hidden_states[N]`` holds). Differences are measured in float32 after storing the reference
    in the storage dtype (:func:`eagle3.contracts.hidden_states.as_stored`), so bfloat16 storage shows
    only rounding (fp8: the quantization of the reference, but the stored values came from unrounded
    layers and can land one fp8 step away).

    Args:
        params: the run's params (target). run_dir: the run directory.
        model: an already loaded target (default: loaded here on ``target.device``).

    Returns:
        tuple: (rows ``{"layer_id", "slot", "compared_with", "max_abs_diff", "ref_scale", "relative"}``
        with ``relative = max_abs_diff / ref_scale`` (``ref_scale`` = max |reference|), figure of
        every layer's mean norm with the stored slots overlaid).
    """
    from eagle3.hooks import decoder_layers
    from eagle3.target import load_target

    ds = hsc.HiddenStatesDataset(_sd(run_dir))
    if model is None:
        model, _, _ = load_target(params.target)
    dec, _ = decoder_layers(model)
    stored = ds.meta["stored_layers"]
    n = ds.meta["num_hidden_layers"]
    worst: dict[tuple, list] = {}
    all_norms = np.zeros(n + 1)
    stored_norms = np.zeros(len(stored))
    count = 0
    for i in range(min(n_samples, len(ds))):
        item = ds[i]
        hsl = _compare_sample(model, dec.norm, item, stored, n, getattr(torch, ds.meta["dtype"]), worst)
        got = item["hidden_states"].float()
        all_norms += np.array([float(h[0].float().norm(dim=-1).sum()) for h in hsl])
        stored_norms += got.norm(dim=-1).sum(0).numpy()
        count += got.shape[0]
    rows = [{"layer_id": k, "slot": s, "compared_with": name, "max_abs_diff": v[0], "ref_scale": v[1],
             "relative": v[0] / v[1] if v[1] else 0.0} for (k, s, name), v in worst.items()]
    return rows, _fig_convention(all_norms / max(count, 1), stored, stored_norms / max(count, 1),
                                 min(n_samples, len(ds)))


def _compare_sample(model, final_norm, item: dict, stored: list[int], n: int, dtype: torch.dtype,
                    worst: dict[tuple, list]) -> tuple:
    """One stored sample against transformers' ``hidden_states`` (``[max |diff|, max |ref|]`` per
    (layer id, slot, comparison) updated in ``worst``); returns transformers' ``hidden_states``."""
    dev = next(model.parameters()).device
    out = model(input_ids=item["token_ids"][None].to(dev), output_hidden_states=True, use_cache=False)
    hsl = out.hidden_states
    got = item["hidden_states"].float()
    for s, k in enumerate(stored):
        if k < n:
            ref = hsc.as_stored(hsl[k][0], dtype).cpu()
            pairs = [(f"hidden_states[{k}]", got[:, s], ref)]
        else:
            ref = hsc.as_stored(hsl[n][0], dtype).cpu()
            normed = hsc.as_stored(final_norm(got[:, s].to(dev, next(model.parameters()).dtype)), dtype).cpu()
            pairs = [("final_norm(slot) vs hidden_states[N]", normed, ref),
                     ("slot vs hidden_states[N] (contrast)", got[:, s], ref)]
        for name, a, b in pairs:
            d = float((a - b).abs().max())
            w = worst.setdefault((k, s, name), [0.0, 0.0])
            w[0] = max(w[0], d)
            w[1] = max(w[1], float(b.abs().max()))
    return hsl


def _fig_convention(all_norms: np.ndarray, stored: list[int], stored_norms: np.ndarray, n_samples: int):
    """Every layer's mean norm per token (transformers) with the stored slots' on top."""
    fig = Figure(figsize=(7, 3.4))
    ax = fig.subplots()
    ax.plot(range(len(all_norms)), all_norms, marker=".", color="0.5",
            label="transformers hidden_states[k] (k = N is after the final norm)")
    ax.scatter(stored, stored_norms, s=60, facecolors="none", edgecolors="C3", lw=2,
               label="stored slots (id N before the final norm)", zorder=3)
    ax.set(xlabel="layer id k", ylabel="mean ||h|| per token", yscale="log",
           title=f"per-layer hidden-state norm ({n_samples} samples)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
