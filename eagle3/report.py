"""The run's shared report: ``report/index.html`` with each stage's headline numbers and figures."""

from __future__ import annotations

import base64
import dataclasses
import html
import json
from collections import Counter
from pathlib import Path

from eagle3.evaluate.methods import VLLM_EAGLE3, VLLM_NGRAM, VLLM_NONE
from eagle3.evaluate.mismatch import REMEASURE_SPEED, RULE_TEXT, RULES
from eagle3.evaluate.prompts import left_out_reasons, out_of_domain_first
from eagle3.evaluate.stats import (
    SPEEDUP_SLACK,
    EvaluateStats,
    PooledStats,
    SetStats,
    read_stats,
    speedup_bound,
    value_at,
)
from eagle3.io import read_json
from eagle3.rundir import STAGES
from eagle3.stage import Stats, stage_record

__all__ = ["MISSING", "headline_keys", "stats_classes", "summary_html", "summary_text", "index_html", "key_numbers",
           "SingleFile"]

def stats_classes() -> dict[int, type[Stats]]:
    """Stage number -> its :class:`eagle3.stage.Stats` subclass (field names = ``stats.json`` keys)."""
    # Imported here: the stage packages pull in torch, which `eagle3 status` does not need.
    from eagle3.extract.finalize import ExtractStats
    from eagle3.synthesize.stage import SynthesizeStats
    from eagle3.train.stage import TrainStats
    from eagle3.vocab.stage import VocabStats

    return {1: SynthesizeStats, 2: VocabStats, 3: ExtractStats, 4: TrainStats, 5: EvaluateStats}


def headline_keys() -> dict[int, tuple[str, ...]]:
    """Stage number -> the keys the index shows for it, in order (each stage's ``Stats.HEADLINE``; a
    dot-joined path into nested parts, as stage 5's ``pooled.methods.vllm/eagle3.tau``)."""
    classes = stats_classes()
    return {s: classes[s].HEADLINE for s in STAGES}


MISSING = "(missing from stats.json)"


def key_numbers(run_dir: str | Path) -> dict[str, dict]:
    """stage folder -> {headline key: value} of each stage that has a ``stats.json``.

    A headline key the file lacks is shown as ``MISSING`` rather than skipped, so that a stage whose
    keys drifted is visible on the index page; a path whose first key is there but not the rest is a
    cell of stage 5's grid that was not measured (no n-gram run): None. A path into a stage folder is
    shown from that folder on (:func:`_from_stage_folder`).
    """
    out = {}
    keys = headline_keys()
    for s, name in STAGES.items():
        st = stage_record(run_dir, s).stats
        if not st:
            continue
        out[name] = {k: _from_stage_folder(value_at(st, k) if k.split(".")[0] in st else MISSING) for k in keys[s]}
    return out


def _from_stage_folder(value):
    """``/abs/outputs/<run>/04_train/drafter`` -> ``04_train/drafter``: relative to the run directory,
    which the index lives in. A stage records absolute paths (stage 4's ``drafter_dir``), and a copied
    or moved run keeps those of the folder that wrote it: the index showed the old run's drafter."""
    if not isinstance(value, str) or not value.startswith("/"):
        return value
    parts = Path(value).parts
    for i, part in enumerate(parts):
        if part in STAGES.values():
            return Path(*parts[i:]).as_posix()
    return value


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


