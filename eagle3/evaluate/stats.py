"""Stage 5's ``stats.json``: a grid of numbers, ``sets[set].methods[method][metric]``, its one reader.

The grid holds, per evaluation set and pooled over every set (``pooled``), per measurement
(:mod:`eagle3.evaluate.methods`), the metrics of :data:`METRICS` that were measured, plus
``speedup``; beside it the run-level parts: ``settings``, ``parity``, ``warnings``,
``diagnosis``, ``training_data``, ``measured`` and the serve command. Example::

    {"settings": {"k": 3, "temperature": 0.0, "acceptance_rule": "exact match with the target argmax"},
     "pooled": {"prompts": 16, "excluded_training": 0, "speed_prompts": 2,
                "methods": {"vllm/eagle3": {"tau": 1.42, "tokens_per_forward": 1.42, ...}, ...}},
     "sets": {"general-chat": {"domain": "out-of-domain", "prompts": 8, ..., "methods": {...}}, ...},
     "parity": {"ok": true, "gap": 0.01, "tolerance": 0.15, "prompts": 4, "tau_offline": 1.5, "tau_vllm": 1.49},
     "warnings": [...], "diagnosis": [], "training_data": {...}, "measured": {...},
     "vllm_serve_command": "...", "vllm_serve_where": "..."}

A number's place is a path of dot-joined keys (``pooled.methods.vllm/eagle3.tau``): the report's
index names its headline numbers so (:data:`HEADLINE_PAIRS`), and ``scripts/compare_runs.py``
compares two runs path by path (:func:`number_leaves`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from eagle3.evaluate.methods import METHODS, OFFLINE_EAGLE3, VLLM_EAGLE3, VLLM_NGRAM, VLLM_NONE, is_vllm
from eagle3.evaluate.metrics import paired_speedup
from eagle3.evaluate.prompts import out_of_domain_first
from eagle3.rundir import EVALUATE
from eagle3.stage import Stats, stage_record

__all__ = ["METRICS", "SPEED_METRICS", "SPEEDUP_SLACK", "speedup_bound", "HEADLINE_PAIRS", "Settings", "Parity", "PooledStats", "SetStats",
           "EvaluateStats", "grid", "set_stats", "read_stats", "value_at", "number_leaves"]

# What stats.json keeps of each measurement (results.json keeps the rest: per-position rates, rounds,
# splits by source and context). τ: 1 + accepted drafts per round with drafts; tokens per target
# forward: every round counted, a round without drafts as one token; prompts: those the acceptance
# numbers rest on. Adding a metric here adds it to every set and method that measured it.
METRICS = ("tau", "tokens_per_forward", "draft_acceptance_rate", "prompts")
# vLLM's speed pass (one request at a time, on a few prompts per set, every prompt timed once per
# round with the methods interleaved): output tokens/s (the median of the per-round rates), the
# per-round rates, their spread ((max - min) / median) and whether it stayed within
# evaluate.speed_spread_tolerance (False: the rounds disagree, another load disturbed the timing),
# and the tokens per target forward of the timed answers themselves (they bound the speed-up), and
# the most CPUs other processes took from the timed engines' CPUs (None: they took none; else
# speed_steady is False), and the most they took at all (speed_other_cpus). Offline decoding's rate
# (transformers) is not a serving speed: results.json keeps it.
SPEED_METRICS = ("tokens_per_s", "tokens_per_s_rounds", "speed_spread", "speed_steady", "speed_tokens_per_forward",
                 "speed_busy_cpus", "speed_other_cpus")

# How far a speed-up may exceed the tokens per target forward of the answers it was timed on before it
# counts as a disturbed timing: a method's tokens/s over no speculation's is at most its tokens per
# forward, less its drafting cost; 1.25 leaves room for the noise of a few prompts timed one at a time.
# A load that slows one engine more than another all the time (rounds that agree) shows here only.
SPEEDUP_SLACK = 1.25

# The (method, metric) numbers of every set pooled that the report's index and the notebook show.
# The speed-up's flag stands beside it: False when the timing rounds disagree.
HEADLINE_PAIRS = ((OFFLINE_EAGLE3, "tau"), (VLLM_EAGLE3, "tau"), (VLLM_EAGLE3, "tokens_per_forward"),
                  (VLLM_NGRAM, "tau"), (VLLM_NGRAM, "tokens_per_forward"), (VLLM_EAGLE3, "speedup"),
                  (VLLM_EAGLE3, "speedup_steady"))


def speedup_bound(entry: dict) -> float | None:
    """The most a method's speed-up over no speculation can be: the tokens per target forward of its timed
    answers (``speed_tokens_per_forward``), else of its acceptance pass; None where neither is known."""
    bound = entry.get("speed_tokens_per_forward") or entry.get("tokens_per_forward")
    return float(bound) if isinstance(bound, (int, float)) else None


def grid(methods: dict[str, dict]) -> dict[str, dict[str, Any]]:
    """``{method: {metric: value}}`` of one group of prompts from results.json's per-method entries:
    the :data:`METRICS` each entry holds, for vLLM also the :data:`SPEED_METRICS`, ``speedup`` (the
    median over rounds of its tokens/s over no speculation's in the same round,
    :func:`eagle3.evaluate.metrics.paired_speedup`; the ratio of the two medians without per-round
    rates; 1.0 for no speculation itself) and ``speedup_steady`` (both rows' ``speed_steady``: False
    when either's rounds disagree, or when the speed-up exceeds :data:`SPEEDUP_SLACK` times
    :func:`speedup_bound`), in the order of :data:`eagle3.evaluate.methods.METHODS`."""
    none = methods.get(VLLM_NONE) or {}
    out = {}
    for m in sorted(methods, key=lambda m: METHODS.index(m) if m in METHODS else len(METHODS)):
        src = methods[m]
        keep = METRICS + (SPEED_METRICS if is_vllm(m) else ())
        cell = {key: src[key] for key in keep if key in src}
        if is_vllm(m) and src.get("tokens_per_s") and none.get("tokens_per_s"):
            up = paired_speedup(src.get("tokens_per_s_rounds") or [], none.get("tokens_per_s_rounds") or [])
            cell["speedup"] = up if up is not None else src["tokens_per_s"] / none["tokens_per_s"]
            steady = (src.get("speed_steady"), none.get("speed_steady"))
            cell["speedup_steady"] = None if None in steady else all(steady)
            if m != VLLM_NONE and cell["speedup"] > SPEEDUP_SLACK * (speedup_bound(src) or float("inf")):
                cell["speedup_steady"] = False
        out[m] = cell
    return out


class _Grid:
    """``get(method, metric)`` over a group's ``methods``."""

    methods: dict[str, dict[str, Any]]

    def get(self, method: str, metric: str) -> Any:
        """The number, or None where the method or the metric was not measured."""
        return (self.methods.get(method) or {}).get(metric)


