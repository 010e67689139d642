"""Stage 4 benchmark: training throughput of our loop against a bare speculators step on the same batches.

  python benchmarks/bench_train.py                       # CPU: SmolLM2-135M-shaped target, draft vocab 2048
  python benchmarks/bench_train.py --device cuda         # GPU: Llama-3.1-8B-shaped target (no download)
  ... --profile          # + torch.profiler of one pass each (top ops, syncs per step)
  ... --host-profile     # + cProfile of one pass of ours: the loop's time by part
  ... --hs-dtype float8_e4m3fn                            # Stage 3 files in fp8 (dequantized by the loader)
  ... --compare-autocast --ttt 2 --draft-vocab 8192 --token-budget 2048   # CPU: ours in float32 vs
                                                          # bf16 autocast (train.autocast), alternating
  ... --compare-optimizer --ttt 2 --draft-vocab 8192     # ours with AdamW vs Muon (train.optimizer), alternating

Both modes write a synthetic run directory (Stage 2 mapping + Stage 3 files of random hidden
states in the contract layout) and time, on the same packed micro-batches:

* ``ours``: ``eagle3.train.run`` end to end (reading the files, collate, forward/backward, clip,
  AdamW, metrics, metrics.jsonl, progress.json), tokens/s between the end of the warm-up steps and
  the end of the last step (from the per-step timestamps in metrics.jsonl);
* ``bare``: the same ``Eagle3DraftModel`` built the same way, batches collated beforehand and kept
  in memory, and a plain loop of forward, backward, grad clip, AdamW step.

The loop's overhead is ``1 - ours / bare`` (goal: <= 5 %; both loops under the same ``--compile``).
On GPU it also prints the model FLOP utilisation (training FLOPs per token from the layer shapes, below, against the bf16 dense peak of
the card, 989 TFLOP/s for an H200 SXM) and the peak memory. The target is built in code, so nothing
is downloaded: a config.json with the shapes (GPU: Llama-3.1-8B, hidden 4096, 32 layers, 32/8 heads,
intermediate 14336, vocab 128256, llama3 rope; CPU: SmolLM2-135M, the embedded default) and random
``embed_tokens``/``lm_head``/``norm`` weights, which is all speculators reads from a verifier.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from eagle3.contracts import hidden_states as hsc
from eagle3.rundir import EXTRACT, TRAIN, VOCAB, RunDir

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                rms_norm_eps=1e-5, tie_word_embeddings=False,
                rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                    rms_norm_eps=1e-5, tie_word_embeddings=True,
                    rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def fake_target(path: Path, shape: dict, dtype=torch.bfloat16, seed: int = 0) -> Path:
    """config.json + model.safetensors (embed_tokens, lm_head, final norm only) for a Llama-shaped verifier."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    path.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(**shape, dtype=str(dtype).replace("torch.", ""))
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(path)
    g = torch.Generator().manual_seed(seed)
    V, H = shape["vocab_size"], shape["hidden_size"]
    save_file({"model.embed_tokens.weight": (torch.randn(V, H, generator=g) * 0.02).to(dtype),
               "lm_head.weight": (torch.randn(V, H, generator=g) * 0.02).to(dtype),
               "model.norm.weight": torch.ones(H, dtype=dtype)}, str(path / "model.safetensors"))
    return path