def _fixed(v, decimals: int, suffix: str = "") -> str:
    """A number with a fixed count of decimals, so that a column of the headline table reads evenly
    (1.000 beside 1.490, not 1 beside 1.49); anything else as ``_fmt`` shows it."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return f"{v:.{decimals}f}{suffix}"
    return _fmt(v)


def _ratio(a, b) -> float | None:
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


# The result table: a row per vLLM measurement, a column per metric (metric, header, decimals, suffix).
_TABLE_METHODS = ((VLLM_EAGLE3, "EAGLE-3 drafter"), (VLLM_NGRAM, "n-gram lookup"), (VLLM_NONE, "no speculation"))
_TABLE_COLUMNS = (("tokens_per_forward", "tokens per target forward", 3, ""),
                  ("tau", "τ (1 + accepted drafts per round with drafts)", 3, ""),
                  ("tokens_per_s", "tokens/s (one request at a time)", 1, ""),
                  ("speedup", "speed-up vs no speculation", 2, "x"))

_Group = SetStats | PooledStats


def _fewer(e: SetStats) -> str:
    """Why a set has fewer prompts than its source's records, e.g. `` of 12 (4 over evaluate.num_prompts
    / prompts_per_category); 1 bad record skipped``; empty when nothing was left out (or not recorded)."""
    out = ""
    if e.candidates > e.prompts:
        why = left_out_reasons(dataclasses.asdict(e))
        out = f" of {e.candidates}" + (f" ({why})" if why else "")
    if e.bad_records:
        out += f"; {e.bad_records} bad record{'s' * (e.bad_records != 1)} skipped"
    return out


def _groups(st: EvaluateStats) -> list[tuple[str, str, _Group]]:
    """(name, row label, numbers) per evaluation set, out-of-domain first, or the pooled numbers as one
    group when there are no per-set numbers. A label says on how many prompts the speed columns rest:
    far fewer than the acceptance ones."""
    out = []
    for n, e in sorted(st.sets.items(), key=lambda kv: out_of_domain_first(kv[1].domain)):
        speed = f"; tokens/s on {_fmt(e.speed_prompts)} of them" if e.speed_prompts else ""
        out.append((n, f"{html.escape(n)}<br><small>{html.escape(e.domain)}, {_fmt(e.prompts)} "
                       f"prompts{html.escape(_fewer(e))}{speed}</small>", e))
    return out or [("all prompts", f"all<br><small>{_fmt(st.pooled.prompts)} prompts</small>", st.pooled)]


def _method_rows(name: str, label: str, g: _Group, disturbed: list[str]) -> str:
    """The table rows of one group, a row per :data:`_TABLE_METHODS`; a speed-up above what the timed
    answers' tokens per target forward allow, and tokens/s whose timing rounds disagree (``speed_steady``
    False, with the speed-ups resting on them), go to ``disturbed`` and are marked."""
    body = ""
    for m, method_label in _TABLE_METHODS:
        if g.get(m, "speed_steady") is False:
            disturbed.append(f"{method_label} on {name}: tokens/s {_fixed(g.get(m, 'tokens_per_s'), 1)}, rounds "
                             + ", ".join(_fixed(x, 1) for x in g.get(m, "tokens_per_s_rounds") or []))
    for i, (m, method_label) in enumerate(_TABLE_METHODS):
        cell = f"<th rowspan='{len(_TABLE_METHODS)}'>{label}</th>" if i == 0 else ""
        up = g.get(m, "speedup")
        # no speculation's answers are one token per forward by definition: no bound of their own
        timed = g.get(m, "speed_tokens_per_forward") if m != VLLM_NONE else None
        # a method cannot run faster than the tokens per target forward of the answers it was timed
        # on allow (its drafts cost time too): a speed-up well above that is a disturbed timing
        mark, bound = "", speedup_bound(g.methods.get(m) or {})
        if m != VLLM_NONE and isinstance(up, float) and bound and up > SPEEDUP_SLACK * bound:
            mark = " &#9888;"
            disturbed.append(f"{method_label} on {name}: {_fixed(up, 2, 'x')} with {_fixed(bound, 3)} tokens per target "
                             f"forward")
        if m != VLLM_NONE and g.get(m, "speedup_steady") is False and not mark:
            mark = " &#9888;"  # a speed-up over (or of) a row whose rounds disagree
        if isinstance(timed, (int, float)) and isinstance(up, float):
            # the timed answers are a few prompts' (and may be other texts): their own rate beside the speed-up
            mark += f"<br><small>timed answers: {_fixed(timed, 3)} tokens per forward</small>"
        vals = [_fixed(g.get(m, metric), dec, suffix) for metric, _, dec, suffix in _TABLE_COLUMNS]
        vals[-1] += mark  # the speed-up's column, the last
        if g.get(m, "speed_steady") is False:  # the tokens/s column: its rounds disagree
            vals[-2] += (" &#9888;<br><small>rounds " + ", ".join(_fixed(x, 1) for x in g.get(m, "tokens_per_s_rounds") or [])
                         + "</small>")
        body += f"<tr>{cell}<th>{method_label}</th>" + "".join(f"<td>{v}</td>" for v in vals) + "</tr>"
    return body


def _result_table(groups: list[tuple[str, str, _Group]]) -> list[str]:
    """The result table, what it compares, and the notes on its speed columns."""
    head = "<tr><th>set</th><th>vLLM</th>" + "".join(f"<th>{h}</th>" for _, h, _, _ in _TABLE_COLUMNS) + "</tr>"
    disturbed: list[str] = []
    body = "".join(_method_rows(n, label, g, disturbed) for n, label, g in groups)
    differ = [f"{_fmt(g.speed_lengths_differ)} of {_fmt(g.speed_prompts)} on {n}"
              for n, _, g in groups if getattr(g, "speed_lengths_differ", 0)]
    parts = [f"<table>{head}{body}</table>",
             "<p><small>Tokens per target forward compare the methods: every verification round counts, "
             "a round without drafts as one token. τ counts only rounds that had drafts, so n-gram lookup, "
             "which often has nothing to propose, can show a higher τ than the drafter and still give fewer "
             "tokens per forward.</small></p>"]
    if disturbed:
        parts.append(f"<p class='warn' id='disturbed-speed'>&#9888; Disturbed speed measurements "
                     f"({html.escape('; '.join(disturbed))}): timing rounds that disagree, or a speed-up above what "
                     f"the tokens per target forward of the timed answers allow, mean that other load on the machine "
                     f"slowed some requests; do not read these tokens/s or the speed-ups resting on them as a result. "
                     f"Measure the speed again on a quiet machine: <code>{html.escape(REMEASURE_SPEED)}</code> (every "
                     f"method is timed again, its acceptance reused).</p>")
    if differ:
        # at T=0 every method should write the target's greedy answer, but verifying k drafts computes
        # other batch shapes than decoding one token, and the arithmetic's rounding differs
        parts.append(f"<p id='speed-lengths-differ'><small>The methods' answers to some timed prompts have different "
                     f"lengths ({html.escape('; '.join(differ))}): greedy outputs depend on the arithmetic of each "
                     f"engine's batches, so those tokens/s compare different texts (a longer answer spreads its "
                     f"prefill over more tokens), and a re-measurement gives the same answers again. Tokens per "
                     f"target forward, measured on every prompt, are the comparison to trust.</small></p>")
    return parts


def _comparisons(groups: list[tuple[str, str, _Group]]) -> list[str]:
    """The drafter against n-gram lookup per group: tokens per target forward, and which was faster."""
    verdicts, ratios = [], []
    for n, _, g in groups:
        r = _ratio(g.get(VLLM_EAGLE3, "tokens_per_forward"), g.get(VLLM_NGRAM, "tokens_per_forward"))
        if r is not None:
            ratios.append(f"{_fixed(r, 2, 'x')} n-gram's on {html.escape(n)}")
        d, ng, none = (g.get(m, "tokens_per_s") for m in (VLLM_EAGLE3, VLLM_NGRAM, VLLM_NONE))
        if isinstance(d, (int, float)) and isinstance(ng, (int, float)):
            faster = "the drafter" if d > ng else "n-gram lookup"
            on = f", {g.speed_prompts} prompts" if isinstance(g, SetStats) and g.speed_prompts else ""
            # the speed-up column says it too, but a drafter slower than not speculating is the headline
            slower = (f", and no speculation faster than the drafter ({_fixed(none, 1)} tokens/s)"
                      if isinstance(none, (int, float)) and none > d else "")
            verdicts.append(f"on {html.escape(n)} {faster} was faster ({_fixed(max(d, ng), 1)} vs {_fixed(min(d, ng), 1)} "
                            f"tokens/s{on}){slower}")
    parts = [f"<p>The drafter's tokens per target forward: {'; '.join(ratios)}.</p>"] if ratios else []
    if verdicts:
        parts.append(f"<p>In vLLM {'; '.join(verdicts)}; a speed on so few prompts, one request at a time, "
                     f"is indicative only.</p>")
    return parts


def _parity_line(st: EvaluateStats) -> str:
    """Offline τ vs vLLM τ on the parity's own prompts, and the check's verdict."""
    p = st.parity
    verdict = ("not checked" if p.ok is None else ("agrees" if p.ok else "DISAGREES")) + (
        f" (relative gap {_fmt(p.gap)}, tolerance {_fmt(p.tolerance)}{', ' + str(p.prompts) + ' prompts' if p.prompts else ''})"
        if p.ok is not None else "")
    on = f" on the same {p.prompts} prompts" if p.tau_vllm is not None and p.prompts else ""
    return (f"<p>Offline τ {_fixed(p.tau_offline, 3)} vs vLLM τ {_fixed(p.tau_vllm, 3)}{on}: parity "
            f"{html.escape(verdict)}.</p>")


def _settings_html(st: EvaluateStats) -> list[str]:
    """The diagnosis (when offline and vLLM disagree), the settings, and what was measured on which prompts."""
    parts = []
    diag = [x for x in st.diagnosis if x]
    if diag:
        items = "".join(f"<li>{html.escape(str(x))}</li>" for x in diag)
        parts.append(f"<p><strong>Diagnosis</strong></p><ul>{items}</ul>")
    counts = ", ".join(f"{html.escape(n)} {_fmt(e.prompts)}" for n, e in st.sets.items())
    settings = (f"k = {_fmt(st.settings.k)} draft tokens, temperature {_fmt(st.settings.temperature)}, acceptance rule: "
                f"{html.escape(st.settings.acceptance_rule or '-')}; prompts: "
                f"{counts or _fmt(st.pooled.prompts)} ({_fmt(st.pooled.excluded_training)} excluded as training "
                f"prompts, by prompt hash)")
    parts.append(f"<p>Settings: {settings}.</p>")
    items = "".join(f"<li>{html.escape(k)}: {html.escape(str(v))}</li>" for k, v in st.measured.items() if k != "prompts")
    if items:
        parts.append(f"<ul>{items}</ul>")
    return parts


def _warnings_html(warnings: list[dict]) -> tuple[str, str]:
    """(banner at the very top, the full list) of stage 5's mismatch warnings, the list ending with the
    rules checked that did not fire (so that a drafter that did not lose to n-gram says so, rather than
    leaving it to the ratios); no banner when none fired."""
    quiet = [r for r in RULES if r not in {w["rule"] for w in warnings}]
    checked = ("<p id='warnings-not-fired'><small>Checked and not fired: "
               + "; ".join(f"{r} ({html.escape(RULE_TEXT[r])})" for r in quiet) + ".</small></p>") if quiet else ""
    if not warnings:
        return "", f"<h3 id='warnings'>Warnings</h3><p>No mismatch warning.</p>{checked}"
    alarms = [w for w in warnings if not w.get("expected")]
    expected = [w for w in warnings if w.get("expected")]
    banner = _warning_banner(alarms) if alarms else (
        # a warning the recipe trips by design (the default demonstration's small data): a note, not an alarm
        f"<div class='note' id='mismatch-warning'>&#9432; {len(expected)} expected warning"
        f"{'s' if len(expected) > 1 else ''} ({html.escape(', '.join(w['rule'] for w in expected))}): "
        f"{html.escape(expected[0]['message'].split(':')[0])}. See <a href='#warnings'>Warnings</a>.</div>")

    def items(ws: list[dict]) -> str:
        return "".join(f"<li><strong>{html.escape(w['rule'])}</strong>: {html.escape(w['message'])}.<br><em>Fix:</em> "
                       f"{html.escape(w['fix'])}</li>" for w in ws)
    lists = (f"<ul class='warn'>{items(alarms)}</ul>" if alarms else "") + (
        f"<ul class='note'>{items(expected)}</ul>" if expected else "")
    return banner, f"<h3 id='warnings'>Warnings</h3>{lists}{checked}"


def _warning_banner(warnings: list[dict]) -> str:
    """The red banner over the result: how many warnings, which rules, and whether the drafter may not help."""
    # in the order of the list below, a rule that fired on several sets counted (5 warnings, 4 rules)
    counts = Counter(w["rule"] for w in warnings)
    rules = ", ".join(f"{rule} x{n}" if n > 1 else rule for rule, n in counts.items())
    # a measured loss says "may not help"; a data-size/breadth rule alone says what it is, and so does a
    # disturbed timing alone (the machine's load, not the drafter)
    fired = {w["rule"] for w in warnings}
    data = fired & {"small_training_data", "narrow_training_data"}
    speed = fired & {"unsteady_speed"}
    if fired - data - speed:
        what = "this drafter may not help on the traffic you will serve"
    elif data:
        what = "the training data is small or narrow: the numbers below may not carry over to other traffic"
    else:
        what = ("other load on the machine disturbed the speed timing: re-measure before reading the tokens/s "
                f"or speed-ups (<code>{html.escape(REMEASURE_SPEED)}</code>)")
    kind = "speed" if fired == speed else "mismatch"
    return (f"<div class='warn' id='mismatch-warning'><strong>&#9888; {len(warnings)} {kind} "
            f"warning{'s' if len(warnings) > 1 else ''}: {what} "
            f"({html.escape(rules)}). See <a href='#warnings'>Warnings</a>.</strong></div>")


def summary_html(run_dir: str | Path) -> str:
    """The answer first: the drafter vs n-gram lookup vs no speculation in vLLM on every evaluation
    set (out-of-domain first), the parity result, the mismatch warnings, the settings.

    Tokens per target forward are the comparable acceptance number (a round without drafts counts
    as one token); τ counts accepted drafts per verification round, so n-gram's τ is higher than its
    tokens per forward whenever it often has nothing to propose. Empty when stage 5 has not finished;
    a stats.json of an earlier layout is named, with the command that rewrites it.
    """
    try:
        st = read_stats(run_dir)
    except (TypeError, ValueError) as e:
        return f"<div id='headline'><h2>Result</h2><p class='warn'>{html.escape(str(e))}</p></div>"
    if st is None:
        return ""
    banner, warn_list = _warnings_html([w for w in st.warnings if isinstance(w, dict)])
    groups = _groups(st)
    parts = ["<div id='headline'>", banner, "<h2>Result</h2>", *_result_table(groups), *_comparisons(groups),
             _parity_line(st), warn_list, *_settings_html(st), "</div>"]
    return "\n".join(p for p in parts if p)


def _text_table(rows: list[list[str]]) -> list[str]:
    """Rows of cells as left-aligned, space-padded columns (the first row the header)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def summary_text(run_dir: str | Path) -> str:
    """The result as plain text for the terminal and a log (what :func:`summary_html` opens with): per
    evaluation set, out-of-domain first, the drafter, n-gram lookup and no speculation in vLLM (tokens
    per target forward, τ, tokens/s one request at a time and the speed-up over no speculation, marked
    "(unsteady)" where the timing was disturbed: rounds that disagree, requests timed beside other load,
    a speed-up above what the tokens per forward allow; "—" where not measured), the drafter over n-gram,
    the parity line and each mismatch warning with its fix (an expected one as a note). Empty when
    stage 5 has not finished.
    """
    try:
        st = read_stats(run_dir)
    except (TypeError, ValueError) as e:
        return f"result: {e}"
    if st is None:
        return ""

    def num(v, decimals: int) -> str:
        return _fixed(v, decimals) if isinstance(v, (int, float)) and not isinstance(v, bool) else "—"

    def unsteady(ok) -> str:  # timing rounds that disagree: the report's disturbed-speed mark, in words
        return " (unsteady)" if ok is False else ""

    rows = [["set", "vLLM", "tokens per target forward", "τ", "drafter / n-gram", "tokens/s", "speed-up"]]
    sets = sorted(st.sets.items(), key=lambda kv: out_of_domain_first(kv[1].domain)) or [("all prompts", st.pooled)]
    for name, g in sets:
        label = f"{name} ({g.domain}, {g.prompts} prompts)" if isinstance(g, SetStats) else f"{name} ({g.prompts})"
        ratio = _ratio(g.get(VLLM_EAGLE3, "tokens_per_forward"), g.get(VLLM_NGRAM, "tokens_per_forward"))
        for i, (m, method_label) in enumerate(_TABLE_METHODS):
            up = g.get(m, "speedup") if m != VLLM_NONE else None
            rows.append([label if i == 0 else "", method_label, num(g.get(m, "tokens_per_forward"), 3),
                         num(g.get(m, "tau"), 3), num(ratio, 2) + "x" * (ratio is not None) if i == 0 else "",
                         num(g.get(m, "tokens_per_s"), 1) + unsteady(g.get(m, "speed_steady")),
                         (num(up, 2) + "x" * (up is not None) + unsteady(g.get(m, "speedup_steady")))
                         if m != VLLM_NONE else ""])
    p = st.parity
    verdict = "not checked" if p.ok is None else ("agrees" if p.ok else "DISAGREES")
    lines = [f"Result (vLLM, k = {_fmt(st.settings.k)} draft tokens, temperature {_fmt(st.settings.temperature)}):",
             *_text_table(rows),
             "(tokens per target forward compare the methods; τ counts only rounds with drafts, so n-gram "
             "lookup, which often has nothing to propose, can show a higher τ and still fewer tokens per forward)",
             *_other_load_line(st),
             f"Parity: offline τ {num(p.tau_offline, 3)} vs vLLM τ {num(p.tau_vllm, 3)}"
             + (f" on the same {p.prompts} prompts" if p.prompts else "") + f": {verdict}."]
    warnings = [w for w in st.warnings if isinstance(w, dict)]
    for w in warnings:
        mark = "note (expected)" if w.get("expected") else "WARNING"
        lines.append(f"{mark} {w['rule']}: {w['message']}. Fix: {w['fix']}")
    if not warnings:
        lines.append("No mismatch warning.")
    return "\n".join(lines)


