"""Acceptance metrics of speculative decoding (pure functions over per-round counts).

Definitions (``docs/DESIGN.md``, "Acceptance"; one verification round = one target forward after
the prefill):

* acceptance length ``tau = 1 + mean(accepted drafts per round)`` over rounds that had drafts
  (vLLM: ``1 + num_accepted_tokens / num_drafts``);
* tokens per target forward = tokens produced by verification rounds / verification rounds,
  counting rounds without drafts (n-gram lookup misses) as producing one token;
* per-position conditional acceptance at position i = P(draft i accepted | drafts 1..i-1 accepted
  and a draft i was proposed); vLLM's own vector is unconditional (accepted at i / drafts).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["acceptance_metrics", "context_bucket", "summarize_rounds", "group_metrics", "round_rates", "speed_stats",
           "paired_speedup"]


def acceptance_metrics(
    accepted: Sequence[int],
    k: int,
    drafted: Sequence[int] | None = None,
    verification_steps: int | None = None,
) -> dict:
    """Acceptance statistics of a list of verification rounds.

    Args:
        accepted: accepted draft tokens per round that had drafts (ints in ``[0, drafted[r]]``).
        k: number of speculative tokens per round (the per-position vectors have length k).
        drafted: draft tokens proposed per round (default: k every round).
        verification_steps: all target verification forwards, including rounds *without* drafts
            (n-gram misses); default ``len(accepted)``. Each such round produced one token.

    Returns:
        dict with ``tau`` (1 + mean accepted, the bonus token counted; NaN without rounds),
        ``rounds``, ``accepted_tokens``, ``draft_tokens``, ``draft_acceptance_rate``
        (accepted / drafted), ``per_position_conditional`` (list of k; position i counts rounds
        with a draft at i whose drafts 1..i-1 were all accepted; None where nothing was counted),
        ``per_position_unconditional`` (accepted at i / rounds, vLLM's vector),
        ``verification_steps`` and ``tokens_per_forward``
        (``(verification_steps + accepted_tokens) / verification_steps``).

    Raises:
        ValueError: lengths differ, or an accepted count is negative or exceeds its drafted count.

    Example (a logged run): k=4, rounds accepting 2, 0, 4 -> tau = 1 + 6/3 = 3.0.
    """
    acc = [int(a) for a in accepted]
    drf = [int(d) for d in drafted] if drafted is not None else [int(k)] * len(acc)
    if len(drf) != len(acc):
        raise ValueError(f"accepted ({len(acc)}) and drafted ({len(drf)}) differ in length")
    for r, (a, d) in enumerate(zip(acc, drf)):
        if a < 0 or a > d or d > k:
            raise ValueError(f"round {r}: accepted={a} drafted={d} k={k} is impossible")
    n = len(acc)
    steps = n if verification_steps is None else int(verification_steps)
    if steps < n:
        raise ValueError(f"verification_steps={steps} < rounds with drafts={n}")
    tot_acc, tot_drf = sum(acc), sum(drf)
    cond: list[float | None] = []
    uncond: list[float | None] = []
    for i in range(1, k + 1):
        den = sum(1 for a, d in zip(acc, drf) if d >= i and a >= i - 1)
        num = sum(1 for a in acc if a >= i)
        cond.append(num / den if den else None)
        uncond.append(num / n if n else None)
    return {
        "tau": 1.0 + tot_acc / n if n else float("nan"),
        "rounds": n,
        "accepted_tokens": tot_acc,
        "draft_tokens": tot_drf,
        "draft_acceptance_rate": tot_acc / tot_drf if tot_drf else float("nan"),
        "per_position_conditional": cond,
        "per_position_unconditional": uncond,
        "verification_steps": steps,
        "tokens_per_forward": (steps + tot_acc) / steps if steps else float("nan"),
    }


_BUCKET_EDGES = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def context_bucket(context_len: int) -> str:
    """Context-length bucket label of a round (tokens before the verification), e.g. '128-255'."""
    lo = 0
    for hi in _BUCKET_EDGES:
        if context_len < hi:
            return f"{lo}-{hi - 1}"
        lo = hi
    return f">={lo}"


def _bucket_start(label: str) -> int:
    return int(label.lstrip(">=").split("-")[0])


def _metrics_of(recs: list[dict], k: int) -> dict:
    acc = [r[2] for rec in recs for r in rec["rounds"] if r[1] > 0]
    drf = [r[1] for rec in recs for r in rec["rounds"] if r[1] > 0]
    steps = sum(rec.get("verification_steps", len(rec["rounds"])) for rec in recs)
    return acceptance_metrics(acc, k, drf, verification_steps=steps)


def group_metrics(records: list[dict], k: int, *keys: str) -> dict:
    """Acceptance metrics (:func:`acceptance_metrics`) of the records grouped by ``keys``.

    Args:
        records: as in :func:`summarize_rounds`, each holding the ``keys`` fields.
        keys: one key (``"set"``) gives ``{value: metrics}``; two (``"set", "category"``) give
            ``{value1: {value2: metrics}}``, and so on. Groups sorted by value.

    Returns:
        dict: nested by the keys' values; each leaf also has ``prompts`` (records in the group).
    """
    if not keys:
        return _metrics_of(records, k) | {"prompts": len(records)}
    groups: dict[str, list] = {}
    for rec in records:
        groups.setdefault(str(rec.get(keys[0], "?")), []).append(rec)
    return {g: group_metrics(v, k, *keys[1:]) for g, v in sorted(groups.items())}


def summarize_rounds(records: list[dict], k: int) -> dict:
    """Acceptance metrics overall, by prompt source and by context-length bucket.

    Args:
        records: one dict per prompt: ``source`` (str), ``rounds`` (list of
            ``[context_len, drafted, accepted]``) and optionally ``verification_steps`` (int,
            default: number of rounds).
        k: speculative tokens per round.

    Returns:
        dict: ``overall``, ``by_source`` {source: metrics}, ``by_context`` {bucket: metrics}
        (buckets sorted by length), ``accepted_histogram`` (rounds per accepted count 0..k) and
        ``prompts``. Metrics as in :func:`acceptance_metrics` (by context: rounds only).
    """
    def metrics_of(recs: list[dict]) -> dict:
        return _metrics_of(recs, k)

    by_source: dict[str, list] = {}
    for rec in records:
        by_source.setdefault(rec.get("source", "?"), []).append(rec)
    ctx: dict[str, list] = {}
    for rec in records:
        for r in rec["rounds"]:
            if r[1] > 0:
                ctx.setdefault(context_bucket(r[0]), []).append(r)
    hist = [0] * (k + 1)
    for rec in records:
        for r in rec["rounds"]:
            if r[1] > 0:
                hist[r[2]] += 1
    return {
        "overall": metrics_of(records),
        "by_source": {s: metrics_of(v) for s, v in sorted(by_source.items())},
        "by_context": {
            b: acceptance_metrics([r[2] for r in v], k, [r[1] for r in v])
            for b, v in sorted(ctx.items(), key=lambda kv: _bucket_start(kv[0]))
        },
        "accepted_histogram": hist,
        "prompts": len(records),
    }


# Speed (tokens/s) of vLLM's one-request-at-a-time timing. Each method times the same prompts in
# several rounds, interleaved with the other methods (eagle3.evaluate.vllm_jobs.speed_schedule): load
# from other processes that lasts less than a round slows one round of every method, not one method.


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def round_rates(rows: Sequence[dict]) -> dict[int, float]:
    """``{round: tokens/s}`` of timed rows (``{"round", "output_tokens", "time_s"}``; a row without
    ``round`` is round 0): each round's output tokens over its seconds, rounds sorted."""
    tok: dict[int, float] = {}
    sec: dict[int, float] = {}
    for r in rows:
        g = int(r.get("round", 0))
        tok[g] = tok.get(g, 0) + r["output_tokens"]
        sec[g] = sec.get(g, 0.0) + r["time_s"]
    return {g: tok[g] / sec[g] for g in sorted(tok) if sec[g] > 0}


def speed_stats(rows: Sequence[dict], tolerance: float | None = None) -> dict:
    """The speed of one method on one group of prompts from its timed rows (:func:`round_rates`).

    Returns:
        dict: ``tokens_per_s`` (median of the per-round tokens/s; None without a timed token),
        ``tokens_per_s_rounds`` (per round, in round order), ``speed_spread`` ((max - min) / median of
        the rounds; None under two rounds), ``speed_steady`` (False when the spread exceeds
        ``tolerance``, ``evaluate.speed_spread_tolerance``: the rounds disagree, another load disturbed
        some of them; None under two rounds or without a tolerance).
    """
    rates = list(round_rates(rows).values())
    if not rates:
        return {"tokens_per_s": None, "tokens_per_s_rounds": [], "speed_spread": None, "speed_steady": None}
    med = _median(rates)
    spread = (max(rates) - min(rates)) / med if len(rates) > 1 and med > 0 else None
    return {"tokens_per_s": med, "tokens_per_s_rounds": rates,
            "speed_spread": round(spread, 4) if spread is not None else None,
            "speed_steady": None if spread is None or tolerance is None else bool(spread <= tolerance)}


def paired_speedup(rates: Sequence[float], base_rates: Sequence[float]) -> float | None:
    """A method's speed-up over the baseline (no speculation) from their per-round tokens/s (same
    rounds, same order: :func:`speed_stats`' ``tokens_per_s_rounds``): the median over rounds of the
    method's rate over the baseline's in the same round. The two timed the same prompts next to each
    other, so a load that slowed a round slowed both. None without a common round."""
    ratios = [a / b for a, b in zip(rates, base_rates) if b]
    return _median(ratios) if ratios else None
