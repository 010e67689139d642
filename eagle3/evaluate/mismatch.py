"""Train/serve mismatch warnings: will this drafter help on traffic unlike its training data?

Each warning is a dict ``{"rule", "message", "numbers", "fix"}`` (stage 5's ``stats.json``
``warnings`` and the top of the report index). The rules, with their thresholds from
``params.evaluate``:

* ``drafter_below_ngram``: on an evaluation set, the drafter's tokens per target forward in vLLM
  (offline when vLLM was not run) is below n-gram prompt lookup's (vLLM): serving n-gram would be
  at least as good, for free.
* ``ood_far_below_id``: an out-of-domain set's acceptance gain is far below the in-distribution one:
  ``tau_ood - 1 < warn_ood_ratio * (tau_id - 1)`` (τ in vLLM, else offline; in-distribution = the
  held-out split). τ − 1 is the accepted drafts per round, the part of τ the drafter earns.
* ``small_training_data``: fewer than ``warn_min_conversations`` training conversations or fewer
  than ``warn_min_tokens`` training completion tokens (stage 1's counts). Published EAGLE-3 drafters
  train on 10^5 conversations and more; a few hundred fit one narrow task at best. On the default
  demonstration (:func:`default_demonstration`: the embedded target on the default prompts, sized to
  finish in about 35 minutes on 2 CPU cores) it always fires: the warning then says so
  (``"expected": true``), names the recipes sized for a drafter that helps, and the report shows it
  as a note, not an alarm.
* ``narrow_training_data``: the training conversations come from one source, or (when the samples
  record categories) from one category.
* ``unsteady_speed``: a vLLM method's tokens/s on a set (or pooled) spread over its timing rounds by
  more than ``speed_spread_tolerance`` ((max - min) / median): another load disturbed the timing, and
  that row's speed and the speed-ups that rest on it are not a result. The fix is one command.
"""

from __future__ import annotations

from eagle3.evaluate.methods import LABELS, OFFLINE_EAGLE3, VLLM_EAGLE3, VLLM_NGRAM, VLLM_NONE, is_vllm
from eagle3.evaluate.stats import SPEEDUP_SLACK, PooledStats, SetStats, speedup_bound

__all__ = ["RULES", "RULE_TEXT", "SIZED_RECIPES", "default_demonstration", "mismatch_warnings", "set_tau",
           "set_tokens_per_forward"]

RULES = ("drafter_below_ngram", "ood_far_below_id", "small_training_data", "narrow_training_data", "unsteady_speed")
# what each rule checks, in words (the report says which were checked and did not fire)
RULE_TEXT = {
    "drafter_below_ngram": "the drafter's tokens per target forward below n-gram's on a set",
    "ood_far_below_id": "out-of-domain τ far below in-distribution τ",
    "small_training_data": "few training conversations or completion tokens",
    "narrow_training_data": "one training source or one category",
    "unsteady_speed": "a method's tokens/s disagreeing between its timing rounds",
}

# the command that measures stage 5's speed again (docs/USAGE.md)
REMEASURE_SPEED = "eagle3 run PARAMS --stages 5 --remeasure-speed"

_MORE_DATA = ("add prompts like your traffic to synthesize.sources (your own logs or a chat data set), and/or "
              "let the target write its own with a {kind: self} source (self-prompting), then re-run stages 1-5")


# the recipes of the embedded target sized for a drafter that helps (README "Results")
SIZED_RECIPES = ("params/smollm2-135m-2x.yaml (twice the self-written prompts, about 63 minutes on 2 CPU cores: "
                 "`make run PARAMS=params/smollm2-135m-2x.yaml`) or the GPU recipe params/smollm2-135m-h200.yaml "
                 "(50,000 self-written conversations, docs/GPU.md)")


def default_demonstration(params) -> bool:
    """Whether ``params`` train the default demonstration's drafter: the embedded default target on
    the default prompts (:func:`eagle3.config.default_sources`, no ``synthesize.limit``), which
    ``make run`` sizes to finish in about 35 minutes on 2 CPU cores, small data by design."""
    from eagle3.config import Params, default_sources

    return (params.target.model == Params().target.model and params.synthesize.sources == default_sources()
            and params.synthesize.limit is None and not params.evaluate.drafter_dir)


def _prompts(s: SetStats, where: str) -> str:
    """``", 96 prompts"`` (``", 2 prompts: few, a noisy measurement"`` under 8) of a set for the
    measurement ``where`` (offline: the offline prompts); empty when not recorded (0: a set with no
    prompts has no numbers to warn about)."""
    n = s.get(OFFLINE_EAGLE3, "prompts") if where == "offline" else s.prompts
    if not n:
        return ""
    return f", {n} prompt{'s' if n != 1 else ''}" + (": few, a noisy measurement" if n < 8 else "")


def _drafter(s: SetStats, metric: str) -> tuple[float | None, str]:
    """The drafter's ``metric`` on one set and where it comes from: vLLM, else offline."""
    if s.get(VLLM_EAGLE3, metric) is not None:
        return s.get(VLLM_EAGLE3, metric), "vLLM"
    return s.get(OFFLINE_EAGLE3, metric), "offline"