def _other_load_line(st) -> list[str]:
    """The terminal's line on other processes during the speed pass (none where they took under half a CPU)."""
    cpus = st.pooled.get(VLLM_NONE, "speed_other_cpus") if st.pooled else None
    if not cpus or cpus < 0.5:
        return []
    return [f"(tokens/s timed while other processes took up to {cpus:.1f} CPUs; the timed engines leave the CPUs "
            f"taken at their start to them, and a load that competed with them marks the numbers unsteady)"]


_STYLE = ("<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto;}"
          "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}"
          "img{max-width:100%;margin:4px 0;border:1px solid #eee}code{background:#f4f4f4}"
          ".warn{background:#fff0f0;border:2px solid #c00;padding:6px 12px;color:#600}"
          ".note{background:#f4f6fa;border:1px solid #99a;padding:6px 12px}"
          "ul.warn,ul.note{padding-left:2.2em}</style>")  # the list's bullets inside its box


@dataclasses.dataclass
class SingleFile:
    """How the single-file report differs from the index: its figures inside the page (read from
    ``report_dir``, written as ``data:`` URIs), each stage page's tables (``tables``: stage folder ->
    the HTML tables of its executed notebook) instead of a link to the page, and the engine logs named,
    not linked (a file sent alone has nothing beside it)."""

    report_dir: Path
    tables: dict[str, list[str]]


