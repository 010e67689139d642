"""Stage 2 driver: ``run(params, run_dir) -> VocabStats``.

Reads stage 1's samples (:mod:`eagle3.contracts.samples`); writes into the stage-2 folder:

* the tokenized splits and row lengths (:mod:`eagle3.contracts.tokenized`);
* ``token_counts.npy``, ``heldout_token_counts.npy``: int64 ``[target_vocab_size]`` masked-token
  frequencies of each split (:func:`eagle3.vocab.mapping.write_counts`);
* the draft vocab mapping (:mod:`eagle3.contracts.vocab_mapping`);
* ``tokenize_meta.json`` (hashes that make tokenization resumable), figures, ``progress.json``,
  ``stats.json``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from eagle3.chat import stop_token_ids, template_kwargs
from eagle3.config import Params
from eagle3.contracts import tokenized
from eagle3.contracts.samples import read_samples, samples_path
from eagle3.contracts.vocab_mapping import write_mapping
from eagle3.errors import VocabError
from eagle3.io import atomic_write_json, read_json
from eagle3.rundir import VOCAB
from eagle3.stage import StageRun, Stats, completed_stats
from eagle3.vocab.mapping import (
    COMMON_SIZES,
    Coverage,
    cached_vocab_mapping,
    count_masked_tokens,
    default_cache_dir,
    write_counts,
)
from eagle3.vocab.render import LossMaskRenderer, tokenize_samples

__all__ = ["run", "VocabStats", "tokenizer_hash", "corpus_hash", "target_vocab_size"]

log = logging.getLogger(__name__)

SPLITS = tokenized.SPLITS
_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "merges.txt", "tiktoken.model", "chat_template.jinja",
    "chat_template.json", "generation_config.json",
)


# --------------------------------------------------------------------------- hashes


def tokenizer_hash(model_dir: str | Path, tokenizer=None) -> str:
    """sha256 (16 hex) of the target's tokenizer files, generation config and chat template text."""
    h = hashlib.sha256()
    d = Path(model_dir)
    for name in _TOKENIZER_FILES:
        p = d / name
        if p.is_file():
            h.update(name.encode() + b"\0" + p.read_bytes() + b"\0")
    if tokenizer is not None:
        h.update(str(getattr(tokenizer, "chat_template", "")).encode())
    return h.hexdigest()[:16]


def corpus_hash(samples: list[dict], settings: dict) -> str:
    """sha256 (16 hex) of the samples (ids, sources, messages, finish reasons, turn usage, template settings)
    plus the stage settings that change which tokens are supervised (``settings``)."""
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for s in samples:
        # turn_usage: its completion counts decide whether an empty reasoning block was generated
        keep = {k: s.get(k) for k in ("id", "source", "messages", "finish_reasons", "turn_usage")}
        st = s.get("settings") or {}
        keep["template"] = {k: st.get(k) for k in ("chat_template_kwargs", "enable_thinking")}
        h.update(json.dumps(keep, sort_keys=True, ensure_ascii=False).encode() + b"\n")
    return h.hexdigest()[:16]