def set_tau(s: SetStats) -> tuple[float | None, str]:
    """The drafter's τ on one set and where it comes from: vLLM, else offline."""
    return _drafter(s, "tau")


def set_tokens_per_forward(s: SetStats) -> tuple[float | None, str]:
    """The drafter's tokens per target forward on one set: vLLM, else offline."""
    return _drafter(s, "tokens_per_forward")


def _r(x: float | None) -> float | None:
    return round(float(x), 4) if x is not None else None


def _below_ngram(sets: dict[str, SetStats]) -> list[dict]:
    """``drafter_below_ngram`` on each set where the drafter's tokens per forward are below n-gram's."""
    out = []
    for name, s in sets.items():
        d, where = set_tokens_per_forward(s)
        ng = s.get(VLLM_NGRAM, "tokens_per_forward")
        if d is not None and ng is not None and d < ng:
            out.append({"rule": "drafter_below_ngram",
                        # the prompt count says how much to trust it: a 2-prompt set is not a 96-prompt one
                        "message": f"on {name} ({s.domain}{_prompts(s, where)}) the drafter gives {d:.3f} tokens "
                                   f"per target forward ({where}), n-gram prompt lookup {ng:.3f}: serving n-gram would be "
                                   f"as fast, for free",
                        "numbers": {"set": name, "tokens_per_forward_drafter": _r(d), "source": where,
                                    "tokens_per_forward_ngram": _r(ng)},
                        "fix": f"train on more and more varied data ({_MORE_DATA}); until then serve with "
                               "speculative_config {method: ngram}"})
    return out


def _ood_far_below_id(sets: dict[str, SetStats], ratio: float) -> list[dict]:
    """``ood_far_below_id`` on each out-of-domain set whose accepted drafts per round fall below
    ``ratio`` times the in-distribution set's (the held-out split, else the first in-distribution set)."""
    ids = [(n, set_tau(s)) for n, s in sets.items() if s.domain == "in-distribution" and set_tau(s)[0] is not None]
    ref = next(((n, t) for n, t in ids if n == "heldout"), ids[0] if ids else None)
    if ref is None:
        return []
    out = []
    id_name, (id_tau, id_where) = ref
    for name, s in sets.items():
        tau, where = set_tau(s)
        if s.domain != "out-of-domain" or tau is None or not tau - 1 < ratio * (id_tau - 1):
            continue
        out.append({"rule": "ood_far_below_id",
                    "message": f"out-of-domain τ on {name} is {tau:.3f} ({where}) against {id_tau:.3f} on "
                               f"{id_name} ({id_where}): accepted drafts per round {tau - 1:.3f} < "
                               f"{ratio} x {id_tau - 1:.3f}; the drafter learned its training "
                               f"distribution, not the target",
                    "numbers": {"set": name, "tau_ood": _r(tau), "in_distribution_set": id_name,
                                "tau_id": _r(id_tau), "ratio": ratio, "rule": "tau_ood - 1 < ratio * (tau_id - 1)"},
                    "fix": f"train on data like the traffic you will serve: {_MORE_DATA}"})
    return out


def _small(conv: int, toks: int, below: list[str], ev, training: dict, demonstration: bool) -> dict:
    """The ``small_training_data`` warning; on the default demonstration an expected one, its fix the
    recipes sized for more (:data:`SIZED_RECIPES`); with a ``kind: self`` source already there, its
    fix is that source's count."""
    numbers = {"conversations": conv, "completion_tokens": toks, "min_conversations": ev.warn_min_conversations,
               "min_tokens": ev.warn_min_tokens}
    measured = (f"the drafter was trained on {conv} conversations / {toks} completion tokens "
                f"({' and '.join(below)}, the evaluate.warn_min_* thresholds)")
    if demonstration:
        return {"rule": "small_training_data", "expected": True, "numbers": numbers,
                "message": f"expected of the default demonstration, small by design to finish in about 35 minutes "
                           f"on 2 CPU cores: {measured}",
                "fix": f"train on more with a recipe sized for it: {SIZED_RECIPES}"}
    if "self" in (training.get("sources") or {}):
        fix = ("more training conversations: raise the count of the kind: self source (e.g. --set "
               "synthesize.sources.N.self_prompt.count=..., N its place in the list), add sources, or raise a "
               "source's limit or synthesize.limit where one is set")
    else:
        fix = ("more training conversations: add sources, raise a source's limit or synthesize.limit where one is "
               "set, or add a {kind: self, self_prompt: {count: N}} source (the target writes N prompts itself)")
    return {"rule": "small_training_data", "message": measured, "numbers": numbers, "fix": fix}


