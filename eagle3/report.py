"""The run's shared report: ``report/index.html`` with each stage's headline numbers and figures."""

from __future__ import annotations

import html
import json
from pathlib import Path

from eagle3.io import read_json
from eagle3.rundir import STAGES
from eagle3.stage import Stats

__all__ = ["MISSING", "headline_keys", "stats_classes", "index_html", "key_numbers"]

# Headline keys of the stages whose Stats class has not landed yet (their stats.json keys today).
_HEADLINE_FALLBACK: dict[int, tuple[str, ...]] = {
    1: ("samples", "samples_train", "samples_heldout", "turns", "completion_tokens", "completion_tokens_mean",
        "length_fraction", "reasoning_capture_rate", "failed", "tokens_per_s", "elapsed_s"),
    2: ("target_vocab_size", "draft_vocab_size", "distinct_tokens", "masked_tokens", "coverage", "heldout_oov_rate",
        "train_rows", "train_tokens", "train_truncated_rows", "heldout_rows", "cache_hit"),
    4: ("best_step", "best_val_tau_hat", "final_step", "final_val_tau_hat", "final_train_loss", "total_steps",
        "tokens_seen", "tokens_per_s", "train_time_s", "drafter_dir"),
}


def stats_classes() -> dict[int, type[Stats]]:
    """Stage number -> its :class:`eagle3.stage.Stats` subclass (field names = ``stats.json`` keys)."""
    # Imported here: the stage packages pull in torch, which `eagle3 status` does not need.
    from eagle3.evaluate.stage import EvaluateStats
    from eagle3.extract.finalize import ExtractStats

    return {3: ExtractStats, 5: EvaluateStats}


def headline_keys() -> dict[int, tuple[str, ...]]:
    """Stage number -> the keys the index shows for it, in order (each stage's ``Stats.HEADLINE``)."""
    classes = stats_classes()
    return {s: (classes[s].HEADLINE if s in classes else _HEADLINE_FALLBACK[s]) for s in STAGES}


MISSING = "(missing from stats.json)"


def key_numbers(run_dir: str | Path) -> dict[str, dict]:
    """stage folder -> {headline key: value} of each stage that has a ``stats.json``.

    A headline key the file lacks is shown as ``MISSING`` rather than skipped, so that a stage whose
    keys drifted is visible on the index page.
    """
    out = {}
    keys = headline_keys()
    for s, name in STAGES.items():
        st = read_json(Path(run_dir) / name / "stats.json", None)
        if not st:
            continue
        out[name] = {k: st.get(k, MISSING) for k in keys[s]}
    return out


def _unfinished(run_dir: Path, stage: int) -> str:
    """What the index says for a stage without ``stats.json``: not run, or how far it got."""
    prog = read_json(Path(run_dir) / STAGES[stage] / "progress.json", None)
    if not prog:
        return "not run"
    total = prog.get("total")
    done = f"{prog.get('done', 0)}/{total}" if total is not None else str(prog.get("done", 0))
    return f"not finished: {prog.get('status', 'unknown')} at {done} {prog.get('unit', '')}".rstrip()


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v)
    return str(v)


def index_html(run_dir: str | Path, pages: list[str], figures: dict[str, list[str]]) -> str:
    """HTML text of the index page: per stage a table of key numbers, its figures, its notebook."""
    run_dir = Path(run_dir)
    nums = key_numbers(run_dir)
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>eagle3 report: {html.escape(run_dir.name)}</title>",
        "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto;}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}"
        "img{max-width:520px;margin:4px;border:1px solid #eee}code{background:#f4f4f4}</style>",
        "</head><body>",
        f"<h1>eagle3 report: {html.escape(run_dir.name)}</h1>",
        f"<p>Run directory: <code>{html.escape(str(run_dir.resolve()))}</code></p>",
    ]
    for s, name in STAGES.items():
        page = next((p for p in pages if p.startswith(f"{s:02d}_")), None)
        parts.append(f"<h2>{s}. {html.escape(name[3:])}</h2>")
        if page:
            parts.append(f"<p>Executed notebook: <a href='{html.escape(page)}'>{html.escape(page)}</a></p>")
        if name in nums:
            rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(_fmt(v))}</td></tr>" for k, v in nums[name].items())
            parts.append(f"<table>{rows}</table>")
        else:
            parts.append(f"<p><em>{html.escape(_unfinished(run_dir, s))}</em></p>")
        for fig in figures.get(name, []):
            parts.append(f"<img src='{html.escape(fig)}' alt='{html.escape(Path(fig).stem)}'>")
    parts.append("</body></html>")
    return "\n".join(parts)
