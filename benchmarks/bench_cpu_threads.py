"""The target's decoding on a CPU, quiet and beside one CPU-bound job, under OpenMP wait settings:
libgomp's default (threads spin at the end of each parallel region), ``OMP_WAIT_POLICY=PASSIVE``
(they sleep) or a ``GOMP_SPINCOUNT`` (spin that long, then sleep), or any other variables (fewer threads).

    python benchmarks/bench_cpu_threads.py [--params params/smollm2-135m.yaml] [--tokens 48] [--rounds 2] \
        [--policies default,PASSIVE,GOMP_SPINCOUNT=1000,OMP_NUM_THREADS=1] [--vllm]

Each cell is a fresh process (OpenMP reads its settings when it starts), the cells interleaved round by
round; "beside a job" starts ``python -c 'while True: pass'`` for the cell's duration. transformers:
greedy decoding of one prompt in the target's dtype on every CPU (torch's default thread count);
``--vllm``: the same in a vLLM engine with the project's CPU settings (about a minute per cell). Prints
tokens/s per cell (the median over rounds) and the ratios to the first setting.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROMPT = "Write a short paragraph about why the sky is blue."


def child(params_file: str, tokens: int, use_vllm: bool) -> None:
    """Decode ``tokens`` greedy tokens (after one warm-up) and print ``{"tokens_per_s": x}``."""
    from eagle3.params_file import load_params
    from eagle3.target import load_target, resolve_target, target_dtype

    params = load_params(params_file)
    if use_vllm:
        from vllm import LLM, SamplingParams

        from eagle3.vllm_utils import engine_kwargs

        llm = LLM(**engine_kwargs(resolve_target(params.target).path, dtype=target_dtype(params.target)))
        sampling = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        llm.generate([PROMPT], sampling, use_tqdm=False)
        start = time.perf_counter()
        out = llm.generate([PROMPT], sampling, use_tqdm=False)
        n = len(out[0].outputs[0].token_ids)
    else:
        import torch

        model, tok, _ = load_target(params.target, device="cpu")
        ids = torch.tensor([tok(PROMPT)["input_ids"]])
        kw = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=tok.eos_token_id)
        with torch.no_grad():
            model.generate(ids, **kw)
            start = time.perf_counter()
            n = model.generate(ids, **kw).shape[1] - ids.shape[1]
    print(json.dumps({"tokens_per_s": n / (time.perf_counter() - start)}), flush=True)


def cell(args, policy: str | None, loaded: bool) -> float:
    """One fresh process's tokens/s under ``policy`` (None: OpenMP's default; ``NAME=value``: that variable,
    e.g. ``GOMP_SPINCOUNT=10000``, several joined by ``+``; else an ``OMP_WAIT_POLICY``), beside a busy
    job if ``loaded``."""
    env = dict(os.environ)
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "EAGLE3_OPENMP_AUTO"):
        env.pop(name, None)
    for setting in (policy or "").split("+"):
        if "=" in setting:
            name, value = setting.split("=", 1)
            env[name] = value
        elif setting:
            env["OMP_WAIT_POLICY"] = setting
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if loaded else None
    try:
        cmd = [sys.executable, __file__, "--child", "--params", args.params, "--tokens", str(args.tokens)]
        out = subprocess.run(cmd + (["--vllm"] if args.vllm else []), env=env, capture_output=True, text=True, check=True)
    finally:
        if busy:
            busy.kill()
            busy.wait()
    line = [x for x in out.stdout.splitlines() if x.startswith("{")][-1]
    return json.loads(line)["tokens_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", default="params/smollm2-135m.yaml")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--vllm", action="store_true")
    ap.add_argument("--policies", default="default,PASSIVE",
                    help="comma-separated: default, an OMP_WAIT_POLICY value, or NAME=value[+NAME=value] "
                         "(GOMP_SPINCOUNT=10000, OMP_NUM_THREADS=1, VLLM_CPU_OMP_THREADS_BIND=0)")
    ap.add_argument("--child", action="store_true")
    args = ap.parse_args()
    if args.child:
        return child(args.params, args.tokens, args.vllm)
    policies = [None if p == "default" else p for p in args.policies.split(",")]
    cells = [(p, loaded) for loaded in (False, True) for p in policies]
    rates: dict = {c: [] for c in cells}
    for r in range(args.rounds):
        for c in cells:
            rates[c].append(cell(args, *c))
            print(f"round {r + 1}: {c[0] or 'default'} {'beside a job' if c[1] else 'quiet'}: {rates[c][-1]:.1f} tokens/s", flush=True)
    med = {c: statistics.median(v) for c, v in rates.items()}
    engine = "vLLM" if args.vllm else "transformers"
    print(f"\n{engine} decoding, {args.tokens} tokens, {os.cpu_count()} CPUs, median of {args.rounds} rounds")
    print("| OpenMP setting | quiet tokens/s | beside one busy job | busy / quiet | vs default: quiet / beside a job |")
    print("| --- | --- | --- | --- | --- |")
    for p in policies:
        q, b = med[(p, False)], med[(p, True)]
        print(f"| {p or 'default (spin)'} | {q:.1f} | {b:.1f} | {b / q:.2f} | "
              f"{q / med[(policies[0], False)]:.2f} / {b / med[(policies[0], True)]:.2f} |")


if __name__ == "__main__":  # vLLM engines spawn processes
    main()
