"""Stage 3 (extract hidden states) on the embedded SmolLM2 target: conventions, files, resume,
bad input, data parallel, online mode and the vLLM adoption path.

A module-scoped reference run (10 rendered chat conversations, bf16 storage, 4 rows per shard)
is extracted once; the resume / data-parallel / adoption tests compare their files with it byte
for byte.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _extract_fixtures import write_train_parquet

from eagle3.contracts.hidden_states import (
    HiddenStatesDataset,
    NonFiniteError,
    SampleWriter,
    check_sample_file,
    save_sample,
    written_sha256,
)
from eagle3.errors import ExtractError
from eagle3.extract import load_rows, online_samples, preflight, run, verify
from eagle3.extract.core import extract_batches, plan_batches
from eagle3.hooks import PrefillCapture, resolve_layer_ids
from eagle3.io import read_json
from eagle3.params_file import load_params
from eagle3.rundir import STAGES, prepare_run_dir

VOCAB_DIR, EXTRACT_DIR = STAGES[2], STAGES[3]  # the stage folder names

N_ROWS = 10
EXTRACT_PARAMS = {"token_budget": 384, "shard_size": 4, "dtype": "bfloat16"}


def make_params(out: Path, name: str, **extract):
    return load_params(None, {
        "run": {"name": name, "output_dir": str(out)},
        "tracking": {"mode": "disabled"},
        "target": {"dtype": "float32", "device": "cpu"},
        "vocab": {"max_seq_len": 512},
        "extract": {**EXTRACT_PARAMS, **extract},
    })


def new_run(out: Path, name: str, tok, n: int = N_ROWS, extra_rows=(), **extract):
    params = make_params(out, name, **extract)
    rd = prepare_run_dir(params, out / name)
    write_train_parquet(rd, tok, n=n, extra_rows=extra_rows)
    return params, rd


def assert_same_outputs(a: Path, b: Path) -> None:
    """Identical manifest.jsonl and identical bytes in every sample file."""
    ma = (a / EXTRACT_DIR / "manifest.jsonl").read_bytes()
    assert ma == (b / EXTRACT_DIR / "manifest.jsonl").read_bytes()
    for line in ma.decode().splitlines():
        rel = json.loads(line)["file"]
        assert (a / EXTRACT_DIR / rel).read_bytes() == (b / EXTRACT_DIR / rel).read_bytes(), rel


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """One intra-op thread for this module (restored after): small CPU forwards are several times
    slower with 2 OpenMP threads when other processes compete for the 2 cores, and one thread keeps
    the in-process runs and the subprocesses (torchrun sets OMP_NUM_THREADS=1) on the same kernels."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok(embedded_target):
    from eagle3.target import load_tokenizer

    return load_tokenizer(embedded_target)


@pytest.fixture(scope="module")
def ref(tmp_path_factory, tok):
    """(params, run_dir, stats) of an uninterrupted single-process extraction."""
    out = tmp_path_factory.mktemp("extract_ref")
    params, rd = new_run(out, "ref", tok)
    stats = run(params, rd)
    return params, rd, stats


# ------------------------------------------------------------------------------------------------
# Pure logic
# ------------------------------------------------------------------------------------------------


def test_layer_ids_default_and_bad_ids():
    # eagle3.hooks raises the caller's error class (ValueError by default; Stage 3 passes ExtractError)
    assert resolve_layer_ids(None, 30) == [2, 15, 27]
    assert resolve_layer_ids([1, 29], 30) == [1, 29]
    with pytest.raises(ValueError, match=r"\[30\] out of range.*1 <= k < 30"):
        resolve_layer_ids([2, 30], 30)
    with pytest.raises(ValueError, match=r"\[0\] out of range"):
        resolve_layer_ids([0, 5], 30)
    with pytest.raises(ValueError, match=r"duplicated id\(s\) \[5\]"):
        resolve_layer_ids([5, 5, 9], 30)
    with pytest.raises(ValueError, match="ascending"):
        resolve_layer_ids([9, 5], 30)
    with pytest.raises(ValueError, match="at least one"):
        resolve_layer_ids([], 30)


def test_plan_batches_token_budget_longest_first():
    # sorted by length desc: 1(9) 3(9) 0(5) 2(3) 4(1); budget 18 -> [1,3] (2x9), [0,2,4] (3x5)
    assert plan_batches([5, 9, 3, 9, 1], 18) == [[1, 3], [0, 2, 4]]
    # a sample longer than the budget gets a batch of its own
    assert plan_batches([50, 2, 2], 10) == [[0], [1, 2]]
    for b in plan_batches(list(range(1, 40)), 64):
        lens = [i + 1 for i in b]
        assert len(b) * max(lens) <= 64 or len(b) == 1


# ------------------------------------------------------------------------------------------------
# Convention check on the embedded model
# ------------------------------------------------------------------------------------------------


