"""transformers generate throughput of the embedded 135M target on this GPU (bf16, greedy).

usage: bench_synthesize_hf.py N_PROMPTS MAX_NEW BS[,BS...] [static]   (PROMPTS_DIR: the two jsonl files)
Prompts: AlpacaEval instructions + GSM8K test questions, rendered with the chat template, sorted by
length, cut into batches of BS (left padding), like eagle3.synthesize's TransformersBackend.
tokens/s = completion tokens (up to and including the first <|im_end|>) / generate wall time.
"""
import json
import os
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle3.params_file import load_params
from eagle3.target import resolve_target

N, MAXNEW = int(sys.argv[1]), int(sys.argv[2])
BSS = [int(x) for x in sys.argv[3].split(",")]
static = len(sys.argv) > 4 and sys.argv[4] == "static"
r = resolve_target(load_params(None, {"target": {"model": "embedded:smollm2-135m"}}).target)
tok = AutoTokenizer.from_pretrained(r.path)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
model = AutoModelForCausalLM.from_pretrained(r.path, dtype=torch.bfloat16).to(DEV).eval()
gc = model.generation_config
eos = gc.eos_token_id if isinstance(gc.eos_token_id, list) else [gc.eos_token_id]
pad = gc.pad_token_id if gc.pad_token_id is not None else eos[0]
tok.pad_token_id = pad  # transformers 5.17's GGUF tokenizer has none (see tok_probe)
tok.padding_side = "left"
d = Path(os.environ.get("PROMPTS_DIR", "../shared/data/prompts"))
texts = [json.loads(line)["instruction"] for line in open(d / "alpaca_eval_instructions.jsonl")]
texts += [json.loads(line)["question"] for line in open(d / "gsm8k_test.jsonl")]
texts = texts[:N]
rendered = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True) for t in texts]
lens = [len(tok(x, add_special_tokens=False)["input_ids"]) for x in rendered]
order = sorted(range(len(rendered)), key=lambda i: lens[i])
print(f"{len(texts)} prompts, prompt tokens mean {sum(lens) / len(lens):.0f} max {max(lens)}; eos {eos} pad {pad}; "
      f"static={static}", flush=True)
res = []
for bs in BSS:
    torch.cuda.synchronize() if DEV == "cuda" else None
    tot_new = tot_pos = steps = 0
    t0 = time.perf_counter()
    for i in range(0, len(order), bs):
        batch = [rendered[j] for j in order[i:i + bs]]
        enc = tok(batch, padding=True, return_tensors="pt", add_special_tokens=False).to(DEV)
        kw = dict(max_new_tokens=MAXNEW, do_sample=False, pad_token_id=pad, eos_token_id=eos)
        if static:
            kw["cache_implementation"] = "static"
        with torch.inference_mode():
            out = model.generate(**enc, **kw)
        new = out[:, enc["input_ids"].shape[1]:]
        steps += new.shape[1]
        tot_pos += new.numel()
        for row in new.tolist():
            k = next((n for n, t in enumerate(row) if t in eos), None)
            tot_new += (k + 1) if k is not None else len(row)
    torch.cuda.synchronize() if DEV == "cuda" else None
    dt = time.perf_counter() - t0
    rec = {"batch_size": bs, "prompts": len(order), "max_new_tokens": MAXNEW, "static_cache": static,
           "completion_tokens": tot_new, "generated_positions": tot_pos, "useful_share": round(tot_new / tot_pos, 3),
           "decode_steps": steps, "wall_s": round(dt, 2), "tokens_per_s": round(tot_new / dt, 1),
           "ms_per_step": round(1000 * dt / steps, 2),
           "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if DEV == "cuda" else None}
    print("SYN", json.dumps(rec), flush=True)
    res.append(rec)
out = Path(os.environ.get("OUT", ".")) / f"synth_{'static' if static else 'dynamic'}.json"
out.write_text(json.dumps(res, indent=1))
