"""The run's shared report: ``report/index.html`` with each stage's headline numbers and figures."""

from __future__ import annotations

import html
import json
from pathlib import Path

from eagle3.io import read_json
from eagle3.rundir import STAGES
from eagle3.stage import Stats

__all__ = ["MISSING", "headline_keys", "stats_classes", "summary_html", "index_html", "key_numbers"]

def stats_classes() -> dict[int, type[Stats]]:
    """Stage number -> its :class:`eagle3.stage.Stats` subclass (field names = ``stats.json`` keys)."""
    # Imported here: the stage packages pull in torch, which `eagle3 status` does not need.
    from eagle3.evaluate.stage import EvaluateStats
    from eagle3.extract.finalize import ExtractStats
    from eagle3.synthesize.stage import SynthesizeStats
    from eagle3.train.stage import TrainStats
    from eagle3.vocab.stage import VocabStats

    return {1: SynthesizeStats, 2: VocabStats, 3: ExtractStats, 4: TrainStats, 5: EvaluateStats}


def headline_keys() -> dict[int, tuple[str, ...]]:
    """Stage number -> the keys the index shows for it, in order (each stage's ``Stats.HEADLINE``)."""
    classes = stats_classes()
    return {s: classes[s].HEADLINE for s in STAGES}


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


def _ratio(a, b) -> float | None:
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def summary_html(run_dir: str | Path) -> str:
    """The answer first: the drafter vs n-gram lookup vs no speculation in vLLM, from stage 5's stats.

    Tokens per target forward are the comparable acceptance number (a round without drafts counts
    as one token); τ counts accepted drafts per verification round, so n-gram's τ is higher than its
    tokens per forward whenever it often has nothing to propose. Empty when stage 5 has not finished.
    """
    st = read_json(Path(run_dir) / STAGES[5] / "stats.json", None)
    if not st:
        return ""
    none_tps = st.get("tokens_per_s_vllm_none")
    rows = [
        ("EAGLE-3 drafter", st.get("tokens_per_forward_vllm"), st.get("tau_vllm"), st.get("tokens_per_s_vllm_eagle3")),
        ("n-gram lookup", st.get("tokens_per_forward_ngram"), st.get("tau_ngram"), st.get("tokens_per_s_vllm_ngram")),
        ("no speculation", 1.0 if none_tps else None, None, none_tps),
    ]
    head = ("<tr><th>vLLM</th><th>tokens per target forward</th><th>τ (accepted per round)</th>"
            "<th>tokens/s</th><th>speed-up vs no speculation</th></tr>")
    body = "".join(
        f"<tr><th>{name}</th><td>{_fmt(tpf)}</td><td>{_fmt(tau)}</td><td>{_fmt(tps)}</td>"
        f"<td>{_fmt(_ratio(tps, none_tps))}</td></tr>" for name, tpf, tau, tps in rows)
    parts = ["<h2>Result</h2>", f"<table>{head}{body}</table>"]
    d, n = st.get("tokens_per_s_vllm_eagle3"), st.get("tokens_per_s_vllm_ngram")
    if isinstance(d, (int, float)) and isinstance(n, (int, float)):
        faster = "the drafter" if d > n else "n-gram lookup"
        parts.append(f"<p>In vLLM {faster} was faster ({_fmt(max(d, n))} vs {_fmt(min(d, n))} tokens/s).</p>")
    parity = st.get("parity_ok")
    parity_txt = ("not checked" if parity is None else ("agrees" if parity else "DISAGREES")) + (
        f" (relative gap {_fmt(st.get('parity_gap'))}, tolerance {_fmt(st.get('parity_tolerance'))})"
        if parity is not None else "")
    parts.append(f"<p>Offline τ {_fmt(st.get('tau_offline'))} vs vLLM τ {_fmt(st.get('tau_vllm'))}: parity "
                 f"{html.escape(parity_txt)}. Settings: k = {_fmt(st.get('k'))} draft tokens, temperature "
                 f"{_fmt(st.get('temperature'))}, {_fmt(st.get('num_prompts'))} held-out prompts.</p>")
    diag = [x for x in (st.get("diagnosis") or []) if x]
    if diag:
        items = "".join(f"<li>{html.escape(str(x))}</li>" for x in diag)
        parts.append(f"<p><strong>Warnings</strong></p><ul>{items}</ul>")
    return "\n".join(parts)


def index_html(run_dir: str | Path, pages: list[str], figures: dict[str, list[str]]) -> str:
    """HTML text of the index page: the result (:func:`summary_html`), then per stage a table of its
    headline numbers, its figures (full width, linked to the file) and its executed notebook."""
    run_dir = Path(run_dir)
    nums = key_numbers(run_dir)
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>eagle3 report: {html.escape(run_dir.name)}</title>",
        "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto;}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}"
        "img{max-width:100%;margin:4px 0;border:1px solid #eee}code{background:#f4f4f4}</style>",
        "</head><body>",
        f"<h1>eagle3 report: {html.escape(run_dir.name)}</h1>",
        f"<p>Run directory: <code>{html.escape(str(run_dir.resolve()))}</code></p>",
        summary_html(run_dir),
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
            f = html.escape(fig)
            parts.append(f"<a href='{f}'><img src='{f}' alt='{html.escape(Path(fig).stem)}'></a>")
    parts.append("</body></html>")
    return "\n".join(parts)
