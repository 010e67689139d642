"""Speed (tokens/s) that a busy machine cannot pick, ETAs that do not grow while a batch is in flight,
and the machine line at the start of a run (synthetic timings, progress sequences and CPU info)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3.evaluate.methods import VLLM_EAGLE3, VLLM_NGRAM, VLLM_NONE
from eagle3.evaluate.metrics import paired_speedup, speed_stats
from eagle3.evaluate.stats import grid
from eagle3.evaluate.vllm_jobs import speed_by_set, speed_schedule

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------ speed statistic

QUIET = {"eagle3": 50.0, "ngram": 40.0, "none": 35.0}  # tokens/s on a quiet machine
PROMPTS = [{"id": "p1", "set": "heldout"}, {"id": "p2", "set": "heldout"}, {"id": "p3", "set": "chat"}]


def _timed(disturbed: dict[tuple[str, int], float], rounds: int = 3, tokens: int = 32) -> dict[str, dict]:
    """Each method's vLLM result with speed rows: every prompt once per round, ``tokens`` output tokens
    at the :data:`QUIET` rate, slowed ``factor`` times where ``disturbed[(method, round)] = factor``."""
    out = {}
    for m, rate in QUIET.items():
        rows = [{"id": p["id"], "round": r, "output_tokens": tokens,
                 "time_s": tokens / rate * disturbed.get((m, r), 1.0)} for r in range(rounds) for p in PROMPTS]
        out[m] = {"method": m, "k": 0, "speed": rows}
    return out


def _old_rate(result: dict) -> float:
    """The statistic this replaced: every timed token over every timed second."""
    rows = result["speed"]
    return sum(r["output_tokens"] for r in rows) / sum(r["time_s"] for r in rows)


def _grid(results: dict[str, dict], group: str = "all", tolerance: float = 0.25) -> dict:
    methods = {f"vllm/{m}": {k: v for k, v in speed_by_set(res, PROMPTS, tolerance)[group].items()
                             if k != "tokens_per_forward"} for m, res in results.items()}
    return grid(methods)


def test_a_disturbed_baseline_does_not_inflate_the_speedup_and_its_row_is_flagged():
    """No speculation timed while another job held the machine (one of three rounds 30x slower, as
    1.0 tokens/s against a quiet 35): the old pooled rate gave the drafter an 8x speed-up; the median
    of the rounds keeps 50/35 = 1.43x, flags no speculation's row and the speed-ups that rest on it."""
    res = _timed({("none", 1): 30.0})
    assert _old_rate(res["eagle3"]) / _old_rate(res["none"]) > 8  # what the headline showed
    g = _grid(res)
    assert g[VLLM_NONE]["tokens_per_s"] == pytest.approx(35.0)
    assert g[VLLM_EAGLE3]["speedup"] == pytest.approx(50 / 35) and g[VLLM_NGRAM]["speedup"] == pytest.approx(40 / 35)
    assert g[VLLM_NONE]["speed_steady"] is False and g[VLLM_NONE]["speed_spread"] > 0.9
    assert g[VLLM_EAGLE3]["speed_steady"] is True and g[VLLM_EAGLE3]["speed_spread"] == pytest.approx(0.0)
    assert g[VLLM_EAGLE3]["speedup_steady"] is False and g[VLLM_NGRAM]["speedup_steady"] is False
    assert g[VLLM_NONE]["tokens_per_s_rounds"] == pytest.approx([35.0, 35 / 30, 35.0], rel=1e-3)


def test_a_disturbed_method_does_not_win():
    """The drafter (truly 50 tokens/s) disturbed 8x in one round: the old rate put n-gram (40) ahead;
    the median keeps the drafter first, flags its row, and leaves n-gram's unflagged."""
    res = _timed({("eagle3", 0): 8.0})
    assert _old_rate(res["eagle3"]) < _old_rate(res["ngram"])
    g = _grid(res, "heldout")
    assert g[VLLM_EAGLE3]["tokens_per_s"] > g[VLLM_NGRAM]["tokens_per_s"]
    assert g[VLLM_EAGLE3]["speedup"] > g[VLLM_NGRAM]["speedup"] > 1.0
    assert (g[VLLM_EAGLE3]["speed_steady"], g[VLLM_NGRAM]["speed_steady"], g[VLLM_NONE]["speed_steady"]) == (
        False, True, True)
    assert (g[VLLM_EAGLE3]["speedup_steady"], g[VLLM_NGRAM]["speedup_steady"]) == (False, True)