def synthetic_run(run_dir: Path, H: int, N: int, V: int, draft: int, lengths: list[int], seed: int = 0,
                  hs_dtype: torch.dtype = torch.bfloat16) -> None:
    """Stage 2's mapping (random draft vocab of ``draft`` ids) and Stage 3's files (random hidden states,
    stored as ``hs_dtype``: bf16, or fp8 codes + scales through the contract's ``storage_tensors``)."""

    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    from eagle3.contracts.vocab_mapping import VocabMapping, write_mapping

    RunDir(run_dir).stage(VOCAB, create=True)
    kept = np.sort(rng.choice(V, size=draft, replace=False)) if draft < V else np.arange(V)
    counts = np.zeros(V, dtype=np.int64)
    counts[kept] = 1  # the draft vocab = the ids seen (the DESIGN rule through the contract's builder)
    write_mapping(run_dir, VocabMapping.build(counts, draft, cache_key="bench"))
    aux = [2, N // 2, N - 3]
    d3 = RunDir(run_dir).stage(EXTRACT, create=True)
    hsc.write_meta(d3, {"aux_layer_ids": aux, "num_hidden_layers": N, "hidden_size": H, "dtype": hsc.dtype_name(hs_dtype),
                        "target": "bench", "stored_layers": [*aux, N], "shard_size": 2000})
    writer = hsc.SampleWriter(d3, d3 / hsc.journal_name(0), [*aux, N])
    for row, L in enumerate(lengths):
        ids = torch.from_numpy(kept[rng.integers(0, draft, size=L)]).long()
        lm = torch.ones(L, dtype=torch.int8)
        lm[: L // 4] = 0
        hs = torch.randn(L, len(aux) + 1, H, generator=g).to(torch.bfloat16)
        writer.submit({"row": row, "id": f"b{row:05d}", "file": hsc.sample_relpath(row, 2000)},
                      {"token_ids": ids, "loss_mask": lm, **hsc.storage_tensors(hs, hs_dtype)})
    writer.close()
    hsc.write_manifest(d3, hsc.known_entries(d3), len(lengths))


def params_for(target: str, device: str, token_budget: int, steps: int, epochs: int, **train):
    from eagle3.params_file import load_params

    # AdamW unless a mode names another: the bare loop steps AdamW, and ours is compared with it
    t = {"token_budget": token_budget, "epochs": epochs, "max_steps": steps, "lr": 1e-4, "warmup_steps": 2,
         "eval_every": 10**6, "checkpoint_every": 10**6, "val_fraction": 0.0, "device": device, "optimizer": "adamw"}
    t.update(train)
    return load_params(None, {"target": {"model": target, "dtype": "auto", "device": device},
                              "tracking": {"mode": "disabled"}, "train": t})


def run_ours(params, run_dir: Path, warmup: int) -> dict:
    from eagle3.train import run

    shutil.rmtree(RunDir(run_dir).stage(TRAIN), ignore_errors=True)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    run(params, run_dir)
    recs = [json.loads(x) for x in RunDir(run_dir).train_metrics.read_text().splitlines()]
    recs = [r for r in recs if r["kind"] == "train"]
    meas = recs[warmup:]
    wall = meas[-1]["t"] - recs[warmup - 1]["t"]
    toks = sum(r["tokens"] for r in meas)
    out = {"steps": len(meas), "tokens": toks, "wall_s": wall, "tokens_per_s": toks / wall}
    if torch.cuda.is_available():
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def run_ours_batches_on_device(params, run_dir: Path, warmup: int) -> dict:
    """``ours`` with the training batches collated beforehand and kept on the device, as the bare step
    has them: what the loop costs without its data path (read, collate, pin, copy)."""
    from eagle3.train.loop import Trainer

    micro = Trainer._micro

    def on_device(self, index_lists, val: bool = False):
        batches = micro(self, index_lists, val)
        if val:
            return batches
        resident = [{k: v.to(self.ctx.device) for k, v in b.items()} for b in batches]
        return (b for b in resident)  # a generator, like MicroBatches: the loop closes what it iterates

    Trainer._micro = on_device
    try:
        return run_ours(params, run_dir, warmup)
    finally:
        Trainer._micro = micro


def run_bare(params, run_dir: Path, warmup: int) -> dict:
    """speculators' model, our batches pre-collated in memory, plain fwd/bwd/clip/AdamW loop."""
    from eagle3.contracts.hidden_states import HiddenStatesDataset
    from eagle3.drafters.eagle3 import build_drafter
    from eagle3.train.data import MicroBatches, build_schedule, collate_fn, read_manifest
    from eagle3.train.model import (
        configure_compile,
        default_attn_implementation,
        loss_config,
        resolve_inputs,
    )

    dev = torch.device("cuda:0" if params.train.device.startswith("cuda") else "cpu")
    train_params = params.train
    from eagle3.train.loop import autocast_dtype

    inp = resolve_inputs(params, run_dir)
    refs = read_manifest(run_dir)
    attn = train_params.attn_implementation if train_params.attn_implementation != "auto" else default_attn_implementation(dev.type)
    sched = build_schedule([r.num_tokens - 1 for r in refs], train_params.token_budget, train_params.seed,
                           train_params.epochs, 1, train_params.max_steps)
    ds = HiddenStatesDataset.for_training(refs, inp.n_aux, inp.hidden_size, inp.target_vocab_size)
    dtype = autocast_dtype(train_params.autocast, dev.type) or torch.float32
    batches = [{k: v.to(dev) for k, v in b.items()} for b in
               MicroBatches([g[0] for _, g in sched], collate_fn(train_params.token_budget, inp.hidden_size, inp.n_aux, dtype), dataset=ds)]
    torch.manual_seed(train_params.seed)
    model = build_drafter(params, inp, attn).to(dev)
    # the same torch.compile coverage as ours (train.compile): the bare step differs only in the loop
    configure_compile(model, train_params.compile, attn, train_params.ttt_steps)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=train_params.lr, betas=(0.9, 0.95),
                            fused=dev.type == "cuda" or None)
    kw = dict(ttt_steps=train_params.ttt_steps, ttt_step_loss_decay=train_params.ttt_step_loss_decay,
              loss_config=loss_config(train_params.loss, train_params.loss_implementation if train_params.loss_implementation != "auto"
                                      else ("fused" if dev.type == "cuda" else "eager")))
    adt = autocast_dtype(train_params.autocast, dev.type)
    ac = (lambda: torch.autocast(dev.type, dtype=adt)) if adt is not None else (lambda: torch.autocast("cpu", enabled=False))
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    toks, t0 = 0, None
    for i, b in enumerate(batches):
        if i == warmup:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.time()
        with ac():
            _, loss, _ = model(**b, **kw)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], train_params.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            toks += int((b["document_ids"] != -1).sum())
    if dev.type == "cuda":
        torch.cuda.synchronize()
    wall = time.time() - t0
    out = {"steps": len(batches) - warmup, "tokens": toks, "wall_s": wall, "tokens_per_s": toks / wall}
    if dev.type == "cuda":
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
            "aten::item", "aten::_local_scalar_dense", "aten::nonzero")


