"""Stage 4's loader alone: how fast stage-3 files become collated micro-batches (no model, no GPU).

  python benchmarks/bench_loader.py                         # Llama-3.1-8B shape (hidden 4096), bf16 files
  python benchmarks/bench_loader.py --workers 0,1,2,4,8 --hidden 4096 --token-budget 8192

Writes a synthetic stage-3 run (bench_train.synthetic_run: 3 aux layers + the last, samples of
``--doc-len`` tokens) and times, on the same packing plan (speculators' multipack, the loop's):

* ``collate``: speculators' ``CollateFn`` on items already read (the worker's own work per batch), and
  how much of it is its ``torch.zeros`` of the output buffers (fresh pages: page faults + zero fill);
* ``loader, N workers``: :class:`eagle3.train.data.MicroBatches` (torch ``DataLoader``) end to end, ms per
  micro-batch as the training loop would receive it (workers add the move of each batch into shared
  memory and the main process's first touch of those pages).

The training loop needs one micro-batch per optimizer step: on the H200 the bare 8B-shape step takes
~76-112 ms (benchmarks/RESULTS.md), so a loader slower than that per batch caps the loop. Run it with
``THP_MEM_ALLOC_ENABLE=1`` (torch's transparent-huge-page CPU allocations) to see the page-fault share.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--token-budget", type=int, default=8192)
    ap.add_argument("--doc-len", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--workers", default="0,1,2", help="comma-separated DataLoader worker counts")
    ap.add_argument("--epochs", type=int, default=2, help="passes over the plan per measurement")
    ap.add_argument("--workdir", default="/tmp/bench_loader_run")
    args = ap.parse_args()

    import bench_train as bt

    from eagle3.contracts.hidden_states import HiddenStatesDataset
    from eagle3.train.data import MicroBatches, collate_fn, epoch_plan, read_manifest

    rd = Path(args.workdir)
    if not (rd / "03_extract" / "manifest.jsonl").exists():
        bt.synthetic_run(rd, args.hidden, 32, 128256, 32000, [args.doc_len + 1] * args.samples)
    refs = read_manifest(rd)
    ds = HiddenStatesDataset.for_training(refs, 3, args.hidden, 128256, torch.bfloat16)
    plan = epoch_plan([r.num_tokens for r in refs], args.token_budget, 0, 0)
    coll = collate_fn(args.token_budget, args.hidden, 3, torch.bfloat16)
    for b in MicroBatches(plan, coll, dataset=ds):  # page cache warm
        mb = sum(v.numel() * v.element_size() for v in b.values() if torch.is_tensor(v)) / 2**20

    rows = []
    items = [[ds[(int(i), False)] for i in b] for b in plan]
    t = time.perf_counter()
    for its in items * args.epochs:
        coll(its)
    rows.append(("collate (speculators CollateFn), in process", (time.perf_counter() - t) / (len(items) * args.epochs)))
    shapes = [(args.token_budget, 3 * args.hidden), (args.token_budget, args.hidden)]
    t = time.perf_counter()
    for _ in range(len(items) * args.epochs):
        for s in shapes:
            torch.zeros(s, dtype=torch.bfloat16)
    rows.append(("  of which torch.zeros of the hidden-state buffers", (time.perf_counter() - t) / (len(items) * args.epochs)))
    for w in [int(x) for x in args.workers.split(",")]:
        loader = MicroBatches(plan * args.epochs, coll, dataset=ds, num_workers=w)
        t = time.perf_counter()
        n = sum(1 for _ in loader)
        rows.append((f"loader (DataLoader), {w} workers", (time.perf_counter() - t) / n))

    print(f"\nhidden {args.hidden}, token budget {args.token_budget}, samples of {args.doc_len} tokens, "
          f"{mb:.0f} MiB per micro-batch, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}")
    print("| what | ms per micro-batch | MiB/s |\n|---|---|---|")
    for name, s in rows:
        print(f"| {name} | {s * 1e3:.1f} | {mb / s:.0f} |")


if __name__ == "__main__":  # DataLoader workers may spawn
    main()