def target_vocab_size(model_dir: str | Path, trust_remote_code: bool = False) -> int:
    """The target's vocab size (rows of its LM head): ``config.vocab_size`` (``text_config`` for
    multimodal configs), as speculators' ``get_target_vocab_size`` reads it."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    cfg = getattr(cfg, "text_config", None) or cfg
    return int(cfg.vocab_size)


# --------------------------------------------------------------------------- stage


@dataclass
class VocabStats(Stats):
    """What stage 2 writes to ``stats.json`` (same keys, same order). ``coverage`` is the share of the
    train split's masked tokens inside the draft vocab, ``heldout_oov_rate`` the share of the held-out
    split's outside it (padding ids included; :meth:`eagle3.vocab.mapping.Coverage.oov_rate`);
    ``coverage_at_<n>k`` exist only for sizes up to the target vocab (None otherwise, not written);
    ``<split>_*`` are the tokenization counters of each split, ``tokenize_reports`` their full reports."""

    HEADLINE: ClassVar[tuple[str, ...]] = (
        "target_vocab_size", "draft_vocab_size", "distinct_tokens", "masked_tokens", "coverage", "heldout_oov_rate",
        "train_rows", "train_tokens", "train_truncated_rows", "heldout_rows", "cache_hit")
    target_vocab_size: int
    draft_vocab_size: int
    draft_vocab_size_from: str
    full_size: bool
    distinct_tokens: int
    masked_tokens: int
    coverage: float
    padded_ids: int
    heldout_masked_tokens: int
    heldout_oov_rate: float | None
    coverage_at_8k: float | None
    coverage_at_16k: float | None
    coverage_at_32k: float | None
    coverage_at_64k: float | None
    cache_key: str
    cache_hit: bool
    corpus_hash: str
    tokenizer_hash: str
    max_seq_len: int
    multi_turn_policy: str
    train_samples: int
    train_rows: int
    train_tokens: int
    train_supervised_tokens: int
    train_truncated_rows: int
    train_truncated_tokens: int
    train_truncated_supervised_tokens: int
    train_dropped_rows_after_truncation: int
    train_no_supervised_samples: int
    train_failed_samples: int
    train_history_rerendered_samples: int
    train_exploded_rows: int
    train_completion_token_agreement: float | None
    heldout_samples: int
    heldout_rows: int
    heldout_tokens: int
    heldout_supervised_tokens: int
    heldout_truncated_rows: int
    heldout_truncated_tokens: int
    heldout_truncated_supervised_tokens: int
    heldout_dropped_rows_after_truncation: int
    heldout_no_supervised_samples: int
    heldout_failed_samples: int
    heldout_history_rerendered_samples: int
    heldout_exploded_rows: int
    heldout_completion_token_agreement: float | None
    tokenize_reports: dict

    def to_dict(self) -> dict[str, Any]:
        """The ``stats.json`` dict: ``coverage_at_<n>k`` of sizes above the target vocab left out."""
        return {k: v for k, v in super().to_dict().items() if not (k.startswith("coverage_at_") and v is None)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VocabStats:
        """From a ``stats.json`` dict; the ``coverage_at_<n>k`` keys :meth:`to_dict` left out are None."""
        return super().from_dict({**{f"coverage_at_{s // 1024}k": None for s in COMMON_SIZES}, **d})


def _tokenize_split(params, run_dir, split, samples, renderer, hashes, prog) -> dict:
    """Tokenize one split unless its files and ``tokenize_meta.json`` already match ``hashes``."""
    meta_path = tokenized.split_path(run_dir, split).parent / "tokenize_meta.json"
    done = (read_json(meta_path, {}) or {}).get(split)
    if done and done.get("hashes") == hashes and tokenized.split_complete(run_dir, split):
        prog.update(len(samples), tokens=int(done["report"]["tokens"]), **{f"{split}_resumed": True})
        return done["report"]
    chunks, rep = tokenize_samples(
        samples, renderer, params.vocab.max_seq_len, params.vocab.multi_turn_policy,
        on_chunk=lambda n, t: prog.update(n, tokens=t),
    )
    tokenized.write_split(run_dir, split, chunks if samples else [])
    report = rep.as_dict()
    if rep.no_supervised_samples or rep.failed_samples:
        log.warning(
            "%s: %d samples without a supervised token (%s...), %d rejected (%s)", split,
            rep.no_supervised_samples, rep.no_supervised_ids[:5], rep.failed_samples, rep.failed[:2],
        )
    meta = read_json(meta_path, {}) or {}
    meta[split] = {"hashes": hashes, "report": report}
    atomic_write_json(meta_path, meta)
    return report


_REPORT_KEYS = ("samples", "rows", "tokens", "supervised_tokens", "truncated_rows", "truncated_tokens",
                "truncated_supervised_tokens", "dropped_rows_after_truncation", "no_supervised_samples",
                "failed_samples", "history_rerendered_samples", "exploded_rows")


def _split_stats(reports: dict[str, dict]) -> dict[str, Any]:
    """``<split>_<counter>`` keys of stats.json from the tokenization reports."""
    out: dict[str, Any] = {}
    for split in SPLITS:
        r = reports[split]
        for k in _REPORT_KEYS:
            out[f"{split}_{k}"] = r[k]
        n = r.get("turns_with_completion_tokens", 0)
        # share of turns whose supervised span has exactly as many tokens as stage 1 recorded generating
        out[f"{split}_completion_token_agreement"] = r.get("turns_matching_completion_tokens", 0) / n if n else None
    return out


def _pick_size(params: Params, cov: Coverage) -> tuple[int, str]:
    if params.vocab.target_coverage is not None:
        return cov.size_for(params.vocab.target_coverage), "target_coverage"
    return int(params.vocab.draft_vocab_size), "draft_vocab_size"


def _load(params: Params, run_dir: Path):
    """Samples by split, the target's renderer, vocab size and tokenizer hash, with the input checks."""
    from eagle3.target import load_tokenizer, resolve_target

    all_samples = read_samples(run_dir)
    by_split = {s: [x for x in all_samples if x["split"] == s] for s in SPLITS}
    if not by_split["train"]:
        raise VocabError(f"{samples_path(run_dir)}: no sample has split == 'train'; nothing to count")
    target = resolve_target(params.target)
    tok = load_tokenizer(target, params.target.trust_remote_code)
    kw = template_kwargs(params)
    renderer = LossMaskRenderer(tok, stop_token_ids(tok, target.path, kwargs=kw), kw, params.vocab.history_reasoning,
                                params.synthesize.think_tags)
    V = target_vocab_size(target.path, params.target.trust_remote_code)
    if params.vocab.draft_vocab_size is not None and params.vocab.draft_vocab_size > V:
        raise VocabError(
            f"vocab.draft_vocab_size={params.vocab.draft_vocab_size} exceeds the target vocab size {V}; "
            f"use at most {V} (= full size, no mapping)"
        )
    return all_samples, by_split, tok, renderer, V, tokenizer_hash(target.path, tok)


