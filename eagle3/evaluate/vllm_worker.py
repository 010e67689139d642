"""One vLLM acceptance measurement in its own process: ``python -m eagle3.evaluate.vllm_worker JOB.json OUT.json``.

vLLM engines spawn processes and hold memory until the interpreter exits, so Stage 5 runs every
engine (EAGLE-3 drafter, n-gram lookup, no speculation) in a fresh subprocess, one at a time
(:func:`eagle3.evaluate.vllm_jobs.run_vllm_job`). The job file (JSON) holds:

``target`` (model dir), ``dtype``, ``max_model_len``, ``seed``, ``method`` ("eagle3" | "ngram" |
"none"), ``drafter`` (dir, with "eagle3": the trained drafter, served as its kind says), ``k``,
``prompt_lookup_min``/``prompt_lookup_max`` (ngram), ``temperature``, ``max_new_tokens``, ``chat_template_kwargs`` (or null), optionally
``tensor_parallel_size`` and ``trust_remote_code``, and ``prompts``: a list of
``{"id", "messages", "prompt_ids"}``.

``max_num_seqs`` (the acceptance pass's engine width, default 1), ``acceptance`` (bool, default
true: run the acceptance pass), ``speed_ids`` (prompt ids of the speed pass; default: none),
``speed_rounds`` (times the speed pass times each of them, default 1) and ``gpu_memory_utilization``
(engines sharing a GPU).

The prompts go through ``LLM.chat`` (vLLM renders the chat template itself, exactly as its chat
endpoint does); the rendered ids are returned per prompt so that the caller can compare them with
its own rendering. One engine, without prefix caching (every prompt is prefilled), runs two passes:

* **acceptance**: every prompt in one ``LLM.chat`` call, up to ``max_num_seqs`` requests at a time
  (the time does not matter here). The engine core runs in this process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless the environment sets it): ``LLM.chat`` then adds
  every request before the first engine step, so the schedule (which requests share a prefill or a
  decode batch) is the same on every run. With vLLM's default engine-core process, steps start as
  soon as the first request arrives and the rest join as they come: batch composition followed the
  machine's timing, and with it, through the batch's arithmetic, T=0 outputs and acceptance (a
  re-run's τ differed once in CI). Counters are read with ``LLM.get_metrics()`` before and after
  (a one-prompt warm-up runs first) and the differences reported:
  ``vllm:spec_decode_num_drafts``, ``_num_draft_tokens``, ``_num_accepted_tokens``,
  ``_num_accepted_tokens_per_pos``, ``vllm:iteration_tokens_total`` (count = engine steps),
  ``vllm:generation_tokens``. Per request, vLLM's per-step accepted/drafted lists
  (``per_request_spec_decode_metrics="detailed"``) are returned too: the per-set numbers.
* **speed**: the ``speed_ids`` prompts one ``LLM.chat`` call each, so one request is in the engine
  at a time (the single-stream setting where speculation pays), ``speed_rounds`` times over; output
  tokens and seconds per prompt and round, and the timed answer's ids and per-step lists as in the
  acceptance pass (a request alone in the engine computes other batch shapes, so its T=0 answer can
  differ from the acceptance pass's).

``python -m eagle3.evaluate.vllm_worker --serve-speed JOB.json`` runs the speed pass on request
instead (:func:`serve_speed`): the stage starts one such worker per method and asks them in turn,
prompt by prompt, so that a load that comes and goes slows every method alike
(:func:`eagle3.evaluate.vllm_jobs.run_speed`).

The worker runs in its own session (so that a timeout kills its engine's processes with it), which
also puts it out of reach of a signal sent to the stage's process group: when ``EAGLE3_PARENT_PID``
is set (:func:`eagle3.evaluate.vllm_jobs.run_vllm_job` sets it), a watchdog thread kills the
worker's whole process group as soon as that parent is gone (a SIGKILLed ``eagle3 run``, a kernel
that exited), so that no orphaned engine keeps its memory or races the re-run.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from eagle3.evaluate.metrics import speed_stats

COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
    "vllm:generation_tokens",
    "vllm:prompt_tokens",
)


def read_counters(llm) -> dict:
    """Sum the spec-decode counters, the per-position vector and the engine step count.

    Returns:
        dict: counter name -> value (summed over engines), ``per_pos`` (list),
        ``engine_steps`` (count of ``vllm:iteration_tokens_total``).
    """
    out: dict = {name: 0 for name in COUNTERS}
    out["per_pos"] = []
    out["engine_steps"] = 0
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            out[m.name] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = [int(v) for v in m.values]
            cur = out["per_pos"]
            out["per_pos"] = [a + b for a, b in zip(cur + [0] * (len(vals) - len(cur)), vals)]
        elif m.name == "vllm:iteration_tokens_total":
            out["engine_steps"] += int(m.count)
    return out


def _diff(after: dict, before: dict) -> dict:
    d = {k: after[k] - before.get(k, 0) for k in after if k != "per_pos"}
    b = before.get("per_pos") or [0] * len(after["per_pos"])
    d["per_pos"] = [x - y for x, y in zip(after["per_pos"], b + [0] * (len(after["per_pos"]) - len(b)))]
    return d


def _speculative_config(job: dict) -> dict | None:
    """vLLM's ``speculative_config`` for the job's method (None for "none"). The trained drafter
    ("eagle3") is served as the kind recorded in its ``config.json`` says
    (:meth:`eagle3.drafters.DrafterKind.speculative_config`).

    Raises:
        ValueError: an unknown method.
    """
    method = job["method"]
    if method == "eagle3":
        from eagle3.contracts.drafter import kind_name
        from eagle3.drafters import get

        return get(kind_name(job["drafter"], ValueError), ValueError).speculative_config(job["drafter"], int(job["k"]))
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": int(job["k"]),
                "prompt_lookup_min": int(job["prompt_lookup_min"]),
                "prompt_lookup_max": int(job["prompt_lookup_max"])}
    if method != "none":
        raise ValueError(f"unknown method {method!r}")
    return None


def _engine(job: dict, spec: dict | None):
    """The ``vllm.LLM`` of the job: ``max_num_seqs`` requests at a time, no prefix caching, stats on,
    the engine core in this process (a schedule that does not depend on timing: module docstring)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # read when the engine is built; a set value is kept
    from vllm import LLM

    from eagle3.vllm_utils import engine_kwargs

    extra: dict = {"disable_log_stats": False, "max_num_seqs": int(job.get("max_num_seqs", 1)),
                   "enable_prefix_caching": False,
                   "max_num_batched_tokens": max(int(job["max_model_len"]), 2048)}
    if spec is not None:
        extra["speculative_config"] = spec
        extra["per_request_spec_decode_metrics"] = "detailed"
    if job.get("trust_remote_code"):
        extra["trust_remote_code"] = True
    if job.get("gpu_memory_utilization"):  # engines sharing a GPU (the speed pass's, timed together)
        extra["gpu_memory_utilization"] = float(job["gpu_memory_utilization"])
    return LLM(**engine_kwargs(job["target"], dtype=job["dtype"], max_model_len=int(job["max_model_len"]),
                               seed=int(job["seed"]), tensor_parallel_size=int(job.get("tensor_parallel_size", 1)),
                               **extra))