def test_a_load_over_a_whole_round_slows_every_method_and_the_paired_speedup_holds():
    """Interleaved timing: a load that lasts a round slows that round of every method alike. The
    speed-up pairs each round with the baseline's same round: exact even when two of three rounds
    are disturbed (the per-method medians are then the disturbed rates)."""
    res = _timed({(m, r): 3.0 for m in QUIET for r in (0, 2)})
    g = _grid(res)
    assert g[VLLM_EAGLE3]["speedup"] == pytest.approx(50 / 35) and g[VLLM_EAGLE3]["tokens_per_s"] == pytest.approx(50 / 3)
    assert g[VLLM_EAGLE3]["speed_steady"] is False  # the rounds disagree: flagged all the same


def test_speed_stats_and_paired_speedup_on_hand_numbers():
    rows = [{"round": 0, "output_tokens": 30, "time_s": 1.0}, {"round": 0, "output_tokens": 10, "time_s": 1.0},
            {"round": 1, "output_tokens": 40, "time_s": 1.0}, {"round": 2, "output_tokens": 44, "time_s": 2.0}]
    s = speed_stats(rows, 0.5)
    assert s["tokens_per_s_rounds"] == [20.0, 40.0, 22.0] and s["tokens_per_s"] == 22.0
    assert s["speed_spread"] == pytest.approx(20 / 22, abs=1e-4) and s["speed_steady"] is False
    assert speed_stats(rows[:1], 0.5) | {"tokens_per_s_rounds": None} == {
        "tokens_per_s": 30.0, "tokens_per_s_rounds": None, "speed_spread": None, "speed_steady": None}
    assert speed_stats([], 0.5)["tokens_per_s"] is None
    assert paired_speedup([20.0, 40.0, 22.0], [10.0, 10.0, 11.0]) == 2.0 and paired_speedup([1.0], []) is None


def test_the_schedule_interleaves_the_methods_prompt_by_prompt_and_rotates_their_order():
    sched = speed_schedule(["eagle3", "ngram", "none"], ["a", "b"], 2)
    assert len(sched) == 12
    assert [(r, p) for r, p, _ in sched[:3]] == [(0, "a")] * 3  # one prompt's methods next to each other
    assert [m for _, _, m in sched] == ["eagle3", "ngram", "none", "ngram", "none", "eagle3",
                                        "ngram", "none", "eagle3", "none", "eagle3", "ngram"]
    firsts = [sched[i][2] for i in range(0, 12, 3)]
    assert len(set(firsts)) == 3  # no method always runs first


# ----------------------------------------------------------------------------------------- ETA


def test_the_eta_does_not_grow_while_a_batch_is_in_flight(tmp_path, monkeypatch):
    """Stage 1 answers 256 prompts in batches of 64, 100 s each: between two batches nothing lands.
    The ETA counted the time since the last batch as work without progress and grew (7 to 29
    minutes); it now counts down from the last batch's estimate and stops at the time of the batches
    after the one in flight."""
    import eagle3.stage.progress as progress_mod
    from eagle3.stage import Progress

    now = [1_000.0]
    monkeypatch.setattr(progress_mod.time, "time", lambda: now[0])
    prog = Progress(tmp_path, total=256, unit="samples", interval_s=0.0)
    assert prog.snapshot("running")["eta_s"] is None  # nothing finished: no rate yet
    etas = []
    for batch in range(3):
        for t in range(0, 101, 10):  # every 10 s of the batch
            now[0] = 1_000.0 + 100 * batch + t
            if t == 100:
                prog.update(64, tokens=64 * 100)
            prog._write("running", force=True)
            etas.append(prog.snapshot("running")["eta_s"])
    in_flight = [e for e in etas if e is not None]
    assert all(b <= a for a, b in zip(in_flight, in_flight[1:])), in_flight  # never grows
    assert etas[10] == pytest.approx(300.0) and etas[16] == pytest.approx(250.0)  # 192 left at 0.64/s, 50 s on
    assert etas[20] == pytest.approx(210.0) and etas[21] == pytest.approx(200.0)  # the second batch lands on time
    assert etas[-1] == pytest.approx(100.0)  # 64 left at 0.64/s
    now[0] = 1_000.0 + 350.0
    assert prog.snapshot("running")["eta_s"] == pytest.approx(50.0)
    now[0] = 1_000.0 + 500.0  # the last batch runs long: no batch after it, the ETA stays at 0
    assert prog.snapshot("running")["eta_s"] == pytest.approx(0.0)
    prog.close()