@dataclass
class Settings:
    """What the acceptance numbers were measured with: ``k`` draft tokens per round, the sampling
    temperature, and the rule that accepted a draft."""

    k: int
    temperature: float
    acceptance_rule: str = ""


@dataclass
class Parity:
    """The parity check (:mod:`eagle3.evaluate.parity`): ``ok`` is None where it was not checked
    (temperature > 0, or a backend not run); ``gap`` = |τ offline − τ vLLM| / τ offline, both τ on the
    same ``prompts`` (the offline prompts), so ``tau_vllm`` is not the pooled vLLM τ."""

    ok: bool | None = None
    gap: float | None = None
    tolerance: float | None = None
    prompts: int = 0
    tau_offline: float | None = None
    tau_vllm: float | None = None


@dataclass
class PooledStats(_Grid):
    """Every evaluation set together: ``prompts`` (of the acceptance numbers), training prompts
    excluded, ``speed_prompts`` timed, and the grid (τ from vLLM's counters over every prompt,
    offline τ over the offline prompts)."""

    prompts: int = 0
    excluded_training: int = 0
    speed_prompts: int = 0
    methods: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class SetStats(_Grid):
    """One evaluation set: its domain, its prompt counts (and the prompts its source had that were
    left out, by reason: ``candidates`` records, ``excluded_training``, ``duplicates`` of an earlier
    set, ``skipped_too_long``, ``capped`` by ``evaluate.num_prompts``, ``bad_records``), its categories,
    ``speed_prompts`` timed, ``speed_lengths_differ`` (timed prompts whose answers have other lengths
    under other methods: T=0 outputs depend on each engine's batch arithmetic) and the grid."""

    domain: str = ""
    prompts: int = 0
    excluded_training: int = 0
    candidates: int = 0
    duplicates: int = 0
    skipped_too_long: int = 0
    capped: int = 0
    bad_records: int = 0
    categories: int = 0
    speed_prompts: int = 0
    speed_lengths_differ: int = 0
    methods: dict[str, dict[str, Any]] = field(default_factory=dict)


