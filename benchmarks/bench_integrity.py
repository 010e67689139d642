"""Cost of the hidden-state integrity checks: a stage-4 read with and without the sha256
check, per sample and per MiB, for the embedded default's sample shape and a Llama-3.1-8B one.

  python benchmarks/bench_integrity.py [--repeats 5]

Each shape: one sample file written through the contract's writer (``SampleWriter``, random bf16
hidden states ``[seq, 4, hidden]``), then read through ``HiddenStatesDataset`` as stage 4 does:
``ds[i]`` (decode only, later epochs) and ``ds[(i, True)]`` (the first read of a file in a call:
bytes read, size and sha256 checked, decoded). The page cache is warm in both (the file was just
written): the numbers are the CPU cost of the check, not of the disk. Also printed: the resume scan's
re-hash of one file (``sha256_file``), which Stage 3 pays once per recorded file on resume.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from eagle3.contracts import hidden_states as hsc

SHAPES = {  # name: (tokens, hidden); 3 aux layers + layer N = 4 slots
    "smollm2-135m (default, 400 tok)": (400, 576),
    "smollm2-135m (2048 tok)": (2048, 576),
    "llama-3.1-8b (2048 tok)": (2048, 4096),
}


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (seq, hidden) in SHAPES.items():
            d = Path(tmp) / name.split()[0] / str(seq)
            d.mkdir(parents=True)
            w = hsc.SampleWriter(d, d / hsc.journal_name(0), [2, 15, 27, 30], threads=1)
            w.submit({"row": 0, "id": "s0", "file": hsc.sample_relpath(0, 2000)},
                     {"token_ids": torch.zeros(seq, dtype=torch.int64), "loss_mask": torch.ones(seq, dtype=torch.int8),
                      "hidden_states": torch.randn(seq, 4, hidden).to(torch.bfloat16)})
            w.close()
            ref = hsc.ref_of(d, w.entries[0])
            ds = hsc.HiddenStatesDataset.for_training([ref], 3, hidden, 1 << 17)
            ds._item = None  # raw tensors: the read itself, without the training-item reshaping
            mib = ref.bytes / 2**20
            # .clone(): every page read (the collate copies them too); load_file alone only maps the file
            plain = _best(lambda ds=ds: ds[0]["hidden_states"].clone(), a.repeats)
            checked = _best(lambda ds=ds: ds[(0, True)]["hidden_states"].clone(), a.repeats)
            rehash = _best(lambda f=ref.file: hsc.sha256_file(f), a.repeats)
            rows.append((name, mib, plain * 1e3, checked * 1e3, (checked - plain) / mib * 1e3, rehash * 1e3))
    print(f"{'sample':34} {'MiB':>7} {'read ms':>8} {'checked ms':>10} {'check ms/MiB':>12} {'resume re-hash ms':>17}")
    for r in rows:
        print(f"{r[0]:34} {r[1]:7.2f} {r[2]:8.2f} {r[3]:10.2f} {r[4]:12.2f} {r[5]:17.2f}")


if __name__ == "__main__":
    main()