def _figure_html(fig: str, single: SingleFile | None) -> str:
    """A stage figure (``figures/<stage>__<name>.png``, relative to ``report/``): linked to its file on the
    index, inside the page on the single file."""
    alt = html.escape(Path(fig).stem)
    if single is None:
        return f"<a href='{html.escape(fig)}'><img src='{html.escape(fig)}' alt='{alt}'></a>"
    data = base64.b64encode((single.report_dir / fig).read_bytes()).decode("ascii")
    return f"<img src='data:image/png;base64,{data}' alt='{alt}'>"


def _page_link(s: int, name: str, page: str, single: SingleFile | None) -> str:
    """The index's link to a stage's executed notebook, or the single file's copy of its tables."""
    if single is None:
        return f"<p>Executed notebook: <a href='{html.escape(page)}'>{html.escape(page)}</a></p>"
    tables = single.tables.get(name) or []
    if not tables:
        return f"<p>Executed notebook: report/{html.escape(page)} of the run (no table)</p>"
    return (f"<details><summary>The tables of stage {s}'s executed notebook ({len(tables)}; its page: "
            f"report/{html.escape(page)} of the run)</summary>{''.join(tables)}</details>")


def _logs_html(run_dir: Path, name: str, single: SingleFile | None) -> str:
    """The engine logs of a stage: linked from the index (relative to report/), named on the single file."""
    logs = sorted((run_dir / name / "logs").glob("*.log")) if (run_dir / name / "logs").is_dir() else []
    if not logs:
        return ""
    if single is not None:
        return f"<p>Engine logs (in the run folder, {html.escape(name)}/logs/): {html.escape(', '.join(p.name for p in logs))}</p>"
    links = ", ".join(f"<a href='../{html.escape(name)}/logs/{html.escape(p.name)}'>{html.escape(p.name)}</a>"
                      for p in logs)
    return f"<p>Engine logs: {links}</p>"