def profiled(fn, label: str, trace_dir: str | None, steps: int):
    """Run ``fn()`` under torch.profiler (CPU + CUDA) and print where host and device time goes:
    the top ops by self CUDA time and by self CPU time, and the host-device syncs per measured step.
    The profile covers the whole call (set-up and warm-up steps included)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts, record_shapes=False) as prof:
        t0 = time.perf_counter()
        out = fn()
        wall = time.perf_counter() - t0
    ka = prof.key_averages()
    cuda = torch.cuda.is_available()
    print(f"\n--- torch.profiler: {label} ({wall:.1f} s profiled, set-up included) ---")
    if cuda:
        print(ka.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
    print(ka.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
    syncs = {e.key: e.count for e in ka if any(e.key.startswith(k) for k in SYNC_OPS)}
    print(f"host-device syncs ({label}), calls per measured step ({steps} steps): "
          + ", ".join(f"{k} {v / max(steps, 1):.1f}" for k, v in sorted(syncs.items())))
    if cuda:
        dev_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in ka)
        print(f"device busy (sum of kernel self time) {dev_us / 1e6:.2f} s of {wall:.2f} s profiled")
    if trace_dir:
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(trace_dir) / f"trace_{label}.json"))
    return out


HOST_PARTS = {  # cProfile cumulative time of these functions inside Trainer.loop (a tuple: the sum of its patterns)
    "drafter forward (speculators)": "speculators/models/eagle3/core.py:forward",
    "backward": "torch/_tensor.py:backward",
    # AdamW.step is adamw.py's own in older torch and inherited from Adam (adam.py) in 2.13: one of the two runs
    "optimizer step (AdamW)": ("torch/optim/adamw.py:step", "torch/optim/adam.py:step"),
    "clip_grad_norm_": "clip_grad.py:clip_grad_norm_",
    # the loop's next(batches) resumes the generator MicroBatches.__iter__ returns: a generator expression
    # of __iter__ (read + pack in the loop's thread) or _threaded (the hand-over from the loader threads)
    "next batch (read, collate, hand-over)": "MicroBatches",
    "metrics reduce (the step's one sync)": "eagle3/train/metrics.py:reduce",
    "metrics.jsonl / W&B": "eagle3/train/loop.py:_log",
    "progress.json + bar": "eagle3/stage/progress.py:update",
    "validation": "eagle3/train/loop.py:evaluate",
    "checkpoints": "eagle3/train/loop.py:_checkpoint",
}


def part_matches(pattern: str | tuple[str, ...], key: tuple[str, int, str]) -> bool:
    """Whether a cProfile key ``(file, line, function)`` belongs to a :data:`HOST_PARTS` pattern:
    ``"path/file.py:function"`` (or a tuple of them) by substring; ``"MicroBatches"`` by the first
    lines of the generators ``MicroBatches.__iter__`` returns (a ``<genexpr>`` is named alike everywhere)."""
    if pattern == "MicroBatches":
        import inspect

        from eagle3.train.data import MicroBatches

        src, first = inspect.getsourcelines(MicroBatches.__iter__)
        return key[0].replace("\\", "/").endswith("eagle3/train/data.py") and (
            (key[2] == "<genexpr>" and first <= key[1] < first + len(src))
            or key[1] == MicroBatches._threaded.__code__.co_firstlineno)
    return any(p in f"{key[0]}:{key[2]}" for p in ((pattern,) if isinstance(pattern, str) else pattern))


def host_breakdown(fn) -> None:
    """Run ``fn()`` (ours) under cProfile and print the share of ``Trainer.loop``'s wall time in each
    part (:data:`HOST_PARTS`): what the loop adds over forward + backward + optimizer. Fractions
    survive a loaded machine better than tokens/s do. On CUDA the forward/backward rows are launch
    time only and the sync row holds the GPU's work: use ``--profile`` there."""
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    fn()
    pr.disable()
    st = pstats.Stats(pr).stats

    def cum(pattern: str | tuple[str, ...]) -> float:
        return sum(v[3] for k, v in st.items() if part_matches(pattern, k))

    total = cum("eagle3/train/loop.py:loop")
    print(f"\nTrainer.loop under cProfile: {total:.2f} s")
    print("| part | seconds | share of the loop |\n|---|---|---|")
    for label, pat in HOST_PARTS.items():
        v = cum(pat)
        print(f"| {label} | {v:.3f} | {100 * v / max(total, 1e-9):.1f}% |")
    missing = [label for label, pat in HOST_PARTS.items() if not any(part_matches(pat, k) for k in st)]
    if missing:  # a renamed function would print 0% as if it cost nothing: say so
        print(f"(not found in this profile, so shown as 0: {', '.join(missing)})")