def test_stored_slots_match_transformers_hidden_states(target_model, tok):
    model, _ = target_model
    from _extract_fixtures import conversations, tokenize

    seqs = [tokenize(tok, c)[0][:L] for c, L in zip(conversations(3, seed=7), (48, 30, 41))]
    n = model.config.num_hidden_layers
    norm_calls = []
    h_norm = model.model.norm.register_forward_hook(lambda *a: norm_calls.append(1))
    cap = PrefillCapture(model, None, torch.float32)
    try:
        assert cap.stored_layers == [2, 15, 27, 30] and len(cap._handles) == 4
        singles = []
        for ids in seqs:
            x = torch.tensor([ids])
            got = cap.capture(x)[0]  # [seq, 4, 576]
            assert got.shape == (len(ids), 4, 576)
            assert not norm_calls, "the forward must stop after the last decoder layer"
            with torch.inference_mode():
                ref = model(input_ids=x, output_hidden_states=True, use_cache=False).hidden_states
            for slot, k in enumerate([2, 15, 27]):
                torch.testing.assert_close(got[:, slot], ref[k][0], rtol=0, atol=1e-5)
            # last slot is layer N before the final norm: norm(last) == hidden_states[N] != last
            with torch.inference_mode():
                torch.testing.assert_close(model.model.norm(got[:, 3]), ref[n][0], rtol=0, atol=1e-4)
            assert (got[:, 3] - ref[n][0]).abs().max() > 1.0
            norm_calls.clear()  # the reference forward and the check above ran the norm, capture() must not
            singles.append(got)
        # a padded batch of three == one at a time (float32 tolerance)
        lens = [len(s) for s in seqs]
        x = torch.zeros(3, max(lens), dtype=torch.long)
        mask = torch.zeros(3, max(lens), dtype=torch.long)
        for j, s in enumerate(seqs):
            x[j, : len(s)] = torch.tensor(s)
            mask[j, : len(s)] = 1
        batch = cap.capture(x, mask)
        for j, s in enumerate(singles):  # other reduction shapes: float32 rounding only
            torch.testing.assert_close(batch[j, : lens[j]], s, rtol=1e-3, atol=1e-3)
        # bfloat16 storage is the float32 capture rounded once
        cap16 = PrefillCapture(model, None, torch.bfloat16)
        try:
            assert torch.equal(cap16.capture(torch.tensor([seqs[0]]))[0], singles[0].to(torch.bfloat16))
        finally:
            cap16.close()
    finally:
        cap.close()
        h_norm.remove()
    # hooks removed: the model runs as before
    with torch.inference_mode():
        model(input_ids=torch.tensor([seqs[0]]), use_cache=False)


def test_plan_batches_packed_counts_real_tokens():
    # packed: sum of lengths <= budget (no padding), still longest first and deterministic
    assert plan_batches([5, 9, 3, 9, 1], 18, packed=True) == [[1, 3], [0, 2, 4]]
    assert plan_batches([5, 9, 3, 9, 1], 14, packed=True) == [[1], [3, 0], [2, 4]]
    assert plan_batches([50, 2, 2], 10, packed=True) == [[0], [1, 2]]
    plan = plan_batches(list(range(1, 40)), 64, packed=True)
    assert sorted(r for b in plan for r in b) == list(range(39))
    assert all(len(b) == 1 or sum(b) + len(b) <= 64 for b in plan)  # lengths are index + 1
    # lengths 10..40 under 128 tokens: packing fills batches the padded plan cannot
    lens = [10 + (7 * i) % 31 for i in range(40)]
    packed, padded = plan_batches(lens, 128, packed=True), plan_batches(lens, 128)
    assert len(packed) < len(padded)


def test_resolve_batching_follows_the_attention_of_the_config():
    from types import SimpleNamespace as NS

    from eagle3.extract.core import resolve_batching

    assert resolve_batching("auto", NS(sliding_window=None)) == "packed"
    assert resolve_batching("auto", NS(sliding_window=4096, use_sliding_window=False)) == "packed"  # Qwen2-style off
    assert resolve_batching("auto", NS(sliding_window=4096)) == "padded"  # Mistral-style on
    assert resolve_batching("auto", NS(layer_types=["sliding_attention", "full_attention"])) == "padded"
    assert resolve_batching("padded", NS()) == "padded" and resolve_batching("packed", NS()) == "packed"


def test_packed_capture_equals_the_padded_batch_and_each_sample_alone(target_model, tok):
    """The packed row (no padding, per-sample positions, document-causal attention)
    stores per sample what the right-padded masked batch stores, within bf16 rounding."""
    from _extract_fixtures import conversations, tokenize

    from eagle3.contracts.tokenized import TokenizedSplit
    from eagle3.extract.core import forward_batch

    model, _ = target_model
    seqs = [tokenize(tok, c)[0][:L] for c, L in zip(conversations(4, seed=3), (61, 17, 40, 1))]
    rows = TokenizedSplit.from_lists([f"s{i}" for i in range(4)], seqs, source="test")
    batch = [0, 1, 2, 3]
    cap = PrefillCapture(model, None, torch.float32)
    cap16 = PrefillCapture(model, None, torch.bfloat16)
    try:
        assert cap.packed_kernel == "sdpa" and cap.packing_problem() is None
        packed = forward_batch(cap, rows, batch, packed=True)
        padded = forward_batch(cap, rows, batch, packed=False)
        assert packed.hs.shape == (sum(len(s) for s in seqs), 4, 576) and padded.hs.shape == (4, 61, 4, 576)
        assert packed.finite.tolist() == padded.finite.tolist() == [True] * 4
        for j, s in enumerate(seqs):
            alone = cap.capture(torch.tensor([s]))[0]
            a, b = packed.sample(j), padded.sample(j)
            assert a.shape == b.shape == alone.shape == (len(s), 4, 576)
            torch.testing.assert_close(a, alone, rtol=1e-4, atol=1e-4)  # float32: other reduction shapes only
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
            # what the stage stores (bf16): equal to the padded path's bf16 within one bf16 rounding step
            a16, b16 = cap16.capture_packed(torch.tensor(s), [len(s)]), forward_batch(cap16, rows, batch, packed=False).sample(j)
            torch.testing.assert_close(a16.float(), b16.float(), rtol=2 ** -7, atol=1e-2)
        p16 = forward_batch(cap16, rows, batch, packed=True)
        for j in range(4):
            torch.testing.assert_close(p16.sample(j).float(), padded.sample(j).to(torch.bfloat16).float(),
                                       rtol=2 ** -7, atol=1e-2)
        # the model is back on its own attention after the packed call
        assert model.config._attn_implementation == "sdpa"
        with pytest.raises(ValueError, match="do not split"):
            cap.capture_packed(torch.tensor(seqs[0]), [10, 10])
    finally:
        cap.close()
        cap16.close()


class _NoHostRead(torch.utils._python_dispatch.TorchDispatchMode):
    """Fails on every op that reads a tensor's value on the host: on CUDA each one waits for the stream
    (``cudaStreamSynchronize``), so the host stops queueing the next batch while the GPU drains."""

    HOST_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default,  # .item(), int(t)
                  torch.ops.aten.is_nonzero.default,  # bool(t), `if t.all():`
                  torch.ops.aten.equal.default, torch.ops.aten.nonzero.default,  # data-dependent results
                  torch.ops.aten.masked_select.default)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.HOST_READS:
            raise AssertionError(f"host read of a tensor value in the packed forward: {func}")
        return func(*args, **(kwargs or {}))


