"""Fixtures for the Stage 3 tests: a small Stage 2-shaped ``train.parquet`` from real chat renders.

Until Stage 2 lands, the tests write ``02_vocab/train.parquet`` themselves (columns ``id``,
``source``, ``input_ids`` list<int64>, ``loss_mask`` list<int8>) by rendering short conversations
with the embedded target's chat template; the loss mask marks the assistant reply tokens.
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
    """Write ``run_dir/02_vocab/train.parquet`` with ``n`` rendered conversations (+ raw extra rows)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids_col, mask_col, id_col, src_col = [], [], [], []
    for conv in conversations(n, seed):
        ids, mask = tokenize(tok, conv)
        ids_col.append(ids)
        mask_col.append(mask)
        id_col.append(hashlib.sha256(repr(conv).encode()).hexdigest()[:12])
        src_col.append("test")
    for sid, ids, mask in extra_rows:
        id_col.append(sid)
        src_col.append("test")
        ids_col.append(list(ids))
        mask_col.append(list(mask))
    table = pa.table({
        "id": pa.array(id_col, pa.string()),
        "source": pa.array(src_col, pa.string()),
        "input_ids": pa.array(ids_col, pa.list_(pa.int64())),
        "loss_mask": pa.array(mask_col, pa.list_(pa.int8())),
    })
    out = Path(run_dir) / "02_vocab" / "train.parquet"
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out)
    return out
