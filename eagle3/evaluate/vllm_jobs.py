"""vLLM measurements from the stage's side: job files, one engine per subprocess, their summaries.

vLLM engines spawn processes and hold memory until the interpreter exits, so every measurement
(EAGLE-3 drafter, n-gram lookup, no speculation) runs ``python -m eagle3.evaluate.vllm_worker`` in a
fresh subprocess, one at a time; the worker creates its engine under ``if __name__ == "__main__":``.
Acceptance comes from vLLM's ``vllm:spec_decode_*`` counters (the headline) and its per-request
per-step lists (splits by source and context length).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from eagle3.errors import EvaluateError
from eagle3.evaluate.metrics import summarize_rounds
from eagle3.io import atomic_write_json

__all__ = ["build_job", "run_vllm_job", "vllm_records", "vllm_summary", "vllm_serve_command"]

# The repository root, put on the worker's PYTHONPATH so that it imports this same tree.
_ROOT = Path(__file__).resolve().parents[2]


def build_job(params, method: str, target_path: str | Path, drafter_dir: str | Path, prompts: list[dict],
              chat_template_kwargs: dict | None) -> dict:
    """The job dict of one measurement (the worker's input; see :mod:`eagle3.evaluate.vllm_worker`).

    Args:
        method: "eagle3" | "ngram" | "none".
        prompts: ``{"id", "messages", "prompt_ids", ...}`` (only those three keys are sent).
    """
    ev = params.evaluate
    return {"target": str(target_path), "dtype": params.target.dtype if params.target.dtype != "auto" else "auto",
            "max_model_len": params.target.max_model_len, "seed": params.run.seed, "method": method,
            "tensor_parallel_size": params.target.tensor_parallel_size,
            "trust_remote_code": params.target.trust_remote_code,
            "drafter": str(drafter_dir) if method == "eagle3" else None, "k": ev.num_speculative_tokens,
            "prompt_lookup_min": ev.ngram.prompt_lookup_min, "prompt_lookup_max": ev.ngram.prompt_lookup_max,
            "temperature": ev.temperature, "max_new_tokens": ev.max_new_tokens,
            "chat_template_kwargs": chat_template_kwargs,
            "prompts": [{"id": p["id"], "messages": p["messages"], "prompt_ids": p["prompt_ids"]} for p in prompts]}


def run_vllm_job(job: dict, out_path: str | Path, log_path: str | Path | None = None,
                 timeout_s: float = 1800.0) -> dict:
    """Run ``python -m eagle3.evaluate.vllm_worker`` on ``job`` in a subprocess and return its result.

    The job file is written beside ``out_path`` (``<out>.job.json``); the child's output goes to
    ``log_path`` (default ``<out>.log``). The child runs in its own process group, killed on timeout.

    Raises:
        EvaluateError: the child failed or timed out (the message holds the log tail).
    """
    from eagle3.vllm_utils import cpu_env

    out_path = Path(out_path)
    job_path = out_path.with_suffix(".job.json")
    atomic_write_json(job_path, job)
    log_path = Path(log_path) if log_path else out_path.with_suffix(".log")
    env = cpu_env()
    env["PYTHONPATH"] = str(_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "eagle3.evaluate.vllm_worker", str(job_path), str(out_path)],
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the engine's own workers are in the same group
            proc.wait()
            rc = None
    if rc != 0 or not out_path.exists():
        tail = "\n".join(Path(log_path).read_text(errors="replace").splitlines()[-30:])
        why = f"timed out after {timeout_s:.0f} s" if rc is None else f"exited with code {rc}"
        raise EvaluateError(f"vLLM job {job['method']} {why} (log: {log_path}):\n{tail}")
    return json.loads(out_path.read_text())


def vllm_records(result: dict, prompts: list[dict]) -> list[dict]:
    """Per-prompt round records from a vLLM result (per-step accepted/drafted lists).

    Context lengths are reconstructed as prompt + 1 + tokens produced by earlier rounds, exact
    when every engine step drafted (EAGLE-3); for n-gram lookup, steps without drafts are not
    reported by vLLM, so its context lengths are lower bounds.
    """
    src = {p["id"]: p["source"] for p in prompts}
    out = []
    for r in result["per_prompt"]:
        acc, drf = r.get("per_step_accepted") or [], r.get("per_step_drafted") or []
        ctx = len(r["prompt_ids"]) + 1
        rounds = []
        for a, d in zip(acc, drf):
            rounds.append([ctx, int(d), int(a)])
            ctx += 1 + int(a)
        out.append({"id": r["id"], "source": src.get(r["id"], "?"), "prompt_len": len(r["prompt_ids"]),
                    "tokens": r["tokens"], "rounds": rounds, "verification_steps": len(rounds),
                    "finish_reason": r.get("finish_reason")})
    return out


def _counter_metrics(c: dict, steps: int) -> dict:
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
        "verification_steps": steps,
        "tokens_per_forward": (steps + acc) / steps if steps > 0 else None,
    }


def vllm_summary(result: dict, prompts: list[dict], k: int) -> dict:
    """The results.json entry of a vLLM measurement: acceptance from vLLM's counters (headline)
    plus per-source/context splits from the per-request data."""
    c = result["counters"]
    method = result["method"]
    n_prompts = len(result["per_prompt"])
    steps = c["engine_steps"] - n_prompts  # one prefill step per prompt (unchunked, max_num_seqs=1)
    summary: dict = {"backend": "vllm", "method": method, "k": result["k"], "temperature": result["temperature"],
                     "acceptance_rule": "vLLM rejection sampler (greedy: exact match with the target argmax)"
                     if result["temperature"] <= 0 else "vLLM rejection sampler",
                     "dtype": result.get("dtype"), "vllm_version": result.get("vllm_version"),
                     "tokens_per_s": result.get("tokens_per_s"), "output_tokens": result.get("output_tokens"),
                     "generate_s": result.get("generate_s"), "startup_s": result.get("startup_s"),
                     "counters": c, "prompts": n_prompts}
    if method == "none":
        summary.update({"tau": None, "rounds": 0, "verification_steps": steps,
                        "tokens_per_forward": (c["vllm:generation_tokens"] - n_prompts) / steps if steps > 0 else None})
        return summary
    summary.update(_counter_metrics(c, steps))
    s = summarize_rounds(vllm_records(result, prompts), k)
    summary["per_request_check"] = {"drafts": s["overall"]["rounds"], "accepted": s["overall"]["accepted_tokens"]}
    if method == "eagle3":
        summary["per_position_conditional"] = s["overall"]["per_position_conditional"]
        summary["by_context"] = s["by_context"]
    summary["by_source"] = {src: {kk: v for kk, v in m.items() if kk not in ("verification_steps", "tokens_per_forward")}
                            for src, m in s["by_source"].items()}
    summary["accepted_histogram"] = s["accepted_histogram"]
    return summary


def vllm_serve_command(target_name: str, drafter_dir: str | Path, k: int, extra: str = "") -> str:
    """The ``vllm serve`` command line that serves the target with this drafter (EAGLE-3, k tokens)."""
    spec = json.dumps({"method": "eagle3", "model": str(drafter_dir), "num_speculative_tokens": int(k)})
    cmd = f"vllm serve {shlex.quote(str(target_name))} --speculative-config {shlex.quote(spec)}"
    return cmd + (f" {extra}" if extra else "")
