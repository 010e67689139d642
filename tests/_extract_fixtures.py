"""Fixtures for the Stage 3 tests: a small stage-2 train split from real chat renders.

The split is written through :func:`eagle3.contracts.tokenized.write_split` from short conversations
rendered with the embedded target's chat template; the loss mask marks the assistant reply tokens.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

TOPICS = ["sorting a list", "reading a CSV file", "a binary search", "parsing JSON", "the fibonacci numbers",
          "a linked list", "matrix multiplication", "string reversal", "prime numbers", "a stack", "recursion",
          "hash maps", "regular expressions", "file paths", "unit tests", "HTTP requests"]


def conversations(n: int, seed: int = 0) -> list[list[dict]]:
    """``n`` short user/assistant conversations of varied length (deterministic)."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        reps = rng.randint(1, 4)
        user = f"Explain {topic} in Python." + " Please be precise." * rng.randint(0, 2)
        reply = " ".join([f"Here is how {topic} works: step {k + 1} uses a loop and a function call."
                          for k in range(reps)])
        out.append([{"role": "user", "content": user}, {"role": "assistant", "content": reply}])
    return out


def tokenize(tok, conv: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of the full render and a loss mask over the assistant turn's tokens."""
    prompt = tok.apply_chat_template(conv[:-1], tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template(conv, tokenize=False)
    p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    ids = tok(full, add_special_tokens=False)["input_ids"]
    assert ids[: len(p_ids)] == p_ids
    return ids, [0] * len(p_ids) + [1] * (len(ids) - len(p_ids))


def write_train_parquet(run_dir: Path, tok, n: int = 12, seed: int = 0, extra_rows: list[tuple] = ()) -> Path:
    """Write the run's train split with ``n`` rendered conversations (+ raw ``(id, ids, mask)`` extra rows);
    returns the parquet file."""
    import numpy as np

    from eagle3.contracts import tokenized
    from eagle3.rundir import VOCAB, RunDir

    rows = []
    for conv in conversations(n, seed):
        ids, mask = tokenize(tok, conv)
        rows.append((hashlib.sha256(repr(conv).encode()).hexdigest()[:12], ids, mask))
    rows += [(sid, list(ids), list(mask)) for sid, ids, mask in extra_rows]
    RunDir(run_dir).stage(VOCAB, create=True)
    tokenized.write_split(run_dir, "train", [[
        tokenized.TokenizedRow(sid, "test", np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.int8), len(ids))
        for sid, ids, mask in rows]])
    return tokenized.split_path(run_dir, "train")