def test_packed_forward_reads_no_tensor_value_on_the_host(target_model, tok):
    """One ``cudaStreamSynchronize`` per batch (seen in an H200 profile) came from
    transformers' packed-sequence detection (``find_packed_sequence_indices``: ``if (...).all()`` on the
    position ids), which ran because a mask function was registered for the packed attention; the GPU
    then idled ~20 ms per batch while the host prepared the next one. The packed forward (stage 3's
    and online training's) must queue a batch without reading any device value."""
    from _extract_fixtures import conversations, tokenize

    from eagle3.contracts.tokenized import TokenizedSplit
    from eagle3.extract.core import forward_batch

    model, _ = target_model
    seqs = [tokenize(tok, c)[0][:L] for c, L in zip(conversations(3, seed=5), (23, 9, 14))]
    rows = TokenizedSplit.from_lists([f"s{i}" for i in range(3)], seqs, source="test")
    cap = PrefillCapture(model, None, torch.float32)
    try:
        want = forward_batch(cap, rows, [0, 1, 2], packed=False)
        with _NoHostRead():
            got = forward_batch(cap, rows, [0, 1, 2], packed=True)
        for j in range(3):
            torch.testing.assert_close(got.sample(j), want.sample(j), rtol=1e-3, atol=1e-3)
        with pytest.raises(AssertionError, match="host read"), _NoHostRead():  # the guard sees a host read
            bool(torch.ones(2).all())
    finally:
        cap.close()


def test_varlen_call_follows_both_torch_signatures(monkeypatch):
    """The CUDA packed kernel calls torch.nn.attention.varlen.varlen_attn causally under both of its
    signatures (is_causal= in torch 2.9-2.10; window_size=(-1, 0) and enable_gqa= later)."""
    import torch.nn.attention.varlen as tv

    from eagle3.hooks import _varlen_call

    seen = {}

    def old_sig(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, scale=None):
        seen.update(is_causal=is_causal, scale=scale, max_q=max_q)
        return query

    def new_sig(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False, seqused_k=None):
        seen.update(window_size=window_size, enable_gqa=enable_gqa, scale=scale)
        return query

    q, k = torch.zeros(5, 4, 8), torch.zeros(5, 2, 8)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    monkeypatch.setattr(tv, "varlen_attn", old_sig)
    _varlen_call()(q, k, k, cu, 3, 0.5)
    assert seen == {"is_causal": True, "scale": 0.5, "max_q": 3}
    seen.clear()
    monkeypatch.setattr(tv, "varlen_attn", new_sig)
    _varlen_call()(q, k, k, cu, 3, None)
    assert seen == {"window_size": (-1, 0), "enable_gqa": True, "scale": None}


def test_packed_finite_flags_name_the_bad_sample():
    from eagle3.extract.core import finite_flags_packed

    hs = torch.zeros(10, 2, 3)
    hs[6, 1, 2] = float("nan")
    assert finite_flags_packed(hs, [3, 2, 4, 1]).tolist() == [True, True, False, True]
    hs[0, 0, 0] = float("inf")
    assert finite_flags_packed(hs, [3, 2, 4, 1]).tolist() == [False, True, False, True]


def test_fp8_quantization_per_token_and_slot():
    from eagle3.contracts.hidden_states import FP8, SCALES, as_stored, quantize_fp8, read_states, storage_tensors

    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 4, 576, generator=g) * torch.tensor([0.1, 3.0, 40.0, 900.0])[None, :, None]
    x[2, 1] = 0.0  # an all-zero vector: scale 1, codes 0
    x[5, 3, 17] = 5e4  # an outlier channel: its vector's scale follows it, the others' do not
    q, sc = quantize_fp8(x)
    assert q.dtype == FP8 and q.shape == x.shape and sc.dtype == torch.float32 and sc.shape == (7, 4, 1)
    assert float(sc[2, 1, 0]) == 1.0 and not q[2, 1].float().any()
    assert torch.equal(sc[..., 0], torch.where(x.abs().amax(-1) > 0, x.abs().amax(-1) / 448, 1.0))
    back = read_states({"hidden_states": q, SCALES: sc}, torch.bfloat16)
    assert set(back) == {"hidden_states"} and back["hidden_states"].dtype == torch.bfloat16
    y = as_stored(x, FP8)
    # e4m3: 3 mantissa bits, round to nearest: |error| <= 2^-4 |x| for normal codes (>= 2^-6 x scale)
    normal = x.abs() >= 2 ** -6 * sc
    assert ((y - x).abs() <= 2 ** -4 * x.abs() + 1e-6)[normal].all()
    assert (y - x).abs().amax(-1).le(2 ** -9 * 448 * sc[..., 0] + 2 ** -4 * x.abs().amax(-1)).all()
    assert float((y[5, 3, 17] - 5e4).abs()) == 0.0  # the maximum maps to 448 exactly
    rel = ((y - x).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-30))[x.norm(dim=-1) > 0]
    assert float(rel.max()) < 0.04 and float(rel.mean()) < 0.03
    assert set(storage_tensors(x, torch.bfloat16)) == {"hidden_states"}
    assert torch.equal(as_stored(x, torch.bfloat16), x.to(torch.bfloat16).float())


