"""Stage 5's tables and figures (notebook 05, the report and the PNGs beside ``results.json``).

Figures are ``matplotlib.figure.Figure`` objects built without pyplot: no global plotting state
changes (no backend switch, no figure registry), so a notebook displays them inline when a cell
returns one, and nothing has to be closed.
"""

from __future__ import annotations

from pathlib import Path

from eagle3.evaluate.methods import LABELS, METHODS, OFFLINE_EAGLE3, VLLM_EAGLE3, VLLM_NGRAM, VLLM_NONE, is_vllm
from eagle3.evaluate.prompts import out_of_domain_first
from eagle3.evaluate.stats import METRICS, SPEED_METRICS, EvaluateStats, grid
from eagle3.io import read_json
from eagle3.rundir import RunDir

__all__ = ["read_results", "comparison_table", "pooled_table", "parity_table", "set_table", "category_table",
           "warnings_table", "formatted", "MISSING_CELL", "figures"]

_SIZE = (6.5, 3.6)  # inches


def read_results(run_dir: str | Path) -> dict:
    """Stage 5's ``results.json`` of a run (settings, prompts, backends, parity, diagnosis).

    Raises:
        FileNotFoundError: stage 5 has not written it yet.
    """
    path = RunDir(run_dir).evaluate_results
    res = read_json(path, None)
    if res is None:
        raise FileNotFoundError(f"{path}: not found; run stage 5 (evaluate) first")
    return res


def _frame(rows: list[dict], counts: tuple[str, ...] = (), columns: list[str] | None = None):
    """A DataFrame whose count columns are pandas' nullable ``Int64``: a count missing in some row
    (None) would otherwise turn the whole column into float64, printed as ``939.000000``."""
    import pandas as pd

    df = pd.DataFrame(rows, columns=columns)
    return df.astype({c: "Int64" for c in counts if c in df.columns})


MISSING_CELL = "—"  # a number not measured (a method not run, no speed pass), in every shown table

# decimals of a float column by its name (the rest: 3); a speed-up is written with its "x"
_DECIMALS = {"tokens_per_s": 1, "speedup": 2, "draft_acceptance_rate": 3}


def _cell(value, column: str) -> str:
    """One table cell as shown: a count with thousands separators, a rate with fixed decimals
    (:data:`_DECIMALS`), a speed-up as ``1.23x``, :data:`MISSING_CELL` for None / NaN / ``<NA>``."""
    import math

    if value is None or (isinstance(value, float) and math.isnan(value)) or str(value) == "<NA>":
        return MISSING_CELL
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        return str(value)
    if float(value).is_integer() and not isinstance(value, float):
        return f"{int(value):,}"
    text = f"{float(value):.{_DECIMALS.get(column, 3)}f}"
    return text + "x" if column == "speedup" else text


def formatted(df):
    """``df`` with every cell as text for display (:func:`_cell`): rates with fixed decimals, counts
    as integers, a missing number as "—" (pandas shows ``NaN`` / ``<NA>`` and six decimals).

    Args:
        df: a table of this module (pandas DataFrame).

    Returns:
        pandas.DataFrame: the same rows and columns, each cell a string.
    """
    out = df.astype(object).copy()
    for col in out.columns:
        out[col] = [_cell(v, str(col)) for v in df[col].tolist()]
    return out


def comparison_table(results: dict):
    """Drafter vs n-gram vs no speculation (and offline): τ, tokens/forward, tokens/s (pandas DataFrame)."""
    rows = []
    for name, b in results["backends"].items():
        rows.append({"method": LABELS.get(name, name), "backend": b["backend"], "k": b.get("k"),
                     "tau": b.get("tau"), "tokens_per_forward": b.get("tokens_per_forward"),
                     "draft_acceptance_rate": b.get("draft_acceptance_rate"), "rounds": b.get("rounds"),
                     "tokens_per_s": b.get("tokens_per_s") if b["backend"] == "vllm" else None,
                     "speed_steady": b.get("speed_steady") if b["backend"] == "vllm" else None})
    return _frame(rows, counts=("k", "rounds"))


