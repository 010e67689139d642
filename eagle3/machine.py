"""The machine a run runs on: one line at the start of ``eagle3 run`` (CPU features, the target's dtype
and why, the expected duration), and the other load on its CPUs while a stage runs.

On a CPU the target's dtype decides the run's length: with AMX or AVX512-BF16 the target runs in
bfloat16, without them in float32 (bf16 would be emulated at a small fraction of the float32 rate:
:func:`eagle3.target.target_dtype`), and the default run takes about 35 minutes instead of 78 on 2
cores. The expected duration comes from the measured table :data:`MEASURED_RUNS`
(benchmarks/RESULTS.md); params without a measurement get none (each stage shows its own ETA).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CPU_FEATURES", "MEASURED_RUNS", "MachineInfo", "machine_info", "cpu_flags", "dtype_choice", "optimizer_choice",
           "expected_duration", "machine_line", "OtherLoad", "usable_cpus", "BUSY_OPENMP", "openmp_env",
           "openmp_for_start", "TIMING_THREAD_VARS", "timing_threads"]

# /proc/cpuinfo flag -> name, the ones that decide the target's dtype and speed on a CPU (best first)
CPU_FEATURES = (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX512"), ("avx2", "AVX2"))

# Whole `eagle3 run` times measured from a fresh clone (set-up included) on 2 cores, by params file
# stem and the target's dtype (benchmarks/RESULTS.md): (minutes, what was measured).
MEASURED_RUNS = {
    ("smollm2-135m", "bfloat16"): (35, "34 min 30 s on 2 cores with AVX512-BF16"),
    ("smollm2-135m", "float32"): (78, "77 min 39 s on 2 AVX2-only cores"),
    ("smollm2-135m-2x", "bfloat16"): (63, "63 min 25 s on 2 cores with AVX512-BF16"),
}
MEASURED_CPUS = 2

# libgomp's threads spin after each parallel region before they sleep (GOMP_SPINCOUNT iterations; 300,000
# by default). Beside another CPU-bound job on 2 cores a spinning thread holds a core the job needs, the
# thread descheduled from it stalls every region, and the target's decoding ran at 7.4 tokens/s instead
# of 25.3 (quiet). Threads that sleep at once (OMP_WAIT_POLICY=PASSIVE) ran at 17.1 beside the job but
# 15.8 quiet; a spin of 1,000 at 12.6 / 19.0; of 10,000 at 5.9 / 23.5 (benchmarks/bench_cpu_threads.py,
# benchmarks/RESULTS.md). So a process that starts while other processes keep the CPUs busy gets PASSIVE,
# and one that starts on a quiet machine keeps the default, at full speed.
BUSY_OPENMP = {"OMP_WAIT_POLICY": "PASSIVE"}
OPENMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
# set beside the OpenMP variables eagle3 chose: a later start may choose again (the user's are kept)
OPENMP_AUTO = "EAGLE3_OPENMP_AUTO"

# The thread counts of an engine that times one request at a time (stage 5's speed pass): OpenMP's (torch,
# vLLM's CPU kernels) and numba's (vLLM's n-gram proposer starts a numba thread pool of one thread per CPU).
TIMING_THREAD_VARS = ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS")


def usable_cpus() -> list[int]:
    """The CPU ids this process may run on (its affinity mask; all CPUs where there is none)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class MachineInfo:
    """What the start line says about the machine.

    Attributes:
        cpus: CPUs this process may run on (its affinity mask).
        model: the CPU's model name ('' when unknown).
        flags: the :data:`CPU_FEATURES` flags the CPU has.
        native_bf16: oneDNN's own check (:func:`eagle3.target.cpu_has_native_bf16`).
        gpu: the first GPU's name, or None.
        load_1m: the 1-minute load average (runnable processes; 0.0 where unknown).
    """

    cpus: int
    model: str
    flags: frozenset[str]
    native_bf16: bool
    gpu: str | None
    load_1m: float


def cpu_flags(cpuinfo: str) -> tuple[frozenset[str], str]:
    """``(flags, model name)`` of the first processor in ``/proc/cpuinfo`` text; flags are those of
    :data:`CPU_FEATURES` only."""
    flags: set[str] = set()
    model = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return frozenset(f for f, _ in CPU_FEATURES if f in flags), model


def machine_info(cpuinfo: str | None = None) -> MachineInfo:
    """This machine's :class:`MachineInfo`; ``cpuinfo``: ``/proc/cpuinfo``'s text (read when None)."""
    from eagle3.target import cpu_has_native_bf16

    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:  # not Linux
            cpuinfo = ""
    flags, model = cpu_flags(cpuinfo)
    gpu = None
    import torch

    if torch.cuda.is_available():
        gpu = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    return MachineInfo(cpus=len(usable_cpus()), model=model, flags=flags, native_bf16=cpu_has_native_bf16(),
                       gpu=gpu, load_1m=load)


