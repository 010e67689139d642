"""The comparison page's tables (pandas DataFrames), one column per run, from :class:`RunView` s.

A cell shows ``—`` where the run has not measured it (a stage not finished, a set or method it did
not run); numbers keep the decimals of the stage pages (τ and tokens per forward 3, tokens/s 1).
"""

from __future__ import annotations

from typing import Any

from eagle3.compare.runs import RunView
from eagle3.evaluate.methods import VLLM_EAGLE3, VLLM_NGRAM, VLLM_NONE

__all__ = ["NOT_MEASURED", "EVAL_METHODS", "runs_table", "params_table", "data_table", "eval_sets",
           "set_coverage", "set_table", "category_table", "position_table", "parity_table", "warnings_table"]

NOT_MEASURED = "—"
# the measurements the page puts side by side: the drafter, its baseline and no speculation (vLLM)
EVAL_METHODS = (VLLM_EAGLE3, VLLM_NGRAM, VLLM_NONE)
_SHORT = {VLLM_EAGLE3: "drafter", VLLM_NGRAM: "n-gram", VLLM_NONE: "no speculation"}
# (metric in the stats grid, column label, decimals)
_SET_METRICS = (("tau", "τ", 3), ("tokens_per_forward", "tokens per forward", 3),
                ("tokens_per_s", "tokens/s", 1), ("speedup", "speed-up", 2))


def _num(v: Any, decimals: int = 3) -> str:
    if v is None:
        return NOT_MEASURED
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    return f"{v:,}" if isinstance(v, int) else f"{v:.{decimals}f}"


def _frame(rows: dict[Any, dict[str, Any]], runs: list[RunView], index_names: list[str] | None = None):
    """``{row key: {run label: cell}}`` -> a DataFrame with a column per run, in run order."""
    import pandas as pd

    labels = [r.label for r in runs]
    df = pd.DataFrame([[row.get(lab, NOT_MEASURED) for lab in labels] for row in rows.values()],
                      index=pd.MultiIndex.from_tuples(list(rows)) if rows and isinstance(next(iter(rows)), tuple)
                      else list(rows), columns=labels)
    if index_names and len(df.index.names) == len(index_names):
        df.index.names = index_names
    return df


def runs_table(runs: list[RunView]):
    """One row per run: its folder, the stages it has finished, what could not be read."""
    import pandas as pd

    return pd.DataFrame([{"run": r.label, "folder": str(r.run_dir), "stages finished": r.stages_done,
                          "problems": "; ".join(r.problems) or ""} for r in runs])


def _shown(v: Any) -> str:
    import json

    if isinstance(v, (dict, list)):
        return json.dumps(v)
    return str(v)


def params_table(runs: list[RunView]):
    """The params on which the runs do not all agree, a row per dotted key (``train.lr``), the value of
    each run (:func:`eagle3.params_file.differing_values`: what changes results; the run's name,
    folder and tracking are not compared). Empty when the runs' params agree."""
    from eagle3.params_file import differing_values

    diff = differing_values([r.params for r in runs]) if len(runs) > 1 else {}
    return _frame({k: {r.label: _shown(v) for r, v in zip(runs, vals)} for k, vals in diff.items()}, runs,
                  ["key"])


def _counts(d: dict | None) -> str:
    """``{"human-eval": 18, "mt": 4}`` -> ``human-eval 18, mt 4``."""
    return ", ".join(f"{k} {v:,}" for k, v in (d or {}).items()) or NOT_MEASURED


def data_table(runs: list[RunView]):
    """What each run's drafter trained on (stage 1's train split; the held-out split is evaluated, not
    trained on) and how long (stage 4): conversations, their completion tokens, sources and
    categories (conversations each), held-out conversations, training steps, tokens seen, epochs."""
    rows: dict[str, dict[str, str]] = {}
    for r in runs:
        d, t = r.data, r.train
        cells = {"training conversations": _num(d.get("conversations")),
                 "completion tokens (training conversations)": _num(d.get("completion_tokens")),
                 "sources (conversations)": _counts(d.get("sources")) if d else NOT_MEASURED,
                 "categories (conversations)": _counts(d.get("categories")) if d else NOT_MEASURED,
                 "held-out conversations": _num(d.get("heldout")),
                 "training steps": _num(t.get("total_steps")),
                 "tokens seen in training": _num(t.get("tokens_seen")),
                 "epochs (train.epochs)": _num(r.params.train.epochs),
                 "best validation τ̂": _num(t.get("best_val_tau_hat"))}
        for k, v in cells.items():
            rows.setdefault(k, {})[r.label] = v
    return _frame(rows, runs)


def eval_sets(runs: list[RunView]) -> list[str]:
    """Every evaluation set any run measured, in the order the runs name them (out-of-domain first)."""
    return list(dict.fromkeys(s for r in runs if r.stats for s in r.stats.sets))


def set_coverage(runs: list[RunView]) -> list[str]:
    """A sentence per evaluation set that only some of the runs measured (and per run without stage 5):
    the tables show such a set with ``—`` for the others, and say so here."""
    out = []
    with_eval = [r for r in runs if r.stats]
    for r in runs:
        if not r.stats:
            out.append(f"{r.label} has no evaluation (stage 5 {'unreadable' if r.complete[5] else 'not finished'}): "
                       f"its columns are empty")
    for s in eval_sets(runs):
        have = [r.label for r in with_eval if s in r.stats.sets]
        if len(have) < len(with_eval):
            lack = [r.label for r in with_eval if s not in r.stats.sets]
            out.append(f"set {s} is measured by {', '.join(have)} only, not by {', '.join(lack)}")
    return out


