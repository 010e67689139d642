"""Why training's validation tau_hat is above the tau vLLM measures: the TTT chain of a drafter at
every position of the target's own greedy text, teacher forced, on this machine's target.

For each prompt of a stage-5 vLLM result (``vllm_eagle3.json``: prompt ids, vLLM's output tokens, the
accepted drafts of each round), the target runs over prompt + output once; the drafter's first pass reads
every position (its KV cache, as vLLM's proposer fills it) and, at each position ``p`` of the output, the
chain continues from a copy of that cache cut at ``p`` (the offline decoder's ``Eagle3Drafter``). Printed per
set (held-out split / general chat):

* ``every position``: 1 + the chain length averaged over every output position: what training's
  ``val_tau_hat`` estimates (speculators' full accuracies, summed);
* ``round walk``: rounds walked as decoding schedules them (first at the first draft position, then
  ``chain + 1`` further): ``eagle3.train.metrics.simulate_rounds``' rule, i.e. ``val_tau_sim``;
* ``vLLM``: the engine's own rounds on the same text.

With ``--samples SAMPLES.jsonl`` (the GPU run's stage-1 samples) the same is computed on each held-out
prompt's *training* answer (generated in bf16 on the GPU) instead of vLLM's float32 output, so that the
text's share of the gap is separated from the rounds' share.

usage: rounds_vs_positions.py VLLM_EAGLE3_JSON DRAFTER_DIR K [--samples SAMPLES.jsonl]
  e.g. rounds_vs_positions.py outputs/smollm2-135m/05_evaluate/vllm_eagle3.json outputs/smollm2-135m/04_train/drafter 3
Runs the embedded target in float32 on CPU (~15 min for 192 prompts of 128 tokens on 2 cores).
"""
from __future__ import annotations

import argparse
import copy
import json


def chains(target, runner, drafter_model, seq: list[int], first: int, k: int) -> list[int]:
    """Chain length (0..k) of each round start ``p`` in ``first .. len(seq)-3`` (a round at ``p`` drafts
    ``seq[p+2], seq[p+3], ...``: the target's state at ``p`` and token ``p+1`` feed the first draft)."""
    import torch
    from transformers import DynamicCache

    from eagle3.drafters import crop_cache
    from eagle3.drafters.eagle3 import Eagle3Drafter

    _, aux = runner.forward(torch.tensor([seq]), DynamicCache())
    dr = Eagle3Drafter(drafter_model)
    dl, fb = dr.step(torch.tensor(seq[1:]), dr.combine(aux[:-1]), torch.arange(len(seq) - 1))
    full_cache = dr.cache
    out = []
    for p in range(first, len(seq) - 2):
        c, d = 0, dr.to_target(dl[p].argmax()[None])
        if int(d) == seq[p + 2]:
            c = 1
            dr.cache = copy.deepcopy(full_cache)  # the chain sees positions 0..p only
            crop_cache(dr.cache, p + 1)
            dr.length, h = p + 1, fb[p:p + 1]
            for s in range(1, k):
                if p + 2 + s >= len(seq):
                    break
                lg, h = dr.step(d, h, torch.tensor([p + s]))
                d = dr.to_target(lg[-1].argmax()[None])
                if int(d) != seq[p + 2 + s]:
                    break
                c += 1
        out.append(c)
    return out


def main() -> None:
    import numpy as np
    import torch

    from eagle3.contracts.drafter import read_config
    from eagle3.evaluate.drafter import load_drafter
    from eagle3.hooks import CachedCapture
    from eagle3.params_file import load_params
    from eagle3.target import load_target
    from eagle3.train.metrics import simulate_rounds

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("vllm_json")
    ap.add_argument("drafter_dir")
    ap.add_argument("k", type=int)
    ap.add_argument("--samples", default=None)
    args = ap.parse_args()
    params = load_params(None, {})
    target, tok, _ = load_target(params.target, dtype="float32", device="cpu")
    target.eval()
    drafter_model = load_drafter(args.drafter_dir, target)
    runner = CachedCapture(target, read_config(args.drafter_dir)["eagle_aux_hidden_state_layer_ids"])
    per_prompt = json.load(open(args.vllm_json))["per_prompt"]
    answers = {}
    if args.samples:
        from eagle3.chat import ChatRenderer

        rend = ChatRenderer(tok)
        want = {pp["id"] for pp in per_prompt}
        for line in open(args.samples, encoding="utf-8"):
            s = json.loads(line)
            if s["id"] in want:  # the training answer as stage 2 renders it, prompt cut off
                answers[s["id"]] = rend.render_ids([s["messages"][:2]], add_generation_prompt=False)[0]
    agg: dict[str, dict] = {}
    with torch.no_grad():
        for pp in per_prompt:
            L = len(pp["prompt_ids"])
            name = "general chat" if pp["id"].startswith("general") else "held-out"
            texts = {"vLLM's output": pp["prompt_ids"] + pp["tokens"]}
            if pp["id"] in answers:
                texts["training answer"] = pp["prompt_ids"] + answers[pp["id"]][L:][:len(pp["tokens"])]
            for text, seq in texts.items():
                c = chains(target, runner, drafter_model, seq, L - 1, args.k)
                a = agg.setdefault((name, text), {"every": [], "walk": [0, 0], "vllm": [], "n": 0})
                a["every"] += c
                # one answer, every position a draft position: the rounds stage 4's val_tau_sim walks
                walked = simulate_rounds(c, np.ones(len(c), dtype=bool), np.zeros(len(c), dtype=int), args.k)
                a["walk"] = [a["walk"][0] + walked[0], a["walk"][1] + walked[1]]
                a["vllm"] += pp["per_step_accepted"] if text == "vLLM's output" else []
                a["n"] += 1
    runner.close()
    tau = lambda xs: 1 + sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    print(f"| set | text | prompts | every position (tau_hat) | round walk (tau_sim) | vLLM (k={args.k}) |")
    print("|---|---|---|---|---|---|")
    for (name, text), a in sorted(agg.items()):
        print(f"| {name} | {text} | {a['n']} | {tau(a['every']):.3f} | {a['walk'][0] / a['walk'][1]:.3f} ({a['walk'][1]} rounds) | "
              f"{tau(a['vllm']):.3f} ({len(a['vllm'])} rounds) |")


if __name__ == "__main__":
    main()
