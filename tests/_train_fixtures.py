"""Stage 4 test inputs: a tiny random Llama target, stage 2's folder written through its contracts
(the mapping by the DESIGN.md rule), and 03_extract folders with the
contract layout holding the target's real hidden states (or random ones)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False)


def make_tiny_target(path: Path, seed: int = 0) -> Path:
    """A random LlamaForCausalLM (8 layers, hidden 64, vocab 512, float32) saved as a model directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    cfg = LlamaConfig(**TINY, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, dtype="float32")
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return path


def design_mapping(counts: np.ndarray, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DESIGN.md rule, written out independently of the package (the tests compare against it): rank by
    (-frequency, id), keep the top k (padding with unused ids), sort ascending, ``d2t[i] = kept[i] - i``,
    ``t2d`` = bool mask of the kept ids."""
    V = len(counts)
    order = sorted(range(V), key=lambda i: (-int(counts[i]), i))
    kept = sorted(order[:draft_vocab_size])
    d2t = torch.tensor(kept, dtype=torch.int64) - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d


def write_stage2(run_dir: Path, samples: list[dict], target_vocab: int, draft_vocab_size: int,
                 heldout: list[dict] = (), train_rows: list[dict] | None = None) -> None:
    """Stage 2's folder through its contracts' writers: the mapping (+ mapping.json with a cache key),
    the train/heldout splits (+ row lengths) and the token counts (of ``samples``).

    ``train_rows`` (default ``samples``): the rows of train.parquet, i.e. what Stage 3 extracts (its
    manifest must list exactly these rows); a test that plants held-out samples among the extracted
    ones passes them here too."""
    from eagle3.contracts import tokenized
    from eagle3.contracts.vocab_mapping import VocabMapping, write_mapping
    from eagle3.rundir import VOCAB, RunDir
    from eagle3.vocab.mapping import write_counts

    RunDir(run_dir).stage(VOCAB, create=True)
    counts = np.zeros(target_vocab, dtype=np.int64)
    for s in samples:
        ids = np.asarray(s["token_ids"])
        np.add.at(counts, ids[np.asarray(s["loss_mask"]).astype(bool)], 1)
    write_counts(run_dir, counts, np.zeros(target_vocab, dtype=np.int64))
    mapping = VocabMapping.build(counts, draft_vocab_size, cache_key="test")
    if not mapping.full_size:
        d2t, t2d = design_mapping(counts, draft_vocab_size)
        assert torch.equal(mapping.d2t, d2t) and torch.equal(mapping.t2d, t2d)
    write_mapping(run_dir, mapping, coverage=1.0)
    for name, rows in (("train", samples if train_rows is None else train_rows), ("heldout", list(heldout))):
        tokenized.write_split(run_dir, name, [[
            tokenized.TokenizedRow(r["id"], "test", np.asarray(r["token_ids"], dtype=np.int64),
                                   np.asarray(r["loss_mask"], dtype=np.int8), len(r["token_ids"]))
            for r in rows]])


def write_stage3(run_dir: Path, samples: list[dict], aux_ids: list[int], num_layers: int, hidden: int,
                 target: str, dtype=torch.bfloat16, shard_size: int = 2000) -> None:
    """Stage 3's folder through its contract's writers (meta.json, the sample files, manifest.jsonl)."""
    from eagle3.contracts import hidden_states as hsc
    from eagle3.rundir import EXTRACT, RunDir

    d = RunDir(run_dir).stage(EXTRACT, create=True)
    hsc.write_meta(d, {"aux_layer_ids": aux_ids, "num_hidden_layers": num_layers, "hidden_size": hidden,
                       "dtype": hsc.dtype_name(dtype), "target": target, "stored_layers": [*aux_ids, num_layers],
                       "shard_size": shard_size, "num_samples": len(samples)})
    writer = hsc.SampleWriter(d, d / hsc.journal_name(0), [*aux_ids, num_layers], threads=1)
    for row, s in enumerate(samples):
        writer.submit({"row": row, "id": s["id"], "file": hsc.sample_relpath(row, shard_size)},
                      {"token_ids": torch.as_tensor(s["token_ids"], dtype=torch.int64),
                       "loss_mask": torch.as_tensor(s["loss_mask"], dtype=torch.int8),
                       "hidden_states": s["hidden_states"].to(dtype).contiguous()})
    writer.close()
    hsc.write_manifest(d, hsc.known_entries(d), len(samples))


@torch.no_grad()
def target_hidden_states(model, token_ids, aux_ids: list[int]) -> torch.Tensor:
    """``[seq, n_aux+1, H]``: transformers ``hidden_states[k]`` for the aux ids, then the last decoder
    layer's output before the final norm (captured at the norm's input)."""
    captured = {}
    h = model.model.norm.register_forward_pre_hook(lambda m, a: captured.__setitem__("last", a[0]))
    try:
        out = model(torch.as_tensor(token_ids)[None], output_hidden_states=True)
    finally:
        h.remove()
    slots = [out.hidden_states[k][0] for k in aux_ids] + [captured["last"][0]]
    return torch.stack(slots, dim=1).float()


def random_token_samples(n: int, seed: int = 0, vocab_used: int = 200, min_len: int = 20, max_len: int = 60,
                         prefix: str = "s") -> list[dict]:
    """n samples of Zipf-ish token ids below ``vocab_used`` with the first 5 tokens unsupervised."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, vocab_used + 1)
    p /= p.sum()
    out = []
    for i in range(n):
        L = int(rng.integers(min_len, max_len + 1))
        ids = rng.choice(vocab_used, size=L, p=p).astype(np.int64)
        lm = np.ones(L, dtype=np.int8)
        lm[:5] = 0
        out.append({"id": f"{prefix}{i:04d}", "token_ids": ids, "loss_mask": lm})
    return out