def _stage_section(run_dir: Path, s: int, nums: dict, pages: list[str], figures: dict[str, list[str]],
                   single: SingleFile | None) -> list[str]:
    """One stage's part of the page: its headline numbers (stage 1 also what it left out and why),
    its figures, its executed notebook (a link, or its tables) and its engine logs."""
    name = STAGES[s]
    page = next((p for p in pages if p.startswith(f"{s:02d}_")), None)
    parts = [f"<h2>{s}. {html.escape(name[3:])}</h2>"]
    if page:
        parts.append(_page_link(s, name, page, single))
    if name in nums:
        rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(_fmt(v))}</td></tr>" for k, v in nums[name].items())
        if s == 5:  # its pooled numbers mix in- and out-of-domain prompts
            parts.append("<p><em>Pooled over every evaluation set (offline τ over the offline prompts only, "
                         "vLLM τ over all: not a parity pair; the parity line above compares the same "
                         "prompts); per set: Result, at the top.</em></p>")
        parts.append(f"<table>{rows}</table>")
        if s == 1:  # what the training data lost on its way in (bad records, cut answers), as the terminal said it
            from eagle3.synthesize.summary import skip_summary

            parts.append(f"<p>Stage 1: {html.escape(skip_summary(stage_record(run_dir, s).stats))}.</p>")
    else:
        parts.append(f"<p><em>{html.escape(_unfinished(run_dir, s))}</em></p>")
    parts += [_figure_html(fig, single) for fig in figures.get(name, [])]
    if s == 5:
        st5 = stage_record(run_dir, s).stats
        if st5.get("vllm_serve_command"):
            parts.append(f"<p id='serve'>Serve it on this machine, as printed: "
                         f"<code>{html.escape(st5['vllm_serve_command'])}</code></p>")
        if st5.get("vllm_serve_where"):
            parts.append(f"<p>{html.escape(st5['vllm_serve_where'])}</p>")
    parts.append(_logs_html(run_dir, name, single))
    return [p for p in parts if p]


def index_html(run_dir: str | Path, pages: list[str], figures: dict[str, list[str]],
               single: SingleFile | None = None) -> str:
    """HTML text of the index page: the result (:func:`summary_html`), then per stage a table of its
    headline numbers (stage 1 also what it left out and why: bad prompt records, cut answers), its
    figures (full width, linked to the file) and its executed notebook.

    With ``single`` (:class:`SingleFile`), the single-file report instead: the same page with every
    figure inside it and each stage page's tables, no link to a file beside it.
    """
    run_dir = Path(run_dir)
    nums = key_numbers(run_dir)
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>eagle3 report: {html.escape(run_dir.name)}</title>", _STYLE, "</head><body>",
        f"<h1>eagle3 report: {html.escape(run_dir.name)}</h1>",
        f"<p>Run directory: <code>{html.escape(str(run_dir.resolve()))}</code></p>",
        summary_html(run_dir),
    ]
    for s in STAGES:
        parts += _stage_section(run_dir, s, nums, pages, figures, single)
    parts.append("</body></html>")
    return "\n".join(parts)
