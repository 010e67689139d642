#!/usr/bin/env python
"""Compare two run directories of the same params (e.g. params/ci.yaml before and after a refactor).

    python scripts/compare_runs.py outputs/ci-before outputs/ci

Checks, stage by stage:

* every number (int, float, bool; nested dicts and lists included) of each ``stats.json``, by its
  path of dot-joined keys (``sets.heldout.methods.vllm/eagle3.tau``), except wall-clock, rate and
  time keys (:data:`SKIPPED_KEYS`, and keys ending in ``_s``, ``_per_s`` or ``_seconds``, or holding
  ``per_s``): those differ between two runs of the same code; likewise ``cache_hit`` (whether the
  vocab mapping came from the machine's cache). NaN equals NaN (a τ of no rounds). A stage 5
  ``stats.json`` of the earlier flat layout (``tau_vllm``, ``sets.<set>.tokens_per_s_vllm_none``, ...)
  is compared by the paths its numbers have in the grid layout (:func:`grid_paths`): every number
  it holds must be in the other run, equal; numbers that only the grid layout records are counted,
  not compared;
* the sample ids of ``01_synthesize/samples.jsonl`` (as sets: vLLM may finish them in another order);
* the sha256 of each hidden-state file named in ``03_extract/manifest.jsonl``, per sample id;
* the exported drafter tensors (``04_train/drafter/*.safetensors``): names, dtypes, shapes and
  ``torch.equal`` per tensor.

Prints one table row per check and exits 0 when everything agrees, 1 on any difference, 2 when a
run directory does not exist.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

from eagle3.contracts.hidden_states import read_entries
from eagle3.contracts.samples import read_samples
from eagle3.evaluate.methods import OFFLINE_EAGLE3, VLLM_EAGLE3, VLLM_NGRAM, vllm_method
from eagle3.evaluate.stats import number_leaves
from eagle3.io import read_json
from eagle3.rundir import EVALUATE, STAGES, RunDir

# Keys whose values depend on the machine's speed or the clock, not on the computation, and
# `cache_hit` (stage 2 found its mapping in the machine's cache from an earlier run: same tensors).
SKIPPED_KEYS = frozenset({
    "cache_hit",
    "finished_at", "elapsed_s", "load_s", "generation_s", "setup_s", "train_time_s", "writer_busy_s",
    "tokens_per_s", "tokens_per_s_this_session", "write_bytes_per_s", "calibration_tokens_per_s",
    "preflight_projected_seconds", "projected_seconds", "speedup",
})
_TIME_RE = re.compile(r"(_s|_per_s|_seconds)$|per_s")


def skipped(key: str) -> bool:
    """True for a wall-clock / rate / time key (its last dotted component decides)."""
    last = key.rsplit(".", 1)[-1]
    return last in SKIPPED_KEYS or bool(_TIME_RE.search(last))


# Stage 5's stats.json of the earlier flat layout: a per-method name stood at the top (pooled over
# every set; now pooled.methods.<method>.<metric>) and in each set (now sets.<set>.methods.<method>.<metric>).
FLAT_METHOD_KEYS = {
    "tau_offline": (OFFLINE_EAGLE3, "tau"), "tokens_per_forward_offline": (OFFLINE_EAGLE3, "tokens_per_forward"),
    "draft_acceptance_rate_offline": (OFFLINE_EAGLE3, "draft_acceptance_rate"),
    "offline_prompts": (OFFLINE_EAGLE3, "prompts"),
    "tau_vllm": (VLLM_EAGLE3, "tau"), "tokens_per_forward_vllm": (VLLM_EAGLE3, "tokens_per_forward"),
    "draft_acceptance_rate_vllm": (VLLM_EAGLE3, "draft_acceptance_rate"),
    "speed_tokens_per_forward_vllm": (VLLM_EAGLE3, "speed_tokens_per_forward"),
    "tau_ngram": (VLLM_NGRAM, "tau"), "tokens_per_forward_ngram": (VLLM_NGRAM, "tokens_per_forward"),
    "speed_tokens_per_forward_ngram": (VLLM_NGRAM, "speed_tokens_per_forward"),
    **{f"tokens_per_s_vllm_{m}": (vllm_method(m), "tokens_per_s") for m in ("eagle3", "ngram", "none")},
    **{f"speedup_vllm_{m}": (vllm_method(m), "speedup") for m in ("eagle3", "ngram")},
}
# ... and its run-level names, each now in its part
FLAT_RUN_KEYS = {
    "num_prompts": "pooled.prompts", "excluded_training": "pooled.excluded_training", "k": "settings.k",
    "temperature": "settings.temperature", "parity_ok": "parity.ok", "parity_gap": "parity.gap",
    "parity_tolerance": "parity.tolerance", "parity_prompts": "parity.prompts",
    "parity_tau_offline": "parity.tau_offline", "parity_tau_vllm": "parity.tau_vllm",
}


def is_flat_layout(stats: dict) -> bool:
    """True for a stage 5 ``stats.json`` written before the grid (numbers at the top, no ``settings``)."""
    return "settings" not in stats and "k" in stats


def grid_paths(flat: dict[str, float | int | bool]) -> dict[str, float | int | bool]:
    """The numbers of a flat-layout stage 5 ``stats.json`` (:func:`number_leaves`) by their path in the
    grid layout. The flat layout wrote ``offline_prompts`` 0 in a set without offline numbers, where
    the grid has no offline entry: those zeros are dropped."""
    out = {}
    for path, v in flat.items():
        head, _, rest = path.partition(".")
        last = path.rsplit(".", 1)[-1]
        if not rest and path in FLAT_RUN_KEYS:
            path = FLAT_RUN_KEYS[path]
        elif not rest and path in FLAT_METHOD_KEYS:
            path = "pooled.methods.{}.{}".format(*FLAT_METHOD_KEYS[path])
        elif head == "sets" and last in FLAT_METHOD_KEYS and rest != last:  # sets.<set>.<flat name>
            if last == "offline_prompts" and v == 0:
                continue
            path = "sets.{}.methods.{}.{}".format(rest[: -len(last) - 1], *FLAT_METHOD_KEYS[last])
        out[path] = v
    return out


def _same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def _stats_numbers(stage: int, stats: dict) -> tuple[dict, bool]:
    """(path -> number, not the skipped ones; whether the file is of the flat stage 5 layout)."""
    flat = stage == EVALUATE and is_flat_layout(stats)
    nums = grid_paths(number_leaves(stats)) if flat else number_leaves(stats)
    return {k: v for k, v in nums.items() if not skipped(k)}, flat


def compare_stats(a: RunDir, b: RunDir) -> list[tuple[str, str, bool]]:
    """(check, detail, ok) per stage: the numbers of both ``stats.json`` files, path by path."""
    rows = []
    for s, name in STAGES.items():
        sa, sb = read_json(a.stats(s), None), read_json(b.stats(s), None)
        if sa is None and sb is None:
            continue
        if sa is None or sb is None:
            rows.append((f"{name}/stats.json", f"only in {'B' if sa is None else 'A'}", False))
            continue
        (na, flat_a), (nb, flat_b) = _stats_numbers(s, sa), _stats_numbers(s, sb)
        # one side flat: the grid side's numbers that the flat layout never recorded are not compared
        new = set()
        if flat_a != flat_b:
            new = (nb.keys() - na.keys()) if flat_a else (na.keys() - nb.keys())
        diff = sorted(k for k in (na.keys() | nb.keys()) - new if not _same(na.get(k, "(absent)"), nb.get(k, "(absent)")))
        detail = (f"{len(na.keys() & nb.keys())} numbers equal" if not diff else
                  "; ".join(f"{k}: {na.get(k, '(absent)')} != {nb.get(k, '(absent)')}" for k in diff[:8])
                  + (f" (+{len(diff) - 8} more)" if len(diff) > 8 else ""))
        if flat_a != flat_b:
            detail += (f" (run {'A' if flat_a else 'B'}: the flat layout, compared by grid paths; "
                       f"{len(new)} numbers only the grid records)")
        rows.append((f"{name}/stats.json", detail, not diff))
    return rows


def compare_sample_ids(a: RunDir, b: RunDir) -> list[tuple[str, str, bool]]:
    if not a.samples.exists() and not b.samples.exists():
        return []
    ia = {r["id"] for r in read_samples(a.root)} if a.samples.exists() else set()
    ib = {r["id"] for r in read_samples(b.root)} if b.samples.exists() else set()
    ok = ia == ib
    detail = f"{len(ia)} ids equal" if ok else f"{len(ia - ib)} only in A, {len(ib - ia)} only in B"
    return [("samples.jsonl ids", detail, ok)]


def _manifest(rd: RunDir) -> dict[str, str]:
    # Later lines for the same row win (a resumed stage re-journals a redone file).
    return {e["id"]: e["sha256"] for e in read_entries(rd.manifest)}


def compare_hidden_states(a: RunDir, b: RunDir) -> list[tuple[str, str, bool]]:
    if not a.manifest.exists() and not b.manifest.exists():
        return []
    ma, mb = _manifest(a), _manifest(b)
    diff = sorted(i for i in ma.keys() | mb.keys() if ma.get(i) != mb.get(i))
    detail = f"{len(ma)} file sha256s equal" if not diff else f"{len(diff)} differ, e.g. {diff[0]}"
    return [("hidden-state sha256 (manifest)", detail, not diff)]


def compare_drafter(a: RunDir, b: RunDir) -> list[tuple[str, str, bool]]:
    import torch
    from safetensors.torch import load_file

    fa = sorted(p.name for p in a.drafter_dir.glob("*.safetensors"))
    fb = sorted(p.name for p in b.drafter_dir.glob("*.safetensors"))
    if not fa and not fb:
        return []
    rows = []
    if fa != fb:
        rows.append(("drafter files", f"A {fa} != B {fb}", False))
    for name in sorted(set(fa) & set(fb)):
        ta, tb = load_file(a.drafter_dir / name), load_file(b.drafter_dir / name)
        bad = sorted(k for k in ta.keys() | tb.keys()
                     if k not in ta or k not in tb or ta[k].dtype != tb[k].dtype or ta[k].shape != tb[k].shape
                     or not torch.equal(ta[k], tb[k]))
        detail = f"{len(ta)} tensors equal" if not bad else f"{len(bad)} of {len(ta | tb)} differ: {', '.join(bad[:5])}"
        rows.append((f"drafter/{name}", detail, not bad))
    return rows


def compare(run_a: str | Path, run_b: str | Path) -> list[tuple[str, str, bool]]:
    """All checks as (check, detail, ok) rows."""
    a, b = RunDir(run_a), RunDir(run_b)
    return compare_stats(a, b) + compare_sample_ids(a, b) + compare_hidden_states(a, b) + compare_drafter(a, b)


def format_table(rows: list[tuple[str, str, bool]]) -> str:
    w = max([len(r[0]) for r in rows] + [5])
    lines = [f"{'check':<{w}}  result     detail", f"{'-' * w}  ---------  ------"]
    lines += [f"{c:<{w}}  {'same' if ok else 'DIFFERENT':<9}  {d}" for c, d, ok in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_a", help="the first run directory (e.g. the baseline)")
    ap.add_argument("run_b", help="the second run directory")
    args = ap.parse_args(argv)
    for d in (args.run_a, args.run_b):
        if not Path(d).is_dir():
            print(f"compare_runs: {d} is not a run directory", file=sys.stderr)
            return 2
    rows = compare(args.run_a, args.run_b)
    if not rows:
        print("compare_runs: nothing to compare (no stage output in either directory)", file=sys.stderr)
        return 1
    print(format_table(rows))
    bad = sum(not ok for _, _, ok in rows)
    print(f"\n{len(rows) - bad} of {len(rows)} checks agree" + ("" if not bad else f"; {bad} DIFFERENT"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