def train_flops_per_token(shape: dict, draft_vocab: int, n_aux: int, ttt: int, doc_len: float, layers: int = 1) -> float:
    """Training FLOPs per token of the Eagle-3 drafter (one Llama layer), 2 FLOPs per multiply-add.

    Trainable matmuls (fc once; q/k/v from 2H, o, gate/up/down per TTT step): x6 (forward + two
    backward products). Frozen draft lm_head per TTT step: x4 (forward + input gradient only).
    Frozen verifier head (teacher logits, once): x2. Attention per TTT step: QK^T and PV over the
    causal context, on average doc_len/2 keys, x6.
    """
    H, I = shape["hidden_size"], shape["intermediate_size"]  # noqa: E741 - the usual names of the two widths
    hd = shape.get("head_dim") or H // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    layer = 2 * H * (q + 2 * kv) + q * H + 3 * H * I
    trainable = n_aux * H * H + ttt * layers * layer
    attn = ttt * layers * 2 * q * (doc_len / 2)
    return 6 * trainable + 4 * ttt * H * draft_vocab + 2 * H * draft_vocab + 6 * attn


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--steps", type=int, default=None, help="measured steps (default 6 CPU, 20 GPU)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed first steps (default 2 CPU, 4 GPU)")
    ap.add_argument("--token-budget", type=int, default=None, help="tokens per micro-batch (default 1024 CPU, 8192 GPU)")
    ap.add_argument("--doc-len", type=int, default=None, help="tokens per sample (default 256 CPU, 2048 GPU)")
    ap.add_argument("--draft-vocab", type=int, default=None, help="default 2048 CPU, 32000 GPU")
    ap.add_argument("--repeats", type=int, default=2, help="alternating ours/bare measurements; the best of each is kept")
    ap.add_argument("--only", choices=["ours", "bare"], default=None)
    ap.add_argument("--workdir", default=None, help="where the synthetic run goes (default: a temp dir, removed)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--num-workers", type=int, default=None, help="train.num_workers for ours (default 0 CPU, 4 GPU)")
    ap.add_argument("--max-samples", type=int, default=None, help="synthetic samples (default 32 GPU, enough CPU)")
    ap.add_argument("--hs-dtype", default="bfloat16", choices=["bfloat16", "float8_e4m3fn"],
                    help="storage dtype of the synthetic Stage 3 files (fp8: read back dequantized by the loader)")
    ap.add_argument("--profile", action="store_true",
                    help="one extra pass of each loop under torch.profiler: top ops and syncs per step")
    ap.add_argument("--trace-dir", default=None, help="with --profile: write chrome traces here")
    ap.add_argument("--host-profile", action="store_true",
                    help="one extra pass of ours under cProfile: the loop's time by part (data, logging, sync, ...)")
    ap.add_argument("--ttt", type=int, default=3, help="train.ttt_steps (the CPU default trains 2)")
    ap.add_argument("--autocast", default="auto", choices=["auto", "bfloat16", "none"],
                    help="train.autocast of both loops ('auto': bf16 on GPU, float32 on CPU for this float32 fake target)")
    ap.add_argument("--compare-optimizer", action="store_true",
                    help="instead of ours vs bare: ours with train.optimizer adamw vs muon, alternating, and their ratio")
    ap.add_argument("--compare-autocast", action="store_true",
                    help="instead of ours vs bare: ours with train.autocast none (float32) vs bfloat16, alternating, "
                    "and their ratio (does bf16 autocast pay on an AMX CPU?)")
    ap.add_argument("--batches-on-device", action="store_true",
                    help="a third loop: ours with the batches pre-collated on the device (the loop without its data path)")
    ap.add_argument("--compile", default="attention", choices=["attention", "speculators", "none"],
                    help="train.compile of both loops (the bare step used to keep speculators' compiled forward "
                    "while ours ran the 'attention' default: a compile difference, not a loop cost)")
    ap.add_argument("--loss-impl", default="auto", choices=["auto", "eager", "fused"],
                    help="train.loss_implementation ('auto': fused Triton kernels on GPU, eager on CPU)")
    a = ap.parse_args(argv)
    cuda = a.device == "cuda"
    steps = a.steps or (20 if cuda else 6)
    warmup = a.warmup or (4 if cuda else 2)
    budget = a.token_budget or (8192 if cuda else 1024)
    doc = a.doc_len or (2048 if cuda else 256)
    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="bench_train-"))
    try:
        if a.threads:
            torch.set_num_threads(a.threads)
        shape = LLAMA_8B if cuda else SMOLLM2_135M
        draft = a.draft_vocab or (32000 if cuda else 2048)
        target_s = str(fake_target(work / "target", shape, torch.bfloat16 if cuda else torch.float32))
        per_step = max(1, budget // doc)
        n_samples = min(per_step * (steps + warmup), a.max_samples or (32 if cuda else 10**6))
        epochs = -(-(steps + warmup) * per_step // n_samples) + 1
        rd = work / "run"
        if not RunDir(rd).manifest.exists():
            t0 = time.time()
            synthetic_run(rd, shape["hidden_size"], shape["num_hidden_layers"], shape["vocab_size"], draft,
                          [doc + 1] * n_samples, hs_dtype=getattr(torch, a.hs_dtype))
            print(f"synthetic data: {n_samples} samples x {doc + 1} tokens ({doc} training positions after the "
                  f"shift) in {time.time() - t0:.0f} s", flush=True)
        workers = a.num_workers if a.num_workers is not None else (4 if cuda else 0)
        common = dict(num_workers=workers, loss_implementation=a.loss_impl, ttt_steps=a.ttt, compile=a.compile)
        params = params_for(target_s, "cuda" if cuda else "cpu", budget, steps + warmup, epochs, autocast=a.autocast, **common)
        loops = (("bare", run_bare, params), ("ours", run_ours, params))
        if a.batches_on_device:
            loops += (("ours-on-device", run_ours_batches_on_device, params),)
        if a.compare_autocast:
            loops = tuple((f"ours {m}", run_ours, params_for(target_s, "cuda" if cuda else "cpu", budget, steps + warmup,
                                                             epochs, autocast=m, **common))
                          for m in ("none", "bfloat16"))
        if a.compare_optimizer:
            loops = tuple((f"ours {m}", run_ours, params_for(target_s, "cuda" if cuda else "cpu", budget, steps + warmup,
                                                             epochs, autocast=a.autocast, optimizer=m, **common))
                          for m in ("adamw", "muon"))
        res = {name: [] for name, _, _ in loops}
        for _ in range(a.repeats):
            for name, fn, p in loops:
                if a.only and not name.startswith(a.only):
                    continue
                r = fn(p, rd, warmup)
                print(f"  {name}: {r['tokens_per_s']:.1f} tokens/s ({r['steps']} steps, {r['wall_s']:.2f} s)", flush=True)
                res[name].append(r)
        if a.profile:
            for name, fn, p in loops:
                if not a.only or name.startswith(a.only):
                    profiled(lambda fn=fn, p=p: fn(p, rd, warmup), name, a.trace_dir, steps)
        if a.host_profile:
            host_breakdown(lambda: run_ours(params, rd, warmup))
        best = {k: max(v, key=lambda r: r["tokens_per_s"]) for k, v in res.items() if v}
        if not best:  # --repeats 0: only the profile passes ran
            return 0
        fl = train_flops_per_token(shape, draft, 3, a.ttt, doc)
        peak = next((v for k, v in PEAK_BF16.items() if cuda and k in torch.cuda.get_device_name()), None)
        print()
        dev_name = torch.cuda.get_device_name() if cuda else f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
        print(f"device: {dev_name}; target hidden {shape['hidden_size']}, vocab {shape['vocab_size']}, draft vocab {draft}, "
              f"1 draft layer, {a.ttt} TTT steps, token budget {budget}, samples of {doc} tokens, "
              f"loss {params.train.loss} ({a.loss_impl}), compile {a.compile}, stored states {a.hs_dtype}, torch {torch.__version__}")
        print(f"| {'loop':14} | {'tokens/s':>10} | {'steps':>5} | {'wall s':>7} | {'TFLOP/s':>8} | {'MFU':>6} | {'peak GiB':>8} |")
        print(f"|{'-' * 16}|{'-' * 12}|{'-' * 7}|{'-' * 9}|{'-' * 10}|{'-' * 8}|{'-' * 10}|")
        for k, r in best.items():
            tf = r["tokens_per_s"] * fl
            r.update({"tflops": tf / 1e12, "mfu": tf / peak if peak else None})
            mfu = f"{r['mfu'] * 100:5.1f}%" if r["mfu"] is not None else "     -"
            mem = f"{r['peak_mem_gib']:8.1f}" if "peak_mem_gib" in r else "       -"
            print(f"| {k:14} | {r['tokens_per_s']:10.1f} | {r['steps']:5d} | {r['wall_s']:7.2f} | {tf / 1e12:8.3f} | {mfu} | {mem} |")
        if a.compare_autocast and len(best) == 2:
            ratio = best["ours bfloat16"]["tokens_per_s"] / best["ours none"]["tokens_per_s"]
            print(f"\nbf16 autocast / float32 = {ratio:.3f}  (same batches, same steps, alternating runs)")
            best["ratio"] = ratio
        elif a.compare_optimizer and len(best) == 2:
            ratio = best["ours muon"]["tokens_per_s"] / best["ours adamw"]["tokens_per_s"]
            print(f"\nMuon / AdamW = {ratio:.3f}  (same batches, same steps, alternating runs)")
            best["ratio"] = ratio
        elif "ours" in best and "bare" in best:
            ratio = best["ours"]["tokens_per_s"] / best["bare"]["tokens_per_s"]
            print(f"\nours / bare = {ratio:.3f}  (loop overhead {100 * (1 - ratio):.1f}%; goal <= 5%)")
            best["ratio"] = ratio
            if "ours-on-device" in best:
                r = best["ours-on-device"]["tokens_per_s"] / best["bare"]["tokens_per_s"]
                print(f"ours with the batches on the device / bare = {r:.3f}  (the loop without its data path)")
                best["ratio_on_device"] = r
        best["flops_per_token"] = fl
        if a.json:
            Path(a.json).write_text(json.dumps({"args": vars(a), "all": res, "best": best}, indent=1))
    finally:
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