def set_stats(sets: dict[str, dict]) -> dict[str, SetStats]:
    """stats.json ``sets`` from results.json's ``sets``, out-of-domain sets first."""
    out = {}
    for name, e in sorted(sets.items(), key=lambda kv: out_of_domain_first(kv[1]["domain"])):
        info = e["info"]
        out[name] = SetStats(
            domain=e["domain"], prompts=info["count"], excluded_training=info["excluded_training"],
            **{k: info.get(k, 0) for k in ("candidates", "duplicates", "skipped_too_long", "capped", "bad_records")},
            categories=len(info["by_category"]),
            # every method times the same prompts; a method not run times none
            speed_prompts=max([m.get("speed_prompts") or 0 for m in e["methods"].values()] + [0]),
            speed_lengths_differ=len(e.get("speed_lengths_differ") or []),
            methods=grid(e["methods"]))
    return out


@dataclass
class EvaluateStats(Stats):
    """Stage 5's ``stats.json`` (module docstring): the grid per set and pooled, and the run-level parts.

    ``warnings``: the mismatch warnings (:mod:`eagle3.evaluate.mismatch`); ``diagnosis``: why offline
    and vLLM disagree, when they do (:mod:`eagle3.evaluate.diagnosis`); ``training_data``: what the
    drafter was trained on (:func:`eagle3.evaluate.prompts.training_data`); ``measured``: what was
    measured on which prompts, in words.
    """

    settings: Settings
    pooled: PooledStats = field(default_factory=PooledStats)
    sets: dict[str, SetStats] = field(default_factory=dict)
    parity: Parity = field(default_factory=Parity)
    warnings: list[dict] = field(default_factory=list)
    diagnosis: list[str] = field(default_factory=list)
    training_data: dict = field(default_factory=dict)
    measured: dict = field(default_factory=dict)
    vllm_serve_command: str = ""
    vllm_serve_where: str = ""

    HEADLINE: ClassVar[tuple[str, ...]] = (
        "pooled.prompts", "pooled.excluded_training", "settings.k",
        *(f"pooled.methods.{m}.{metric}" for m, metric in HEADLINE_PAIRS),
        "parity.ok", "parity.gap", "vllm_serve_command")

    def headline(self) -> dict[str, Any]:
        """``{path: value}`` of the ``HEADLINE`` paths, for the report index."""
        d = self.to_dict()
        return {path: value_at(d, path) for path in self.HEADLINE}

    def numbers(self) -> dict[str, float | int | bool]:
        """``{path: number}`` of the settings, the grid and the parity (what W&B logs)."""
        d = self.to_dict()
        return number_leaves({k: d[k] for k in ("settings", "pooled", "sets", "parity")})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EvaluateStats:
        """Build from a ``stats.json`` dict (``complete`` and ``finished_at`` ignored).

        Raises:
            ValueError: a stats.json of the earlier flat layout (``tau_vllm``, ... at the top), which
                has no ``settings``: stage 5 writes it again (``--redo 5``), reusing its measurements.
            TypeError: a key this layout does not know.
        """
        if "settings" not in d:
            raise ValueError("a stage 5 stats.json of an earlier layout (flat keys such as tau_vllm): run stage 5 "
                             "again (`eagle3 run PARAMS --stages 5 --redo 5`; it reuses its measurements)")
        plain = {f.name for f in dataclasses.fields(cls)} - {"settings", "pooled", "sets", "parity"}
        return cls(settings=Settings(**d["settings"]), pooled=PooledStats(**d.get("pooled") or {}),
                   sets={n: SetStats(**e) for n, e in (d.get("sets") or {}).items()},
                   parity=Parity(**d.get("parity") or {}), **{k: v for k, v in d.items() if k in plain})


def read_stats(run_dir: str | Path) -> EvaluateStats | None:
    """Stage 5's ``stats.json`` of a run (complete or not), or None when there is none.

    Raises:
        ValueError: the file is of the earlier flat layout (:meth:`EvaluateStats.from_dict`).
    """
    st = stage_record(run_dir, EVALUATE).stats
    return EvaluateStats.from_dict(st) if st else None


def value_at(d: dict, path: str, default: Any = None) -> Any:
    """The value at a dot-joined ``path`` of keys in nested dicts (``parity.ok``), else ``default``."""
    for key in path.split("."):
        if not isinstance(d, dict) or key not in d:
            return default
        d = d[key]
    return d


def number_leaves(obj: Any, prefix: str = "") -> dict[str, float | int | bool]:
    """Dot-joined path -> value of every int/float/bool leaf of a JSON value (list items by index:
    ``warnings.0.numbers.tau_ood``)."""
    out: dict = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(number_leaves(v, f"{prefix}{k}."))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.update(number_leaves(v, f"{prefix}{i}."))
    elif isinstance(obj, (bool, int, float)):
        out[prefix[:-1]] = obj
    return out