def dtype_choice(target, info: MachineInfo) -> tuple[str, str]:
    """``(dtype, why)``: the dtype :func:`eagle3.target.target_dtype` gives the target (``target``: the
    params' ``target`` section) and the reason, in words."""
    from eagle3.target import target_dtype

    dtype = target_dtype(target)
    if target.dtype != "auto":
        return dtype, "target.dtype says so"
    if dtype == "auto":
        return dtype, "on a GPU: the checkpoint's dtype"
    if dtype == "bfloat16":
        return dtype, "target.dtype auto: the CPU multiplies bfloat16 in hardware"
    return dtype, ("target.dtype auto: no AMX or AVX512-BF16, so bfloat16 would be emulated at a small "
                   "fraction of the float32 rate")


def optimizer_choice(train, info: MachineInfo) -> tuple[str, str]:
    """``(optimizer, why)``: the optimizer stage 4 trains the drafter with on this machine
    (:func:`eagle3.train.optim.resolve_optimizer`; ``train``: the params' ``train`` section) and the reason,
    in words; Muon named on a CPU that emulates bfloat16 is said to be slow (its Newton-Schulz iterations
    run in bfloat16)."""
    from eagle3.train.optim import muon_emulated_warning, resolve_optimizer

    device = train.device if train.device != "auto" else ("cuda" if info.gpu else "cpu")
    on_cpu = device.split(":")[0] == "cpu"
    device_type = "cpu" if on_cpu else "cuda"
    optimizer = resolve_optimizer(train.optimizer, device_type, info.native_bf16)
    if train.optimizer != "auto":
        slow = muon_emulated_warning(train.optimizer, device_type, info.native_bf16)
        return optimizer, "train.optimizer says so" + (f"; {slow}" if slow else "")
    if not on_cpu:
        return optimizer, "train.optimizer auto: on a GPU"
    return optimizer, ("train.optimizer auto: the CPU multiplies bfloat16 in hardware" if info.native_bf16 else
                       "train.optimizer auto: Muon's bfloat16 Newton-Schulz steps would be emulated")


def expected_duration(params_file: str | Path, dtype: str, info: MachineInfo, overridden: bool = False,
                      stages: list[int] | None = None) -> str:
    """The expected duration of ``eagle3 run`` in words, from :data:`MEASURED_RUNS` (``params_file``'s
    stem and ``dtype``); it says where this machine differs from the measured one (CPUs, a GPU, other
    load) and when ``--set`` changed the params (``overridden``). The measurements are whole runs: a
    call of some ``stages`` only (e.g. ``--stages 5 --remeasure-speed``) gets each stage's ETA instead."""
    stem = Path(params_file).stem
    hit = MEASURED_RUNS.get((stem, dtype))
    if stages is not None and sorted(set(stages)) != [1, 2, 3, 4, 5]:
        whole = f" (the measured {hit[0]} min are for all five stages)" if hit and not info.gpu else ""
        return f"stage{'s' * (len(stages) > 1)} {', '.join(map(str, stages))} only: each stage shows its ETA{whole}"
    if hit is None or info.gpu:
        known = sorted({s for s, _ in MEASURED_RUNS})
        return (f"no measured duration for {Path(params_file).name} in {dtype}{' on a GPU' if info.gpu else ''} "
                f"(measured: {', '.join(known)} on {MEASURED_CPUS} CPU cores); each stage shows its ETA")
    minutes, how = hit
    notes = []
    if info.cpus != MEASURED_CPUS:
        notes.append(f"measured on {MEASURED_CPUS} cores, this machine gives the run {info.cpus}")
    if overridden:
        notes.append("--set changes the params it was measured with")
    if info.load_1m > info.cpus:
        notes.append(f"the machine is busy (load {info.load_1m:.1f} on {info.cpus} CPUs): expect longer")
    return f"expected about {minutes} min on a quiet machine ({how}" + "".join(f"; {n}" for n in notes) + ")"


