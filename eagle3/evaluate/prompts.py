"""The evaluation prompts: held-out samples of stage 1 (or ``evaluate.prompts``), never trained on.

A prompt is the turns before the first assistant turn (system/user), rendered exactly as vLLM's
chat endpoint renders it (:class:`eagle3.chat.ChatRenderer`), so that offline and vLLM decode the
same token ids.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from eagle3.chat import ChatRenderer, template_kwargs
from eagle3.contracts import tokenized
from eagle3.contracts.samples import read_samples
from eagle3.errors import EvaluateError
from eagle3.rundir import RunDir

__all__ = ["heldout_prompts"]


def _prompt_prefix(messages: list[dict]) -> list[dict]:
    """The turns before the first assistant turn (system/user), as ``{"role", "content"}``."""
    out = []
    for m in messages:
        if m.get("role") == "assistant":
            break
        out.append({"role": m["role"], "content": m.get("content", "")})
    return out


def _prefix_hash(prefix: list[dict]) -> str:
    blob = json.dumps([[m["role"], m["content"]] for m in prefix], ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def _train_ids(run_dir: Path) -> set[str]:
    """Row ids of stage 2's training split (empty when that split is absent)."""
    if not tokenized.split_path(run_dir, "train").is_file():
        return set()
    return set(tokenized.read_ids(run_dir, "train"))


def _other_prompt_set(source) -> list[dict]:
    """Records ``{"id", "source", "messages", "prompt_hash"}`` of ``evaluate.prompts`` (Stage 1's loader;
    the first system/user turn group of each prompt)."""
    from eagle3.prompts import load_source

    return [{"id": p.id, "source": p.source, "messages": p.first_messages(), "prompt_hash": p.prompt_hash}
            for p in load_source(source, dedup=True)]


def _training_hashes(samples: list[dict]) -> set[str]:
    """Prompt hashes of the training samples: their own ``prompt_hash`` and the hash of their prefix."""
    hashes: set[str] = set()
    for s in samples:
        if s.get("split") == "train":
            hashes.add(_prefix_hash(_prompt_prefix(s.get("messages", []))))
            if s.get("prompt_hash"):
                hashes.add(str(s["prompt_hash"]))
    return hashes


def heldout_prompts(params, run_dir: str | Path, tokenizer) -> tuple[list[dict], dict]:
    """The evaluation prompts: held-out samples of Stage 1 (or ``evaluate.prompts``), never trained on.

    A candidate is dropped when its prompt hash (Stage 1's ``prompt_hash`` or the hash of its
    system/user turns) belongs to a ``split == "train"`` sample, or its id is in stage 2's
    ``train.parquet``. Prompts longer than ``target.max_model_len - max_new_tokens - k - 1``
    tokens are skipped (they could not finish in vLLM).

    Returns:
        ``(prompts, info)``: prompts ``{"id", "source", "prompt_hash", "messages", "prompt_ids"}``
        (at most ``evaluate.num_prompts``) and counts (``candidates``, ``excluded_training``,
        ``skipped_too_long``, ``count``, ``by_source``).

    Raises:
        SamplesError: no samples file (run stage 1) or a corrupt one (file and line named).
        EvaluateError: no held-out prompt left.
    """
    ev = params.evaluate
    run_dir = Path(run_dir)
    has_samples = RunDir(run_dir).samples.exists()
    samples = read_samples(run_dir) if has_samples or ev.prompts is None else []
    train_hashes = _training_hashes(samples)
    train_ids = _train_ids(run_dir)
    cands = _other_prompt_set(ev.prompts) if ev.prompts is not None else [s for s in samples if s.get("split") == "heldout"]
    renderer = ChatRenderer(tokenizer, template_kwargs(params))  # as vLLM's chat endpoint renders it
    limit = params.target.max_model_len - ev.max_new_tokens - ev.num_speculative_tokens - 1
    out, excluded, too_long = [], 0, 0
    for s in cands:
        prefix = _prompt_prefix(s.get("messages", []))
        if not prefix:
            continue
        h = _prefix_hash(prefix)
        if h in train_hashes or (s.get("prompt_hash") and str(s["prompt_hash"]) in train_hashes) or s.get("id") in train_ids:
            excluded += 1
            continue
        ids = renderer.prompt_ids(prefix)
        if len(ids) > limit:
            too_long += 1
            continue
        out.append({"id": str(s["id"]), "source": str(s.get("source", "?")), "prompt_hash": s.get("prompt_hash") or h,
                    "messages": prefix, "prompt_ids": ids})
        if ev.num_prompts is not None and len(out) >= ev.num_prompts:
            break
    if not out:
        raise EvaluateError(
            f"no held-out prompt to evaluate in {run_dir} ({len(cands)} candidates, {excluded} seen in "
            f"training, {too_long} longer than {limit} tokens); raise synthesize.heldout_fraction or set evaluate.prompts")
    by_source: dict[str, int] = {}
    for p in out:
        by_source[p["source"]] = by_source.get(p["source"], 0) + 1
    return out, {"candidates": len(cands), "excluded_training": excluded, "skipped_too_long": too_long,
                 "count": len(out), "by_source": by_source}