def pooled_table(stats: EvaluateStats):
    """Every set pooled, from ``stats.json``: a row per measurement, a column per metric (stats.json's
    acceptance metrics, vLLM's speed pass with its per-round rates, spread and ``speed_steady`` flag, the
    speed-up over no speculation and ``speedup_steady``: False where the timing rounds disagree) (pandas
    DataFrame)."""
    cols = [*METRICS, *SPEED_METRICS, "speedup", "speedup_steady"]
    rows = [{"method": LABELS.get(m, m), **{c: cell.get(c) for c in cols}} for m, cell in stats.pooled.methods.items()]
    return _frame(rows, counts=("prompts",), columns=["method", *cols])


def _ordered_sets(results: dict) -> list[tuple[str, dict]]:
    """results.json ``sets``, out-of-domain sets first (the question the report answers first)."""
    return sorted((results.get("sets") or {}).items(), key=lambda kv: out_of_domain_first(kv[1]["domain"]))


def set_table(results: dict):
    """Per evaluation set (out-of-domain first) and method: τ, tokens per target forward,
    conditional per-position acceptance, tokens/s (the median of the timing rounds), its spread over
    the rounds and ``speed_steady`` (False: the rounds disagree, a disturbed timing), the speed-up
    (same-round ratios, :func:`eagle3.evaluate.metrics.paired_speedup`), prompts (of the acceptance
    numbers) and speed_prompts (of tokens/s: far fewer, one request at a time) (pandas DataFrame)."""
    rows = []
    k = results["settings"]["k"]
    for name, e in _ordered_sets(results):
        speedups = grid(e["methods"])
        for m in METHODS:
            met = e["methods"].get(m)
            if met is None:
                continue
            pos = met.get("per_position_conditional") or [None] * k
            rows.append({"set": name, "domain": e["domain"], "method": LABELS.get(m, m), "tau": met.get("tau"),
                         "tokens_per_forward": met.get("tokens_per_forward"),
                         **{f"P(pos {i + 1})": pos[i] for i in range(k)},
                         "tokens_per_s": met.get("tokens_per_s"), "speed_spread": met.get("speed_spread"),
                         "speed_steady": met.get("speed_steady"), "speedup": speedups[m].get("speedup"),
                         "prompts": met.get("prompts", e["info"]["count"]), "speed_prompts": met.get("speed_prompts")})
    return _frame(rows, counts=("prompts", "speed_prompts"))


def category_table(results: dict, methods: tuple[str, ...] = (VLLM_EAGLE3, VLLM_NGRAM, OFFLINE_EAGLE3)):
    """Per set and category: τ and tokens per target forward of each method side by side (DataFrame)."""
    short = {VLLM_EAGLE3: "drafter", VLLM_NGRAM: "ngram", OFFLINE_EAGLE3: "offline"}
    rows = []
    for name, e in _ordered_sets(results):
        for cat, by_m in e.get("by_category", {}).items():
            row = {"set": name, "category": cat, "prompts": e["info"]["by_category"].get(cat)}
            for m in methods:
                if m in by_m:
                    row[f"tau_{short[m]}"] = by_m[m].get("tau")
                    row[f"tokens_per_forward_{short[m]}"] = by_m[m].get("tokens_per_forward")
            rows.append(row)
    return _frame(rows, counts=("prompts",))


def warnings_table(results: dict):
    """The mismatch warnings: rule, message, suggested fix (DataFrame; empty when none applies)."""
    return _frame([{"rule": w["rule"], "warning": w["message"], "fix": w["fix"]}
                   for w in results.get("warnings") or []], columns=["rule", "warning", "fix"])


def parity_table(results: dict):
    """Offline vs vLLM side by side: τ, acceptance rate and per-position conditional rates (DataFrame).

    Its columns hold rates and counts together, so they keep dtype ``object``: a count prints as
    ``939``, not as the ``939.000000`` of a float64 column."""
    import pandas as pd

    off = results["backends"].get(OFFLINE_EAGLE3) or {}
    vl = results["backends"].get(VLLM_EAGLE3) or {}
    rows = [{"metric": key, "offline": off.get(key), "vllm": vl.get(key)}
            for key in ("tau", "tokens_per_forward", "draft_acceptance_rate", "rounds", "accepted_tokens")]
    k = results["settings"]["k"]
    for i in range(k):
        given = f" | 1..{i} accepted" if i else ""  # position 1 is conditioned on nothing
        rows.append({"metric": f"P(accept pos {i + 1}{given})",
                     "offline": (off.get("per_position_conditional") or [None] * k)[i],
                     "vllm": (vl.get("per_position_conditional") or [None] * k)[i]})
    return pd.DataFrame(rows, dtype=object)


