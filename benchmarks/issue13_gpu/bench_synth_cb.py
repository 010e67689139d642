"""Stage 1's transformers backend on this GPU: padded ``generate`` vs continuous batching
(``generate_batch``, eagle3.synthesize.local.generate_continuous), embedded 135M target, bf16, greedy.

usage: bench_synth_cb.py N_PROMPTS MAX_NEW VARIANT [VARIANT ...]
  VARIANT = padded:BATCH | cb:CALL_SIZE[:key=value,...]   (key=value: ContinuousBatchingConfig fields)
PROMPTS_DIR holds alpaca_eval_instructions.jsonl, gsm8k_test.jsonl, gsm8k_train.jsonl; prompts are
taken in that order (the first 1,024 are last session's set: benchmarks/RESULTS.md).
tokens/s = completion tokens (up to and including the first stop id, as stage 1 counts them) / wall
time of all calls (the continuous manager's start and CUDA-graph warm-up of each call included).
Prints one line "SYN {json}" per variant and writes $OUT/synth_cb.json.
"""
import json
import os
import sys
import time
from pathlib import Path

import torch

from eagle3.chat import ChatRenderer, pad_token_id, stop_token_ids
from eagle3.params_file import load_params
from eagle3.synthesize.local import generate_continuous, generate_padded
from eagle3.target import load_target

N, MAXNEW = int(sys.argv[1]), int(sys.argv[2])
p = load_params(None, {"target": {"model": "embedded:smollm2-135m", "dtype": "bfloat16", "device": "cuda"}})
model, tok, _ = load_target(p.target)
rend = ChatRenderer(tok, {})
eos = stop_token_ids(tok, None, model.generation_config, kwargs=rend.kwargs)
pad = pad_token_id(tok, eos)
d = Path(os.environ.get("PROMPTS_DIR", "../shared/data/prompts"))
texts = [json.loads(x)["instruction"] for x in open(d / "alpaca_eval_instructions.jsonl")]
texts += [json.loads(x)["question"] for x in open(d / "gsm8k_test.jsonl")]
texts += [json.loads(x)["question"] for x in open(d / "gsm8k_train.jsonl")]
rows = [rend.encode(rend.render([{"role": "user", "content": t}])) for t in texts[:N]]
print(f"{len(rows)} prompts, prompt tokens mean {sum(map(len, rows)) / len(rows):.0f} max {max(map(len, rows))}; "
      f"stop ids {eos} pad {pad}; torch {torch.__version__}", flush=True)


def count(toks):
    k = next((i for i, t in enumerate(toks) if t in eos), None)
    return (k + 1) if k is not None else min(len(toks), MAXNEW)


def padded(bs):
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))  # as stage 1 (run_batched)
    out = [None] * len(rows)
    for i in range(0, len(order), bs):
        idx = order[i:i + bs]
        kw = dict(pad_id=pad, eos_ids=eos, max_new_tokens=MAXNEW)
        batch = [rows[j] for j in idx]
        gen = generate_padded(model, batch, **kw)
        for j, o in zip(idx, gen):
            out[j] = o
    return out


res = []
for spec in sys.argv[3:]:
    kind, size, *rest = spec.split(":")
    kw = {}
    for item in (rest[0].split(",") if rest and rest[0] else []):
        k, v = item.split("=")
        kw[k] = json.loads(v) if v not in ("True", "False") else v == "True"
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    calls = []
    if kind == "padded":
        outs = padded(int(size))
    else:
        outs = []
        for i in range(0, len(rows), int(size)):
            t1 = time.perf_counter()
            outs += generate_continuous(model, rows[i:i + int(size)], max_new_tokens=MAXNEW, eos_ids=eos, pad_id=pad,
                                        config_kwargs=kw)
            calls.append(round(time.perf_counter() - t1, 2))
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    toks = sum(count(o) for o in outs)
    rec = {"variant": spec, "prompts": len(rows), "max_new_tokens": MAXNEW, "completion_tokens": toks,
           "stopped": sum(1 for o in outs if any(t in eos for t in o[:MAXNEW])), "wall_s": round(dt, 2),
           "tokens_per_s": round(toks / dt, 1), "call_s": calls,
           "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)}
    print("SYN", json.dumps(rec), flush=True)
    res.append(rec)
    if kind == "padded" and "ref" not in dir():
        ref = outs
    if kind != "padded" and "ref" in dir():
        same = sum(1 for a, b in zip(ref, outs) if a[:count(a)] == b[:count(b)])
        print(f"  greedy turns identical to padded: {same}/{len(outs)}", flush=True)
        rec["identical_to_padded"] = same
    # written after every variant: a later one that hangs (killed by timeout) loses nothing
    (Path(os.environ.get("OUT", ".")) / "synth_cb.json").write_text(json.dumps(res, indent=1))
