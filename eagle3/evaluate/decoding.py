"""Offline *chain* speculation in transformers, exactly as vLLM schedules it.

One round (``vllm/v1/spec_decode/llm_base_proposer.py``): the drafter's first pass over the newly
verified positions, then ``k-1`` chain steps feeding back the drafted token and the drafter's own
state (the kind's proposer: :func:`eagle3.evaluate.drafter.proposer`, for EAGLE-3
:class:`eagle3.drafters.eagle3.Eagle3Drafter`); the target verifies ``[last token, d_1..d_k]``
in one forward. At temperature 0 a draft is accepted while it equals the target's argmax; at
temperature > 0 with the speculative-sampling rule ``min(1, p(d)/q(d))`` and a rejected position
resampled from ``norm(max(0, p - q))`` (Leviathan et al. 2023, "Fast Inference from Transformers
via Speculative Decoding", Alg. 1; Chen et al. 2023, "Accelerating LLM Decoding with Speculative
Sampling"). The bonus/recovered token comes from the target; both caches are cut back to the
accepted tokens. Like vLLM, every round proposes ``k`` drafts and counts all of its accepted
drafts, also past an end-of-sequence token or ``max_new_tokens`` (the output itself is cut there).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from eagle3.chat import stop_token_ids
from eagle3.drafters import Proposer, crop_cache
from eagle3.errors import EvaluateError
from eagle3.evaluate.drafter import proposer
from eagle3.evaluate.metrics import summarize_rounds
from eagle3.hooks import CachedCapture
from eagle3.io import json_digest, read_jsonl
from eagle3.stage import Progress

__all__ = [
    "speculative_accept",
    "speculative_generate",
    "evaluate_offline",
    "backend_summary",
]


def speculative_accept(p_target, q_draft, drafts, generator=None) -> tuple[int, int]:
    """The speculative-sampling acceptance rule for one round (temperature > 0).

    Draft ``i`` is accepted with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection
    the emitted token is sampled from ``norm(max(0, p_i - q_i))``; when all are accepted the bonus
    token is sampled from ``p_k``. The emitted sequence is distributed exactly as sampling the
    target (Leviathan et al. 2023, Alg. 1 and Theorem 3.5; Chen et al. 2023, Alg. 2).

    Args:
        p_target: float tensor ``[n + 1, V]``: target probabilities after each prefix
            (row i = distribution of the token at draft position i; row n = bonus).
        q_draft: float tensor ``[n, V]``: draft probabilities each draft was sampled from, over
            the *target* vocab (zero outside the draft vocab).
        drafts: int64 tensor ``[n]``: the drafted target ids.
        generator: ``torch.Generator`` for reproducibility.

    Returns:
        ``(accepted, next_token)``: number of accepted drafts and the token emitted after them.
    """
    import torch

    n = int(drafts.shape[0])
    for i in range(n):
        d = int(drafts[i])
        p, q = float(p_target[i, d]), float(q_draft[i, d])
        u = float(torch.rand((), generator=generator))
        if q > 0 and u < min(1.0, p / q):
            continue
        resid = torch.clamp(p_target[i] - q_draft[i], min=0)
        total = float(resid.sum())
        if total <= 0:  # p == q up to rounding: resampling from p is exact
            resid = p_target[i]
            total = float(resid.sum())
        tok = int(torch.multinomial(resid / total, 1, generator=generator))
        return i, tok
    tok = int(torch.multinomial(p_target[n] / p_target[n].sum(), 1, generator=generator))
    return n, tok


def _sample(logits_row, temperature: float, generator) -> int:
    """Argmax at temperature 0, else one sample of ``softmax(logits / T)`` (on CPU, float32)."""
    import torch

    if temperature <= 0:
        return int(torch.argmax(logits_row))
    p = torch.softmax(logits_row.float().cpu() / temperature, dim=-1)
    return int(torch.multinomial(p, 1, generator=generator))


def _propose(dr: Proposer, tokens: list[int], pending_aux, k: int, temperature: float, generator, dev):
    """One round's ``k`` drafts (target ids) and, when sampling, the draft distributions ``[k, V]``.

    ``pending_aux`` holds the target's aux states of positions ``dr.length .. len(tokens)-2``.
    """
    import torch

    L = len(tokens)  # tokens[L-1] is the last token, not yet seen by the drafter
    start = dr.length
    # First pass: position p reads token p+1 and the target's state at p.
    dlogits, fb = dr.step(torch.tensor(tokens[start + 1:L], device=dev), dr.combine(pending_aux),
                          torch.arange(start, L - 1, device=dev))
    drafts: list[int] = []
    qs = []
    lg, h = dlogits[-1], fb[-1:]
    for j in range(k):
        if temperature <= 0:
            di = torch.argmax(lg)[None]
        else:
            qd = torch.softmax(lg.float().cpu() / temperature, dim=-1)
            di = torch.multinomial(qd, 1, generator=generator)
            qs.append(dr.draft_probs_target(qd))
        tid = dr.to_target(di.to(dev))
        drafts.append(int(tid))
        if j + 1 < k:  # chain step: the drafted token and the drafter's own state at position L-1+j
            lgs, h = dr.step(tid.to(dev), h, torch.tensor([L - 1 + j], device=dev))
            lg = lgs[-1]
    return drafts, qs


def _verify(vlogits, drafts: list[int], qs: list, temperature: float, generator) -> tuple[int, int]:
    """``(accepted drafts, next token)`` from the target's logits ``[k+1, V]`` over ``[last, d_1..d_k]``."""
    import torch

    if temperature <= 0:
        tgt = torch.argmax(vlogits, dim=-1).tolist()
        a = 0
        while a < len(drafts) and drafts[a] == tgt[a]:
            a += 1
        return a, int(tgt[a])
    p = torch.softmax(vlogits.float().cpu() / temperature, dim=-1)
    return speculative_accept(p, torch.stack(qs), torch.tensor(drafts), generator)