def set_table(runs: list[RunView]):
    """Per evaluation set and measurement (the drafter, n-gram lookup and no speculation in vLLM): τ,
    tokens per target forward, tokens/s (one request at a time, a few prompts) and the speed-up over
    no speculation, a column per (metric, run)."""
    import pandas as pd

    rows = {}
    for s in eval_sets(runs):
        for m in EVAL_METHODS:
            row = {}
            for metric, label, dec in _SET_METRICS:
                for r in runs:
                    st = r.stats.sets.get(s) if r.stats else None
                    row[(label, r.label)] = _num(st.get(m, metric), dec) if st is not None else NOT_MEASURED
            rows[(s, _SHORT[m])] = row
    cols = pd.MultiIndex.from_tuples([(label, r.label) for _, label, _ in _SET_METRICS for r in runs])
    return pd.DataFrame(list(rows.values()), index=pd.MultiIndex.from_tuples(list(rows), names=["set", "method"]),
                        columns=cols) if rows else pd.DataFrame()


def _result_sets(r: RunView) -> dict:
    return (r.results or {}).get("sets") or {}


def category_table(runs: list[RunView]):
    """Per set and category: tokens per target forward of the drafter and of n-gram lookup (vLLM), a
    column per (measurement, run); the category's prompts in brackets after the drafter's."""
    import pandas as pd

    order = eval_sets(runs)  # the set table's order: out-of-domain first
    keys = list(dict.fromkeys((s, c) for r in runs for s, e in _result_sets(r).items() for c in e.get("by_category", {})))
    keys.sort(key=lambda k: order.index(k[0]) if k[0] in order else len(order))
    cols = [(f"{_SHORT[m]} tokens per forward", r.label) for m in (VLLM_EAGLE3, VLLM_NGRAM) for r in runs]
    rows = []
    for s, c in keys:
        row = []
        for m in (VLLM_EAGLE3, VLLM_NGRAM):
            for r in runs:
                e = _result_sets(r).get(s) or {}
                cell = ((e.get("by_category") or {}).get(c) or {}).get(m) or {}
                n = (e.get("info") or {}).get("by_category", {}).get(c)
                v = _num(cell.get("tokens_per_forward"))
                row.append(f"{v} ({n} prompt{'s' * (n != 1)})" if m == VLLM_EAGLE3 and n and v != NOT_MEASURED else v)
        rows.append(row)
    if not rows:
        return pd.DataFrame()
    return pd.DataFrame(rows, index=pd.MultiIndex.from_tuples(keys, names=["set", "category"]),
                        columns=pd.MultiIndex.from_tuples(cols))


def position_table(runs: list[RunView]):
    """Per set and measurement with drafts (the drafter, n-gram lookup): the conditional acceptance of
    each draft position, P(position i accepted | 1..i-1 accepted), a column per (position, run)."""
    import pandas as pd

    k = max([len(((e.get("methods") or {}).get(m) or {}).get("per_position_conditional") or [])
             for r in runs for e in _result_sets(r).values() for m in (VLLM_EAGLE3, VLLM_NGRAM)] + [0])
    rows = {}
    for s in eval_sets(runs):
        for m in (VLLM_EAGLE3, VLLM_NGRAM):
            row = {}
            for r in runs:
                pos = (((_result_sets(r).get(s) or {}).get("methods") or {}).get(m) or {}).get("per_position_conditional")
                for i in range(k):
                    row[(f"position {i + 1}", r.label)] = _num(pos[i]) if pos and i < len(pos) else NOT_MEASURED
            rows[(s, _SHORT[m])] = row
    if not rows or not k:
        return pd.DataFrame()
    cols = pd.MultiIndex.from_tuples([(f"position {i + 1}", r.label) for i in range(k) for r in runs])
    return pd.DataFrame(list(rows.values()), index=pd.MultiIndex.from_tuples(list(rows), names=["set", "method"]),
                        columns=cols)


def parity_table(runs: list[RunView]):
    """Per run: the drafter's offline τ (transformers) against its vLLM τ on the same prompts, the
    relative gap, the tolerance and the verdict."""
    rows: dict[str, dict[str, str]] = {}
    for r in runs:
        p = r.stats.parity if r.stats else None
        verdict = NOT_MEASURED if p is None else ("not checked" if p.ok is None else ("agrees" if p.ok else "DISAGREES"))
        cells = {"offline τ": _num(p.tau_offline if p else None), "vLLM τ (same prompts)": _num(p.tau_vllm if p else None),
                 "relative gap": _num(p.gap if p else None), "tolerance": _num(p.tolerance if p else None),
                 "prompts": _num(p.prompts if p else None), "parity": verdict}
        for k, v in cells.items():
            rows.setdefault(k, {})[r.label] = v
    return _frame(rows, runs)


def warnings_table(runs: list[RunView]):
    """Each run's mismatch warnings (stage 5): run, rule, warning; a run without any says so."""
    import pandas as pd

    rows = []
    for r in runs:
        ws = [w for w in (r.stats.warnings if r.stats else []) if isinstance(w, dict)]
        if not r.stats:
            rows.append({"run": r.label, "rule": NOT_MEASURED, "warning": "no evaluation"})
        elif not ws:
            rows.append({"run": r.label, "rule": "", "warning": "no mismatch warning"})
        rows += [{"run": r.label, "rule": w.get("rule", ""), "warning": w.get("message", "")} for w in ws]
    return pd.DataFrame(rows, columns=["run", "rule", "warning"])

