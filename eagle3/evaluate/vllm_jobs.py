"""vLLM measurements from the stage's side: job files, one engine per subprocess, their summaries.

vLLM engines spawn processes and hold memory until the interpreter exits, so every measurement
(EAGLE-3 drafter, n-gram lookup, no speculation) runs ``python -m eagle3.evaluate.vllm_worker`` in a
fresh subprocess, one at a time; the worker creates its engine under ``if __name__ == "__main__":``.
Acceptance comes from vLLM's ``vllm:spec_decode_*`` counters (pooled) and its per-request per-step
lists (per set, per category, by context length); tokens/s from the worker's one-request-at-a-time
speed pass over a subset of the prompts.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

from eagle3.errors import EvaluateError
from eagle3.evaluate.metrics import group_metrics, speed_stats, summarize_rounds
from eagle3.io import atomic_write_json

__all__ = ["build_job", "run_vllm_job", "speed_schedule", "run_speed", "vllm_records", "vllm_summary", "speed_by_set",
           "speed_lengths_differ"]

# The repository root, put on the worker's PYTHONPATH so that it imports this same tree.
_ROOT = Path(__file__).resolve().parents[2]


def build_job(params, method: str, target_path: str | Path, drafter_dir: str | Path, prompts: list[dict],
              chat_template_kwargs: dict | None, speed_ids: list[str] | None = None, speed_rounds: int = 1) -> dict:
    """The job dict of one measurement (the worker's input; see :mod:`eagle3.evaluate.vllm_worker`).

    Args:
        method: "eagle3" | "ngram" | "none" ("none" has no acceptance to measure: speed pass only).
        prompts: ``{"id", "messages", "prompt_ids", ...}`` (only those three keys are sent).
        speed_ids: ids of the prompts the job's own speed pass times one request at a time (default:
            none; the stage times them in :func:`run_speed` instead unless ``evaluate.speed_engines``
            is ``one_at_a_time``), ``speed_rounds`` times over.
    """
    ev = params.evaluate
    from eagle3.target import target_dtype

    return {"target": str(target_path), "dtype": target_dtype(params.target),
            "max_model_len": params.target.max_model_len, "seed": params.run.seed, "method": method,
            "tensor_parallel_size": params.target.tensor_parallel_size,
            "trust_remote_code": params.target.trust_remote_code,
            "drafter": str(drafter_dir) if method == "eagle3" else None, "k": ev.num_speculative_tokens,
            "prompt_lookup_min": ev.ngram.prompt_lookup_min, "prompt_lookup_max": ev.ngram.prompt_lookup_max,
            "temperature": ev.temperature, "max_new_tokens": ev.max_new_tokens,
            "chat_template_kwargs": chat_template_kwargs,
            "max_num_seqs": ev.vllm_max_num_seqs, "acceptance": method != "none",
            "speed_ids": list(speed_ids or []), "speed_rounds": int(speed_rounds),
            "prompts": [{"id": p["id"], "messages": p["messages"], "prompt_ids": p["prompt_ids"]} for p in prompts]}


def _worker_env(timing: bool = False) -> tuple[dict, str]:
    """``(environment, note)`` of a worker that starts now: vLLM's CPU settings, the OpenMP setting for
    the load of this moment (:func:`eagle3.machine.openmp_for_start`; ``timing``: a speed-pass engine,
    with its thread counts; ``note`` says what it chose, '' otherwise, for the worker's log), this tree
    on its path, this process as its parent."""
    from eagle3.machine import openmp_for_start
    from eagle3.vllm_utils import cpu_env

    env, openmp_note = openmp_for_start(cpu_env(), timing=timing)
    env["PYTHONPATH"] = str(_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["EAGLE3_PARENT_PID"] = str(os.getpid())
    return env, f"eagle3: {openmp_note}\n" if openmp_note else ""


def _log_tail(path: Path, n: int = 30) -> str:
    return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])


def run_vllm_job(job: dict, out_path: str | Path, log_path: str | Path | None = None,
                 timeout_s: float = 1800.0) -> dict:
    """Run ``python -m eagle3.evaluate.vllm_worker`` on ``job`` in a subprocess and return its result.

    The job file is written beside ``out_path`` (``<out>.job.json``); the child's output goes to
    ``log_path`` (default ``<out>.log``). The child runs in its own process group, killed on timeout;
    it is told this process's id (``EAGLE3_PARENT_PID``) and kills its group when this process dies
    (:func:`eagle3.evaluate.vllm_worker.watch_parent`): a SIGKILLed stage leaves no engine behind, and
    the re-run measures again (the result file is only kept with its job key).

    Raises:
        EvaluateError: the child failed or timed out (the message holds the log tail; a timeout names
            ``evaluate.vllm_timeout_s``, the stage's value of ``timeout_s``).
    """
    out_path = Path(out_path)
    job_path = out_path.with_suffix(".job.json")
    atomic_write_json(job_path, job)
    log_path = Path(log_path) if log_path else out_path.with_suffix(".log")
    env, note = _worker_env()
    with open(log_path, "wb") as log:
        log.write(note.encode())
        log.flush()
        proc = subprocess.Popen([sys.executable, "-m", "eagle3.evaluate.vllm_worker", str(job_path), str(out_path)],
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the engine's own workers are in the same group
            proc.wait()
            rc = None
    if rc != 0 or not out_path.exists():
        tail = _log_tail(log_path)
        # a timeout is most often a slower machine than the limit assumed (a shared CPU, many prompts):
        # name the setting, so that the re-run can raise it
        why = (f"timed out after {timeout_s:.0f} s (evaluate.vllm_timeout_s: raise it for a slower or shared "
               f"machine, or measure fewer prompts)" if rc is None else f"exited with code {rc}")
        raise EvaluateError(f"vLLM job {job['method']} {why} (log: {log_path}):\n{tail}")
    return json.loads(out_path.read_text())


def _reply(proc: subprocess.Popen, method: str, log_path: Path, timeout_s: float) -> dict:
    """The next JSON line of a speed worker.

    Raises:
        EvaluateError: the worker ended or did not answer within ``timeout_s`` (message: its log tail).
    """
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else b""
    if not line:
        why = (f"did not answer within {timeout_s:.0f} s (evaluate.vllm_timeout_s)" if not ready
               else f"ended (exit code {proc.poll()})")
        raise EvaluateError(f"vLLM speed worker {method} {why} (log: {log_path}):\n{_log_tail(log_path)}")
    return json.loads(line)


def _speed_workers(jobs: dict[str, dict], work_dir: Path, procs: dict[str, tuple[subprocess.Popen, Path]]) -> None:
    """Start one ``--serve-speed`` worker per method (job files and logs in ``work_dir``), all with one
    OpenMP setting and thread count (timed alike), into ``procs`` = ``{method: (process, log path)}`` as
    each starts (the caller stops those that started when a later one fails)."""
    env, note = _worker_env(timing=True)
    for m, job in jobs.items():
        job_path, log_path = work_dir / f"speed_{m}.job.json", work_dir / f"speed_{m}.log"
        atomic_write_json(job_path, job)
        with open(log_path, "wb") as log:
            log.write(note.encode())
            log.flush()
            procs[m] = (subprocess.Popen(
                [sys.executable, "-m", "eagle3.evaluate.vllm_worker", "--serve-speed", str(job_path)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True), log_path)


def run_speed(jobs: dict[str, dict], ids: list[str], rounds: int, work_dir: str | Path, timeout_s: float = 1800.0,
              on_row=None, load=None) -> dict[str, dict]:
    """Time the prompts ``ids`` under every method at once: one engine per method, each in its own
    ``python -m eagle3.evaluate.vllm_worker --serve-speed`` subprocess (all alive together), asked for
    one prompt at a time in the order of :func:`speed_schedule`, so that a method never runs its
    prompts in a stretch of time of its own: a load that comes and goes slows every method's requests
    of that moment, and the per-round median (:func:`speed_by_set`) sets the round aside.

    Args:
        jobs: ``{method: job}`` (:func:`build_job`; the speed worker reads its engine settings and
            prompts, not ``speed_ids``).
        rounds: times each prompt is timed under each method.
        work_dir: where the job files (``speed_<method>.job.json``) and logs (``speed_<method>.log``) go.
        on_row: ``on_row(method, row)`` after each timed request (the stage's progress).
        load: an :class:`eagle3.machine.OtherLoad`, asked after each timed request whether other
            processes take CPUs the engines use (their threads: :func:`eagle3.machine.timing_threads`,
            which leaves the CPUs other processes took at the start to them): a load there all along
            slows the engines unequally while the rounds still agree, so its most CPUs taken go into
            every method's ``machine_busy_cpus`` (None: never busy, or no ``load``); the most CPUs
            they took at all, competing or not, into ``machine_other_cpus`` (None: no ``load``).

    Returns:
        dict: ``{method: engine info (method, k, dtype, vLLM version, startup_s, ...) + {"speed": rows,
        "machine_busy_cpus": float | None, "machine_other_cpus": float | None}}``, each row as the
        worker's speed pass writes it, with ``round``.

    Raises:
        EvaluateError: a worker failed or did not answer within ``timeout_s`` (engine start, or one request).
    """
    procs: dict[str, tuple[subprocess.Popen, Path]] = {}
    try:
        _speed_workers(jobs, Path(work_dir), procs)
        out = {m: _reply(p, m, log, timeout_s) for m, (p, log) in procs.items()}  # the engines are up
        # the CPUs the engines use: the threads each reports (its engine info), None where none does
        threads = max((info["threads"] for info in out.values() if info.get("threads")), default=None)
        for m in out:
            out[m] = {k: v for k, v in out[m].items() if k != "ready"} | {"speed": []}
        busy: list[float] = []
        seen: list[float] = []
        for r, pid, m in speed_schedule(list(jobs), ids, rounds):
            proc, log = procs[m]
            proc.stdin.write((json.dumps({"id": pid, "round": r}) + "\n").encode())
            proc.stdin.flush()
            row = _reply(proc, m, log, timeout_s)
            out[m]["speed"].append(row)
            if load is not None:
                if load.busy(run_cpus=threads):
                    busy.append(load.others)
                if load.others is not None:
                    seen.append(load.others)
            if on_row is not None:
                on_row(m, row)
        for m in out:
            out[m]["machine_busy_cpus"] = round(max(busy), 2) if busy else None
            out[m]["machine_other_cpus"] = round(max(seen), 2) if seen else None
        return out
    finally:
        _stop_workers(procs)


def _stop_workers(procs: dict[str, tuple[subprocess.Popen, Path]]) -> None:
    """End each speed worker: the end of its input (it exits), or its process group killed after 30 s."""
    for proc, _ in procs.values():
        try:
            proc.stdin.close()
            proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def vllm_records(result: dict, prompts: list[dict]) -> list[dict]:
    """Per-prompt round records from a vLLM result (per-step accepted/drafted lists of the
    acceptance pass), with the prompt's ``set``, ``source`` and ``category``.

    Verification steps of a request = its steps with drafts + the steps without (n-gram misses,
    which vLLM does not list): ``len(tokens) - 1 - sum(1 + accepted)`` (every step emits
    1 + accepted tokens; the prefill emits the first), at least 0. That count is exact but for the
    request's last step, whose accepted drafts may run past the stop/length cut (then it is low by
    that many tokens). Context lengths are prompt + 1 + tokens produced by earlier rounds, exact when
    every step drafted (EAGLE-3); for n-gram lookup they are lower bounds.
    """
    meta = {p["id"]: p for p in prompts}
    out = []
    for r in result["per_prompt"]:
        acc, drf = r.get("per_step_accepted") or [], r.get("per_step_drafted") or []
        ctx = len(r["prompt_ids"]) + 1
        rounds = []
        for a, d in zip(acc, drf):
            rounds.append([ctx, int(d), int(a)])
            ctx += 1 + int(a)
        no_draft = max(0, len(r["tokens"]) - 1 - sum(1 + int(a) for a in acc))
        m = meta.get(r["id"], {})
        out.append({"id": r["id"], "set": m.get("set", "?"), "source": m.get("source", "?"),
                    "category": m.get("category", "?"), "prompt_len": len(r["prompt_ids"]),
                    "tokens": r["tokens"], "rounds": rounds, "verification_steps": len(rounds) + no_draft,
                    "finish_reason": r.get("finish_reason")})
    return out


def _counter_metrics(c: dict) -> dict:
    """τ, acceptance rates and per-position vectors from vLLM's spec-decode counters."""
    drafts = c["vllm:spec_decode_num_drafts"]
    acc = c["vllm:spec_decode_num_accepted_tokens"]
    dtoks = c["vllm:spec_decode_num_draft_tokens"]
    cond, prev = [], drafts
    for x in c["per_pos"]:  # per_pos[i] = rounds with drafts 1..i+1 accepted, so P(i | 1..i-1) = per_pos[i] / per_pos[i-1]
        cond.append(x / prev if prev else None)
        prev = x
    return {
        "tau": 1 + acc / drafts if drafts else float("nan"),
        "rounds": drafts, "accepted_tokens": acc, "draft_tokens": dtoks,
        "draft_acceptance_rate": acc / dtoks if dtoks else float("nan"),
        "per_position_unconditional": [x / drafts if drafts else None for x in c["per_pos"]],
        "per_position_conditional": cond,
    }


def speed_by_set(result: dict, prompts: list[dict], tolerance: float | None = None) -> dict:
    """``{set: {"prompts", "output_tokens", "time_s", "tokens_per_s", "tokens_per_s_rounds",
    "speed_spread", "speed_steady", "tokens_per_forward", "speed_busy_cpus", "speed_other_cpus"}}`` of the speed pass's rows
    (one request at a time, each prompt once per round), plus ``"all"`` over every timed prompt.
    ``speed_busy_cpus``: the result's ``machine_busy_cpus`` (:func:`run_speed`); where set,
    ``speed_steady`` is False. ``speed_other_cpus``: its ``machine_other_cpus`` (provenance: the pass's
    engines leave the CPUs others take at their start to them, so such a load need not disturb it).

    ``tokens_per_s``: the median over rounds of each round's tokens/s, with the per-round values, their
    spread and whether it stays within ``tolerance`` (``evaluate.speed_spread_tolerance``;
    :func:`eagle3.evaluate.metrics.speed_stats`).
    ``prompts``: distinct prompts timed. ``tokens_per_forward`` is that of the timed answers themselves
    (:func:`eagle3.evaluate.metrics.group_metrics` over their :func:`vllm_records`, the acceptance pass's
    definition; 1.0 without speculation), which can differ from the acceptance pass's answers at T=0;
    None for a result written before the speed pass kept its answers.
    """
    where = {p["id"]: p.get("set", "?") for p in prompts}
    groups: dict[str, list] = {}
    for r in result.get("speed") or []:
        groups.setdefault(where.get(r["id"], "?"), []).append(r)
        groups.setdefault("all", []).append(r)
    out = {}
    for g, rs in groups.items():
        n, t = sum(r["output_tokens"] for r in rs), sum(r["time_s"] for r in rs)
        tpf = None
        if all("tokens" in r and "prompt_ids" in r for r in rs):
            m = group_metrics(vllm_records({"per_prompt": rs}, prompts), int(result.get("k") or 0))
            tpf = m["tokens_per_forward"] if m["verification_steps"] else None
        out[g] = {"prompts": len({r["id"] for r in rs}), "output_tokens": n, "time_s": round(t, 3),
                  **speed_stats(rs, tolerance), "tokens_per_forward": tpf,
                  "speed_busy_cpus": result.get("machine_busy_cpus"),
                  "speed_other_cpus": result.get("machine_other_cpus")}
        if result.get("machine_busy_cpus"):  # timed beside other load: not a result, however the rounds agree
            out[g]["speed_steady"] = False
    return out


def speed_schedule(methods: list[str], ids: list[str], rounds: int) -> list[tuple[int, str, str]]:
    """The order of the timed requests, ``[(round, prompt id, method), ...]``: every round times every
    prompt under every method, the methods of one prompt next to each other (A B C, A B C, ...), and
    the order of the methods rotates from prompt to prompt and round to round, so that none always
    runs first (after another engine's request) or last.
    """
    out = []
    n = len(methods)
    for r in range(rounds):
        for j, pid in enumerate(ids):
            shift = (r + j) % n if n else 0
            out += [(r, pid, m) for m in methods[shift:] + methods[:shift]]
    return out


def speed_lengths_differ(results: dict, ids: list[str]) -> list[str]:
    """Ids among ``ids`` whose timed answers (speed pass) have different lengths under the methods of
    ``results`` (``{method: vLLM result}``): their tokens/s compare texts of other lengths (a longer
    answer spreads its prefill over more tokens). Answers of equal length but other tokens are not
    counted (the bound of :func:`speed_by_set`'s ``tokens_per_forward`` covers their content); prompts
    timed by fewer than two methods are not counted either."""
    lengths: dict[str, dict] = {}
    for method, res in results.items():
        for r in res.get("speed") or []:
            lengths.setdefault(r["id"], {})[method] = int(r["output_tokens"])
    return [i for i in ids if len(lengths.get(i, {})) > 1 and len(set(lengths[i].values())) > 1]


def vllm_summary(result: dict, prompts: list[dict], k: int, tolerance: float | None = None) -> dict:
    """The results.json entry of a vLLM measurement over all its prompts: acceptance from vLLM's
    counters (τ, per position), tokens per target forward from the per-request lists
    (:func:`vllm_records`), tokens/s from the speed pass; per-source/context splits.

    For ``none`` every target forward emits one token: tokens per forward is 1.0 by definition.
    ``tokens_per_s`` and its rounds, spread and steadiness are :func:`speed_by_set`'s over every timed prompt.
    """
    method = result["method"]
    by_set = speed_by_set(result, prompts, tolerance)
    every = by_set.get("all") or {}
    summary: dict = {"backend": "vllm", "method": method, "k": result["k"], "temperature": result["temperature"],
                     "acceptance_rule": "vLLM rejection sampler (greedy: exact match with the target argmax)"
                     if result["temperature"] <= 0 else "vLLM rejection sampler",
                     "dtype": result.get("dtype"), "vllm_version": result.get("vllm_version"),
                     "max_num_seqs": result.get("max_num_seqs"),
                     "tokens_per_s": every.get("tokens_per_s"), "speed_prompts": every.get("prompts", 0),
                     **{key: every.get(key) for key in ("tokens_per_s_rounds", "speed_spread", "speed_steady",
                                                        "speed_busy_cpus", "speed_other_cpus")},
                     "threads": result.get("threads"),
                     "output_tokens": result.get("output_tokens"), "generate_s": result.get("generate_s"),
                     "startup_s": result.get("startup_s"), "counters": result.get("counters"),
                     "prompts": len(result["per_prompt"]), "speed_by_set": by_set}
    if method == "none":
        summary.update({"tau": None, "rounds": 0, "tokens_per_forward": 1.0})
        return summary
    summary.update(_counter_metrics(result["counters"]))
    recs = vllm_records(result, prompts)
    s = summarize_rounds(recs, k)
    summary["verification_steps"] = s["overall"]["verification_steps"]
    summary["tokens_per_forward"] = s["overall"]["tokens_per_forward"]
    summary["per_request_check"] = {"drafts": s["overall"]["rounds"], "accepted": s["overall"]["accepted_tokens"]}
    if method == "eagle3":
        summary["per_position_conditional"] = s["overall"]["per_position_conditional"]
        summary["by_context"] = s["by_context"]
    summary["by_source"] = s["by_source"]
    summary["accepted_histogram"] = s["accepted_histogram"]
    return summary