def _training_data(training: dict, ev, demonstration: bool = False) -> list[dict]:
    """``small_training_data`` and ``narrow_training_data`` from stage 1's counts (when known)."""
    if not training.get("known"):
        return []
    out = []
    conv, toks = int(training.get("conversations", 0)), int(training.get("completion_tokens", 0))
    below = [f"{conv} conversations < {ev.warn_min_conversations}"] if conv < ev.warn_min_conversations else []
    below += [f"{toks} completion tokens < {ev.warn_min_tokens}"] if toks < ev.warn_min_tokens else []
    if below:
        out.append(_small(conv, toks, below, ev, training, demonstration))
    srcs, cats = training.get("sources") or {}, training.get("categories") or {}
    if len(srcs) <= 1 or len(cats) <= 1:
        what = f"one source ({', '.join(srcs) or 'none'})" if len(srcs) <= 1 else f"one category ({', '.join(cats)})"
        out.append({"rule": "narrow_training_data",
                    "message": f"the training conversations come from {what}: a drafter learns the "
                               f"distribution it is trained on",
                    "numbers": {"sources": dict(srcs), "categories": dict(cats)},
                    "fix": _MORE_DATA})
    return out


def _unsteady_speed(sets: dict[str, SetStats], pooled: PooledStats | None, tolerance: float) -> list[dict]:
    """``unsteady_speed``: one warning per group (each set, then all sets pooled) with a vLLM method
    whose timing rounds disagree, naming the methods, their per-round tokens/s and the speed-ups hit."""
    groups: list[tuple[str, SetStats | PooledStats]] = list(sets.items()) + ([("all sets pooled", pooled)] if pooled else [])
    out = []
    for name, g in groups:
        bad = [m for m in g.methods if is_vllm(m) and g.get(m, "speed_steady") is False]
        # rounds that agree, but a speed-up above what the timed answers allow: a load that slowed one
        # engine more than another all along (stats.SPEEDUP_SLACK)
        over = [m for m in g.methods if is_vllm(m) and m != VLLM_NONE and m not in bad
                and speedup_bound(g.methods[m]) and isinstance(g.get(m, "speedup"), float)
                and g.get(m, "speedup") > SPEEDUP_SLACK * speedup_bound(g.methods[m])]
        if not bad and not over:
            continue
        busy = [m for m in bad if g.get(m, "speed_busy_cpus")]
        rows = "; ".join(f"{LABELS.get(m, m)} {g.get(m, 'tokens_per_s'):.1f} tokens/s, rounds "
                         f"{', '.join(f'{x:.1f}' for x in g.get(m, 'tokens_per_s_rounds') or [])} (spread "
                         f"{g.get(m, 'speed_spread'):.0%})" for m in bad if m not in busy)
        beside = "; ".join(f"{LABELS.get(m, m)} {g.get(m, 'tokens_per_s'):.1f} tokens/s" for m in busy)
        above = "; ".join(f"{LABELS.get(m, m)} {g.get(m, 'speedup'):.2f}x with "
                          f"{speedup_bound(g.methods[m]):.3f} tokens per target forward" for m in over)
        hit = [LABELS.get(m, m) for m in g.methods if g.get(m, "speedup_steady") is False and m != VLLM_NONE]
        cpus = max((g.get(m, "speed_busy_cpus") for m in busy), default=0.0)
        what = " and ".join(x for x in (
            f"the requests were timed while other processes took {cpus:.1f} CPUs: {beside}" if busy else "",
            f"the timing rounds disagree beyond {tolerance:.0%}: {rows}" if rows else "",
            f"the speed-up exceeds what the timed answers allow: {above}" if over else "") if x)
        out.append({"rule": "unsteady_speed",
                    "message": f"on {name} {what}; another load disturbed the timing, so "
                               + ("these tokens/s" if bad else "") + (" and " if bad and hit else "")
                               + (f"the speed-ups of {', '.join(hit)}" if hit else "") + " are not a result",
                    "numbers": {"set": name, "methods": bad + over,
                                "speed_spread": {m: g.get(m, "speed_spread") for m in bad}, "tolerance": tolerance},
                    "fix": f"measure the speed again on a quiet machine: `{REMEASURE_SPEED}` (acceptance is reused)"})
    return out


def mismatch_warnings(sets: dict[str, SetStats], training: dict, ev, *, pooled: PooledStats | None = None,
                      demonstration: bool = False) -> list[dict]:
    """The warnings that apply, in :data:`RULES` order.

    Args:
        sets: stage 5's per-set stats (:class:`eagle3.evaluate.stats.SetStats`: ``domain``, prompt
            counts and the grid; the drafter's numbers from vLLM, else offline; n-gram's from vLLM).
        training: :func:`eagle3.evaluate.prompts.training_data` (``known``, ``conversations``,
            ``completion_tokens``, ``sources``, ``categories``).
        ev: ``params.evaluate`` (``warn_min_conversations``, ``warn_min_tokens``, ``warn_ood_ratio``,
            ``speed_spread_tolerance``).
        pooled: every set pooled (its speed rows are checked too).
        demonstration: the run is the default demonstration (:func:`default_demonstration`): its
            small-data warning is expected (``"expected": true``) and names the larger recipes.

    Returns:
        list[dict]: ``{"rule", "message", "numbers", "fix"}`` each (plus ``"expected": true`` on a
        warning the run's own recipe is known to trip); empty when none applies.
    """
    return (_below_ngram(sets) + _ood_far_below_id(sets, ev.warn_ood_ratio)
            + _training_data(training, ev, demonstration)
            + _unsteady_speed(sets, pooled, ev.speed_spread_tolerance))
