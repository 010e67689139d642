"""The data-scaling curve of the GPU recipe (benchmarks/RESULTS.md): vLLM τ of each drafter on the
general-chat set and on the held-out split vs the conversations it was trained on, beside its
validation τ̂; one figure and a Markdown table.

usage: scaling_curve.py ROOT OUT.png NAME=CONVERSATIONS [...]
  ROOT/eval/NAME/05_evaluate/results.json (evaluate_drafters.py) and ROOT/stats/NAME/04_train/stats.json
  (brought back from the GPU); e.g. scaling_curve.py gpu curve.png n1000=1000 n4000=4000 full=50692
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

SETS = (("general-chat", "general chat (out-of-domain)"), ("heldout", "held-out split (in-distribution)"))


def main() -> None:
    root, out = Path(sys.argv[1]), Path(sys.argv[2])
    rows = []
    for spec in sys.argv[3:]:
        name, conv = spec.split("=")
        res = json.loads((root / "eval" / name / "05_evaluate" / "results.json").read_text())
        train = json.loads((root / "stats" / name / "04_train" / "stats.json").read_text())
        row = {"name": name, "conversations": int(conv), "steps": train["total_steps"],
               "tokens_seen": train["tokens_seen"], "val_tau_hat": train["best_val_tau_hat"]}
        for key, _ in SETS:
            m = res["sets"][key]["methods"]["vllm/eagle3"]
            row[key] = (m["tau"], m["per_position_unconditional"], m["prompts"])
        rows.append(row)
    rows.sort(key=lambda r: r["conversations"])
    print("| conversations | steps (3 epochs) | validation τ̂ | general chat τ (per position) | held-out τ (per position) |")
    print("|---|---|---|---|---|")
    for r in rows:
        cells = [f"{r[k][0]:.2f} ({' / '.join(f'{x:.2f}' for x in r[k][1])})" for k, _ in SETS]
        print(f"| {r['conversations']:,} | {r['steps']:,} | {r['val_tau_hat']:.2f} | {cells[0]} | {cells[1]} |")
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    xs = [r["conversations"] for r in rows]
    for key, label in SETS:
        ax.plot(xs, [r[key][0] for r in rows], marker="o", label=f"vLLM τ, {label}")
    ax.plot(xs, [r["val_tau_hat"] for r in rows], marker="s", linestyle="--", label="validation τ̂ (training)")
    ax.set_xscale("log")
    ax.set_xlabel("training conversations (SmolLM2-135M-Instruct answers, epochs held at 3)")
    ax.set_ylabel("acceptance length τ (k = 3, T = 0)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
