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


# ------------------------------------------------------------------ stage 5: flat layout vs grid


def _results_sets() -> dict:
    """results.json ``sets`` of two sets: heldout measured offline and in vLLM, general-chat in vLLM only."""
    from eagle3.evaluate.methods import OFFLINE_EAGLE3, VLLM_EAGLE3, VLLM_NGRAM, VLLM_NONE

    def vllm(tau, tpf, rate, tps, timed):
        return {"tau": tau, "tokens_per_forward": tpf, "draft_acceptance_rate": rate, "prompts": 2,
                "tokens_per_s": tps, "speed_prompts": 1, "speed_tokens_per_forward": timed}

    none = {"tau": None, "tokens_per_forward": 1.0, "tokens_per_s": 16.0, "speed_prompts": 1, "speed_tokens_per_forward": 1.0}
    info = {"count": 2, "excluded_training": 1, "candidates": 3, "duplicates": 0, "skipped_too_long": 0, "capped": 0,
            "bad_records": 0, "by_category": {"x": 2}}
    return {"general-chat": {"domain": "out-of-domain", "info": info | {"excluded_training": 0, "candidates": 2},
                             "speed_lengths_differ": [],
                             "methods": {VLLM_EAGLE3: vllm(1.2, 1.15, 0.07, 20.0, 1.1),
                                         VLLM_NGRAM: vllm(2.0, 1.25, 0.1, 22.0, 1.3), VLLM_NONE: none}},
            "heldout": {"domain": "in-distribution", "info": info, "speed_lengths_differ": ["heldout-0"],
                        "methods": {OFFLINE_EAGLE3: {"tau": 1.6, "tokens_per_forward": 1.6, "draft_acceptance_rate": 0.2,
                                                     "prompts": 1},
                                    VLLM_EAGLE3: vllm(1.7, 1.65, 0.23, 24.0, 1.6),
                                    VLLM_NGRAM: vllm(2.5, 1.3, 0.15, 20.0, 1.25), VLLM_NONE: none}}}


def _grid_stats() -> dict:
    """The stage 5 stats.json of :func:`_results_sets`, as the stage writes it now."""
    from eagle3.evaluate.methods import OFFLINE_EAGLE3, VLLM_EAGLE3, VLLM_NGRAM, VLLM_NONE
    from eagle3.evaluate.stats import EvaluateStats, Parity, PooledStats, Settings, grid, set_stats

    backends = {OFFLINE_EAGLE3: {"tau": 1.6, "tokens_per_forward": 1.6, "draft_acceptance_rate": 0.2, "prompts": 1,
                                 "tokens_per_s": 3.0},
                VLLM_EAGLE3: {"tau": 1.45, "tokens_per_forward": 1.4, "draft_acceptance_rate": 0.15, "prompts": 4,
                              "tokens_per_s": 22.0, "speed_prompts": 2},
                VLLM_NGRAM: {"tau": 2.2, "tokens_per_forward": 1.27, "draft_acceptance_rate": 0.12, "prompts": 4,
                             "tokens_per_s": 21.0, "speed_prompts": 2},
                VLLM_NONE: {"tau": None, "tokens_per_forward": 1.0, "prompts": 4, "tokens_per_s": 16.0, "speed_prompts": 2}}
    st = EvaluateStats(settings=Settings(k=3, temperature=0.0, acceptance_rule="exact match"),
                       pooled=PooledStats(prompts=4, excluded_training=1, speed_prompts=2, methods=grid(backends)),
                       sets=set_stats(_results_sets()),
                       parity=Parity(ok=True, gap=0.02, tolerance=0.15, prompts=1, tau_offline=1.6, tau_vllm=1.568),
                       warnings=[{"rule": "drafter_below_ngram", "message": "m", "fix": "f",
                                  "numbers": {"set": "general-chat", "tokens_per_forward_drafter": 1.15,
                                              "tokens_per_forward_ngram": 1.25}}],
                       training_data={"known": True, "conversations": 18})
    return st.to_dict()