def test_fp8_storage_is_half_of_bf16_and_reads_back_close(ref, tmp_path, tok):
    """extract.dtype: float8_e4m3fn: fp8 codes + float32 scales per token and slot; the projection
    knows the size; every reader gets the dequantized values, within fp8 error of the bf16 run."""
    from safetensors.torch import load_file

    from eagle3.contracts.hidden_states import FP8, SCALES, to_training_item

    params, rd = new_run(tmp_path, "fp8", tok, dtype="float8_e4m3fn")
    stats = run(params, rd)
    _, ref_rd, ref_stats = ref
    sd = rd / EXTRACT_DIR
    meta, pf = read_json(sd / "meta.json"), read_json(sd / "preflight.json")
    assert meta["dtype"] == stats.dtype == "float8_e4m3fn" and SCALES in meta["layout"]
    assert pf["bytes_per_token"] == stats.hidden_bytes_per_token == 4 * (576 + 4)
    assert abs(stats.bytes / pf["projected_bytes"] - 1) < 0.01  # the preflight's projection
    assert 0.50 < stats.bytes / ref_stats.bytes < 0.52  # half of bf16, plus the scales and headers
    f = load_file(str(sd / "rows_000000-000004" / "000001.safetensors"))
    n1 = len(load_rows(rd).tokens(1))
    assert f["hidden_states"].dtype == FP8 and f["hidden_states"].shape == (n1, 4, 576)
    assert f[SCALES].dtype == torch.float32 and f[SCALES].shape == (n1, 4, 1)
    assert verify(rd)["problems"] == []
    a, b = HiddenStatesDataset.from_run(rd), HiddenStatesDataset.from_run(ref_rd)
    for i in range(N_ROWS):
        x, y = a[i]["hidden_states"], b[i]["hidden_states"].float()
        assert x.dtype == torch.float32 and SCALES not in a[i] and x.shape == y.shape
        rel = (x - y).norm(dim=-1) / y.norm(dim=-1)  # [seq, slots]
        assert float(rel.mean()) < 0.03 and float(rel.max()) < 0.06, (i, float(rel.mean()), float(rel.max()))
    # training reads dequantize into the training dtype
    refs = [r for r in a.refs][:2]
    train = HiddenStatesDataset.for_training(refs, 3, 576, 49152, torch.bfloat16)
    item = train[0]
    assert item["hidden_states"].dtype == item["verifier_last_hidden_states"].dtype == torch.bfloat16
    assert item["hidden_states"].shape == (refs[0].num_tokens, 3, 576)  # the aux slots (PackedCollate flattens)
    direct = to_training_item(a[0], 3, 576, 49152, "x")
    torch.testing.assert_close(item["hidden_states"].float(), direct["hidden_states"], rtol=2 ** -7, atol=1e-3)
    # online training with fp8 sees the values an fp8 file gives back
    on = next(iter(online_samples(params, rd, [0])))
    torch.testing.assert_close(on["hidden_states"].float(), a[0]["hidden_states"], rtol=0.07, atol=0.02)


def test_progress_heartbeat_counts_bytes_without_walking_the_folder(tmp_path, monkeypatch):
    """progress.json's bytes_on_disk comes from the resume scan's manifest sizes and the
    writer's own count; no write (update, heartbeat, close) lists the stage folder, however many files."""
    from eagle3.extract.progress import ExtractProgress

    sd = tmp_path / EXTRACT_DIR
    for k in range(3):
        d = sd / f"rows_{k * 1000:06d}-{k * 1000 + 1000:06d}"
        d.mkdir(parents=True)
        for r in range(1000):
            (d / f"{k * 1000 + r:06d}.safetensors").write_bytes(b"x" * 10)
    calls = []

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            target = args[0] if args else kwargs.get("top", kwargs.get("path", "."))
            if str(sd) in str(target):
                calls.append((name, str(target)))
            return fn(*args, **kwargs)
        return wrapped

    import os as _os
    for name in ("walk", "scandir", "listdir"):
        monkeypatch.setattr(_os, name, spy(name, getattr(_os, name)))
    for name in ("rglob", "glob", "iterdir"):
        monkeypatch.setattr(Path, name, spy(name, getattr(Path, name)))
    written = {"n": 0}
    prog = ExtractProgress(sd, sd, total=4000, total_tokens=40_000, done=3000, tokens=30_000, projected_bytes=40_000,
                           done_bytes=30_000, writer_ref=lambda: written["n"], other_dirs=[], timeline=sd / "timeline.jsonl")
    prog.interval_s = 0.0
    for _ in range(50):
        written["n"] += 10
        prog.update(1, tokens=10)
    prog._write("running", force=True)  # what the heartbeat thread does
    prog.close()
    snap = read_json(sd / "progress.json")
    assert calls == [], calls[:3]
    assert snap["bytes_on_disk"] == 30_000 + 500 and snap["bytes_written"] == 500 and snap["done"] == 3050


def test_writer_hash_from_memory_equals_the_file_hash(tmp_path):
    """save_sample's sha256 (header from the file, data from the tensors' memory) is the file's, for
    every storage dtype and for a sample that is a slice of a packed batch (what the writer is given); a
    file that does not hold those tensors gets None."""
    import hashlib

    gen = torch.Generator().manual_seed(0)
    batch32 = torch.randn(50, 5, 24, generator=gen)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn):
        tensors = {"token_ids": torch.arange(37) * 7919, "loss_mask": (torch.arange(37) % 3 == 0).to(torch.int8),
                   "hidden_states": batch32.to(dtype)[6:43]}  # a view 6 tokens into the batch's storage
        if dtype == torch.float8_e4m3fn:
            tensors["hidden_states_scales"] = batch32[6:43].abs().amax(-1, keepdim=True)
        path = tmp_path / f"{dtype}.safetensors"
        digest = save_sample(path, tensors, {"id": "s-1"})
        assert digest == hashlib.sha256(path.read_bytes()).hexdigest(), dtype
    # the file on disk is not the one these tensors make: no digest is vouched for
    other = dict(tensors, hidden_states=tensors["hidden_states"][:-1])
    assert written_sha256(path, other) is None
    assert written_sha256(path, {k: v for k, v in tensors.items() if k != "loss_mask"}) is None
    path.write_bytes(path.read_bytes()[:-1])
    assert written_sha256(path, tensors) is None


def test_layer_count_disagreeing_with_the_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=64)
    model = LlamaForCausalLM(cfg).eval()
    del model.model.layers[3]
    with pytest.raises(ExtractError, match="num_hidden_layers = 4 but the model has 3 decoder layers"):
        PrefillCapture(model, [1, 2], torch.float32, error=ExtractError)


# ------------------------------------------------------------------------------------------------
# The stage's files
# ------------------------------------------------------------------------------------------------


