"""The run's shared report: ``report/index.html`` with each stage's headline numbers and figures."""

from __future__ import annotations

import html
import json
from collections import Counter
from pathlib import Path

from eagle3.evaluate.mismatch import RULE_TEXT, RULES
from eagle3.evaluate.prompts import left_out_reasons, out_of_domain_first
from eagle3.io import read_json
from eagle3.rundir import STAGES, VLLM_RESULT_FILE
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
    keys drifted is visible on the index page. A path into a stage folder is shown from that folder on
    (:func:`_from_stage_folder`).
    """
    out = {}
    keys = headline_keys()
    for s, name in STAGES.items():
        st = read_json(Path(run_dir) / name / "stats.json", None)
        if not st:
            continue
        out[name] = {k: _from_stage_folder(st.get(k, MISSING)) for k in keys[s]}
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


_ROWS = (("EAGLE-3 drafter", "tokens_per_forward_vllm", "tau_vllm", "tokens_per_s_vllm_eagle3", "speed_tokens_per_forward_vllm"),
         ("n-gram lookup", "tokens_per_forward_ngram", "tau_ngram", "tokens_per_s_vllm_ngram", "speed_tokens_per_forward_ngram"),
         ("no speculation", None, None, "tokens_per_s_vllm_none", None))


def _method_rows(st: dict) -> list[tuple[str, object, object, object, object, object]]:
    """(method, tokens per forward, τ, tokens/s, speed-up, tokens per forward of the timed answers)
    rows of one set's (or the pooled) stats; the last is None where the stats do not hold it (older
    runs, no speculation)."""
    none_tps = st.get("tokens_per_s_vllm_none")
    rows = []
    for name, tpf, tau, tps, speed_tpf in _ROWS:
        v = st.get(tps)
        t = st.get(tpf) if tpf else (1.0 if none_tps or st.get("tokens_per_forward_vllm") is not None else None)
        rows.append((name, t, st.get(tau) if tau else None, v, _ratio(v, none_tps), st.get(speed_tpf) if speed_tpf else None))
    return rows


_VLLM_RESULT = f"{STAGES[5]}/{VLLM_RESULT_FILE.format(method='<method>')}"  # a measurement to delete

# how far a speed-up may exceed the tokens per target forward before the report calls the timing
# disturbed (a method's tokens/s over no speculation's is at most its tokens per forward, less its
# drafting cost; 1.25 leaves room for the noise of a few prompts timed one at a time)
_SPEEDUP_SLACK = 1.25

def _fewer(e: dict) -> str:
    """Why a set has fewer prompts than its source's records, e.g. `` of 12 (4 over evaluate.num_prompts
    / prompts_per_category); 1 bad record skipped``; empty when nothing was left out (or not recorded)."""
    out = ""
    cands, prompts = e.get("candidates"), e.get("prompts")
    if isinstance(cands, int) and isinstance(prompts, int) and cands > prompts:
        why = left_out_reasons(e)
        out = f" of {cands}" + (f" ({why})" if why else "")
    if e.get("bad_records"):
        out += f"; {e['bad_records']} bad record{'s' * (e['bad_records'] != 1)} skipped"
    return out


def _warnings_html(warnings: list[dict]) -> tuple[str, str]:
    """(banner at the very top, the full list) of stage 5's mismatch warnings, the list ending with the
    rules checked that did not fire (a new user could only infer from the ratios that the drafter did
    not lose to n-gram); no banner when none fired."""
    quiet = [r for r in RULES if r not in {w["rule"] for w in warnings}]
    checked = ("<p id='warnings-not-fired'><small>Checked and not fired: "
               + "; ".join(f"{r} ({html.escape(RULE_TEXT[r])})" for r in quiet) + ".</small></p>") if quiet else ""
    if not warnings:
        return "", f"<h3 id='warnings'>Warnings</h3><p>No mismatch warning.</p>{checked}"
    # in the order of the list below, a rule that fired on several sets counted (5 warnings, 4 rules)
    counts = Counter(w["rule"] for w in warnings)
    rules = ", ".join(f"{rule} x{n}" if n > 1 else rule for rule, n in counts.items())
    # a measured loss says "may not help"; a data-size/breadth rule alone says what it is
    measured = {w["rule"] for w in warnings} - {"small_training_data", "narrow_training_data"}
    what = ("this drafter may not help on the traffic you will serve" if measured else
            "the training data is small or narrow: the numbers below may not carry over to other traffic")
    banner = (f"<div class='warn' id='mismatch-warning'><strong>&#9888; {len(warnings)} mismatch "
              f"warning{'s' if len(warnings) > 1 else ''}: {what} "
              f"({html.escape(rules)}). See <a href='#warnings'>Warnings</a>.</strong></div>")
    items = "".join(
        f"<li><strong>{html.escape(w['rule'])}</strong>: {html.escape(w['message'])}.<br><em>Fix:</em> "
        f"{html.escape(w['fix'])}</li>" for w in warnings)
    return banner, f"<h3 id='warnings'>Warnings</h3><ul class='warn'>{items}</ul>{checked}"


def summary_html(run_dir: str | Path) -> str:
    """The answer first: the drafter vs n-gram lookup vs no speculation in vLLM on every evaluation
    set (out-of-domain first), the parity result, the mismatch warnings, the settings.

    Tokens per target forward are the comparable acceptance number (a round without drafts counts
    as one token); τ counts accepted drafts per verification round, so n-gram's τ is higher than its
    tokens per forward whenever it often has nothing to propose. Empty when stage 5 has not finished.
    """
    st = read_json(Path(run_dir) / STAGES[5] / "stats.json", None)
    if not st:
        return ""
    banner, warn_list = _warnings_html([w for w in st.get("warnings") or [] if isinstance(w, dict)])
    head = ("<tr><th>set</th><th>vLLM</th><th>tokens per target forward</th><th>τ (1 + accepted drafts per round with drafts)</th>"
            "<th>tokens/s (one request at a time)</th><th>speed-up vs no speculation</th></tr>")
    sets = st.get("sets") or {}

    def label(n, e):  # the speed columns rest on far fewer prompts than the acceptance ones: say how many
        speed = f"; tokens/s on {_fmt(e['speed_prompts'])} of them" if e.get("speed_prompts") else ""
        return (f"{html.escape(n)}<br><small>{html.escape(str(e.get('domain', '')))}, {_fmt(e.get('prompts'))} "
                f"prompts{html.escape(_fewer(e))}{speed}</small>")

    ordered = sorted(sets.items(), key=lambda kv: out_of_domain_first(kv[1].get("domain")))
    groups = [(n, label(n, e), e) for n, e in ordered]
    if not groups:  # a stats.json without per-set numbers: the pooled ones
        groups = [("all prompts", f"all<br><small>{_fmt(st.get('num_prompts'))} prompts</small>", st)]
    body, disturbed, differ = "", [], []
    for n, set_label, e in groups:
        rows = _method_rows(e)
        if e.get("speed_lengths_differ"):
            differ.append(f"{_fmt(e['speed_lengths_differ'])} of {_fmt(e.get('speed_prompts'))} on {n}")
        for i, (name, tpf, tau, tps, up, timed_tpf) in enumerate(rows):
            cell = f"<th rowspan='{len(rows)}'>{set_label}</th>" if i == 0 else ""
            # a method cannot run faster than the tokens per target forward of the answers it was timed
            # on allow (its drafts cost time too): a speed-up well above that is a disturbed timing
            mark, bound = "", timed_tpf if isinstance(timed_tpf, (int, float)) else tpf
            if isinstance(up, float) and isinstance(bound, (int, float)) and up > _SPEEDUP_SLACK * bound:
                mark = " &#9888;"
                disturbed.append(f"{name} {_fixed(up, 2, 'x')} with {_fixed(bound, 3)} tokens per target forward")
            if isinstance(timed_tpf, (int, float)) and isinstance(up, float):
                # the timed answers are a few prompts' (and may be other texts): their own rate beside the speed-up
                mark += f"<br><small>timed answers: {_fixed(timed_tpf, 3)} tokens per forward</small>"
            body += (f"<tr>{cell}<th>{name}</th><td>{_fixed(tpf, 3)}</td><td>{_fixed(tau, 3)}</td>"
                     f"<td>{_fixed(tps, 1)}</td><td>{_fixed(up, 2, 'x')}{mark}</td></tr>")
    parts = ["<div id='headline'>", banner, "<h2>Result</h2>", f"<table>{head}{body}</table>",
             "<p><small>Tokens per target forward compare the methods: every verification round counts, "
             "a round without drafts as one token. τ counts only rounds that had drafts, so n-gram lookup, "
             "which often has nothing to propose, can show a higher τ than the drafter and still give fewer "
             "tokens per forward.</small></p>"]
    if disturbed:
        parts.append(f"<p class='warn' id='disturbed-speed'>&#9888; A speed-up above what the tokens per target forward "
                     f"of the timed answers allow ({html.escape('; '.join(disturbed))}) means the speed measurement "
                     f"was disturbed (other load on the machine, one request at a time on few prompts): do not read "
                     f"it as a result; measure again on a quiet machine (delete {html.escape(_VLLM_RESULT)}, then "
                     f"<code>eagle3 run PARAMS --stages 5 --redo 5</code>).</p>")
    if differ:
        # at T=0 every method should write the target's greedy answer, but verifying k drafts computes
        # other batch shapes than decoding one token, and the arithmetic's rounding differs
        parts.append(f"<p id='speed-lengths-differ'><small>The methods' answers to some timed prompts have different "
                     f"lengths ({html.escape('; '.join(differ))}): greedy outputs depend on the arithmetic of each "
                     f"engine's batches, so those tokens/s compare different texts (a longer answer spreads its "
                     f"prefill over more tokens), and a re-measurement gives the same answers again. Tokens per "
                     f"target forward, measured on every prompt, are the comparison to trust.</small></p>")
    verdicts, ratios = [], []
    for n, e in (ordered if sets else [("all prompts", st)]):
        r = _ratio(e.get("tokens_per_forward_vllm"), e.get("tokens_per_forward_ngram"))
        if r is not None:
            ratios.append(f"{_fixed(r, 2, 'x')} n-gram's on {html.escape(n)}")
        d, g = e.get("tokens_per_s_vllm_eagle3"), e.get("tokens_per_s_vllm_ngram")
        if isinstance(d, (int, float)) and isinstance(g, (int, float)):
            faster = "the drafter" if d > g else "n-gram lookup"
            on = f", {e['speed_prompts']} prompts" if e.get("speed_prompts") else ""
            none_tps = e.get("tokens_per_s_vllm_none")
            # the speed-up column says it too, but a drafter slower than not speculating is the headline
            slower = (f", and no speculation faster than the drafter ({_fixed(none_tps, 1)} tokens/s)"
                      if isinstance(none_tps, (int, float)) and none_tps > d else "")
            verdicts.append(f"on {html.escape(n)} {faster} was faster ({_fixed(max(d, g), 1)} vs {_fixed(min(d, g), 1)} "
                            f"tokens/s{on}){slower}")
    if ratios:
        parts.append(f"<p>The drafter's tokens per target forward: {'; '.join(ratios)}.</p>")
    if verdicts:
        parts.append(f"<p>In vLLM {'; '.join(verdicts)}; a speed on so few prompts, one request at a time, "
                     f"is indicative only.</p>")
    parity = st.get("parity_ok")
    parity_txt = ("not checked" if parity is None else ("agrees" if parity else "DISAGREES")) + (
        f" (relative gap {_fmt(st.get('parity_gap'))}, tolerance {_fmt(st.get('parity_tolerance'))}"
        f"{', ' + str(st['parity_prompts']) + ' prompts' if st.get('parity_prompts') else ''})"
        if parity is not None else "")
    # the parity's own sides (same prompts); tau_vllm pools every prompt, so it only stands in for
    # stats.json files written before parity_tau_vllm existed
    tau_off = st.get("parity_tau_offline", st.get("tau_offline"))
    tau_vl = st.get("parity_tau_vllm", st.get("tau_vllm"))
    on = f" on the same {st['parity_prompts']} prompts" if st.get("parity_tau_vllm") is not None and st.get("parity_prompts") else ""
    parts.append(f"<p>Offline τ {_fixed(tau_off, 3)} vs vLLM τ {_fixed(tau_vl, 3)}{on}: parity "
                 f"{html.escape(parity_txt)}.</p>")
    parts.append(warn_list)
    diag = [x for x in (st.get("diagnosis") or []) if x]
    if diag:
        items = "".join(f"<li>{html.escape(str(x))}</li>" for x in diag)
        parts.append(f"<p><strong>Diagnosis</strong></p><ul>{items}</ul>")
    counts = ", ".join(f"{html.escape(n)} {_fmt(e.get('prompts'))}" for n, e in sets.items())
    settings = (f"k = {_fmt(st.get('k'))} draft tokens, temperature {_fmt(st.get('temperature'))}, acceptance rule: "
                f"{html.escape(str(st.get('acceptance_rule') or '-'))}; prompts: "
                f"{counts or _fmt(st.get('num_prompts'))} ({_fmt(st.get('excluded_training', 0))} excluded as training "
                f"prompts, by prompt hash)")
    parts.append(f"<p>Settings: {settings}.</p>")
    measured = st.get("measured") or {}
    if measured:
        items = "".join(f"<li>{html.escape(k)}: {html.escape(str(v))}</li>" for k, v in measured.items() if k != "prompts")
        parts.append(f"<ul>{items}</ul>")
    parts.append("</div>")
    return "\n".join(p for p in parts if p)


def index_html(run_dir: str | Path, pages: list[str], figures: dict[str, list[str]]) -> str:
    """HTML text of the index page: the result (:func:`summary_html`), then per stage a table of its
    headline numbers (stage 1 also what it left out and why: bad prompt records, cut answers), its
    figures (full width, linked to the file) and its executed notebook."""
    run_dir = Path(run_dir)
    nums = key_numbers(run_dir)
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>eagle3 report: {html.escape(run_dir.name)}</title>",
        "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto;}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}"
        "img{max-width:100%;margin:4px 0;border:1px solid #eee}code{background:#f4f4f4}"
        ".warn{background:#fff0f0;border:2px solid #c00;padding:6px 12px;color:#600}"
        "ul.warn{padding-left:2.2em}</style>",  # the list's bullets inside its box
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
            if s == 5:  # its stats.json top-level numbers mix in- and out-of-domain prompts
                parts.append("<p><em>Pooled over every evaluation set (tau_offline over the offline prompts only, "
                             "tau_vllm over all: not a parity pair; the parity line above compares the same "
                             "prompts); per set: Result, at the top.</em></p>")
            parts.append(f"<table>{rows}</table>")
            if s == 1:  # what the training data lost on its way in (bad records, cut answers), as the terminal said it
                from eagle3.synthesize.summary import skip_summary

                parts.append(f"<p>Stage 1: {html.escape(skip_summary(read_json(run_dir / name / 'stats.json', {})))}.</p>")
        else:
            parts.append(f"<p><em>{html.escape(_unfinished(run_dir, s))}</em></p>")
        for fig in figures.get(name, []):
            f = html.escape(fig)
            parts.append(f"<a href='{f}'><img src='{f}' alt='{html.escape(Path(fig).stem)}'></a>")
        if s == 5 and (run_dir / name / "stats.json").exists():
            where = (read_json(run_dir / name / "stats.json", {}) or {}).get("vllm_serve_where")
            if where:
                parts.append(f"<p>{html.escape(where)}</p>")
        logs = sorted((run_dir / name / "logs").glob("*.log")) if (run_dir / name / "logs").is_dir() else []
        if logs:  # engine logs stay out of the notebooks; the page links them (relative to report/)
            links = ", ".join(f"<a href='../{html.escape(name)}/logs/{html.escape(p.name)}'>{html.escape(p.name)}</a>"
                              for p in logs)
            parts.append(f"<p>Engine logs: {links}</p>")
    parts.append("</body></html>")
    return "\n".join(parts)
