"""Masked-token counting throughput: eagle3's vectorized counter vs speculators' own, same data.

Builds a tokenized split in stage 2's format (``input_ids`` list<int64>, ``loss_mask`` list<int8>;
Zipf-distributed ids over the SmolLM2 vocab, ~60 % of positions supervised), writes it as parquet,
then counts masked-token frequencies with

* ``speculators.train.vocab_mapping.save_token_frequency_distribution`` (a per-row loop over a
  ``datasets.Dataset`` in torch format, as speculators' preprocessing calls it), and
* ``eagle3.vocab.count_masked_tokens`` (arrow flatten + ``np.bincount``), from the parquet file and
  from the in-memory table,

checks that all give the same counts and prints a table (best of ``--repeat`` runs).

A second table times stage 2's serving-exact tokenization (chat-template renders of turn prefixes,
loss masks) on the embedded SmolLM2 tokenizer, one conversation per ``apply_chat_template`` call vs
batched calls of 64 (``--tokenize-samples 0`` skips it).

    .venv/bin/python benchmarks/bench_vocab.py [--rows 4000] [--seq 1024] [--repeat 3] [--tokenize-samples 500]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("TQDM_DISABLE", "1")  # speculators' counting loop draws a progress bar


def make_table(rows: int, seq: int, vocab: int, seed: int = 0):
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    lengths = rng.integers(seq // 4, seq + 1, size=rows)
    offs = np.zeros(rows + 1, dtype=np.int32)
    np.cumsum(lengths, out=offs[1:])
    ids = (rng.zipf(1.2, size=int(offs[-1])) - 1) % vocab
    mask = (rng.random(int(offs[-1])) < 0.6).astype(np.int8)
    return pa.table({
        "id": [f"r{i}" for i in range(rows)],
        "source": ["bench"] * rows,
        "input_ids": pa.ListArray.from_arrays(pa.array(offs), pa.array(ids.astype(np.int64))),
        "loss_mask": pa.ListArray.from_arrays(pa.array(offs), pa.array(mask)),
    })


def best_of(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--seq", type=int, default=1024, help="max row length (rows are seq/4..seq tokens)")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tokenize-samples", type=int, default=500, help="conversations for the tokenization table")
    args = ap.parse_args()

    import datasets
    import pyarrow.parquet as pq
    import torch
    from speculators.train.vocab_mapping import save_token_frequency_distribution

    from eagle3.vocab import count_masked_tokens

    table = make_table(args.rows, args.seq, args.vocab)
    tokens = len(table.column("input_ids").combine_chunks().flatten())
    masked = int(np.asarray(table.column("loss_mask").combine_chunks().flatten()).sum())
    tmp = Path(tempfile.mkdtemp(prefix="bench_vocab_"))
    pq.write_table(table, tmp / "train.parquet")
    ds = datasets.Dataset(table).with_format("torch")

    runs = {"n": 0}

    def speculators_count():
        runs["n"] += 1
        out = tmp / f"freq_{runs['n']}.pt"  # the function returns early when the file exists
        save_token_frequency_distribution(ds, out)
        return torch.load(out)

    results = []
    t_spec, ref = best_of(speculators_count, args.repeat)
    results.append(("speculators save_token_frequency_distribution (Dataset, torch)", t_spec))
    t_pq, c_pq = best_of(lambda: count_masked_tokens(tmp / "train.parquet", args.vocab), args.repeat)
    results.append(("eagle3 count_masked_tokens (parquet file)", t_pq))
    t_tab, c_tab = best_of(lambda: count_masked_tokens(table, args.vocab), args.repeat)
    results.append(("eagle3 count_masked_tokens (arrow table)", t_tab))

    dense = np.zeros(args.vocab, dtype=np.int64)
    for k, v in ref.items():
        dense[int(k)] = int(v)
    assert np.array_equal(dense, c_pq) and np.array_equal(dense, c_tab), "counts differ"

    print(f"\n{args.rows} rows, {tokens:,} tokens, {masked:,} masked, vocab {args.vocab}; best of {args.repeat}; counts identical")
    print(f"{'method':<66} {'seconds':>9} {'Mtok/s':>8} {'vs speculators':>15}")
    for name, t in results:
        print(f"{name:<66} {t:>9.3f} {tokens / t / 1e6:>8.2f} {t_spec / t:>14.1f}x")
    if args.tokenize_samples:
        bench_tokenize(args.tokenize_samples)


def bench_tokenize(n: int) -> None:
    """Serving-exact tokenization throughput on the embedded target's tokenizer (chunk 1 vs 64)."""
    from eagle3.chat import stop_token_ids
    from eagle3.config import TargetParams
    from eagle3.target import load_tokenizer, resolve_target
    from eagle3.vocab import LossMaskRenderer, tokenize_samples

    target = resolve_target(TargetParams(model="embedded:smollm2-135m"))
    tok = load_tokenizer(target)
    renderer = LossMaskRenderer(tok, stop_token_ids(tok, target.path))
    rng = np.random.default_rng(0)
    words = np.array("the of and to in is for that def return x y if else while print function value list".split())

    def text(k: int) -> str:
        return " ".join(rng.choice(words, size=k))

    samples = []
    for i in range(n):
        msgs = [{"role": "user", "content": text(60)}, {"role": "assistant", "content": text(250)}]
        if i % 4 == 0:  # a quarter are two-turn conversations
            msgs += [{"role": "user", "content": text(30)}, {"role": "assistant", "content": text(200)}]
        samples.append({"id": str(i), "source": "bench", "split": "train", "messages": msgs,
                        "finish_reasons": ["stop"] * (len(msgs) // 2)})
    print(f"\nserving-exact tokenization, {n} conversations (SmolLM2 ChatML template)")
    print(f"{'apply_chat_template batch':<28} {'seconds':>9} {'samples/s':>10} {'Ktok/s':>8}")
    for chunk in (1, 64):
        t0 = time.perf_counter()
        chunks, rep = tokenize_samples(samples, renderer, 4096, chunk_size=chunk)
        for _ in chunks:
            pass
        dt = time.perf_counter() - t0
        print(f"{chunk:<28} {dt:>9.2f} {n / dt:>10.0f} {rep.tokens / dt / 1e3:>8.0f}")


if __name__ == "__main__":
    main()
