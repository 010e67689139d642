"""Decoding speed with and without the drafter, measured side by side on the same held-out prompts.

    python benchmarks/bench_evaluate.py --params params/ci.yaml [--drafter DIR] [--prompts 4] [--vllm]

Prints one table: target-only greedy decoding (transformers ``generate``) vs offline EAGLE-3
speculation (:func:`eagle3.evaluate.speculative_generate`), and with ``--vllm`` vLLM with the drafter,
with n-gram lookup and without speculation (one engine per subprocess: every prompt one request at a
time, plus the stage's batched acceptance pass over all prompts for eagle3 and n-gram).
The drafter defaults to the run's stage 4 export; the prompts are every evaluation set's (`--prompts` per set).
Offline speculation in eager PyTorch is not expected to be faster (Python overhead per round); the
vLLM rows are the ones that matter for serving.
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    import torch

    from eagle3.chat import stop_token_ids, template_kwargs
    from eagle3.evaluate import (
        find_drafter,
        heldout_prompts,
        load_drafter,
        run_vllm_job,
        speculative_generate,
        training_reference,
    )
    from eagle3.evaluate.vllm_jobs import build_job
    from eagle3.params_file import load_params
    from eagle3.rundir import resolve_run_dir
    from eagle3.target import load_target, resolve_target

    ap = argparse.ArgumentParser()
    ap.add_argument("--params", default="params/ci.yaml")
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--vllm", action="store_true")
    a = ap.parse_args()
    params = load_params(a.params, {"evaluate": {"num_prompts": a.prompts, **({"drafter_dir": a.drafter} if a.drafter else {})}})
    run_dir = resolve_run_dir(params)
    ev = params.evaluate
    model, tok, _ = load_target(params.target)
    prompts, _ = heldout_prompts(params, run_dir, tok)
    drafter = find_drafter(params, run_dir)
    ref = training_reference(params, run_dir, drafter)
    dm = load_drafter(drafter, model, ref, device=str(model.device))
    stops = stop_token_ids(tok, resolve_target(params.target).path, model.generation_config, model.config,
                           kwargs=template_kwargs(params))
    rows = []
    t0, n = time.time(), 0
    for p in prompts:
        out = model.generate(torch.tensor([p["prompt_ids"]], device=model.device), max_new_tokens=ev.max_new_tokens,
                             do_sample=False, pad_token_id=tok.eos_token_id)
        n += out.shape[1] - len(p["prompt_ids"])
    rows.append(("transformers greedy (no speculation)", n / (time.time() - t0), "-"))
    t0, n, acc, rounds = time.time(), 0, 0, 0
    for p in prompts:
        r = speculative_generate(model, dm, p["prompt_ids"], ev.num_speculative_tokens, ev.max_new_tokens,
                                 ref.aux_layer_ids, stop_ids=stops)
        n += len(r["tokens"])
        acc += sum(x[2] for x in r["rounds"])
        rounds += len(r["rounds"])
    rows.append((f"transformers EAGLE-3 offline (k={ev.num_speculative_tokens})", n / (time.time() - t0),
                 f"{1 + acc / max(rounds, 1):.2f}"))
    if a.vllm:
        import tempfile
        from pathlib import Path

        tmp = Path(tempfile.mkdtemp(prefix="bench-eval-"))
        for method in ("none", "ngram", "eagle3"):
            # every prompt timed one request at a time (the stage times evaluate.speed_prompts per set)
            job = build_job(params, method, resolve_target(params.target).path, drafter, prompts, None,
                            speed_ids=[p["id"] for p in prompts])
            job |= {"seed": 0, "temperature": 0.0}  # greedy, one seed: the rows compare like with like
            res = run_vllm_job(job, tmp / f"{method}.json")
            c = res["counters"] or {}
            d = c.get("vllm:spec_decode_num_drafts")
            tau = f"{1 + c['vllm:spec_decode_num_accepted_tokens'] / d:.2f}" if d else "-"
            rows.append((f"vLLM {method}", res["tokens_per_s"], tau))
            if res.get("generate_s"):  # the stage's acceptance pass: all prompts batched
                rows.append((f"  acceptance pass, max_num_seqs={res['max_num_seqs']}",
                             res["output_tokens"] / res["generate_s"], tau))
    print(f"{'method':<48}{'tokens/s':>10}{'tau':>8}")
    for name, tps, tau in rows:
        print(f"{name:<48}{tps:>10.1f}{tau:>8}")
    base = rows[0][1]
    print(f"\noffline speculation / greedy: {rows[1][1] / base:.2f}x")
    if a.vllm:
        tps = {name: t for name, t, _ in rows}
        print(f"vLLM eagle3 / vLLM none: {tps['vLLM eagle3'] / tps['vLLM none']:.2f}x")


if __name__ == "__main__":
    main()