def run(params: Params, run_dir: str | Path) -> VocabStats:
    """Stage 2: tokenize as served, count masked tokens, pick the draft vocab size, build the mapping.

    Resumable: a split whose files were written for the same corpus hash and tokenizer hash is not
    tokenized again; counts, coverage and mapping are recomputed (deterministic, seconds).

    Returns:
        VocabStats: what ``stats.json`` holds.

    Raises:
        SamplesError: missing/invalid samples.jsonl (file:line:field).
        VocabError: a split with samples but no supervised token, ``draft_vocab_size`` larger than the
            target vocab, a token id outside the target vocab.
    """
    from eagle3.vocab.report import CoverageExplorer

    run_dir = Path(run_dir)
    all_samples, by_split, tok, renderer, V, tok_hash = _load(params, run_dir)
    settings = {
        "max_seq_len": params.vocab.max_seq_len,
        "multi_turn_policy": params.vocab.multi_turn_policy,
        "history_reasoning": params.vocab.history_reasoning,
        "template_kwargs": template_kwargs(params),
        "format": 3,  # bump when tokenization or its report changes: earlier splits are redone
    }
    if tuple(params.synthesize.think_tags) != ("<think>", "</think>"):  # in the key only when not the
        settings["think_tags"] = list(params.synthesize.think_tags)  # default: earlier runs keep their hashes
    hashes = {split: corpus_hash(by_split[split], settings) for split in SPLITS}
    finished = _finished(params, run_dir, hashes, tok_hash)
    if finished is not None:
        return finished
    with StageRun(params, run_dir, VOCAB, total=len(all_samples), unit="samples") as st:
        reports: dict[str, dict] = {}
        for split in SPLITS:
            reports[split] = _tokenize_split(params, run_dir, split, by_split[split], renderer,
                                             {"corpus": hashes[split], "tokenizer": tok_hash}, st.progress)
        stats = VocabStats(**_count_and_map(params, run_dir, V, hashes["train"], tok_hash), **_split_stats(reports),
                           tokenize_reports=reports)
        for name, fig in CoverageExplorer.from_run(run_dir, params, tokenizer=tok).figures().items():
            st.figure(name, fig)
        st.progress.extra.update(draft_vocab_size=stats.draft_vocab_size, coverage=stats.coverage)
        st.finish(stats, log=True)
    return stats