def test_run_writes_the_contract_files(ref):
    params, rd, stats = ref
    sd = rd / EXTRACT_DIR
    rows = load_rows(rd)
    meta = read_json(sd / "meta.json")
    assert meta["aux_layer_ids"] == [2, 15, 27] and meta["stored_layers"] == [2, 15, 27, 30]
    assert (meta["num_hidden_layers"], meta["hidden_size"], meta["dtype"]) == (30, 576, "bfloat16")
    assert Path(meta["target"]).is_dir()
    assert sorted(p.name for p in sd.glob("rows_*")) == ["rows_000000-000004", "rows_000004-000008",
                                                         "rows_000008-000012"]
    manifest = [json.loads(x) for x in (sd / "manifest.jsonl").read_text().splitlines()]
    assert [e["row"] for e in manifest] == list(range(N_ROWS))
    import hashlib

    for e in manifest:
        p = sd / e["file"]
        assert e["file"] == f"rows_{e['row'] // 4 * 4:06d}-{e['row'] // 4 * 4 + 4:06d}/{e['row']:06d}.safetensors"
        assert e["id"] == rows.ids[e["row"]] and e["num_tokens"] == rows.lengths[e["row"]]
        assert e["bytes"] == p.stat().st_size and e["sha256"] == hashlib.sha256(p.read_bytes()).hexdigest()
    # preflight: projected hidden bytes = sum(tokens) x (3 + 1) x 576 x 2, hand-checked against the parquet
    import pyarrow.parquet as pq

    tokens = sum(len(x) for x in pq.read_table(rd / VOCAB_DIR / "train.parquet")["input_ids"].to_pylist())
    pf = read_json(sd / "preflight.json")
    assert pf["tokens"] == tokens and pf["projected_hidden_bytes"] == tokens * 4 * 576 * 2
    assert pf["fits"] and pf["free_bytes"] > 0 and pf["projected_seconds"] > 0
    assert pf["calibration"]["tokens_per_s"] > 0
    # the projection is within 1% of what was written
    assert abs(stats.bytes / pf["projected_bytes"] - 1) < 0.01
    assert stats.bytes == sum(e["bytes"] for e in manifest)
    prog = read_json(sd / "progress.json")
    assert prog["status"] == "done" and prog["done"] == prog["total"] == N_ROWS
    assert prog["tokens"] == prog["total_tokens"] == tokens and prog["eta_s"] == 0.0
    assert prog["tokens_per_s"] > 0 and prog["bytes_written"] == stats.bytes == prog["bytes_on_disk"]
    assert prog["projected_bytes"] == pf["projected_bytes"]
    assert read_json(sd / "stats.json")["complete"] and stats.samples_extracted == N_ROWS and stats.tokens_per_s > 0
    assert (sd / "timeline.jsonl").read_text().strip()
    for fig in ("throughput", "bytes_per_token", "layer_norms"):
        assert (sd / f"{fig}.png").stat().st_size > 1000
    assert not list(sd.glob("manifest.part-*")) and not list(sd.rglob("*.tmp"))
    # the dataset API
    ds = HiddenStatesDataset.from_run(rd)
    assert len(ds) == N_ROWS and ds.meta["stored_layers"] == [2, 15, 27, 30]
    item = ds[3]
    assert item["hidden_states"].shape == (rows.lengths[3], 4, 576) and item["hidden_states"].dtype == torch.bfloat16
    assert item["token_ids"].dtype == torch.int64 and item["token_ids"].tolist() == rows.tokens(3).tolist()
    assert item["loss_mask"].dtype == torch.int8 and item["loss_mask"].tolist() == rows.mask(3).tolist()
    assert bool(torch.isfinite(item["hidden_states"]).all())
    # a finished stage is not redone
    t0 = time.time()
    finished = read_json(rd / EXTRACT_DIR / "stats.json")["finished_at"]
    assert run(params, rd) == stats and time.time() - t0 < 5
    assert read_json(rd / EXTRACT_DIR / "stats.json")["finished_at"] == finished


def test_online_samples_equal_the_stored_ones(ref):
    params, rd, _ = ref
    ds = HiddenStatesDataset.from_run(rd)
    got = list(online_samples(params, rd, rows=[4, 1, 7]))
    assert len(got) == 3
    for r, item in zip([4, 1, 7], got):
        stored = ds[r]
        assert set(item) == set(stored)
        assert torch.equal(item["token_ids"], stored["token_ids"]) and torch.equal(item["loss_mask"], stored["loss_mask"])
        assert item["hidden_states"].dtype == torch.bfloat16
        # other batch shapes than the stored run: equal up to bfloat16 rounding
        torch.testing.assert_close(item["hidden_states"].float(), stored["hidden_states"].float(), rtol=2e-2, atol=2e-2)


def test_verify_finds_a_flipped_byte(ref, tmp_path):
    _, rd, _ = ref
    dst = tmp_path / "copy"
    shutil.copytree(rd, dst)
    assert verify(dst)["problems"] == []
    f = dst / EXTRACT_DIR / "rows_000000-000004" / "000002.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x40  # inside the hidden-state data: the header stays valid
    f.write_bytes(bytes(data))
    rep = verify(dst)
    assert [(p["row"], p["problem"]) for p in rep["problems"]] == [(2, "sha256 differs from the manifest")]
    with pytest.raises(ExtractError, match=r"row 2 .*sha256"):
        verify(dst, raise_on_problem=True)


# ------------------------------------------------------------------------------------------------
# Resume
# ------------------------------------------------------------------------------------------------


def _unfinish(rd: Path) -> None:
    """Make a finished folder look like an interrupted one: no stats, no manifest."""
    sd = rd / EXTRACT_DIR
    (sd / "stats.json").unlink()
    lines = (sd / "manifest.jsonl").read_text()
    (sd / "manifest.jsonl").unlink()
    (sd / "manifest.part-000.jsonl").write_text(lines)