def _axes():
    from matplotlib.figure import Figure

    fig = Figure(figsize=_SIZE)
    return fig, fig.add_subplot()


def _per_position(bk: dict, spec: list[str], k: int, temperature: float):
    import numpy as np

    fig, ax = _axes()
    w = 0.8 / max(len(spec), 1)
    for j, n in enumerate(spec):
        vals = [v if v is not None else 0 for v in (bk[n].get("per_position_conditional") or [0] * k)]
        ax.bar(np.arange(1, k + 1) + (j - (len(spec) - 1) / 2) * w, vals, w, label=LABELS[n])
    ax.set_xlabel("draft position i")
    ax.set_ylabel("P(accepted | 1..i-1 accepted)")
    ax.set_ylim(0, 1)
    ax.set_xticks(range(1, k + 1))
    ax.legend(fontsize=8)
    ax.set_title(f"Per-position acceptance (k={k}, T={temperature})")
    return fig


def _tau_histogram(bk: dict, spec: list[str], k: int):
    import numpy as np

    fig, ax = _axes()
    w = 0.8 / max(len(spec), 1)
    for j, n in enumerate(spec):
        h = np.array(bk[n].get("accepted_histogram") or [0] * (k + 1), dtype=float)
        if h.sum():
            ax.bar(np.arange(1, k + 2) + (j - (len(spec) - 1) / 2) * w, h / h.sum(), w, label=LABELS[n])
    ax.set_xlabel("tokens per round (accepted drafts + 1)")
    ax.set_ylabel("fraction of rounds")
    ax.legend(fontsize=8)
    ax.set_title("Acceptance length per round")
    return fig


def _tau_vs_context(bk: dict):
    fig, ax = _axes()
    for n in (OFFLINE_EAGLE3, VLLM_EAGLE3):
        bc = (bk.get(n) or {}).get("by_context") or {}
        if bc:
            ax.plot(list(bc), [m["tau"] for m in bc.values()], marker="o", label=LABELS[n])
    ax.set_xlabel("context length (tokens before the round)")
    ax.set_ylabel("tau")
    ax.legend(fontsize=8)
    ax.set_title("Acceptance length vs context length")
    return fig


def _speed(bk: dict, speed_prompts: int | None = None):
    """Tokens/s per vLLM method (the median of its timing rounds), the rounds' range as an error bar;
    a method whose rounds disagree (``speed_steady`` False) is hatched, marked and named in the title."""
    fig, ax = _axes()
    names = [n for n in METHODS if is_vllm(n) and n in bk]
    unsteady = [n for n in names if bk[n].get("speed_steady") is False]
    if names:
        mid = [bk[n].get("tokens_per_s") or 0 for n in names]
        rounds = [bk[n].get("tokens_per_s_rounds") or [m] for n, m in zip(names, mid)]
        bars = ax.bar([LABELS[n].replace(" in vLLM", "").replace(" (vLLM)", "") + (" (!)" if n in unsteady else "")
                       for n in names], mid,
                      yerr=[[m - min(r) for m, r in zip(mid, rounds)], [max(r) - m for m, r in zip(mid, rounds)]],
                      capsize=4)
        for bar, n in zip(bars, names):
            if n in unsteady:
                bar.set_hatch("//")
                bar.set_alpha(0.5)
    ax.set_ylabel("output tokens/s (vLLM, one request at a time)")
    # the speed rests on a few prompts of every set, pooled: say how many
    pooled = f", all sets pooled ({speed_prompts} prompt{'s' if speed_prompts != 1 else ''})" if speed_prompts else ""
    title = "Decoding speed" + pooled + "; bars: median of the rounds, whiskers: their range"
    if unsteady:
        title += "\n(!) rounds disagree, a disturbed timing: measure again (eagle3 run ... --remeasure-speed)"
    ax.set_title(title, fontsize=9)
    return fig


