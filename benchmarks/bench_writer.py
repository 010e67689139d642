"""Stage 3's writer alone: how fast :class:`SampleWriter` turns hidden states into journaled files.

  python benchmarks/bench_writer.py                            # 8B shape: 2,048 tokens x 4 slots x 4096, bf16
  python benchmarks/bench_writer.py --threads 1,2,8 --samples 64

Times the stage's writer (safetensors file in the temp folder, sha256, atomic rename, journal line)
on the same in-memory samples with the two ways of taking the manifest's sha256, alternating, best of
``--repeats``:

* ``re-read``: the file hashed after it is written (the writer before 2026-12-04: the page cache read
  back through hashlib);
* ``from memory``: :func:`eagle3.contracts.hidden_states.written_sha256`, the header read from the file
  and the data hashed from the tensors it was written from (the stage's default).

Each row checks that both give the same digests. On the H200 the 8B-shape extraction produces
~1.1 GB/s of states (33K tokens/s x 32 KiB per token, benchmarks/RESULTS.md); the writer must keep up
with that through its threads.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from eagle3.contracts.hidden_states import SampleWriter, sample_relpath, save_sample


def save_then_reread(tmp_path, tensors, metadata) -> None:
    """The writer's hash before: return nothing, so the written file is read back and hashed."""
    save_sample(tmp_path, tensors, metadata)


def run_writer(out: Path, samples: list[dict], threads: int, write_fn) -> tuple[float, list[str]]:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    writer = SampleWriter(out, out / "journal.jsonl", [2, 16, 29, 32], threads=threads,
                          max_pending_bytes=8 << 30, write_fn=write_fn)
    t0 = time.perf_counter()
    for row, tensors in enumerate(samples):
        writer.submit({"row": row, "id": f"s{row}", "file": sample_relpath(row, 2000)}, tensors)
    writer.close()
    seconds = time.perf_counter() - t0
    return seconds, [e["sha256"] for e in sorted(writer.entries, key=lambda e: e["row"])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--doc-len", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--threads", default="1,2", help="comma-separated writer thread counts")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float8_e4m3fn"])
    ap.add_argument("--workdir", default=None, help="where the files go (default: a temp folder, removed)")
    args = ap.parse_args()

    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(args.samples):
        tensors = {"token_ids": torch.randint(0, 128256, (args.doc_len,), generator=gen),
                   "loss_mask": torch.ones(args.doc_len, dtype=torch.int8),
                   "hidden_states": torch.randn(args.doc_len, args.slots, args.hidden, generator=gen).to(dtype)}
        if dtype == torch.float8_e4m3fn:
            tensors["hidden_states_scales"] = torch.ones(args.doc_len, args.slots, 1)
        samples.append(tensors)
    total = sum(t.numel() * t.element_size() for s in samples for t in s.values())
    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench_writer_"))
    print(f"{args.samples} samples of {args.doc_len} tokens x {args.slots} x {args.hidden} {args.dtype}: "
          f"{total / 1e6:.0f} MB per pass; files under {root}; torch {torch.__version__}", flush=True)
    print("\n| writer threads | hash | best s | MB/s | MB/s per thread | ratio vs re-read |")
    print("|---|---|---|---|---|---|")
    try:
        for threads in [int(x) for x in args.threads.split(",")]:
            best = {"re-read": float("inf"), "from memory": float("inf")}
            digests = {}
            for _ in range(args.repeats):
                for label, fn in (("re-read", save_then_reread), ("from memory", save_sample)):
                    seconds, digests[label] = run_writer(root / "run", samples, threads, fn)
                    best[label] = min(best[label], seconds)
            if digests["re-read"] != digests["from memory"]:
                raise SystemExit("the two hashes disagree: written_sha256 is wrong")
            for label, seconds in best.items():
                rate = total / seconds / 1e6
                print(f"| {threads} | {label} | {seconds:.3f} | {rate:.0f} | {rate / threads:.0f} | "
                      f"{best['re-read'] / seconds:.2f} |", flush=True)
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