def test_resume_redoes_truncated_corrupt_and_wrong_shape_files(ref, tmp_path):
    from safetensors.torch import save_file

    params, rd, _ = ref
    dst = tmp_path / "ref"
    shutil.copytree(rd, dst)
    _unfinish(dst)
    sd = dst / EXTRACT_DIR
    f = {r: sd / f"rows_{r // 4 * 4:06d}-{r // 4 * 4 + 4:06d}/{r:06d}.safetensors" for r in range(N_ROWS)}
    data = f[1].read_bytes()
    f[1].write_bytes(data[: len(data) - 1000])  # truncated
    f[5].write_bytes(b"\xff" * 8 + f[5].read_bytes()[8:])  # unreadable header
    good = HiddenStatesDataset.from_run(rd)[8]
    save_file({**good, "hidden_states": good["hidden_states"][:, :3].contiguous()}, str(f[8]))  # wrong shape
    f[9].unlink()  # missing
    (sd / "rows_000000-000004" / ".000003.safetensors.abc.tmp").write_bytes(b"partial")  # killed writer
    (sd / "rows_000004-000008" / ".tmpAA8GWp").write_bytes(b"partial")  # safetensors' own, from older writers
    (sd / ".writing").mkdir()
    (sd / ".writing" / ".000006.safetensors.x1.tmp").write_bytes(b"partial")  # the stage's temp folder
    stats = run(params, dst)
    assert stats.files_redone == 3 and stats.samples_extracted == 4 and stats.samples_skipped == 6
    assert_same_outputs(rd, dst)
    assert not list(sd.rglob("*.tmp")) and not list(sd.rglob(".tmp*")) and not (sd / ".writing").exists()


