"""Stage 1's figures (on ``matplotlib.figure.Figure``, never pyplot state) and notebook tables."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from matplotlib.figure import Figure

from eagle3.contracts.samples import read_samples
from eagle3.synthesize.summary import read_timeline, throughput_series, timeline_path

__all__ = ["make_figures", "saved_figures", "summary_table", "preview_rows", "FIGURES"]

FIGURES = ("completion_lengths", "finish_reasons", "throughput", "reasoning_share")


def make_figures(run_dir: str | Path) -> dict:
    """Matplotlib figures of a stage-1 output (no pyplot state): ``completion_lengths`` (histogram of
    completion tokens per assistant turn, ``max_new_tokens`` marked), ``finish_reasons`` (bar),
    ``throughput`` (cumulative completion tokens and tokens/s over wall-clock time, from
    ``throughput.jsonl`` via :func:`throughput_series`) and, when any turn has reasoning, ``reasoning_share`` (histogram of the
    reasoning share of characters per turn)."""
    samples = read_samples(run_dir)
    return {**_length_and_finish_figures(samples), "throughput": _throughput_figure(read_timeline(timeline_path(run_dir))),
            **_reasoning_figure(samples)}


def _length_and_finish_figures(samples: list[dict]) -> dict:
    figs: dict = {}
    per_turn = [u["completion_tokens"] for s in samples for u in s.get("turn_usage", [])]
    max_new = samples[0]["settings"].get("max_new_tokens") if samples else None

    fig = Figure(figsize=(6, 3.2))
    ax = fig.subplots()
    hi = max([max_new or 0, *per_turn]) + 1
    ax.hist(per_turn, bins=min(40, hi), range=(0, hi), color="#4c72b0")
    if max_new:
        ax.axvline(max_new, color="#c44e52", ls="--", label=f"max_new_tokens={max_new}")
        ax.legend()
    ax.set_xlabel("completion tokens per assistant turn")
    ax.set_ylabel("turns")
    ax.set_title(f"Completion length ({len(per_turn)} turns)")
    figs["completion_lengths"] = fig

    fr = Counter(r for s in samples for r in s["finish_reasons"])
    fig = Figure(figsize=(4.5, 3.2))
    ax = fig.subplots()
    names = sorted(fr)
    ax.bar(names, [fr[n] for n in names], color=["#55a868" if n == "stop" else "#c44e52" for n in names])
    ax.set_ylabel("assistant turns")
    ax.set_title("Finish reasons")
    figs["finish_reasons"] = fig
    return figs


def _throughput_figure(tl: list[dict]) -> Figure:
    # constrained layout: the right panel's y label clears the left panel's tick labels
    fig = Figure(figsize=(7, 3.2), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    writes = sorted((r for r in tl if "completion_tokens" in r), key=lambda r: r["t"])
    if writes:
        t0 = min(r["t"] for r in tl)
        cum, acc = [], 0
        for r in writes:
            acc += r["completion_tokens"]
            cum.append(acc)
        ax1.plot([(r["t"] - t0) / 60 for r in writes], cum, color="#4c72b0", drawstyle="steps-post")
        for t_end, rate in throughput_series(tl):
            ax2.plot([(t_end[0] - t0) / 60, (t_end[1] - t0) / 60], [rate, rate], color="#dd8452", lw=2)
    ax1.set_xlabel("minutes")
    ax1.set_ylabel("completion tokens (cumulative)")
    ax2.set_xlabel("minutes")
    ax2.set_ylabel("tokens/s")
    fig.suptitle("Throughput over time")
    return fig


def _reasoning_figure(samples: list[dict]) -> dict:
    figs: dict = {}
    shares = []
    for s in samples:
        for m in s["messages"]:
            if m["role"] == "assistant":
                r, c = len(m.get("reasoning") or ""), len(m["content"])
                shares.append(r / (r + c) if r + c else 0.0)
    if any(shares):
        fig = Figure(figsize=(6, 3.2))
        ax = fig.subplots()
        ax.hist(shares, bins=20, range=(0, 1), color="#8172b2")
        ax.set_xlabel("reasoning share of the turn (characters)")
        ax.set_ylabel("assistant turns")
        ax.set_title(f"Reasoning share ({sum(x > 0 for x in shares)}/{len(shares)} turns with reasoning)")
        figs["reasoning_share"] = fig
    return figs


def saved_figures(run_dir: str | Path) -> list[Path]:
    """The PNG files of :data:`FIGURES` that ``run`` saved in the stage folder (those that exist)."""
    from eagle3.rundir import SYNTHESIZE, RunDir

    d = RunDir(run_dir).stage(SYNTHESIZE)
    return [d / f"{n}.png" for n in FIGURES if (d / f"{n}.png").exists()]


def summary_table(stats) -> dict:
    """The headline numbers of ``stats.json`` as a flat ``{metric: value}`` dict (for notebooks);
    ``stats`` is a :class:`~eagle3.synthesize.stage.SynthesizeStats` or the ``stats.json`` dict."""
    if not isinstance(stats, dict):
        stats = stats.to_dict()
    keys = ["samples", "samples_train", "samples_heldout", "turns", "prompt_tokens", "completion_tokens",
            "completion_tokens_mean", "completion_tokens_p90", "length_fraction", "reasoning_capture_rate",
            "tokens_per_s", "elapsed_s", "generated_this_session", "backend"]
    out = {k: stats.get(k) for k in keys}
    out["finish_reasons"] = json.dumps(stats.get("finish_reasons", {}))
    out["bad_input"] = json.dumps({k: v for k, v in stats.get("bad_input", {}).items() if v})
    out["errors"] = json.dumps(stats.get("errors", {}))
    return out


def preview_rows(samples: list[dict], n: int = 8, width: int = 120) -> list[dict]:
    """The first ``n`` samples as flat rows (id, split, turns, finish reasons, tokens, the last
    prompt and answer cut to ``width`` characters) for a notebook table."""
    rows = []
    for s in samples[:n]:
        last_user = next((m["content"] for m in reversed(s["messages"]) if m["role"] == "user"), "")
        answer = s["messages"][-1]
        rows.append({"id": s["id"], "split": s["split"], "turns": len(s["finish_reasons"]),
                     "finish": ",".join(s["finish_reasons"]), "completion_tokens": s["completion_tokens"],
                     "prompt": last_user[:width], "answer": answer["content"][:width],
                     "reasoning": (answer.get("reasoning") or "")[:width]})
    return rows