def _per_prompt(prompts: list[dict], outs) -> list[dict]:
    """One entry per prompt: vLLM's rendered prompt ids, output ids, finish reason, per-step lists."""
    rows = []
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        sdm = c.spec_decode_metrics
        rows.append({
            "id": p["id"],
            "prompt_ids": list(o.prompt_token_ids or []),
            "tokens": list(c.token_ids),
            "finish_reason": c.finish_reason,
            "per_step_accepted": list(sdm.per_step_accepted) if sdm is not None else None,
            "per_step_drafted": list(sdm.per_step_drafted) if sdm is not None else None,
        })
    return rows


def _sampling(job: dict, i: int, max_tokens: int):
    """Prompt ``i``'s ``SamplingParams``: the job's temperature, its own seed ``seed + i``."""
    from vllm import SamplingParams

    return SamplingParams(temperature=float(job["temperature"]), max_tokens=max_tokens, seed=int(job["seed"]) + i)


def _acceptance_pass(llm, job: dict, convs: list) -> tuple[list[dict], dict, float]:
    """Every prompt in one ``LLM.chat`` call: ``(per-prompt rows, counter differences, seconds)``."""
    ctk = job.get("chat_template_kwargs") or None
    before = read_counters(llm)
    t1 = time.time()
    outs = llm.chat(convs, [_sampling(job, i, int(job["max_new_tokens"])) for i in range(len(convs))],
                    use_tqdm=False, chat_template_kwargs=ctk)
    gen_s = time.time() - t1
    return _per_prompt(job["prompts"], outs), _diff(read_counters(llm), before), gen_s


def _time_prompt(llm, job: dict, convs: list, i: int) -> dict:
    """Prompt ``i`` alone in one ``LLM.chat`` call: its row (as the acceptance pass's), output tokens and seconds."""
    t1 = time.time()
    out = llm.chat(convs[i:i + 1], [_sampling(job, i, int(job["max_new_tokens"]))], use_tqdm=False,
                   chat_template_kwargs=job.get("chat_template_kwargs") or None)[0]
    dt = time.time() - t1
    # the timed answer itself (ids, per-step lists): at T=0 it can differ from the acceptance pass's
    # (another batch, other arithmetic), so its own tokens per forward bound its speed-up
    row = _per_prompt(job["prompts"][i:i + 1], [out])[0]
    return row | {"output_tokens": len(row["tokens"]), "time_s": dt}


def _speed_pass(llm, job: dict, convs: list) -> list[dict]:
    """The ``speed_ids`` prompts one ``LLM.chat`` call each, ``speed_rounds`` times over (default 1):
    per prompt and round its row with ``round``."""
    index = {p["id"]: i for i, p in enumerate(job["prompts"])}
    return [_time_prompt(llm, job, convs, index[pid]) | {"round": r}
            for r in range(int(job.get("speed_rounds", 1))) for pid in job.get("speed_ids") or []]


