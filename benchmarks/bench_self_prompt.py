"""Self-prompting throughput in vLLM (stage 1, ``kind: self``): where the tokens/s go, side by side.

One in-process engine (the stage's own :class:`eagle3.synthesize.local.VllmBackend` and its
``sample_user_turns``); the first-turn requests of the params file's first
``kind: self`` source (:func:`eagle3.synthesize.self_prompt.plan_requests`, request numbers 0..N-1), sampled
in variants that each change one thing against the stage's way (``stage``: ``synthesize.batch_size``
requests per ``generate`` call, per-request seeds, the source's top-p and max tokens):

* ``one call``: all N requests in one ``generate`` call (vLLM's continuous batching refills the
  rows that end; the stage's fixed batches each wait for their longest row);
* ``no seeds``: the same batches without per-request seeds (vLLM's shared generator);
* ``top-p 1``: without top-p (no sort of the logits); ``top-k K``: top-k instead of top-p (no sort).

Variants run in turn, ``--repeats`` rounds, best kept; tokens/s = generated tokens (the end-of-turn
token counted) / wall seconds of the ``generate`` calls; ``rows/step`` = generated tokens / decode
steps (the sum over calls of the longest row), the batch occupancy the fixed batches leave.

    .venv/bin/python benchmarks/bench_self_prompt.py --requests 128
"""

from __future__ import annotations

import argparse
import dataclasses
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="params/smollm2-135m.yaml")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--variants", default="stage,one call,no seeds,top-p 1")
    args = ap.parse_args()

    from eagle3.params_file import load_params
    from eagle3.synthesize.local import VllmBackend
    from eagle3.synthesize.self_prompt import plan_requests

    params = load_params(args.params)
    src = next(s for s in params.synthesize.sources if s.kind == "self")
    settings = src.self_prompt
    bs = params.synthesize.batch_size
    t0 = time.perf_counter()
    be = VllmBackend(params)
    load_s = time.perf_counter() - t0
    reqs = plan_requests(be.tok, settings, range(args.requests))
    variants = {
        "stage": (settings, bs, True),
        "one call": (settings, len(reqs), True),
        "no seeds": (settings, bs, False),
        "top-p 1": (settings.model_copy(update=dict(top_p=1.0)), bs, True),
        "top-k 50": (settings.model_copy(update=dict(top_p=1.0, top_k=50)), bs, True),
        "top-k 100": (settings.model_copy(update=dict(top_p=1.0, top_k=100)), bs, True),
        "top-k 50 one call": (settings.model_copy(update=dict(top_p=1.0, top_k=50)), len(reqs), True),
    }
    names = [v.strip() for v in args.variants.split(",")]
    best: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name in names:
            s, size, seeded = variants[name]
            rs = reqs if seeded else [dataclasses.replace(r, seed=None) for r in reqs]
            toks = steps = unended = 0
            t = time.perf_counter()
            for i in range(0, len(rs), size):
                cands = be.sample_user_turns(rs[i:i + size], s)
                toks += sum(c.num_tokens for c in cands)
                steps += max(c.num_tokens for c in cands)
                unended += sum(c.finish_reason != "stop" for c in cands)
            dt = time.perf_counter() - t
            row = {"calls": -(-len(rs) // size), "tokens": toks, "s": dt, "tps": toks / dt, "occ": toks / steps,
                   "unended": unended}
            print(f"  {name}: {row['tps']:.1f} tokens/s ({toks} tokens, {dt:.1f} s)", flush=True)
            if name not in best or row["tps"] > best[name]["tps"]:
                best[name] = row
    be.close()
    base = best[names[0]]["tps"]
    print(f"\nself-prompting in vLLM: target {params.target.model} ({params.target.dtype}), {len(reqs)} requests, "
          f"T {settings.temperature}, top-p {settings.top_p}, max tokens {settings.max_new_tokens}, "
          f"engine start {load_s:.0f} s")
    print("| variant | generate calls | tokens | not ended | rows/step | s | tokens/s | x stage |\n|---|---|---|---|---|---|---|---|")
    for name in names:
        r = best[name]
        print(f"| {name} | {r['calls']} | {r['tokens']} | {r['unended']} | {r['occ']:.1f} | {r['s']:.1f} | "
              f"{r['tps']:.1f} | {r['tps'] / base:.2f} |")


if __name__ == "__main__":
    main()
