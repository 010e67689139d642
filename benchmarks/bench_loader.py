"""Stage 4's loader alone: how fast stage-3 files become collated micro-batches (no model, no GPU).

  python benchmarks/bench_loader.py                         # Llama-3.1-8B shape (hidden 4096), bf16 files
  python benchmarks/bench_loader.py --workers 0,1,2,4,8 --hidden 4096 --token-budget 8192

Writes a synthetic stage-3 run (bench_train.synthetic_run: 3 aux layers + the last, samples of
``--doc-len`` tokens) and times, on the same packing plan (speculators' multipack, the loop's):

* the collate alone on items already read: speculators' ``CollateFn(shift_batch)`` (the loader's
  former collate: fresh zeroed buffers, the aux states copied twice), the stage's
  :class:`eagle3.train.data.PackedCollate` into fresh buffers, and into one reused buffer (what each
  loader thread does per batch on CUDA, where the buffers are a pinned ring);
* :class:`eagle3.train.data.MicroBatches` end to end with N loader threads, ms per micro-batch as the
  training loop receives it, with fresh buffers and with the buffer ring (on CPU the ring adds a
  copy out of the buffer, which CUDA replaces by the copy to the device).

The training loop needs one micro-batch per optimizer step: on the H200 the bare 8B-shape step takes
~76-144 ms (benchmarks/RESULTS.md), so a loader slower than that per batch caps the loop.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    ap.add_argument("--hidden", type=int, default=4096, help="the target's hidden size (4096: Llama-3.1-8B)")
    ap.add_argument("--token-budget", type=int, default=8192, help="tokens per micro-batch")
    ap.add_argument("--doc-len", type=int, default=2048, help="tokens per synthetic sample")
    ap.add_argument("--samples", type=int, default=16, help="synthetic stage-3 samples written")
    ap.add_argument("--workers", default="0,1,2", help="comma-separated loader thread counts")
    ap.add_argument("--epochs", type=int, default=2, help="passes over the plan per measurement")
    ap.add_argument("--workdir", default=None,
                    help="keep the synthetic run here and reuse it next time (default: a temporary folder, removed)")
    args = ap.parse_args()
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench_loader_"))
    try:
        run(args, work)
    finally:
        if not args.workdir:  # 16 samples of the 8B shape are ~1 GiB
            shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, rd: Path) -> None:
    """Write (or reuse) the synthetic run in ``rd`` and print the table."""
    import bench_train as bt
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import CollateFn

    from eagle3.contracts.hidden_states import HiddenStatesDataset
    from eagle3.train.data import MicroBatches, collate_fn, epoch_plan, read_manifest

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
    reps = len(items) * args.epochs

    def per_batch(label: str, fn) -> None:
        t = time.perf_counter()
        for its in items * args.epochs:
            fn(its)
        rows.append((label, (time.perf_counter() - t) / reps))

    # the former collate: speculators' CollateFn(shift_batch) on its flat item layout
    spec = CollateFn(args.token_budget, args.hidden, num_target_layers=3, dtype=torch.bfloat16, preprocess=shift_batch)
    per_batch("speculators CollateFn(shift_batch), fresh zeroed buffers",
              lambda its: spec([{**x, "hidden_states": x["hidden_states"].flatten(1)} for x in its]))
    per_batch("PackedCollate, fresh buffers", coll)
    out = coll.buffers()
    per_batch("PackedCollate into one reused buffer (the CUDA ring's work per batch)", lambda its: coll(its, out=out))
    for w in [int(x) for x in args.workers.split(",")]:
        for ring in (False, True):
            loader = MicroBatches(plan * args.epochs, coll, dataset=ds, num_workers=w, ring=ring)
            t = time.perf_counter()
            n = sum(1 for _ in loader)
            rows.append((f"MicroBatches, {w} loader thread{'' if w == 1 else 's'}{', buffer ring (+ a copy out on CPU)' if ring else ''}",
                         (time.perf_counter() - t) / n))

    print(f"\nhidden {args.hidden}, token budget {args.token_budget}, samples of {args.doc_len} tokens, "
          f"{mb:.0f} MiB per micro-batch, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}")
    print("| what | ms per micro-batch | MiB/s |\n|---|---|---|")
    for name, s in rows:
        print(f"| {name} | {s * 1e3:.1f} | {mb / s:.0f} |")


if __name__ == "__main__":
    main()