def _cut_output(gen: list[int], max_new_tokens: int, stops: set[int]) -> tuple[list[int], str]:
    """The output cut after the first stop id and at ``max_new_tokens``, and its finish reason."""
    cut = next((i + 1 for i, t in enumerate(gen) if t in stops), len(gen))
    cut = min(cut, max_new_tokens)
    return gen[:cut], "stop" if any(t in stops for t in gen[:cut]) else "length"


def speculative_generate(target, drafter_model, prompt_ids: Sequence[int], k: int, max_new_tokens: int,
                         aux_layer_ids: Sequence[int], temperature: float = 0.0, stop_ids: Iterable[int] = (),
                         generator=None) -> dict:
    """Generate with chain speculation (k drafts per round), exactly as vLLM schedules it.

    Args:
        target: transformers causal LM (the verifier), eval mode.
        drafter_model: a drafter from :func:`eagle3.evaluate.drafter.load_drafter` (same
            device/dtype; e.g. speculators' ``Eagle3DraftModel``).
        prompt_ids: the rendered prompt's token ids.
        k: draft tokens per round (>= 1).
        max_new_tokens: output length cap.
        aux_layer_ids: target layers whose states feed the drafter, in concatenation order.
        temperature: 0 = greedy (exact-match rule); > 0 = speculative sampling.
        stop_ids: end-of-sequence ids (the output stops after the first one).
        generator: ``torch.Generator`` for temperature > 0.

    Returns:
        dict: ``tokens`` (generated ids, cut at the first stop id / max_new_tokens), ``rounds``
        (``[context_len, drafted, accepted]`` per verification round; context_len = tokens before
        the round's verification), ``verification_steps``, ``target_forwards`` (incl. prefill),
        ``finish_reason`` ('stop' | 'length').

    Raises:
        ValueError: ``k < 1``.
    """
    import torch
    from transformers import DynamicCache

    if k < 1:
        raise ValueError("k must be >= 1")
    stops = set(int(s) for s in stop_ids)
    dev = next(target.parameters()).device
    runner = CachedCapture(target, aux_layer_ids, error=EvaluateError)  # aux states in vLLM's convention
    dr = proposer(drafter_model)
    tcache = DynamicCache()
    try:
        with torch.no_grad():
            tokens = [int(t) for t in prompt_ids]
            n0 = len(tokens)
            logits, pending_aux = runner.forward(torch.tensor([tokens], device=dev), tcache)  # prefill
            tokens.append(_sample(logits[-1], temperature, generator))
            rounds: list[list[int]] = []
            while len(tokens) - n0 < max_new_tokens and not any(t in stops for t in tokens[n0:]):
                L = len(tokens)
                drafts, qs = _propose(dr, tokens, pending_aux, k, temperature, generator, dev)
                vlogits, vaux = runner.forward(torch.tensor([[tokens[-1]] + drafts], device=dev), tcache)
                a, nxt = _verify(vlogits, drafts, qs, temperature, generator)
                rounds.append([L, k, a])
                tokens.extend(drafts[:a] + [nxt])
                crop_cache(tcache, L + a)  # keep positions ..L-1 (last token) + a accepted drafts
                dr.crop(L - 1)  # drop this round's chain entries
                pending_aux = vaux[: a + 1]
            out, finish = _cut_output(tokens[n0:], max_new_tokens, stops)
            return {"tokens": out, "rounds": rounds, "verification_steps": len(rounds),
                    "target_forwards": 1 + len(rounds), "finish_reason": finish}
    finally:
        runner.close()


