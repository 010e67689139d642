"""The run's shared report: ``report/index.html`` with each stage's key numbers and figures."""

from __future__ import annotations

import html
import json
from pathlib import Path

from eagle3.io import STAGES, read_json

__all__ = ["index_html", "key_numbers"]

# The stats keys shown on the index page, per stage (missing keys are skipped).
KEY_NUMBERS: dict[str, list[str]] = {
    "01_synthesize": ["samples", "heldout_samples", "turns", "completion_tokens", "reasoning_capture_rate", "finish_reasons", "tokens_per_s", "elapsed_s"],
    "02_vocab": ["samples", "masked_tokens", "distinct_tokens", "draft_vocab_size", "coverage", "heldout_oov_rate", "truncated_samples", "elapsed_s"],
    "03_extract": ["samples", "tokens", "bytes", "bytes_per_token", "tokens_per_s", "aux_layer_ids", "elapsed_s"],
    "04_train": ["steps", "best_step", "best_val_tau_hat", "final_loss", "tokens_per_s", "drafter_dir", "elapsed_s"],
    "05_evaluate": ["tau_offline", "tau_vllm", "tokens_per_forward_vllm", "tau_ngram", "tokens_per_forward_ngram", "parity_ok", "vllm_serve_command"],
}


def key_numbers(run_dir: str | Path) -> dict[str, dict]:
    """stage folder -> {key: value} from each ``stats.json`` (all keys when none is listed)."""
    out = {}
    for _, name in STAGES.items():
        st = read_json(Path(run_dir) / name / "stats.json", None)
        if not st:
            continue
        keys = [k for k in KEY_NUMBERS.get(name, []) if k in st] or [k for k in st if k != "complete"]
        out[name] = {k: st[k] for k in keys}
    return out


def _fmt(v) -> str:
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
            parts.append("<p><em>not run</em></p>")
        for fig in figures.get(name, []):
            parts.append(f"<img src='{html.escape(fig)}' alt='{html.escape(Path(fig).stem)}'>")
    parts.append("</body></html>")
    return "\n".join(parts)
