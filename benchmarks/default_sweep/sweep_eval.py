"""Score stage-4 drafters on the traffic of a finished stage 5 without vLLM (the default's stage-4 settings sweep).

For each evaluation set of a stage 5 (``prompts.json``: held-out split, general chat, ...), the sequences are
vLLM's own T=0 output (``vllm_eagle3.json`` ``per_prompt``: prompt ids + output tokens; at T=0 the text does
not depend on the drafter). The target runs over them once (stage 3's online path,
``eagle3.extract.online_samples``); each drafter then goes through the Trainer's own validation
(``Trainer.evaluate``): teacher-forced TTT chains, and verification rounds walked as decoding schedules them
(``eagle3.train.metrics.simulate_rounds``) for k = 1..K drafts. On the CPU default that walk gave vLLM's
tau to 0.004 (1.552 vs 1.553 general chat, 1.746 vs 1.750 held-out; benchmarks/RESULTS.md), so a
sweep of drafters trained on a GPU machine without vLLM is scored on stage 5's traffic in seconds.

usage (each RUN_DIR: its params.yaml, stage 2's vocab mapping and 04_train/drafter; the target is the first's):
  sweep_eval.py EVAL_DIR RUN_DIR [RUN_DIR ...] [--k 3] [--set section.key=value ...]
Prints one JSON line per drafter and set: tau_sim_k1..kK (tokens per target forward at k drafts), tau_hat.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np


def eval_splits(eval_dir: Path):
    """{set name: TokenizedSplit} of prompt + vLLM output (loss mask on the output tokens)."""
    from eagle3.contracts.tokenized import TokenizedSplit

    res = json.loads((eval_dir / "vllm_eagle3.json").read_text())
    sets = {p["id"]: p["set"] for p in json.loads((eval_dir / "prompts.json").read_text())["prompts"]}
    rows = defaultdict(list)
    for r in res["per_prompt"]:
        rows[sets[r["id"]]].append(r)
    out = {}
    for name, rs in rows.items():
        ids = [np.asarray(r["prompt_ids"] + r["tokens"], dtype=np.int64) for r in rs]
        masks = [np.asarray([0] * len(r["prompt_ids"]) + [1] * len(r["tokens"]), dtype=np.int8) for r in rs]
        lengths = np.asarray([len(x) for x in ids], dtype=np.int64)
        out[name] = TokenizedSplit(path=eval_dir / "vllm_eagle3.json", ids=[r["id"] for r in rs],
                                   sources=[name] * len(rs), lengths=lengths, input_ids=np.concatenate(ids),
                                   loss_mask=np.concatenate(masks), offsets=np.concatenate([[0], np.cumsum(lengths)]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("eval_dir", type=Path)
    ap.add_argument("run_dirs", nargs="+", type=Path)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--set", action="append", default=[])
    a = ap.parse_args()

    import torch
    from safetensors.torch import load_file

    from eagle3.contracts.hidden_states import to_training_item
    from eagle3.distributed import DistContext
    from eagle3.extract.online import OnlineExtractor, online_samples
    from eagle3.params_file import load_params, parse_overrides
    from eagle3.train.data import epoch_plan
    from eagle3.train.loop import Trainer
    from eagle3.train.model import resolve_inputs

    def params_of(rd: Path):  # the run's own drafter shape; k drafts walked whatever its TTT steps
        return load_params(rd / "params.yaml", parse_overrides(a.set + [f"train.ttt_steps={a.k}", "train.online=true"]))

    params = params_of(a.run_dirs[0])
    ctx = DistContext.from_env(device="cuda" if torch.cuda.is_available() else "cpu")
    splits = eval_splits(a.eval_dir)
    ex = OnlineExtractor.get(params, str(ctx.device))
    inputs = resolve_inputs(params, a.run_dirs[0])
    items = {}
    for name, split in splits.items():
        ex.rows = lambda run_dir, split=split: split  # the evaluation text instead of stage 2's train split
        items[name] = [to_training_item(s, inputs.n_aux, inputs.hidden_size, inputs.target_vocab_size, f"{name} {i}")
                       for i, s in enumerate(online_samples(params, a.run_dirs[0], extractor=ex, out_device=str(ctx.device)))]
    for rd in a.run_dirs:
        run_params = params_of(rd)
        tr = Trainer(run_params, rd, ctx)
        tr.inputs = resolve_inputs(run_params, rd)
        tr.fetch, tr.train_ds, tr.val_ds, tr.schedule = None, None, None, [None]  # online (params_of): no stage-3 files
        model, _, _ = tr._model()
        weights = load_file(str(rd / "04_train" / "drafter" / "model.safetensors"))
        missing, unexpected = model.load_state_dict(weights, strict=False)
        frozen = [m for m in missing if not m.startswith(("embed_tokens", "verifier_")) and "rotary" not in m]
        if frozen or unexpected:
            raise SystemExit(f"{rd}: drafter weights do not match: missing {frozen}, unexpected {unexpected}")
        stats = json.loads((rd / "04_train" / "stats.json").read_text())
        for name, its in items.items():
            tr.vfetch = lambda idx, its=its: [its[i] for i in idx]
            tr.val_plan = epoch_plan([len(x["input_ids"]) - 1 for x in its], run_params.train.token_budget, 0, 0)
            with tempfile.NamedTemporaryFile(suffix=".jsonl") as f:
                tr.metrics_file = Path(f.name)  # not the run's train metrics
                rec = tr.evaluate(model, 0)
            print("SWEEP_EVAL", json.dumps({
                "run": rd.name, "set": name, "prompts": len(its),
                **{f"tau_sim_k{k}": round(rec[f"val_tau_sim_k{k}"], 4) for k in range(1, a.k + 1)},
                "tau_hat": round(rec["val_tau_hat"], 4), "train_val_tau_hat": stats.get("final_val_tau_hat"),
                "train_val_tau_sim": stats.get("final_val_tau_sim"), "best_step": stats.get("best_step"),
                "final_step": stats.get("final_step")}), flush=True)


if __name__ == "__main__":
    main()