@pytest.mark.slow
def test_sigkill_at_a_random_point_then_resume_is_identical(ref, tmp_path, tok):
    params, rd, _ = ref
    p2, rd2 = new_run(tmp_path, "killed", tok)
    seed = int.from_bytes(os.urandom(2), "little")
    rng = random.Random(seed)
    k, extra_sleep = rng.randint(1, N_ROWS // 2), rng.uniform(0.0, 0.4)
    journal = rd2 / EXTRACT_DIR / "manifest.part-000.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "eagle3.extract", str(rd2 / "params.yaml"), "--run-dir", str(rd2)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            if journal.exists() and len(journal.read_text().splitlines()) >= k:
                break
            time.sleep(0.02)
        time.sleep(extra_sleep)
        assert proc.poll() is None, f"the run finished before the kill (seed {seed})"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not (rd2 / EXTRACT_DIR / "stats.json").exists()
    n_before = len(list((rd2 / EXTRACT_DIR).glob("rows_*/*.safetensors")))
    assert 0 < n_before < N_ROWS, (seed, n_before)
    stats = run(p2, rd2)
    assert stats.samples_skipped >= 1, seed
    assert_same_outputs(rd, rd2)


def _files(sd: Path) -> dict[int, Path]:
    return {r: sd / f"rows_{r // 4 * 4:06d}-{r // 4 * 4 + 4:06d}/{r:06d}.safetensors" for r in range(N_ROWS)}


def test_broken_files_of_a_complete_stage_are_found_and_redone(ref, tmp_path):
    """A bit flip that keeps the size, a truncated file and a lost manifest line in a
    finished stage 3: `verify` names each, `--redo 3` (reopen_stage) re-checks every file against the
    manifest, redoes the two broken ones and rewrites the same manifest."""
    from eagle3.commands.run import reopen_stage
    from eagle3.commands.verify import verify_run

    params, rd, _ = ref
    dst = tmp_path / "ref"
    shutil.copytree(rd, dst)
    sd = dst / EXTRACT_DIR
    f = _files(sd)
    data = bytearray(f[2].read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit inside the hidden states: header and size unchanged
    f[2].write_bytes(bytes(data))
    f[5].write_bytes(f[5].read_bytes()[:-64])
    lines = (sd / "manifest.jsonl").read_text().splitlines(keepends=True)
    (sd / "manifest.jsonl").write_text("".join(lines[:7] + lines[8:]))  # row 7's line lost
    probs = verify_run(dst)
    assert any("no line for row 7" in p for p in probs) and any("9 records but meta.json says num_samples = 10" in p for p in probs)
    assert any("row 2 " in p and "sha256 differs from the manifest" in p for p in probs)
    assert any("row 5 " in p and "size" in p for p in probs)
    assert run(params, dst).files_redone == 0  # complete, inputs unchanged: returned as it is (stage 4 checks)
    assert "re-opened" in reopen_stage(dst, 3, params)
    stats = run(params, dst)
    assert stats.files_redone == 2 and stats.samples_extracted == 2 and stats.samples_skipped == N_ROWS - 2
    assert_same_outputs(rd, dst)
    assert verify_run(dst) == []


def test_a_stale_train_split_is_refused_then_redone(ref, tmp_path, tok):
    """A sample removed and stage 2 re-run -> a finished stage 3 refuses (not "already
    complete"), naming the changed file; `--redo 3` starts it over on the new split."""
    from eagle3.commands.run import reopen_stage

    params, rd, _ = ref
    dst = tmp_path / "ref"
    shutil.copytree(rd, dst)
    write_train_parquet(dst, tok, n=N_ROWS - 1)  # the same conversations but the last
    with pytest.raises(ExtractError, match=r"(?s)stage 3 \(03_extract\) is complete, but its inputs changed.*"
                                           r"02_vocab/train.parquet: sha256 .*--redo 3"):
        run(params, dst)
    assert "starts over" in reopen_stage(dst, 3, params)
    stats = run(params, dst)
    assert stats.num_samples == N_ROWS - 1 and stats.samples_extracted == N_ROWS - 1
    assert verify(dst)["problems"] == []


@pytest.mark.slow
def test_sigkill_during_a_file_write_then_resume_is_identical(ref, tmp_path, tok):
    """The kill lands inside sample writes on both writer threads (each has a partial
    file; one also has, like safetensors' save_file, a `.tmpXXXXXX` of its own): everything they
    left is in the stage's temp folder, the next run removes it and ends byte-identical to the
    uninterrupted run. Both threads hang on purpose: with only one hung, the kill can catch the other
    mid-write of a real file, a state the test does not expect."""
    _, rd, _ = ref
    p2, rd2 = new_run(tmp_path, "killed", tok, writer_threads=2)  # the two threads the test hangs
    sd = rd2 / EXTRACT_DIR
    marker = tmp_path / "in_write"
    script = f"""
import itertools, sys, threading, time
from pathlib import Path
from eagle3.params_file import load_params
from eagle3.contracts.hidden_states import save_sample
from eagle3.extract import run
calls = itertools.count(1)  # next() is atomic: the two writer threads share it
hung = threading.Semaphore(0)
def hang_in_third_and_fourth_write(tmp, tensors, metadata):
    n = next(calls)
    if n in (3, 4):
        from safetensors.torch import save
        data = save(tensors, metadata=metadata)
        Path(tmp).write_bytes(data[: len(data) // 2])
        if n == 3:
            (Path(tmp).parent / ".tmpAA8GWp").write_bytes(data[: len(data) // 3])  # what save_file leaves mid-write
        hung.release()
        if n == 4:
            hung.acquire(); hung.acquire()  # both partial files are on disk
            Path({str(marker)!r}).touch()
        time.sleep(600)
    save_sample(tmp, tensors, metadata)
run(load_params({str(rd2 / "params.yaml")!r}), Path({str(rd2)!r}), write_fn=hang_in_third_and_fourth_write)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None and not marker.exists():
            time.sleep(0.05)
        assert marker.exists(), "the run never reached its fourth write"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    left = sorted(p.name for p in (sd / ".writing").iterdir())
    ours = [n for n in left if re.fullmatch(r"\.\d{6}\.safetensors\.\w+\.tmp", n)]
    assert len(ours) == 2 and ".tmpAA8GWp" in left and len(left) == 3, left  # two partial files, the library's
    assert not [p for p in sd.glob("rows_*/.*")], "no temp file in a rows_* folder"
    stats = run(p2, rd2)
    assert stats.samples_skipped >= 1
    assert_same_outputs(rd, rd2)
    assert not (sd / ".writing").exists()


# ------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------


def test_bad_aux_ids_fail_before_loading_the_model(tmp_path, tok):
    params, rd = new_run(tmp_path, "aux", tok, n=2, aux_layer_ids=[2, 31])
    with pytest.raises(ExtractError, match=r"\[31\] out of range for a target with num_hidden_layers N = 30"):
        run(params, rd)
    params, rd = new_run(tmp_path, "dup", tok, n=2, aux_layer_ids=[4, 4, 20])
    with pytest.raises(ExtractError, match=r"duplicated id\(s\) \[4\]"):
        run(params, rd)
    assert not list((rd / EXTRACT_DIR).glob("rows_*"))


def test_row_longer_than_max_seq_len(tmp_path, tok):
    params, rd = new_run(tmp_path, "long", tok, n=2, extra_rows=[("too-long", [5] * 600, [1] * 600)])
    with pytest.raises(ExtractError, match=r"row 2 \(id too-long\) has 600 tokens, more than vocab.max_seq_len = 512"):
        run(params, rd)


def test_meta_of_another_model_is_refused(ref, tmp_path):
    params, rd, _ = ref
    dst = tmp_path / "ref"
    shutil.copytree(rd, dst)
    _unfinish(dst)
    meta = read_json(dst / EXTRACT_DIR / "meta.json")
    meta.update(hidden_size=4096, num_hidden_layers=32)
    (dst / EXTRACT_DIR / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ExtractError, match=r"num_hidden_layers: 32 .* 30 now(.|\n)*hidden_size: 4096 .* 576 now(.|\n)*disagrees"):
        run(params, dst)
    assert len(list((dst / EXTRACT_DIR).glob("rows_*/*.safetensors"))) == N_ROWS  # nothing lost


def test_foreign_file_in_the_output_dir(ref, tmp_path):
    params, rd, _ = ref
    dst = tmp_path / "ref"
    shutil.copytree(rd, dst)
    _unfinish(dst)
    junk = dst / EXTRACT_DIR / "rows_000004-000008" / "notes.txt"
    junk.write_text("mine")
    with pytest.raises(ExtractError, match=r"not written by Stage 3(.|\n)*notes.txt"):
        run(params, dst)
    assert junk.read_text() == "mine"
    assert len(list((dst / EXTRACT_DIR).glob("rows_*/*.safetensors"))) == N_ROWS


def test_preflight_refuses_when_the_projection_does_not_fit(tmp_path, tok):
    params, rd = new_run(tmp_path, "nodisk", tok, n=3, disk_margin=1e12)
    pf = preflight(params, rd)
    assert not pf["fits"] and pf["required_free_bytes"] == int(pf["todo_bytes"] * 1e12)
    with pytest.raises(ExtractError) as ei:
        run(params, rd)
    msg = str(ei.value)
    for part in ("not enough free disk", "4 layers x 576 hidden x 2 bytes = 4608 bytes", "free:", "vocab.max_seq_len",
                 "train.online: true", "fewer samples"):
        assert part in msg, part
    assert read_json(rd / EXTRACT_DIR / "preflight.json")["fits"] is False
    assert not list((rd / EXTRACT_DIR).glob("rows_*"))


def test_full_disk_is_a_clean_error_and_resumable(ref, tmp_path, tok):
    _, rd_ref, _ = ref
    params, rd = new_run(tmp_path, "full", tok)
    calls = {"n": 0}

    def disk_fills_up(tmp: Path, tensors: dict, metadata: dict) -> None:
        from safetensors.torch import save

        calls["n"] += 1
        data = save(tensors, metadata=metadata)
        with open(tmp, "wb") as f:
            if calls["n"] > 3:
                f.write(data[: len(data) // 2])
                raise OSError(errno.ENOSPC, "No space left on device")
            f.write(data)

    with pytest.raises(ExtractError, match=r"disk full while writing .*\.safetensors(.|\n)*re-run to resume"):
        run(params, rd, write_fn=disk_fills_up)
    sd = rd / EXTRACT_DIR
    assert read_json(sd / "progress.json")["status"] == "failed"
    assert not list(sd.rglob("*.tmp")), "partial files must be removed"
    files = sorted(sd.glob("rows_*/*.safetensors"))
    assert 3 <= len(files) < N_ROWS
    rows = load_rows(rd)
    journal = [json.loads(x) for x in (sd / "manifest.part-000.jsonl").read_text().splitlines()]
    assert len(journal) == len(files)
    for e in journal:
        assert check_sample_file(sd / e["file"], rows.tokens(e["row"]), 4, 576, torch.bfloat16) is None
    stats = run(params, rd)
    assert stats.samples_skipped == len(files)
    assert_same_outputs(rd_ref, rd)


def test_nan_sample_stops_the_run_naming_it(target_model, tmp_path, tok):
    model, _ = target_model
    params, rd = new_run(tmp_path, "nan", tok, n=4, extra_rows=[("poisoned", [1, 48000, 3, 4, 5], [0, 1, 1, 1, 1])])
    rows = load_rows(rd)
    assert sum(int((rows.tokens(r) == 48000).sum()) for r in range(len(rows))) == 1
    emb = model.model.embed_tokens.weight
    saved = emb[48000].clone()
    (rd / EXTRACT_DIR).mkdir()
    cap = PrefillCapture(model, None, torch.bfloat16)
    writer = SampleWriter(rd / EXTRACT_DIR, rd / EXTRACT_DIR / "j.jsonl", cap.stored_layers)
    try:
        with torch.no_grad():
            emb[48000] = float("nan")
        with pytest.raises(NonFiniteError, match=r"sample id poisoned \(row 4\): layer id 2 \(slot 0\), token [01] "):
            extract_batches(cap, rows, plan_batches(rows.lengths, 384), writer, shard_size=4)
    finally:
        with torch.no_grad():
            emb[48000] = saved
        cap.close()
    written = {p.name for p in (rd / EXTRACT_DIR).glob("rows_*/*.safetensors")}
    assert "000004.safetensors" not in written


# ------------------------------------------------------------------------------------------------
# Data parallel
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_torchrun_two_cpu_processes_write_the_same_files(ref, tmp_path, tok):
    _, rd_ref, _ = ref
    params, rd = new_run(tmp_path, "dp", tok, data_parallel=2)
    stats = run(params, rd)  # launches torchrun --nproc-per-node 2 -m eagle3.extract
    assert stats.world_size == 2 and stats.samples_extracted == N_ROWS
    assert_same_outputs(rd_ref, rd)
    assert not list((rd / EXTRACT_DIR).glob(".rank*"))


# ------------------------------------------------------------------------------------------------
# vLLM backend: what runs without a GPU
# ------------------------------------------------------------------------------------------------


def test_vllm_launch_configs_match_speculators(ref):
    import argparse

    from hs_connectors.transfer import FileBackend

    from eagle3.extract.vllm_backend import serve_command

    params, rd, _ = ref
    cmd = serve_command(params, rd, port=8123)
    assert cmd[:2] == ["vllm", "serve"] and Path(cmd[2]).is_dir()
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and cmd[cmd.index("--port") + 1] == "8123"
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec == {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27, 30]}}}
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    staging = str(rd / EXTRACT_DIR / "vllm_staging")
    assert kv == FileBackend.build_kv_transfer_config(argparse.Namespace(hidden_states_path=staging))


def test_vllm_input_is_what_the_speculators_client_reads(ref, tmp_path):
    import datasets
    from speculators.train.data import build_client_item

    from eagle3.extract.vllm_backend import write_vllm_input

    _, rd, _ = ref
    rows = load_rows(rd)
    out = write_vllm_input(rows, [3, 1], tmp_path / "vllm_input")
    ds = datasets.load_from_disk(str(out))
    assert build_client_item(ds[0]) == {"input_ids": rows.tokens(3).tolist()}
    assert build_client_item(ds[1]) == {"input_ids": rows.tokens(1).tolist()}
    assert ds.with_format(None)["row"] == [3, 1]


def test_adopting_vllm_files_gives_the_transformers_layout(ref, tmp_path, tok):
    from safetensors.torch import save_file

    from eagle3.extract.vllm_backend import adopt_vllm_outputs

    params_ref, rd_ref, _ = ref
    params, rd = new_run(tmp_path, "adopt", tok, backend="vllm")
    ds = HiddenStatesDataset.from_run(rd_ref)
    raw = rd / EXTRACT_DIR / "vllm_raw"
    raw.mkdir(parents=True)
    row_map = list(reversed(range(N_ROWS)))  # hs_i is row N-1-i, as a client input of todo rows would be
    for i, r in enumerate(row_map):  # what ExampleHiddenStatesConnector writes: hidden_states + token_ids
        item = ds[r]
        tokens = item["token_ids"].clone()
        if r == 0:
            tokens[1] += 1  # a mismatching file: rejected, row 0 stays missing
        save_file({"hidden_states": item["hidden_states"], "token_ids": tokens}, str(raw / f"hs_{i}.safetensors"))
    (raw / "hs_99.safetensors").write_bytes(b"not a safetensors file")
    out = adopt_vllm_outputs(params, rd, row_map=row_map)
    assert out["adopted"] == N_ROWS - 1 and out["missing"] == [0] and out["stats"] is None
    problems = sorted(p["problem"] for p in out["problems"])
    assert problems[0].startswith("index 99 not in the input") and "token_ids differ from row 0" in problems[1]
    assert sorted(p.name for p in raw.iterdir()) == ["hs_99.safetensors"]  # adopted raw files are deleted
    (raw / "hs_99.safetensors").unlink()
    item = ds[0]  # the retried row, in float32 as a float32 vLLM engine would write it
    save_file({"hidden_states": item["hidden_states"].float(), "token_ids": item["token_ids"]},
              str(raw / f"hs_{N_ROWS - 1}.safetensors"))
    out = adopt_vllm_outputs(params, rd, row_map=row_map)
    assert out["adopted"] == 1 and out["missing"] == [] and out["stats"]["complete"]
    assert out["stats"]["backend"] == "vllm"
    assert_same_outputs(rd_ref, rd)


def test_vllm_backend_on_cpu_refuses_clearly(tmp_path, tok):
    params, rd = new_run(tmp_path, "vcpu", tok, n=2, backend="vllm")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ExtractError, match="needs a GPU(.|\n)*backend: transformers on CPU"):
        run(params, rd)
