#!/usr/bin/env python
"""Compare two run directories of the same params (e.g. params/ci.yaml before and after a refactor).

    python scripts/compare_runs.py outputs/ci-before outputs/ci

Checks, stage by stage:

* every number (int, float, bool; nested dicts and lists included) of each ``stats.json``, except
  wall-clock, rate and time keys (:data:`SKIPPED_KEYS`, and keys ending in ``_s``, ``_per_s`` or
  ``_seconds``, or holding ``per_s``): those differ between two runs of the same code; likewise
  ``cache_hit`` (whether the vocab mapping came from the machine's cache);
* the sample ids of ``01_synthesize/samples.jsonl`` (as sets: vLLM may finish them in another order);
* the sha256 of each hidden-state file named in ``03_extract/manifest.jsonl``, per sample id;
* the exported drafter tensors (``04_train/drafter/*.safetensors``): names, dtypes, shapes and
  ``torch.equal`` per tensor.

Prints one table row per check and exits 0 when everything agrees, 1 on any difference, 2 when a
run directory does not exist.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from eagle3.contracts.hidden_states import read_entries
from eagle3.contracts.samples import read_samples
from eagle3.io import read_json
from eagle3.rundir import STAGES, RunDir

# Keys whose values depend on the machine's speed or the clock, not on the computation, and
# `cache_hit` (stage 2 found its mapping in the machine's cache from an earlier run: same tensors).
SKIPPED_KEYS = frozenset({
    "cache_hit",
    "finished_at", "elapsed_s", "load_s", "generation_s", "setup_s", "train_time_s", "writer_busy_s",
    "tokens_per_s", "tokens_per_s_this_session", "write_bytes_per_s", "calibration_tokens_per_s",
    "preflight_projected_seconds", "projected_seconds", "tokens_per_s_vllm_eagle3", "tokens_per_s_vllm_ngram",
    "tokens_per_s_vllm_none", "speedup_vllm_eagle3",
})
_TIME_RE = re.compile(r"(_s|_per_s|_seconds)$|per_s")


def skipped(key: str) -> bool:
    """True for a wall-clock / rate / time key (its last dotted component decides)."""
    last = key.rsplit(".", 1)[-1]
    return last in SKIPPED_KEYS or bool(_TIME_RE.search(last))


def numbers(obj, prefix: str = "") -> dict[str, float | int | bool]:
    """Dotted key -> value of every int/float/bool leaf of a JSON value (lists indexed ``key.0``)."""
    out: dict = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(numbers(v, f"{prefix}{k}."))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.update(numbers(v, f"{prefix}{i}."))
    elif isinstance(obj, (bool, int, float)):
        out[prefix[:-1]] = obj
    return out


def compare_stats(a: RunDir, b: RunDir) -> list[tuple[str, str, bool]]:
    """(check, detail, ok) per stage: the numbers of both ``stats.json`` files."""
    rows = []
    for s, name in STAGES.items():
        sa, sb = read_json(a.stats(s), None), read_json(b.stats(s), None)
        if sa is None and sb is None:
            continue
        if sa is None or sb is None:
            rows.append((f"{name}/stats.json", f"only in {'B' if sa is None else 'A'}", False))
            continue
        na = {k: v for k, v in numbers(sa).items() if not skipped(k)}
        nb = {k: v for k, v in numbers(sb).items() if not skipped(k)}
        diff = sorted(k for k in na.keys() | nb.keys() if na.get(k, "(absent)") != nb.get(k, "(absent)"))
        detail = (f"{len(na)} numbers equal" if not diff else
                  "; ".join(f"{k}: {na.get(k, '(absent)')} != {nb.get(k, '(absent)')}" for k in diff[:8])
                  + (f" (+{len(diff) - 8} more)" if len(diff) > 8 else ""))
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