def test_the_eta_stops_at_the_batches_after_the_one_in_flight(tmp_path, monkeypatch):
    import eagle3.stage.progress as progress_mod
    from eagle3.stage import Progress

    now = [0.0]
    monkeypatch.setattr(progress_mod.time, "time", lambda: now[0])
    prog = Progress(tmp_path, total=4, unit="vLLM measurements", interval_s=0.0)
    now[0] = 120.0
    prog.update(1)  # the first of four measurements took 2 minutes
    assert prog.snapshot("running")["eta_s"] == pytest.approx(360.0)
    now[0] = 300.0  # the second is slower: the ETA counts down to the last two's 240 s, no lower
    assert prog.snapshot("running")["eta_s"] == pytest.approx(240.0)
    prog.close()


def test_other_load_says_when_other_processes_take_the_cpus():
    from eagle3.machine import OtherLoad

    clock = [0.0]
    ticks = {"busy": 0, "total": 0, "own": 0}
    load = OtherLoad(machine=lambda: (ticks["busy"], ticks["total"]), own=lambda: ticks["own"],
                     clock=lambda: clock[0], cpus=(2, 2))
    # 10 s on 2 CPUs (2,000 ticks): this run took 950, others 50: quiet
    clock[0] = 10.0
    ticks.update(busy=1_000, total=2_000, own=950)
    assert load.busy_text() is None and load.others == pytest.approx(0.05)
    clock[0] += 5  # within the sampling interval: the last answer stands, no walk of /proc
    ticks.update(busy=10**6)
    assert load.sample() == pytest.approx(0.05)
    clock[0] = 20.0
    ticks.update(busy=1_000 + 1_900, total=4_000, own=950 + 900)  # others took 1,000 of 2,000
    assert load.busy_text() == ("machine busy: other processes took 1.0 of 2 CPUs (this run's rates and ETA "
                                "are slower)")
    # on 8 CPUs of which the run uses 2, others may take 6 before it counts as busy
    wide = OtherLoad(machine=lambda: (0, 0), own=lambda: 0, clock=lambda: clock[0], cpus=(8, 2))
    wide.others, wide._last = 5.0, (clock[0], 0, 0, 0)
    assert wide.busy_text() is None


def _load(others: float, cpus: tuple[int, int] = (2, 2)):
    """An OtherLoad whose last interval saw other processes take ``others`` CPUs."""
    from eagle3.machine import OtherLoad

    clock, ticks = [0.0], {"busy": 0, "total": 0, "own": 0}
    load = OtherLoad(machine=lambda: (ticks["busy"], ticks["total"]), own=lambda: ticks["own"],
                     clock=lambda: clock[0], cpus=cpus)
    clock[0] = 10.0  # 10 s on the CPUs: 1,000 ticks per CPU, this run idle
    ticks.update(busy=round(others * 1_000), total=cpus[0] * 1_000)
    return load


def test_a_process_started_on_a_busy_machine_gets_a_short_openmp_spin():
    """libgomp's spinning threads stall beside another CPU-bound job (7.4 vs 25.3 tokens/s measured):
    a process that starts while others take a CPU gets OMP_WAIT_POLICY=PASSIVE, marked as eagle3's; one that
    starts quiet keeps libgomp's default (eagle3's earlier choice removed); the user's setting is kept."""
    from eagle3.machine import BUSY_OPENMP, OPENMP_AUTO, openmp_for_start

    env, note = openmp_for_start({"PATH": "/bin"}, load=_load(1.0))
    assert env == {"PATH": "/bin", "OMP_WAIT_POLICY": "PASSIVE", OPENMP_AUTO: "1"}
    assert BUSY_OPENMP == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert note == ("other processes took 1.0 of 2 CPUs: OpenMP threads sleep while they wait "
                    "(OMP_WAIT_POLICY=PASSIVE), so a core shared with them does not stall every step")
    # the next start (the stage's vLLM worker) on a machine that became quiet: libgomp's default again
    assert openmp_for_start(env, load=_load(0.2)) == ({"PATH": "/bin"}, None)
    # a run on 2 of 8 CPUs: others may take the 6 it leaves free
    assert openmp_for_start({}, load=_load(6.0, cpus=(8, 2))) == ({}, None)

    class Unread:  # the user's setting: nothing is measured
        def busy(self):
            raise AssertionError("sampled")

    for user in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "50000"}):
        assert openmp_for_start(user, load=Unread()) == (user, None)


