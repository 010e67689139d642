"""Stage 5's speed pass of a finished run, timed quiet and beside one CPU-bound job, under thread settings.

    python benchmarks/bench_speed_pass.py outputs/smollm2-135m [--rounds 3] [--repeats 1] \
        [--settings default,OMP_NUM_THREADS=2+NUMBA_NUM_THREADS=2]

Each cell runs the run's own speed pass again (:func:`eagle3.evaluate.vllm_jobs.run_speed` on the engines
of ``05_evaluate/logs/speed_<method>.job.json``, the prompts its ``vllm_speed.json`` timed, fresh engine
processes, the methods in turn prompt by prompt): ``default`` is what stage 5 does (the engines' threads
from :func:`eagle3.machine.timing_threads` at their start), ``NAME=value[+NAME=value]`` sets variables
first (a thread count set so is kept, as a user's is). "Beside a job": ``python -c 'while True: pass'``
as another process (outside this process tree, so it counts as other load) from one second before the
engines start until the cell ends. Prints tokens/s per method, the speed-ups over no speculation, and
per setting the ratio of the speed-ups beside the job to the quiet ones (1.00: the job changed nothing).
The engine logs go to a temporary folder; the run is not changed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eagle3.rundir import ENGINE_LOGS_DIR


def _other_job() -> int:
    """The pid of a busy loop that is not this process's child (``sh`` exits and leaves it to init)."""
    out = subprocess.run(["sh", "-c", f"{sys.executable} -c 'while True: pass' >/dev/null 2>&1 & echo $!"],
                         capture_output=True, text=True, check=True)
    return int(out.stdout)


def cell(run: Path, setting: str, loaded: bool, rounds: int) -> dict[str, float]:
    """``{method: tokens/s}`` of one speed pass of ``run`` under ``setting``, beside a job if ``loaded``."""
    from eagle3.evaluate.vllm_jobs import run_speed

    stage = run / "05_evaluate"
    jobs = {m: json.loads((stage / ENGINE_LOGS_DIR / f"speed_{m}.job.json").read_text())
            for m in ("none", "ngram", "eagle3") if (stage / ENGINE_LOGS_DIR / f"speed_{m}.job.json").exists()}
    timed = json.loads((stage / "vllm_speed.json").read_text())["methods"]
    ids = list(dict.fromkeys(r["id"] for r in next(iter(timed.values()))["speed"]))
    saved = dict(os.environ)
    for part in (p for p in setting.split("+") if "=" in p):
        name, value = part.split("=", 1)
        os.environ[name] = value
    job = _other_job() if loaded else None
    try:
        time.sleep(1.0 if loaded else 0.0)
        with tempfile.TemporaryDirectory() as work:
            out = run_speed(jobs, ids, rounds, work)
    finally:
        if job is not None:
            os.kill(job, signal.SIGKILL)
        os.environ.clear()
        os.environ.update(saved)
    return {m: sum(r["output_tokens"] for r in res["speed"]) / sum(r["time_s"] for r in res["speed"])
            for m, res in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", type=Path, help="a run folder whose stage 5 finished with a speed pass")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the speed pass per cell")
    ap.add_argument("--repeats", type=int, default=1, help="cells per setting and load, interleaved")
    ap.add_argument("--settings", default="default,OMP_NUM_THREADS=2+NUMBA_NUM_THREADS=2")
    args = ap.parse_args()
    settings = args.settings.split(",")
    rows = []
    for rep in range(args.repeats):
        for setting in settings:
            for loaded in (False, True):
                rate = cell(args.run, setting, loaded, args.rounds)
                rows.append((setting, loaded, rate))
                print(f"repeat {rep + 1}: {setting} {'beside a job' if loaded else 'quiet'}: "
                      + ", ".join(f"{m} {v:.1f}" for m, v in rate.items()) + " tokens/s", flush=True)
    print(f"\nspeed pass of {args.run}, {args.rounds} rounds per cell, {os.cpu_count()} CPUs")
    print("| setting | load | none tokens/s | n-gram | EAGLE-3 drafter | n-gram speed-up | drafter speed-up |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    speedups: dict = {}
    for setting, loaded, rate in rows:
        up = {m: rate[m] / rate["none"] for m in ("ngram", "eagle3") if m in rate}
        speedups.setdefault((setting, loaded), []).append(up)
        print(f"| {setting} | {'beside a job' if loaded else 'quiet'} | {rate['none']:.1f} | {rate.get('ngram', 0):.1f} | "
              f"{rate.get('eagle3', 0):.1f} | {up.get('ngram', 0):.3f}x | {up.get('eagle3', 0):.3f}x |")
    print("\n| setting | n-gram speed-up beside a job / quiet | drafter speed-up beside a job / quiet |")
    print("| --- | --- | --- |")
    for setting in settings:
        mean = {k: {m: sum(u[m] for u in v) / len(v) for m in v[0]} for k, v in speedups.items() if k[0] == setting}
        q, b = mean[(setting, False)], mean[(setting, True)]
        print(f"| {setting} | " + " | ".join(f"{b[m] / q[m]:.3f}" for m in ("ngram", "eagle3") if m in q) + " |")


if __name__ == "__main__":  # vLLM engines spawn processes
    main()