def _flat_stats() -> dict:
    """The same numbers in the flat layout of stage 5's stats.json (every key it wrote)."""
    def one(tau, tpf, tps, ng_tau, ng_tpf, ng_tps, timed, ng_timed):
        return {"tau_vllm": tau, "tokens_per_forward_vllm": tpf, "tau_ngram": ng_tau, "tokens_per_forward_ngram": ng_tpf,
                "tokens_per_s_vllm_eagle3": tps, "tokens_per_s_vllm_ngram": ng_tps, "tokens_per_s_vllm_none": 16.0,
                "speed_prompts": 1, "speedup_vllm_eagle3": tps / 16.0, "speedup_vllm_ngram": ng_tps / 16.0,
                "speed_tokens_per_forward_vllm": timed, "speed_tokens_per_forward_ngram": ng_timed}

    counts = {"prompts": 2, "excluded_training": 1, "candidates": 3, "duplicates": 0, "skipped_too_long": 0, "capped": 0,
              "bad_records": 0, "categories": 1}
    return {"num_prompts": 4, "k": 3, "temperature": 0.0, "tau_offline": 1.6, "tokens_per_forward_offline": 1.6,
            "tau_vllm": 1.45, "tokens_per_forward_vllm": 1.4, "tau_ngram": 2.2, "tokens_per_forward_ngram": 1.27,
            "tokens_per_s_vllm_eagle3": 22.0, "tokens_per_s_vllm_ngram": 21.0, "tokens_per_s_vllm_none": 16.0,
            "speedup_vllm_eagle3": 22.0 / 16.0, "draft_acceptance_rate_offline": 0.2, "draft_acceptance_rate_vllm": 0.15,
            "parity_ok": True, "parity_gap": 0.02, "parity_tolerance": 0.15, "parity_prompts": 1,
            "parity_tau_offline": 1.6, "parity_tau_vllm": 1.568, "excluded_training": 1,
            "sets": {"general-chat": {"domain": "out-of-domain", **counts, "excluded_training": 0, "candidates": 2,
                                      **one(1.2, 1.15, 20.0, 2.0, 1.25, 22.0, 1.1, 1.3), "tau_offline": None,
                                      "tokens_per_forward_offline": None, "offline_prompts": 0,
                                      "speed_lengths_differ": 0},
                     "heldout": {"domain": "in-distribution", **counts, **one(1.7, 1.65, 24.0, 2.5, 1.3, 20.0, 1.6, 1.25),
                                 "tau_offline": 1.6, "tokens_per_forward_offline": 1.6, "offline_prompts": 1,
                                 "speed_lengths_differ": 1}},
            "warnings": [{"rule": "drafter_below_ngram", "message": "m", "fix": "f",
                          "numbers": {"set": "general-chat", "tokens_per_forward_drafter": 1.15,
                                      "tokens_per_forward_ngram": 1.25}}],
            "training_data": {"known": True, "conversations": 18}, "measured": {}, "acceptance_rule": "exact match",
            "diagnosis": [], "vllm_serve_command": "", "vllm_serve_where": ""}


def test_a_run_of_the_flat_stage_5_layout_compares_with_a_grid_run_number_by_number(tmp_path):
    """A run made before stage 5's stats.json became a grid, against one made after: every number of the
    flat file is found at its grid path, equal (the grid's extra numbers are counted, not compared)."""
    flat, grid = RunDir(tmp_path / "before"), RunDir(tmp_path / "after")
    write_stats(flat.stage(5, create=True), _flat_stats())
    write_stats(grid.stage(5, create=True), _grid_stats())
    for a, b in ((flat, grid), (grid, flat)):
        [(check, detail, ok)] = compare_runs.compare(a.root, b.root)
        assert (check, ok) == ("05_evaluate/stats.json", True), detail
        assert "numbers equal" in detail and "the flat layout, compared by grid paths" in detail
    # where each flat name went
    moved = compare_runs.grid_paths({"tau_vllm": 1.45, "parity_ok": True, "sets.my.set.tokens_per_s_vllm_none": 16.0,
                                     "sets.heldout.offline_prompts": 0, "sets.heldout.prompts": 2})
    assert moved == {"pooled.methods.vllm/eagle3.tau": 1.45, "parity.ok": True,
                     "sets.my.set.methods.vllm/none.tokens_per_s": 16.0, "sets.heldout.prompts": 2}
    # a number that changed, and one the grid lost, are differences, named by their grid path
    changed = _flat_stats()
    changed["sets"]["heldout"]["tau_ngram"] = 2.4
    write_stats(flat.stage(5), changed)
    lost = _grid_stats()
    del lost["parity"]["tau_vllm"]
    write_stats(grid.stage(5), lost)
    [(_, detail, ok)] = compare_runs.compare(flat.root, grid.root)
    assert not ok and "sets.heldout.methods.vllm/ngram.tau: 2.4 != 2.5" in detail
    assert "parity.tau_vllm: 1.568 != (absent)" in detail
    # two grid runs: timings (tokens/s, speed-ups) skipped, NaN equal to NaN
    nan = _grid_stats()
    nan["pooled"]["methods"]["vllm/eagle3"] |= {"speedup": 9.9, "tokens_per_s": 1.0}
    nan["sets"]["heldout"]["methods"]["vllm/ngram"]["draft_acceptance_rate"] = float("nan")
    write_stats(flat.stage(5), nan)
    both_nan = _grid_stats()
    both_nan["sets"]["heldout"]["methods"]["vllm/ngram"]["draft_acceptance_rate"] = float("nan")
    write_stats(grid.stage(5), both_nan)
    [(_, detail, ok)] = compare_runs.compare(flat.root, grid.root)
    assert ok and "flat layout" not in detail, detail