def _engine_info(llm, job: dict, spec: dict | None, startup_s: float) -> dict:
    """What a result says of its engine: method, speculative config, k, sampling, dtype, vLLM version,
    torch's thread count."""
    return {
        "method": job["method"],
        "speculative_config": spec,
        "k": int(job["k"]) if spec else 0,
        "temperature": float(job["temperature"]),
        "max_new_tokens": int(job["max_new_tokens"]),
        "max_num_seqs": int(job.get("max_num_seqs", 1)),
        "dtype": str(llm.llm_engine.model_config.dtype).replace("torch.", ""),
        "vllm_version": __import__("vllm").__version__,
        "threads": __import__("torch").get_num_threads(),  # the speed pass's engines: eagle3.machine.timing_threads
        "startup_s": round(startup_s, 2),
    }


def _ready_engine(job: dict) -> tuple[Any, dict | None, list, float]:
    """``(llm, speculative config, conversations, startup seconds)`` after a one-prompt warm-up."""
    spec = _speculative_config(job)
    t0 = time.time()
    llm = _engine(job, spec)
    startup_s = time.time() - t0
    convs = [p["messages"] for p in job["prompts"]]
    llm.chat(convs[:1], [_sampling(job, 0, 8)], use_tqdm=False,
             chat_template_kwargs=job.get("chat_template_kwargs") or None)  # warm-up
    return llm, spec, convs, startup_s


def serve_speed(job: dict, requests, replies) -> None:
    """The speed pass on request: the engine of ``job`` (warmed up), then one JSON line on ``replies``
    per line read from ``requests``: first the engine's info (:func:`_engine_info` plus ``"ready":
    true``), then for each ``{"id", "round"}`` read the timed row of that prompt (:func:`_time_prompt`,
    with ``round``). Ends at the end of ``requests``. The stage drives one such worker per method, so
    that the methods time the same prompt next to each other (:func:`eagle3.evaluate.vllm_jobs.run_speed`).
    """
    llm, spec, convs, startup_s = _ready_engine(job)
    replies.write(json.dumps(_engine_info(llm, job, spec, startup_s) | {"ready": True}) + "\n")
    replies.flush()
    index = {p["id"]: i for i, p in enumerate(job["prompts"])}
    for line in requests:
        if not line.strip():
            continue
        req = json.loads(line)
        row = _time_prompt(llm, job, convs, index[req["id"]]) | {"round": int(req["round"])}
        replies.write(json.dumps(row) + "\n")
        replies.flush()


def run_job(job: dict) -> dict:
    """Run one measurement (see the module docstring); returns the result dict.

    Raises:
        ValueError: an unknown method.
    """
    llm, spec, convs, startup_s = _ready_engine(job)
    per_prompt, counters, gen_s = [], None, None
    if job.get("acceptance", True):
        per_prompt, counters, gen_s = _acceptance_pass(llm, job, convs)
    speed = _speed_pass(llm, job, convs)
    n_speed = sum(r["output_tokens"] for r in speed)
    t_speed = sum(r["time_s"] for r in speed)
    return _engine_info(llm, job, spec, startup_s) | {
        "generate_s": round(gen_s, 3) if gen_s is not None else None,
        "output_tokens": sum(len(r["tokens"]) for r in per_prompt),
        "counters": counters,
        "per_prompt": per_prompt,
        "speed": speed,
        "speed_output_tokens": n_speed,
        "speed_s": round(t_speed, 3),
        "tokens_per_s": speed_stats(speed)["tokens_per_s"],
    }


def watch_parent(parent_pid: int, interval_s: float = 0.5) -> threading.Thread:
    """Start a daemon thread that SIGKILLs this process group once ``parent_pid`` is no longer our
    parent (it died: we were re-parented to init or a subreaper).

    The worker is its session's leader (``start_new_session``), so the group is the worker and the
    engine processes it spawned; nothing else is in it.
    """
    def loop() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    t = threading.Thread(target=loop, name="eagle3-parent-watchdog", daemon=True)
    t.start()
    return t


def main(argv: list[str] | None = None) -> int:
    """Command line: ``python -m eagle3.evaluate.vllm_worker JOB.json OUT.json`` (OUT written atomically),
    or ``python -m eagle3.evaluate.vllm_worker --serve-speed JOB.json``: :func:`serve_speed` on stdin and
    stdout (everything else the process prints goes to stderr)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2:
        print("usage: python -m eagle3.evaluate.vllm_worker JOB.json OUT.json | --serve-speed JOB.json",
              file=sys.stderr)
        return 2
    parent = os.environ.get("EAGLE3_PARENT_PID")
    if parent and os.getpgrp() == os.getpid():  # only as a session/group leader: never kill a caller's group
        watch_parent(int(parent))
    if argv[0] == "--serve-speed":
        replies = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)  # the engine's own prints go to the log, not into the replies
        serve_speed(json.loads(Path(argv[1]).read_text()), sys.stdin, replies)
        return 0
    job = json.loads(Path(argv[0]).read_text())
    result = run_job(job)
    from eagle3.io import atomic_write_json

    atomic_write_json(argv[1], result)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