def machine_line(params, params_file: str | Path, info: MachineInfo | None = None, overridden: bool = False,
                 stages: list[int] | None = None) -> str:
    """The line ``eagle3 run`` prints before it starts (and ``--check-machine`` prints alone): the CPUs
    and their features, a GPU, the target's dtype and why, the drafter's optimizer and why, the expected duration (by ``params_file``'s
    name; for a run directory's ``params.yaml``, by the run's name; of the ``stages`` this call runs,
    default all: :func:`expected_duration`)."""
    info = info or machine_info()
    names = [name for flag, name in CPU_FEATURES if flag in info.flags]
    missing = [name for flag, name in CPU_FEATURES[:2] if flag not in info.flags]
    feats = ", ".join(names) or "none of AVX2/AVX512/AVX512-BF16/AMX"
    if missing and len(missing) == 2:
        feats += "; no AMX or AVX512-BF16"
    cpu = f"{info.cpus} CPU{'s' * (info.cpus != 1)}" + (f" ({info.model})" if info.model else "")
    gpu = f", GPU {info.gpu}" if info.gpu else ""
    dtype, why = dtype_choice(params.target, info)
    optimizer, optimizer_why = optimizer_choice(params.train, info)
    # a run directory's own params.yaml: the run's name stands for the params file it was made from
    named = f"{params.run.name}.yaml" if Path(params_file).name == "params.yaml" else params_file
    return (f"eagle3: machine: {cpu}: {feats}{gpu}; target dtype {dtype} ({why}); "
            f"drafter optimizer {optimizer} ({optimizer_why}); {expected_duration(named, dtype, info, overridden, stages)}")


def _machine_ticks() -> tuple[int, int]:
    """``(busy, total)`` clock ticks of every CPU since boot (``/proc/stat``; steal counted as busy: a
    neighbour on the host takes it)."""
    vals = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (vals + [0] * 8)[:8]
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait


def _tree_ticks(root: int | None = None) -> int:
    """CPU clock ticks of process ``root`` (default: this one), its descendants, and the children it
    reaped (``/proc/<pid>/stat``)."""
    root = os.getpid() if root is None else root
    info: dict[int, tuple[int, int]] = {}  # pid -> (ppid, ticks)
    own_reaped = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            rest = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # the process ended meanwhile
            continue
        info[int(d)] = (int(rest[1]), int(rest[11]) + int(rest[12]))
        if int(d) == root:
            own_reaped = int(rest[13]) + int(rest[14])
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in info.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = own_reaped, [root]
    while todo:
        pid = todo.pop()
        total += info.get(pid, (0, 0))[1]
        todo.extend(children.get(pid, ()))
    return total


class OtherLoad:
    """How many CPUs other processes (and, in a VM, the host's other guests: steal time) took since the
    last sample: the machine's busy ticks less this process tree's.

    A stage's rates and ETAs are this run's share of the machine: when others take CPUs the run would
    use, ``progress.json`` says so (``machine_busy``). Samples are at least :attr:`MIN_INTERVAL_S`
    apart (a sample walks ``/proc``); between them the last answer stands.

    Args:
        machine: ``() -> (busy, total)`` ticks of every CPU (default ``/proc/stat``).
        own: ``() -> ticks`` of this process tree (default ``/proc/<pid>/stat``).
        clock: seconds (default ``time.monotonic``).
        cpus: CPUs of the machine and of this run (default ``os.cpu_count()`` and the affinity mask).
        min_interval_s: the shortest interval between samples (default :attr:`MIN_INTERVAL_S`).
    """

    MIN_INTERVAL_S = 10.0
    # others may take this much CPU beyond the CPUs this run leaves free before the machine counts as busy
    SLACK_CPUS = 0.5

    def __init__(self, machine: Callable[[], tuple[int, int]] | None = None, own: Callable[[], int] | None = None,
                 clock: Callable[[], float] = time.monotonic, cpus: tuple[int, int] | None = None,
                 min_interval_s: float | None = None) -> None:
        self.min_interval_s = self.MIN_INTERVAL_S if min_interval_s is None else min_interval_s

        self.machine, self.own, self.clock = machine or _machine_ticks, own or _tree_ticks, clock
        self.cpus = cpus or (os.cpu_count() or 1, len(usable_cpus()))
        self._last: tuple[float, int, int, int] | None = None
        self.others: float | None = None  # CPUs the others took over the last interval
        self._last = self._take()

    def _take(self) -> tuple[float, int, int, int] | None:
        try:
            busy, total = self.machine()
            return self.clock(), busy, total, self.own()
        except (OSError, ValueError, IndexError):  # no /proc (not Linux): nothing to say
            return None

    def sample(self) -> float | None:
        """CPUs other processes took over the interval since the last sample (at least
        ``min_interval_s`` old; else the last value), or None where unknown."""
        now = self.clock()
        if self._last is not None and now - self._last[0] < self.min_interval_s:
            return self.others
        point = self._take()
        if point is not None and self._last is not None:
            _, busy0, total0, own0 = self._last
            _, busy1, total1, own1 = point
            if total1 > total0:
                # total ticks over the interval = CPUs x interval: the others' share, in CPUs
                self.others = max(0.0, (busy1 - busy0) - (own1 - own0)) / (total1 - total0) * self.cpus[0]
        if point is not None:
            self._last = point
        elif self._last is None:
            self._last = (now, 0, 0, 0)
        return self.others

    def busy(self, run_cpus: float | None = None) -> bool:
        """Whether other processes took more than the CPUs this run leaves free plus :attr:`SLACK_CPUS`
        over the last interval (False where unknown). ``run_cpus``: the CPUs the run's work of this moment
        uses, where fewer than the run's (default: the run's usable CPUs)."""
        others = self.sample()
        total, run = self.cpus
        return others is not None and others > (total - (run if run_cpus is None else run_cpus)) + self.SLACK_CPUS

    def busy_text(self) -> str | None:
        """``"other processes took 1.4 of 2 CPUs"`` while :meth:`busy`, else None."""
        if not self.busy():
            return None
        return (f"machine busy: other processes took {self.others:.1f} of {self.cpus[0]} CPUs "
                f"(this run's rates and ETA are slower)")


