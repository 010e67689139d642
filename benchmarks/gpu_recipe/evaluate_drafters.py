"""Stage 5 on a CPU (or any vLLM) machine for drafters trained on a GPU machine and brought back: each
drafter is evaluated with eagle3.evaluate.run in a run dir that holds the GPU run's stage-1 samples (so
every drafter meets the same held-out split, and the general-chat set excludes every training prompt of
the full run, a superset of each subset's) and ``evaluate.drafter_dir`` pointing at the drafter.

usage: evaluate_drafters.py ROOT NAME:DRAFTER_DIR:K:METHODS [...] [--set key=value ...]
  ROOT/samples_full.jsonl: the GPU run's samples; run dirs ROOT/eval/NAME; METHODS = eagle3+ngram+none
  e.g. evaluate_drafters.py gpu full:gpu/full/drafter:3:eagle3+ngram+none --set evaluate.num_prompts=96
Prints one line "EVAL {json}" per run (per set: τ, tokens per target forward, per-position acceptance,
tokens/s per method) and leaves each run's results.json / stats.json in ROOT/eval/NAME/05_evaluate.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main() -> None:
    from eagle3.evaluate import run
    from eagle3.params_file import apply_overrides, load_params, parse_overrides
    from eagle3.rundir import RunDir

    root = Path(sys.argv[1])
    args = sys.argv[2:]
    sets = [a for i, a in enumerate(args) if i > 0 and args[i - 1] == "--set"]
    specs = [a for i, a in enumerate(args) if a != "--set" and not (i > 0 and args[i - 1] == "--set")]
    for spec in specs:
        name, drafter, k, methods = spec.split(":")
        over: dict = {"run": {"name": name, "output_dir": str(root / "eval")}, "tracking": {"mode": "disabled"},
                      "target": {"max_model_len": 2048},
                      "evaluate": {"drafter_dir": drafter, "num_speculative_tokens": int(k),
                                   "vllm_methods": methods.split("+")}}
        over = apply_overrides(over, parse_overrides(sets))
        params = load_params(None, over)
        rd = RunDir(root / "eval" / name)
        samples = rd.samples
        samples.parent.mkdir(parents=True, exist_ok=True)
        if not samples.exists():
            samples.symlink_to(root / "samples_full.jsonl")
        t = time.time()
        st = run(params, rd.root)
        out = {"run": name, "k": int(k), "wall_s": round(time.time() - t, 1)}
        res = json.loads((rd.stage(5) / "results.json").read_text())
        out["sets"] = res.get("sets")
        out["warnings"] = [w.get("rule") if isinstance(w, dict) else w for w in (st.to_dict().get("warnings") or [])]
        print("EVAL", json.dumps(out, default=str), flush=True)


if __name__ == "__main__":  # vLLM engines spawn processes
    main()