def offline_prompt_key(prompt: dict, index: int, seed: int, temperature: float) -> str:
    """The resume key of one prompt's offline record: its token ids and, when it samples
    (``temperature`` > 0), the seed it samples with (``seed + index``: :func:`evaluate_offline`); at
    T = 0 its place in the prompt list does not change its record."""
    return json_digest([prompt["prompt_ids"], seed + index if temperature > 0 else None])


def _resume_records(out_file: Path, key: str) -> dict[str, dict]:
    """Records already in ``out_file`` with this (settings) ``key``, by prompt id (the last per id).

    A torn last line (an interrupted append) is cut off the file, and so are records with another key
    (other settings or drafter) and older records of a prompt measured again; records of prompts the
    current list does not hold are kept (an evaluation source removed and added back is not redone).
    """
    recs = read_jsonl(out_file, error=EvaluateError, missing_ok=True)
    good = {r["id"]: r for r in recs if r.get("key") == key}
    text = "".join(json.dumps(r) + "\n" for r in good.values())
    if out_file.exists() and out_file.read_text(encoding="utf-8") != text:
        out_file.write_text(text, encoding="utf-8")
    return good


def evaluate_offline(target, tokenizer, drafter_model, prompts: list[dict], k: int, max_new_tokens: int,
                     aux_layer_ids: Sequence[int], temperature: float = 0.0, seed: int = 0,
                     out_file: str | Path | None = None, key: str = "", progress: Progress | None = None,
                     stop_ids: Iterable[int] | None = None) -> list[dict]:
    """Run :func:`speculative_generate` over prompts; one record per prompt.

    With ``out_file`` (JSONL) the records are appended as they finish and prompts already there
    (same settings ``key`` and :func:`offline_prompt_key`) are skipped on a re-run; a torn last line
    is dropped. Prompt ``i`` samples with
    ``torch.Generator().manual_seed(seed + i)``. ``stop_ids`` default: :func:`eagle3.chat.stop_token_ids`
    of the tokenizer and the target's generation/model configs.

    Returns:
        list[dict]: ``{"key", "id", "prompt_key", "source", "prompt_len", "tokens", "rounds", "verification_steps",
        "target_forwards", "finish_reason", "time_s"}`` in prompt order.
    """
    import torch

    out_file = Path(out_file) if out_file is not None else None
    done = _resume_records(out_file, key) if out_file is not None else {}
    stops = stop_ids if stop_ids is not None else stop_token_ids(
        tokenizer, None, getattr(target, "generation_config", None), target.config)
    records = []
    for i, p in enumerate(prompts):
        prompt_key = offline_prompt_key(p, i, seed, temperature)
        if done.get(p["id"], {}).get("prompt_key") == prompt_key:
            records.append(done[p["id"]])
            if progress is not None:  # done by an earlier execution: counted, not in the rate
                progress.resumed(1, tokens=len(done[p["id"]]["tokens"]))
            continue
        gen = torch.Generator().manual_seed(seed + i)
        t0 = time.time()
        r = speculative_generate(target, drafter_model, p["prompt_ids"], k, max_new_tokens, aux_layer_ids,
                                 temperature=temperature, stop_ids=stops, generator=gen)
        rec = {"key": key, "id": p["id"], "prompt_key": prompt_key, "source": p["source"],
               "prompt_len": len(p["prompt_ids"]),
               **r, "time_s": round(time.time() - t0, 3)}
        if out_file is not None:
            with open(out_file, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")
                f.flush()
                os.fsync(f.fileno())  # a record on disk is a prompt a re-run will not redo
        records.append(rec)
        if progress is not None:
            progress.update(1, tokens=len(r["tokens"]))
    return records


def backend_summary(records: list[dict], k: int, temperature: float, backend: str, method: str) -> dict:
    """The results.json entry of a backend measured per round (offline): settings, overall metrics,
    splits by source and context, the accepted-count histogram, output tokens and tokens/s."""
    s = summarize_rounds(records, k)
    gen_tokens = sum(len(r["tokens"]) for r in records)
    secs = sum(r.get("time_s", 0.0) for r in records)
    return {
        "backend": backend, "method": method, "k": k, "temperature": temperature,
        "acceptance_rule": "exact match with the target argmax" if temperature <= 0 else
        "speculative sampling min(1, p/q), resample from norm(max(0, p - q)) (Leviathan et al. 2023)",
        **s["overall"],
        "by_source": s["by_source"], "by_context": s["by_context"],
        "accepted_histogram": s["accepted_histogram"], "prompts": s["prompts"],
        "output_tokens": gen_tokens, "tokens_per_s": gen_tokens / secs if secs else None,
    }