def _users_openmp(env: dict[str, str]) -> bool:
    """Whether ``env`` holds an OpenMP wait setting the user made (one eagle3 chose carries its mark)."""
    return OPENMP_AUTO not in env and any(v in env for v in OPENMP_VARS)


def openmp_env(env: dict[str, str], busy: bool) -> dict[str, str]:
    """A copy of ``env`` (a process environment) with the OpenMP wait setting for a process that starts
    now: :data:`BUSY_OPENMP` when the machine is ``busy`` (marked with ``EAGLE3_OPENMP_AUTO=1``), libgomp's
    default otherwise. An ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` the user set (no mark) is kept as is;
    one eagle3 set for an earlier start (marked) is chosen again."""
    out = dict(env)
    if _users_openmp(out):
        return out
    for var in (*OPENMP_VARS, OPENMP_AUTO):
        out.pop(var, None)
    if busy:
        out.update(BUSY_OPENMP)
        out[OPENMP_AUTO] = "1"
    return out


def timing_threads(usable: int, others: float | None = None) -> int:
    """Threads of an engine that times one request at a time: the ``usable`` CPUs less one, kept for the
    rest of the process as vLLM's own CPU binding keeps one (``VLLM_CPU_NUM_OF_RESERVED_CPU``), and less
    the CPUs ``others`` (other processes) take; at least 1.

    Why: beside one CPU-bound job on 2 cores, engines of two threads slowed unequally (no speculation
    4.4x, the drafter 1.5x: its speed-up 4.22x against 1.40x quiet), while one thread per engine kept
    each speed-up within 5% of its quiet value; the cost, on a quiet 2-core machine, is 0.74x the
    tokens/s of two threads at the same speed-ups (within 4%) (benchmarks/bench_speed_pass.py,
    benchmarks/RESULTS.md "The speed pass beside another job")."""
    free = usable - (others or 0.0)
    return max(1, min(usable - 1, int(free)))


def openmp_for_start(env: dict[str, str] | None = None, window_s: float = 2.0,
                     load: OtherLoad | None = None, timing: bool = False) -> tuple[dict[str, str], str | None]:
    """``(environment, note)`` for a process (a stage's kernel, a vLLM worker) that starts now: the
    other load is measured over ``window_s`` seconds (``load``: an :class:`OtherLoad` already sampled,
    for tests) and :func:`openmp_env` applied to ``env`` (default ``os.environ``). ``timing``: the process
    times one request at a time (a speed-pass engine): :data:`TIMING_THREAD_VARS` are set to
    :func:`timing_threads` of this moment, unless the user set ``OMP_NUM_THREADS``. ``note`` says what
    was chosen and why (the short spin, the thread count), else None."""
    env = dict(os.environ if env is None else env)
    set_threads = timing and "OMP_NUM_THREADS" not in env
    if _users_openmp(env) and not set_threads:
        return env, None  # nothing to measure
    if load is None:
        load = OtherLoad(min_interval_s=0.0)
        time.sleep(window_s)
    busy = load.busy()
    out = env if _users_openmp(env) else openmp_env(env, busy)
    notes = []
    if busy and out is not env:
        setting = " ".join(f"{k}={v}" for k, v in BUSY_OPENMP.items())
        notes.append(f"other processes took {load.others:.1f} of {load.cpus[0]} CPUs: OpenMP threads sleep while "
                     f"they wait ({setting}), so a core shared with them does not stall every step")
    if set_threads:
        threads = timing_threads(load.cpus[1], load.others)
        out.update({var: str(threads) for var in TIMING_THREAD_VARS if var not in env})
        notes.append(f"{threads} thread(s) per timed engine ({load.cpus[1]} usable CPUs less one for the rest "
                     f"of the process{f' and {load.others:.1f} taken by other processes' if busy else ''})")
    return out, "; ".join(notes) or None
