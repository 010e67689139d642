"""scripts/compare_runs.py on two small fabricated run directories."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle3.contracts.hidden_states import write_manifest
from eagle3.contracts.samples import write_samples
from eagle3.rundir import RunDir
from eagle3.stage import write_stats

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("compare_runs", ROOT / "scripts" / "compare_runs.py")
compare_runs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare_runs)


def _run(root: Path, *, loss: float = 2.5, elapsed: float = 10.0, ids=("a", "b"), sha="00", weight=1.0) -> Path:
    rd = RunDir(root)
    write_stats(rd.stage(1, create=True), {"samples": len(ids), "elapsed_s": elapsed, "tokens_per_s": 100 / elapsed,
                                           "finish_reasons": {"length": 2}})
    write_samples(root, [{"id": i, "source": "q", "split": "train", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]} for i in ids])
    write_stats(rd.stage(3, create=True), {"num_samples": len(ids), "bytes": 4096, "writer_busy_s": elapsed / 3})
    write_manifest(rd.stage(3), {n: {"row": n, "id": i, "num_tokens": 3, "file": f"rows/{n:06d}.safetensors",
                                     "bytes": 10, "sha256": sha + i} for n, i in enumerate(ids)}, len(ids))
    write_stats(rd.stage(4, create=True), {"final_train_loss": loss, "train_time_s": elapsed, "best_step": 6})
    rd.drafter_dir.mkdir(parents=True)
    save_file({"fc.weight": torch.full((2, 3), weight), "d2t": torch.arange(4)}, str(rd.drafter_dir / "model.safetensors"))
    return root


def test_same_runs_agree_despite_different_timings(tmp_path, capsys):
    a = _run(tmp_path / "a")
    b = _run(tmp_path / "b", elapsed=99.0)
    assert compare_runs.main([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "6 of 6 checks agree" in out and "DIFFERENT" not in out
    assert "2 ids equal" in out and "2 file sha256s equal" in out and "2 tensors equal" in out
    assert "3 numbers equal" in out  # 01: samples + finish_reasons.length + complete; times skipped


def test_every_kind_of_difference_is_reported(tmp_path, capsys):
    a = _run(tmp_path / "a")
    b = _run(tmp_path / "b", loss=2.25, ids=("a", "c"), sha="11", weight=1.5)
    assert compare_runs.main([str(a), str(b)]) == 1
    rows = {c: (ok, d) for c, d, ok in compare_runs.compare(a, b)}
    assert rows["04_train/stats.json"] == (False, "final_train_loss: 2.5 != 2.25")
    assert rows["samples.jsonl ids"] == (False, "1 only in A, 1 only in B")
    assert rows["hidden-state sha256 (manifest)"] == (False, "3 differ, e.g. a")
    assert rows["drafter/model.safetensors"] == (False, "1 of 2 differ: fc.weight")
    assert rows["01_synthesize/stats.json"][0] is True
    assert "DIFFERENT" in capsys.readouterr().out


def test_time_keys_are_skipped_and_missing_dir_is_exit_2(tmp_path):
    keys = ["elapsed_s", "x.tokens_per_s_vllm_none", "finished_at", "projected_seconds", "cache_hit"]
    assert [k for k in keys if compare_runs.skipped(k)] == keys
    assert not compare_runs.skipped("num_samples") and not compare_runs.skipped("tokens_seen")
    assert compare_runs.main([str(tmp_path / "nope"), str(tmp_path)]) == 2
