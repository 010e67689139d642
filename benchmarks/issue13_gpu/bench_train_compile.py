"""Issue 13 failure 2: time to the first training step (torch.compile), step time and SIGTERM-to-exit
of ``python -m eagle3.train`` on SmolLM2-135M shapes (hidden 576, 30 layers, vocab 49152; draft vocab
16384, token budget 8192), synthetic hidden states (benchmarks/bench_train.py's synthetic_run).

usage: bench_train_compile.py WORK NAME:attn:loss:cap_s[:after_s[:compile_mode[:first]]] ...
  attn: auto | sdpa | simple_flex_attention;  loss: auto | eager | fused
  compile_mode: train.compile (attention | speculators | none), default attention
  SIGTERM goes `after_s` seconds after the first step (or, with `first`, that long into the first
  step, once progress.json shows the first-step phase), or at `cap_s`.
env: FAKE_TARGET=1 (config-only target with random head weights; else the embedded GGUF, converted),
  NSAMP (samples, 300), DRAFT (16384), BUDGET (8192), LOGDIR (logs; default $OUT), TORCH_LOGS
  (default "recompiles,graph_breaks"), STACK_EVERY (s between all-thread stack dumps; 0 = off).
Each variant gets its own TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR (cold compile). Prints one
RESULT json line per variant and appends it to LOGDIR/results.jsonl. See benchmarks/RESULTS.md.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from eagle3.params_file import dump_params, load_params
from eagle3.target import resolve_target

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench_train
OUT = Path(os.environ.get("LOGDIR") or os.environ["OUT"])
OUT.mkdir(parents=True, exist_ok=True)
work = Path(sys.argv[1])
work.mkdir(parents=True, exist_ok=True)

if os.environ.get("FAKE_TARGET"):
    import torch as _t
    from bench_train import SMOLLM2_135M, fake_target
    tpath = work / "target"
    if not (tpath / "config.json").exists():
        fake_target(tpath, SMOLLM2_135M, _t.bfloat16)
    tgt = type("Target", (), {"path": tpath})
else:
    tgt = resolve_target(load_params(None, {"target": {"model": "embedded:smollm2-135m"}}).target)
rd = work / "run"
if not (rd / "03_extract" / "manifest.jsonl").exists():
    from bench_train import synthetic_run
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(120, 700, size=int(os.environ.get("NSAMP", "300")))]
    t0 = time.time()
    synthetic_run(rd, 576, 30, 49152, int(os.environ.get("DRAFT", "16384")), lengths)
    print(f"synthetic data {len(lengths)} samples in {time.time()-t0:.1f}s", flush=True)
budget = int(os.environ.get("BUDGET", "8192"))
for spec in sys.argv[2:]:
    parts = spec.split(":")
    name, attn, loss, cap = parts[0], parts[1], parts[2], float(parts[3])
    after = float(parts[4]) if len(parts) > 4 else 15.0
    cmode = parts[5] if len(parts) > 5 else "attention"
    term_in_first = len(parts) > 6 and parts[6] == "first"  # SIGTERM `after` s into the first step
    shutil.rmtree(rd / "04_train", ignore_errors=True)
    p = load_params(None, {"target": {"model": str(tgt.path), "dtype": "auto", "device": "cuda"},
                           "tracking": {"mode": "disabled"},
                           "train": {"token_budget": budget, "epochs": 3, "max_steps": 400, "lr": 1e-3, "warmup_steps": 5,
                                     "eval_every": 25, "checkpoint_every": 1000, "val_fraction": 0.05,
                                     "attn_implementation": attn, "loss_implementation": loss, "compile": cmode}})
    pf = work / f"{name}.yaml"
    pf.write_text(dump_params(p))
    env = dict(os.environ, STACKLOG=str(OUT / f"{name}_stacks.txt"), PYTHONUNBUFFERED="1",
               TORCHINDUCTOR_CACHE_DIR=str(work / f"inductor_{name}"), TRITON_CACHE_DIR=str(work / f"triton_{name}"))
    env.setdefault("TORCH_LOGS", "recompiles,graph_breaks")
    lf = open(OUT / f"{name}.log", "w")
    t0 = time.time()
    pr = subprocess.Popen([sys.executable, str(Path(__file__).parent / "train_with_stacks.py"), str(pf), "--run-dir", str(rd)],
                          env=env, stdout=lf, stderr=subprocess.STDOUT)
    mf = rd / "04_train" / "metrics.jsonl"
    first = sent = rc = phase_seen = sent_abs = None
    pj = rd / "04_train" / "progress.json"
    while True:
        rc = pr.poll()
        now = time.time() - t0
        if rc is not None:
            break
        if first is None and mf.exists() and mf.stat().st_size:
            first = now
            print(f"[{name}] first step after {first:.1f}s", flush=True)
        if phase_seen is None and pj.exists():
            try:
                ph = json.loads(pj.read_text()).get("extra", {}).get("phase")
            except Exception:  # noqa: BLE001 - a progress.json being rewritten: poll again
                ph = None
            if ph and ph.startswith("first step"):
                phase_seen = now
                print(f"[{name}] progress phase {ph!r} at {now:.1f}s", flush=True)
        fire = (first is not None and now > first + after) if not term_in_first else (phase_seen is not None and now > phase_seen + after)
        if sent is None and (fire or now > cap):
            pr.send_signal(signal.SIGTERM)
            sent, sent_abs = now, time.time()
            print(f"[{name}] SIGTERM at {now:.1f}s", flush=True)
        if sent is not None and now > sent + 30:
            pr.kill()
            print(f"[{name}] SIGKILL: no exit 30 s after SIGTERM", flush=True)
            pr.wait()
            rc = "killed"
            break
        time.sleep(0.25)
    end = time.time() - t0
    recs = [json.loads(x) for x in mf.read_text().splitlines()] if mf.exists() else []
    tr = [r for r in recs if r["kind"] == "train"]
    rate = None
    if len(tr) > 6:
        m = tr[3:]
        rate = sum(r["tokens"] for r in m[1:]) / (m[-1]["t"] - m[0]["t"])
    prog = (rd / "04_train" / "progress.json")
    res = {"name": name, "attn": attn, "loss": loss, "first_step_s": first, "steps": len(tr),
           "val_evals": sum(r["kind"] == "val" for r in recs), "tokens_per_s_after_warmup": rate,
           "step_time_s": [r["time_s"] for r in tr[:4]], "sigterm_at_s": sent,
           "exit_after_sigterm_s": None if sent is None or rc == "killed" else round(end - sent, 1), "rc": rc,
           "checkpoints": sorted(x.name for x in (rd / "04_train" / "checkpoints").glob("step_*")),
           "progress": json.loads(prog.read_text()) if prog.exists() else None, "compile": cmode,
           "phase_seen_s": phase_seen, "first_step_time_s": tr[0]["time_s"] if tr else None}
    if sent_abs is not None and res["progress"]:
        res["progress_closed_after_sigterm_s"] = round(res["progress"]["updated"] - sent_abs, 2)
    if len(tr) > 2:
        res["step_gaps_s"] = [round(b["t"] - a["t"], 3) for a, b in zip(tr, tr[1:])]
    print("RESULT", json.dumps(res), flush=True)
    with open(OUT / "results.jsonl", "a") as f:
        f.write(json.dumps(res) + "\n")