def _finished(params: Params, run_dir: Path, hashes: dict[str, str], tok_hash: str) -> VocabStats | None:
    """The stats of a complete stage 2 whose inputs are unchanged, else None (then it runs).

    Unchanged: both splits tokenized from the same corpus and tokenizer hashes (``tokenize_meta.json``),
    the mapping written, and the size rule giving the same draft vocab size on the stored counts.
    Nothing is rewritten then: opening notebook 02 on a finished run leaves ``stats.json`` and
    ``progress.json`` byte-identical.
    """
    from eagle3.contracts.vocab_mapping import mapping_paths
    from eagle3.vocab.mapping import read_counts

    done = completed_stats(run_dir, VOCAB, VocabStats)
    if done is None or not mapping_paths(run_dir)[1].exists():  # mapping.json (none written: run)
        return None
    meta = read_json(tokenized.split_path(run_dir, "train").parent / "tokenize_meta.json", {}) or {}
    for split in SPLITS:
        m = meta.get(split) or {}
        if m.get("hashes") != {"corpus": hashes[split], "tokenizer": tok_hash} or not tokenized.split_complete(run_dir, split):
            return None
    try:
        counts, _ = read_counts(run_dir)
    except (VocabError, OSError, ValueError):  # counts missing or torn: the stage recomputes them
        return None
    if _pick_size(params, Coverage.from_counts(counts)) != (done.draft_vocab_size, done.draft_vocab_size_from):
        return None
    return done


def _count_and_map(params: Params, run_dir: Path, V: int, c_hash: str, tok_hash: str) -> dict[str, Any]:
    """Count both splits, pick the size, build (or reuse) and write the mapping; the stats so far."""
    counts = count_masked_tokens(tokenized.split_path(run_dir, "train"), V)
    held = count_masked_tokens(tokenized.split_path(run_dir, "heldout"), V)
    write_counts(run_dir, counts, held)
    cov = Coverage.from_counts(counts)
    size, size_from = _pick_size(params, cov)
    cache_dir = Path(params.vocab.cache_dir) if params.vocab.cache_dir else default_cache_dir(params.target.cache_dir)
    mapping, hit = cached_vocab_mapping(counts, size, c_hash, tok_hash, cache_dir)
    write_mapping(run_dir, mapping, coverage=cov.at(size), corpus_hash=c_hash, tokenizer_hash=tok_hash, cache_hit=hit)
    return {
        "target_vocab_size": V,
        "draft_vocab_size": size,
        "draft_vocab_size_from": size_from,
        "full_size": mapping.full_size,
        "distinct_tokens": cov.distinct,
        "masked_tokens": cov.total,
        "coverage": cov.at(size),
        "padded_ids": max(size - cov.distinct, 0) if not mapping.full_size else 0,
        "heldout_masked_tokens": int(held.sum()),
        "heldout_oov_rate": cov.oov_rate(held, size),
        **{f"coverage_at_{s // 1024}k": cov.at(s) if s <= V else None for s in COMMON_SIZES},
        "cache_key": mapping.cache_key,
        "cache_hit": hit,
        "corpus_hash": c_hash,
        "tokenizer_hash": tok_hash,
        "max_seq_len": params.vocab.max_seq_len,
        "multi_turn_policy": params.vocab.multi_turn_policy,
    }