def _by_set(results: dict):
    """Tokens per target forward per set and method (grouped bars, out-of-domain sets first)."""
    import numpy as np

    fig, ax = _axes()
    sets = _ordered_sets(results)
    names = [m for m in METHODS if any(m in e["methods"] for _, e in sets)]
    w = 0.8 / max(len(names), 1)
    for j, m in enumerate(names):
        vals = [(e["methods"].get(m) or {}).get("tokens_per_forward") or 0 for _, e in sets]
        bars = ax.bar(np.arange(len(sets)) + (j - (len(names) - 1) / 2) * w, vals, w, label=LABELS[m])
        if m == OFFLINE_EAGLE3:  # offline decoding runs on evaluate.offline_prompts of each set: say how few
            counts = [(e["methods"].get(m) or {}).get("prompts") for _, e in sets]
            ax.bar_label(bars, labels=[f"{n} of {e['info']['count']} prompts" if n and n < e["info"]["count"] else ""
                                       for n, (_, e) in zip(counts, sets)], fontsize=7)
    ax.set_xticks(range(len(sets)))
    ax.set_xticklabels([f"{n}\n({e['domain']})" for n, e in sets], fontsize=8)
    ax.set_ylabel("tokens per target forward")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylim(0, max([b.get_height() for b in ax.patches] + [1.0]) * 1.35)  # room for the legend above the bars
    ax.legend(fontsize=8, ncol=2, loc="upper center")
    ax.set_title("Tokens per target forward by evaluation set")
    return fig


def _by_category(results: dict):
    """Tokens per target forward per category of every set: the drafter (vLLM, else offline) vs n-gram,
    one panel per set (not τ: n-gram's τ counts only the rounds where it had a proposal)."""
    import numpy as np
    from matplotlib.figure import Figure

    sets = [(n, e) for n, e in _ordered_sets(results) if e.get("by_category")]
    fig = Figure(figsize=(_SIZE[0], max(_SIZE[1], 2.6 * len(sets))))
    if not sets:
        fig.add_subplot().set_title("no per-category data")
        return fig
    axes = fig.subplots(len(sets), 1, squeeze=False)[:, 0]
    for ax, (name, e) in zip(axes, sets):
        cats = list(e["by_category"])
        shown = [m for m in (VLLM_EAGLE3, OFFLINE_EAGLE3, VLLM_NGRAM) if any(m in e["by_category"][c] for c in cats)]
        if VLLM_EAGLE3 in shown and OFFLINE_EAGLE3 in shown:
            shown.remove(OFFLINE_EAGLE3)
        w = 0.8 / max(len(shown), 1)
        for j, m in enumerate(shown):
            vals = [((e["by_category"][c].get(m) or {}).get("tokens_per_forward") or 0) for c in cats]
            ax.bar(np.arange(len(cats)) + (j - (len(shown) - 1) / 2) * w, vals, w, label=LABELS[m])
        ax.set_xticks(range(len(cats)))
        ax.set_xticklabels(cats, fontsize=7, rotation=30, ha="right")
        ax.set_ylabel("tokens per target forward", fontsize=8)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_ylim(0, max([b.get_height() for b in ax.patches] + [1.0]) * 1.35)  # room for the legend above the bars
        ax.set_title(f"{name} ({e['domain']}): tokens per target forward per category", fontsize=9)
        ax.legend(fontsize=7, ncol=len(shown), loc="upper center")
    fig.tight_layout()
    return fig


def figures(results: dict) -> dict:
    """The stage's figures from ``results.json``, as ``matplotlib.figure.Figure`` (no pyplot state).

    Returns:
        dict: ``per_position`` (conditional acceptance bars per draft position), ``tau_histogram``
        (share of rounds per accepted+1), ``tau_vs_context`` (τ by context-length bucket), ``speed``
        (vLLM output tokens/s per method), ``by_set`` (tokens per target forward per set and method)
        and ``by_category`` (τ per category, one panel per set) when results.json has ``sets``.
    """
    bk = results["backends"]
    k = results["settings"]["k"]
    spec = [n for n in (OFFLINE_EAGLE3, VLLM_EAGLE3, VLLM_NGRAM) if n in bk]
    return {
        "per_position": _per_position(bk, spec, k, results["settings"]["temperature"]),
        "tau_histogram": _tau_histogram(bk, spec, k),
        "tau_vs_context": _tau_vs_context(bk),
        "speed": _speed(bk, sum((e["methods"].get(VLLM_NONE) or e["methods"].get(VLLM_EAGLE3) or {})
                                .get("speed_prompts") or 0 for e in (results.get("sets") or {}).values()) or None),
    } | ({"by_set": _by_set(results), "by_category": _by_category(results)} if results.get("sets") else {})