def test_an_engine_that_times_one_request_at_a_time_leaves_a_cpu_and_the_others_load():
    """The speed pass's engines run one thread per usable CPU less one (vLLM's own reservation) less the
    CPUs other processes take at their start, at least one: on 2 cores one thread quiet or busy, so a
    second job does not change the configuration that is timed; OpenMP's and numba's pools alike."""
    from eagle3.machine import OPENMP_AUTO, TIMING_THREAD_VARS, openmp_for_start, timing_threads

    assert [timing_threads(2, o) for o in (None, 0.0, 0.6, 1.0, 2.0)] == [1, 1, 1, 1, 1]
    assert [timing_threads(16, o) for o in (None, 0.3, 4.2, 15.5)] == [15, 15, 11, 1]
    assert timing_threads(1) == 1
    assert TIMING_THREAD_VARS == ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS")
    # a job on one of 2 CPUs competes with the run's two threads, not with one engine thread; two jobs do
    assert (_load(1.0).busy(), _load(1.0).busy(run_cpus=1), _load(1.9).busy(run_cpus=1)) == (True, False, True)
    env, note = openmp_for_start({"PATH": "/bin"}, load=_load(0.1), timing=True)
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}
    assert note == "1 thread(s) per timed engine (2 usable CPUs less one for the rest of the process)"
    env, note = openmp_for_start({}, load=_load(5.0, cpus=(16, 16)), timing=True)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", OPENMP_AUTO: "1", "OMP_NUM_THREADS": "11", "NUMBA_NUM_THREADS": "11"}
    assert note.endswith("; 11 thread(s) per timed engine (16 usable CPUs less one for the rest of the process "
                         "and 5.0 taken by other processes)")
    # the user's thread count and wait policy are kept; a wait policy alone still gets the thread count
    assert openmp_for_start({"OMP_NUM_THREADS": "2"}, load=_load(1.0), timing=True)[0] == {
        "OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE", OPENMP_AUTO: "1"}
    assert openmp_for_start({"OMP_WAIT_POLICY": "ACTIVE"}, load=_load(1.0), timing=True)[0] == {
        "OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}


def test_the_openmp_choice_measures_a_real_busy_loop():
    """Measured, not assumed: beside a CPU-bound process the 2-second window counts it as other load."""
    from eagle3.machine import openmp_for_start

    # another process's job, not this one's child (the run's own process tree is not "other load"): the
    # shell exits at once and leaves the loop to init
    pid = int(subprocess.run(["sh", "-c", f"{sys.executable} -c 'while True: pass' >/dev/null 2>&1 & echo $!"],
                             capture_output=True, text=True, check=True).stdout)
    try:
        time.sleep(0.5)
        env, note = openmp_for_start({}, window_s=2.0)
    finally:
        os.kill(pid, signal.SIGKILL)
    assert env.get("OMP_WAIT_POLICY") == "PASSIVE", note
    assert note.startswith("other processes took ")


# ------------------------------------------------------------------------------- machine line

AVX2_ONLY = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B12
flags\t\t: fpu vme sse sse2 avx avx2 fma bmi2
processor\t: 1
flags\t\t: fpu vme sse sse2 avx avx2 fma bmi2
"""
BF16 = AVX2_ONLY.replace("avx2 fma", "avx2 avx512f avx512_bf16 fma").replace("AMD EPYC 7B12", "AMD EPYC 9B14")


def _line(monkeypatch, cpuinfo: str, native: bool, params_file: str = "params/smollm2-135m.yaml", cpus: int = 2,
          load: float = 0.3, overrides: list[str] | None = None, stages: list[int] | None = None) -> str:
    import eagle3.target as target
    from eagle3.machine import MachineInfo, cpu_flags, machine_line
    from eagle3.params_file import load_params

    monkeypatch.setattr(target, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setattr(target, "pick_device", lambda device="auto": "cpu")
    flags, model = cpu_flags(cpuinfo)
    info = MachineInfo(cpus=cpus, model=model, flags=flags, native_bf16=native, gpu=None, load_1m=load)
    return machine_line(load_params(ROOT / params_file, overrides or []), params_file, info, bool(overrides), stages)


def test_the_start_line_of_an_avx2_only_machine_says_float32_and_78_minutes(monkeypatch):
    line = _line(monkeypatch, AVX2_ONLY, native=False)
    assert line.startswith("eagle3: machine: 2 CPUs (AMD EPYC 7B12): AVX2; no AMX or AVX512-BF16; target dtype float32 (")
    assert "bfloat16 would be emulated" in line
    assert ("; drafter optimizer adamw (train.optimizer auto: Muon's bfloat16 Newton-Schulz steps would be emulated); "
            "expected") in line
    assert line.endswith("expected about 78 min on a quiet machine (77 min 39 s on 2 AVX2-only cores)")


def test_the_start_line_of_a_bf16_machine_says_bfloat16_and_35_minutes(monkeypatch):
    line = _line(monkeypatch, BF16, native=True)
    assert "2 CPUs (AMD EPYC 9B14): AVX512-BF16, AVX512, AVX2; target dtype bfloat16 (target.dtype auto: the CPU " in line
    assert "; drafter optimizer muon (train.optimizer auto: the CPU multiplies bfloat16 in hardware); expected" in line
    assert line.endswith("expected about 35 min on a quiet machine (34 min 30 s on 2 cores with AVX512-BF16)")


def test_the_start_line_names_what_differs_from_the_measurement(monkeypatch):
    line = _line(monkeypatch, AVX2_ONLY, native=False, cpus=4, load=6.5, overrides=["train.epochs=3"])
    assert line.endswith("expected about 78 min on a quiet machine (77 min 39 s on 2 AVX2-only cores; measured on 2 cores, this machine "
                         "gives the run 4; --set changes the params it was measured with; the machine is busy (load "
                         "6.5 on 4 CPUs): expect longer)")
    muon = _line(monkeypatch, AVX2_ONLY, native=False, overrides=["train.optimizer=muon"])
    assert "drafter optimizer muon (train.optimizer says so; this CPU emulates bfloat16, in which Muon's" in muon
    assert "drafter optimizer adamw (train.optimizer says so)" in _line(
        monkeypatch, BF16, native=True, params_file="params/smollm2-135m-2x.yaml")  # it pins AdamW
    ci = _line(monkeypatch, AVX2_ONLY, native=False, params_file="params/ci.yaml")
    assert "target dtype float32 (target.dtype says so)" in ci  # ci.yaml sets it
    assert ci.endswith("no measured duration for ci.yaml in float32 (measured: smollm2-135m, smollm2-135m-2x on 2 "
                       "CPU cores); each stage shows its ETA")


def test_a_call_of_some_stages_gets_their_etas_not_the_whole_runs_duration(monkeypatch):
    """``--stages 5 --remeasure-speed`` said "expected about 35 min" for a stage that took 3; the measured
    durations are whole runs, so a call of some stages says so and points at each stage's ETA."""
    line = _line(monkeypatch, BF16, native=True, stages=[5])
    assert line.endswith("stage 5 only: each stage shows its ETA (the measured 35 min are for all five stages)")
    assert _line(monkeypatch, BF16, native=True, stages=[4, 5]).endswith("stages 4, 5 only: each stage shows its ETA "
                                                                        "(the measured 35 min are for all five stages)")
    assert _line(monkeypatch, BF16, native=True, stages=[1, 2, 3, 4, 5]).endswith("expected about 35 min on a quiet machine (34 min 30 s "
                                                                                 "on 2 cores with AVX512-BF16)")


def test_a_run_directorys_params_file_is_known_by_the_run_name(monkeypatch):
    import eagle3.target as target
    from eagle3.machine import MachineInfo, cpu_flags, machine_line
    from eagle3.params_file import load_params

    monkeypatch.setattr(target, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(target, "pick_device", lambda device="auto": "cpu")
    flags, model = cpu_flags(AVX2_ONLY)
    info = MachineInfo(cpus=2, model=model, flags=flags, native_bf16=False, gpu=None, load_1m=0.0)
    params = load_params(ROOT / "params/smollm2-135m.yaml", [])  # run.name smollm2-135m
    assert machine_line(params, "outputs/smollm2-135m/params.yaml", info).endswith("expected about 78 min on a quiet machine (77 min 39 s "
                                                                                   "on 2 AVX2-only cores)")


def test_check_machine_prints_the_line_without_a_run(monkeypatch, tmp_path, capsys):
    """``eagle3 run PARAMS --check-machine``: the line, exit 0, no run directory."""
    import eagle3.target as target
    from eagle3.cli import main

    monkeypatch.setattr(target, "cpu_has_native_bf16", lambda: False)
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(ROOT / "params/smollm2-135m.yaml"), "--check-machine"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("eagle3: machine: ") and "target dtype" in out and not (tmp_path / "outputs").exists()


# -------------------------------------------------------- the flag wherever the number is shown


def _stats_and_results():
    """stats.json-like sets and pooled grid, and results.json-like entries, of a run whose no-speculation
    timing was disturbed in one round of three (:func:`_timed`)."""
    from eagle3.evaluate.stats import PooledStats, SetStats

    res = _timed({("none", 1): 30.0})
    per_set = {s: {f"vllm/{m}": {k: v for k, v in speed_by_set(r, PROMPTS, 0.25)[s].items() if k != "tokens_per_forward"}
                   for m, r in res.items()} for s in ("heldout", "chat")}
    sets = {s: SetStats(domain="in-distribution" if s == "heldout" else "out-of-domain", prompts=8, methods=grid(m))
            for s, m in per_set.items()}
    pooled_entries = {f"vllm/{m}": {k: v for k, v in speed_by_set(r, PROMPTS, 0.25)["all"].items()
                                    if k != "tokens_per_forward"} for m, r in res.items()}
    pooled = PooledStats(prompts=16, methods=grid(pooled_entries))
    results = {"settings": {"k": 3, "temperature": 0.0}, "backends": {m: e | {"backend": "vllm"} for m, e in pooled_entries.items()},
               "sets": {s: {"domain": sets[s].domain, "info": {"count": 8, "by_category": {}},
                            "methods": per_set[s], "by_category": {}} for s in per_set}, "warnings": []}
    return sets, pooled, results


def test_the_warning_names_the_set_the_method_and_the_one_command():
    from eagle3.config import EvaluateParams
    from eagle3.evaluate.mismatch import mismatch_warnings

    sets, pooled, _ = _stats_and_results()
    w = [x for x in mismatch_warnings(sets, {"known": False}, EvaluateParams(), pooled=pooled) if x["rule"] == "unsteady_speed"]
    assert [x["numbers"]["set"] for x in w] == ["heldout", "chat", "all sets pooled"]
    assert all(x["numbers"]["methods"] == ["vllm/none"] for x in w)
    assert w[0]["message"].startswith("on heldout the timing rounds disagree beyond 25%: no speculation (vLLM) 35.0 "
                                      "tokens/s, rounds 35.0, 1.2, 35.0 (spread 97%)")
    assert "the speed-ups of EAGLE-3 in vLLM, n-gram lookup in vLLM are not a result" in w[0]["message"]
    assert w[0]["fix"] == ("measure the speed again on a quiet machine: `eagle3 run PARAMS --stages 5 "
                           "--remeasure-speed` (acceptance is reused)")
    quiet_sets = {s: g for s, g in sets.items()}
    for g in list(quiet_sets.values()) + [pooled]:
        g.methods["vllm/none"]["speed_steady"] = True
    assert [x for x in mismatch_warnings(quiet_sets, {"known": False}, EvaluateParams(), pooled=pooled)
            if x["rule"] == "unsteady_speed"] == []


def test_the_notebook_tables_and_the_chart_carry_the_flag():
    from eagle3.evaluate.report import comparison_table, figures, pooled_table, set_table
    from eagle3.evaluate.stats import EvaluateStats, Settings

    sets, pooled, results = _stats_and_results()
    t = set_table(results)
    none = t[t["method"] == "no speculation (vLLM)"]
    assert none["speed_steady"].tolist() == [False, False] and none["tokens_per_s"].tolist() == pytest.approx([35.0] * 2)
    drafter = t[t["method"] == "EAGLE-3 in vLLM"]
    assert drafter["speedup"].tolist() == pytest.approx([50 / 35] * 2) and drafter["speed_steady"].tolist() == [True] * 2
    st = EvaluateStats(settings=Settings(k=3, temperature=0.0), pooled=pooled, sets=sets)
    p = pooled_table(st).set_index("method")
    assert p.loc["EAGLE-3 in vLLM", "speedup_steady"] is False or p.loc["EAGLE-3 in vLLM", "speedup_steady"] == False  # noqa: E712
    assert p.loc["no speculation (vLLM)", "speed_steady"] == False  # noqa: E712
    assert st.headline()["pooled.methods.vllm/eagle3.speedup_steady"] is False  # the report index's headline
    assert comparison_table(results).set_index("method").loc["no speculation (vLLM)", "speed_steady"] == False  # noqa: E712
    fig = figures(results)["speed"]
    ax = fig.axes[0]
    assert "(!) rounds disagree" in ax.get_title() and "--remeasure-speed" in ax.get_title()
    assert [t.get_text() for t in ax.get_xticklabels()][-1].endswith("(!)")


def test_remeasure_speed_drops_only_the_timing(tmp_path):
    """``eagle3 run --remeasure-speed`` drops the methods' timing together (vllm_speed.json) and keeps
    the acceptance measurements; where each method times itself in its own job, every vLLM measurement
    goes (their timing is inside them)."""
    from eagle3.evaluate.stage import forget_speed
    from eagle3.params_file import load_params

    stage = tmp_path / "05_evaluate"
    stage.mkdir()

    def write():
        for m in ("speed", "eagle3", "ngram", "none"):
            (stage / f"vllm_{m}.json").write_text("{}")

    write()
    params = load_params(ROOT / "params/ci.yaml", ["evaluate.speed_engines=together"])
    assert [f.name for f in forget_speed(tmp_path, params)] == ["vllm_speed.json"]
    assert sorted(f.name for f in stage.iterdir()) == ["vllm_eagle3.json", "vllm_ngram.json", "vllm_none.json"]
    write()
    params = load_params(ROOT / "params/ci.yaml", ["evaluate.speed_engines=one_at_a_time"])
    assert [f.name for f in forget_speed(tmp_path, params)] == ["vllm_eagle3.json", "vllm_ngram.json", "vllm_none.json"]
    assert [f.name for f in stage.iterdir()] == ["vllm_speed.json"]


def test_a_steady_but_impossible_speed_up_is_flagged_in_the_stats_and_warned():
    """A load that slows one engine more than another all along leaves rounds that agree: no speculation
    at ~9 tokens/s in every round beside a busy job, the drafter at ~37, so a speed-up of 3.8x where its
    timed answers' 1.624 tokens per target forward allow at most ~1.6x. The stats mark it (the terminal,
    report and notebook read `speedup_steady`), and the warning names it with the command."""
    from eagle3.config import EvaluateParams
    from eagle3.evaluate.mismatch import mismatch_warnings
    from eagle3.evaluate.stats import SetStats

    def timed(rounds, tpf):
        return {"tokens_per_s": sorted(rounds)[1], "tokens_per_s_rounds": rounds, "speed_spread": 0.05,
                "speed_steady": True, "speed_tokens_per_forward": tpf, "tokens_per_forward": tpf, "tau": 2.0}

    g = grid({VLLM_NONE: timed([9.2, 9.4, 9.6], 1.0), VLLM_EAGLE3: timed([35.9, 36.4, 37.0], 1.624),
              VLLM_NGRAM: timed([10.2, 10.4, 10.5], 1.2)})
    assert g[VLLM_EAGLE3]["speedup"] == pytest.approx(36.4 / 9.4, rel=0.02)
    assert g[VLLM_EAGLE3]["speedup_steady"] is False  # 3.87x > 1.25 x 1.624
    assert g[VLLM_NGRAM]["speedup_steady"] is True  # 1.11x within what 1.2 tokens per forward allow
    sets = {"general-chat": SetStats(domain="out-of-domain", prompts=8, methods=g)}
    w = [x for x in mismatch_warnings(sets, {"known": False}, EvaluateParams()) if x["rule"] == "unsteady_speed"]
    assert len(w) == 1 and w[0]["numbers"]["methods"] == [VLLM_EAGLE3]
    assert w[0]["message"] == ("on general-chat the speed-up exceeds what the timed answers allow: EAGLE-3 in vLLM "
                               "3.87x with 1.624 tokens per target forward; another load disturbed the timing, so the "
                               "speed-ups of EAGLE-3 in vLLM are not a result")
    assert "--remeasure-speed" in w[0]["fix"]


def test_requests_timed_beside_other_load_are_not_a_result_even_when_their_rounds_agree(tmp_path, monkeypatch):
    """The speed pass asks the machine's other load after each timed request; timed while other processes
    kept the CPUs busy, every method's tokens/s is flagged (speed_steady False, the CPUs named) and the
    warning says so, whatever the rounds say."""
    import types

    import eagle3.evaluate.vllm_jobs as vllm_jobs
    import eagle3.machine as machine
    from eagle3.config import EvaluateParams
    from eagle3.evaluate.mismatch import mismatch_warnings
    from eagle3.evaluate.stats import SetStats

    monkeypatch.setattr(machine, "openmp_for_start",  # the engines time with one thread each
                        lambda env, timing=False: (dict(env, OMP_NUM_THREADS="1") if timing else dict(env), None))
    fake = tmp_path / "python"  # a speed worker: ready with its thread count, then 8 tokens in 0.25 s per request
    fake.write_text('#!/bin/sh\necho "{\\"ready\\": true, \\"threads\\": $OMP_NUM_THREADS}"\nwhile read line; do\n'
                    '  id=$(echo "$line" | sed \'s/.*"id": "\\([^"]*\\)".*/\\1/\')\n'
                    '  r=$(echo "$line" | sed \'s/.*"round": \\([0-9]*\\).*/\\1/\')\n'
                    '  echo "{\\"id\\": \\"$id\\", \\"round\\": $r, \\"output_tokens\\": 8, \\"time_s\\": 0.25}"\ndone\n')
    fake.chmod(0o755)
    monkeypatch.setattr(vllm_jobs, "sys", types.SimpleNamespace(executable=str(fake)))

    class Load:  # other processes take 1.2 CPUs from the third timed request on
        def __init__(self):
            self.calls, self.others, self.run_cpus = 0, 0.1, set()

        def busy(self, run_cpus=None):
            self.run_cpus.add(run_cpus)
            self.calls += 1
            self.others = 1.2 if self.calls >= 3 else 0.1
            return self.calls >= 3

    jobs = {m: {"method": m, "k": 3} for m in ("eagle3", "none")}
    quiet = vllm_jobs.run_speed(jobs, ["p1"], 2, tmp_path)
    assert [quiet[m]["machine_busy_cpus"] for m in jobs] == [None, None]
    load = Load()
    busy = vllm_jobs.run_speed(jobs, ["p1"], 2, tmp_path, load=load)
    assert [busy[m]["machine_busy_cpus"] for m in jobs] == [1.2, 1.2]
    assert load.run_cpus == {1}  # busy means: others take CPUs the engines' one thread could use
    # what other processes took at all, competing or not, is kept beside it (None without a load to ask)
    assert [busy[m]["machine_other_cpus"] for m in jobs] == [1.2, 1.2]
    assert [quiet[m]["machine_other_cpus"] for m in jobs] == [None, None]
    prompts = [{"id": "p1", "set": "chat"}]
    q, b = (speed_by_set(r["none"], prompts, 0.25)["chat"] for r in (quiet, busy))
    assert (q["tokens_per_s"], q["speed_steady"], q["speed_busy_cpus"]) == (32.0, True, None)
    assert (b["tokens_per_s"], b["speed_steady"], b["speed_busy_cpus"], b["speed_other_cpus"]) == (32.0, False, 1.2, 1.2)
    entries = {f"vllm/{m}": {k: v for k, v in speed_by_set(r, prompts, 0.25)["chat"].items() if k != "tokens_per_forward"}
               for m, r in busy.items()}
    sets = {"chat": SetStats(domain="out-of-domain", prompts=1, methods=grid(entries))}
    w = [x for x in mismatch_warnings(sets, {"known": False}, EvaluateParams()) if x["rule"] == "unsteady_speed"]
    assert w[0]["message"].startswith("on chat the requests were timed while other processes took 1.2 CPUs: "
                                      "EAGLE-3 in vLLM 32.0 tokens/s; no speculation (vLLM) 32.0 tokens/s;")
