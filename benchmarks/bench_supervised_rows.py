"""Stage 4 on a real run: one training step (forward + backward) of the drafter with
``train.supervised_rows`` off (speculators' forward: both heads and the loss on every packed position)
and on (:class:`eagle3.drafters.eagle3.SupervisedRows`: only the rows the loss mask supervises), alternating
in one process on the same packed micro-batches of the run's stage-3 files, per token budget.

  python benchmarks/bench_supervised_rows.py RUN_DIR [--budgets 2048,1024,512] [--steps 6] [--ttt 2]

RUN_DIR is a finished run of the embedded default (stages 2-3; e.g. outputs/smollm2-135m). Prints one
JSON line per (budget, mode): tokens/s of the measured steps (best of --repeats), the supervised share.
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    from eagle3.contracts.hidden_states import HiddenStatesDataset
    from eagle3.drafters.eagle3 import SupervisedRows, build_drafter
    from eagle3.params_file import load_params
    from eagle3.train.data import MicroBatches, collate_fn, epoch_plan, read_manifest
    from eagle3.train.model import loss_config, resolve_inputs

    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--budgets", default="2048,1024,512")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--ttt", type=int, default=2)
    a = ap.parse_args()
    params = load_params(f"{a.run_dir}/params.yaml")
    inp = resolve_inputs(params, a.run_dir)
    refs = read_manifest(a.run_dir)
    ds = HiddenStatesDataset.for_training(refs, n_aux=inp.n_aux, hidden_size=inp.hidden_size,
                                          vocab_size=inp.target_vocab_size)
    lengths = [max(r.num_tokens - 1, 0) for r in refs]
    for budget in [int(x) for x in a.budgets.split(",")]:
        plan = epoch_plan(lengths, budget, 0, 0)
        # the same tokens per measurement at every budget: 2048 x steps
        n = max(1, (2048 * a.steps) // budget)
        batches = list(MicroBatches(plan[: n + 1], collate_fn(budget, inp.hidden_size, inp.n_aux, torch.float32),
                                    dataset=ds))
        tokens = sum(int((b["document_ids"] != -1).sum()) for b in batches[1:])
        sup = sum(int(b["loss_mask"].sum()) for b in batches[1:]) / tokens
        models = {}
        for mode in ("full", "rows"):
            torch.manual_seed(0)
            m = build_drafter(params, inp, "sdpa")
            losses = loss_config("kl_div", "eager")
            if mode == "rows":
                losses = SupervisedRows(m).wrap_loss(losses)
            models[mode] = (m, losses)
        best: dict[str, float] = {}
        for _ in range(a.repeats):
            for mode, (m, losses) in models.items():
                times = []
                for b in batches:
                    t = time.perf_counter()
                    _, loss, _ = m(**b, ttt_steps=a.ttt, ttt_step_loss_decay=1.0, loss_config=losses)
                    loss.backward()
                    m.zero_grad(set_to_none=True)
                    times.append(time.perf_counter() - t)
                rate = tokens / sum(times[1:])  # the first batch is a warm-up
                best[mode] = max(best.get(mode, 0.0), rate)
        for mode in models:
            print(json.dumps({"budget": budget, "mode": mode, "ttt": a.ttt, "micro_batches": len(batches) - 1,
                              "tokens": tokens, "supervised_share": round(sup, 3),
                              "tokens_per_s": round(best[mode], 1),
                              "vs_full": round(best[mode] / best["full"], 3),
                              "threads": torch.get_num_threads()}), flush=True)


if __name__ == "__main__":
    main()