def make_tiny_run(run_dir: Path, target_dir: Path, n: int = 24, draft_vocab_size: int = 128, seed: int = 0,
                  aux_ids: list[int] | None = None, heldout: int = 0) -> list[dict]:
    """A run directory with 02_vocab/ and 03_extract/ for the tiny target (real hidden states)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    N = model.config.num_hidden_layers
    aux = aux_ids or [2, N // 2, N - 3]
    samples = random_token_samples(n + heldout, seed=seed)
    for s in samples:
        s["hidden_states"] = target_hidden_states(model, s["token_ids"], aux)
    train, held = samples[:n], samples[n:]
    write_stage2(run_dir, train, model.config.vocab_size, draft_vocab_size, heldout=held, train_rows=samples)
    write_stage3(run_dir, samples, aux, N, model.config.hidden_size, str(target_dir))
    return samples


def tiny_params(target_dir: Path, **train):
    """Params for the tiny target on CPU (tracking off) with ``train`` overrides."""
    from eagle3.params_file import load_params

    t = {"token_budget": 128, "epochs": 3, "lr": 3e-3, "warmup_steps": 2, "eval_every": 4, "checkpoint_every": 4,
         "val_fraction": 0.2, "keep_checkpoints": 2, "seed": 0, "device": "cpu",
         "ttt_steps": 3,  # the GPU recipes' TTT steps (the CPU default trains 2)
         "optimizer": "adamw"}  # the tiny runs' lr and epochs are sized for AdamW (Muon: its own tests)
    t.update(train)
    return load_params(None, {"target": {"model": str(target_dir), "dtype": "float32", "device": "cpu"},
                              "tracking": {"mode": "disabled"}, "vocab": {"draft_vocab_size": 128}, "train": t})


PROMPTS = [
    "Write a Python function that returns the sum of a list of numbers.",
    "Write a Python function that reverses a string.",
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that counts the vowels in a string.",
    "Write a Python function that returns the largest element of a list.",
    "Write a Python function that computes the factorial of n.",
    "Write a Python function that removes duplicates from a list.",
    "Write a Python function that checks whether a string is a palindrome.",
]


@torch.no_grad()
def make_target_run(run_dir: Path, model, tok, target_dir: Path, prompts=PROMPTS, max_new_tokens: int = 48,
                    draft_vocab_size: int = 2048) -> list[dict]:
    """Stage 2 and stage 3 folders from the target's own greedy answers to ``prompts`` (chat template,
    loss mask on the answer, generated in one left-padded batch), with its real hidden states at the
    default aux ids [2, N//2, N-3]."""
    N = model.config.num_hidden_layers
    aux = [2, N // 2, N - 3]
    chats = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in prompts]
    side = tok.padding_side
    tok.padding_side = "left"
    try:
        enc = tok(chats, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tok.padding_side = side
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    samples = []
    width = enc["input_ids"].shape[1]
    for i in range(len(prompts)):
        prompt = enc["input_ids"][i][enc["attention_mask"][i].bool()]
        answer = out[i, width:]
        eos = (answer == tok.eos_token_id).nonzero()
        if len(eos):
            answer = answer[: int(eos[0]) + 1]
        ids = torch.cat([prompt, answer])
        lm = np.zeros(ids.shape[0], dtype=np.int8)
        lm[prompt.shape[0]:] = 1
        s = {"id": f"p{i:03d}", "token_ids": ids.numpy().astype(np.int64), "loss_mask": lm}
        s["hidden_states"] = target_hidden_states(model, s["token_ids"], aux)
        samples.append(s)
    write_stage2(run_dir, samples, model.config.vocab_size, draft_vocab_size)
    write_stage3(run_dir, samples, aux, N, model.config.hidden_size, str(target_dir))
    return samples
